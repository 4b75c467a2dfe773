#!/usr/bin/env bash
# The test command: installs the package with its test dependencies, then runs the whole suite,
# spread over up to 4 pytest workers (one per core; a file's tests stay on one worker, so its
# module fixtures are made once; a worker that reaches a Slurm test starts its own local Slurm). `--fast`: the unit tier only (no test marked slow), minutes on 2 cores.
# Files go to the workers in collection order, the longest first (tests/conftest.py), not
# pytest-xdist's default of the most tests first.
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
# One intra-op thread for torch in the test processes and all they start (trainers, torchrun and
# mpirun ranks, the evaluator's harness): torch sizes its pool from MKL_NUM_THREADS. With a worker
# per core, two OpenMP threads a process spin against the other workers' processes: the embedded
# default took 1369 s beside a busy worker with them, 508 s with one (docs/benchmarks.md). The
# evaluator's sandboxed programs never see it (hpc/sandbox/process.py passes OMP_NUM_THREADS, not
# MKL_NUM_THREADS): what they time keeps the threads a user's run gives them.
export MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
set +e
python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder --durations=30 "${args[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
