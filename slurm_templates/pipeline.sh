#!/bin/bash
# Evaluate, then analyze: submits evaluate_array.sbatch and analyze.sbatch chained with
# --dependency=afterok, so the report is written only when every shard succeeded. Prints both job ids.
#
#   slurm_templates/pipeline.sh TASKS CANDIDATES RUN_DIR [SHARDS]
#
# Environment: HPC_BACKEND, HPC_EVAL_ARGS (see evaluate_array.sbatch); HPC_SBATCH_ARGS: options for
# both submissions (e.g. "--partition=gpu --account=ACC"); HPC_EVAL_SBATCH_ARGS: options for the
# array only (e.g. "--gpus-per-task=1 --time=02:00:00"). The report goes to RUN_DIR/report.
set -euo pipefail
if [ $# -lt 3 ] || [ $# -gt 4 ]; then
    echo "usage: $0 TASKS CANDIDATES RUN_DIR [SHARDS]" >&2
    exit 2
fi
tasks="$(realpath -m "$1")" candidates="$(realpath -m "$2")" run="$(realpath -m "$3")" shards="${4:-4}"
if ! [[ "$shards" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: SHARDS must be a positive integer, got '$shards'" >&2
    exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
mkdir -p "$run"
# shellcheck disable=SC2086  # the *_ARGS variables are lists of options
eval_job=$(sbatch --parsable --chdir="$repo" --array="0-$((shards - 1))" --output="$run/evaluate-%A_%a.out" \
    ${HPC_SBATCH_ARGS:-} ${HPC_EVAL_SBATCH_ARGS:-} \
    --export="ALL,HPC_TASKS=$tasks,HPC_CANDIDATES=$candidates,HPC_OUT=$run,HPC_REPO=$repo" \
    "$here/evaluate_array.sbatch")
eval_job="${eval_job%%;*}"
# shellcheck disable=SC2086
analyze_job=$(sbatch --parsable --chdir="$repo" --dependency="afterok:$eval_job" --output="$run/analyze-%j.out" \
    ${HPC_SBATCH_ARGS:-} --export="ALL,HPC_RUNS=$run,HPC_OUT=$run/report,HPC_TASKS=$tasks,HPC_REPO=$repo" \
    "$here/analyze.sbatch")
analyze_job="${analyze_job%%;*}"
echo "evaluate array: $eval_job ($shards shards) -> $run"
echo "analysis (afterok:$eval_job): $analyze_job -> $run/report"
