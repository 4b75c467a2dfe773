#!/usr/bin/env bash
# The main job on the embedded default: train the tiny policy with the whole recipe machinery at
# CPU scale (SFT warm-up on the shipped solutions, then PPO against the real CPU evaluator), write
# runs/default/train.h5 and the report, print the reward before and after. A second run resumes
# (or, finished, does nothing); remove runs/default to start over.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh" ""
cd "$root"
exec python jobs/train.py --config configs/train/default.yaml --out runs/default "$@"
