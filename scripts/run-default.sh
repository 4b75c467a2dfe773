#!/usr/bin/env bash
# The main job on the embedded default: evaluate the shipped suite's solutions on the CPU backend
# at CPU scale, write results/default.h5 and print the summary table.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh" ""
cd "$root"
exec hpc eval-suite kernels/tasks kernels/solutions --backend cpu --scale cpu --out results/default.h5 "$@"
