#!/usr/bin/env bash
# The test command: installs the package with its test dependencies, then runs the whole suite.
# pytest's "no tests collected" (exit 5) is a failure here, not a pass.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/system-deps.sh"
source "$root/scripts/setup-env.sh" test
cd "$root"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
