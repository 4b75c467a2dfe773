#!/usr/bin/env bash
# The GPU test suite, one command on a CUDA machine that already has torch, h5py, pyyaml and
# pytest (the lent H200 machine): no install, the package runs from the checkout.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pytest -p no:cacheprovider -m gpu tests "$@"
