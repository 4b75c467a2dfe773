#!/usr/bin/env bash
# The test command: installs the package with its test dependencies, then runs the whole suite,
# spread over up to 4 pytest workers (one per core; a file's tests stay on one worker, so its
# module fixtures are made once; a worker that reaches a Slurm test starts its own local Slurm). `--fast`: the unit tier only (no test marked slow), minutes on 2 cores.
# pytest's "no tests collected" (exit 5) is a failure here, not a pass.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/system-deps.sh"
source "$root/scripts/setup-env.sh" test
cd "$root"
args=()
if [ "${1:-}" = "--fast" ]; then
  shift
  args+=(-m "not slow")
fi
cores="$(nproc)"
workers="${HPC_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
set +e
python -m pytest -n "$workers" --dist loadfile --durations=30 "${args[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
