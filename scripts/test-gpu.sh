#!/usr/bin/env bash
# The GPU test suite, one command on a CUDA machine that already has torch, h5py, pyyaml and
# pytest (the lent H200 machine): no install, the package runs from the checkout.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# only the modules that hold GPU tests: the others import packages (submitit, megatron-core) the GPU
# machine's image lacks, and a module that fails to import stops the whole collection
files=$(grep -rlE "mark\.gpu|cuda_config" tests --include='test_*.py' | sort)
python3 -m pytest -p no:cacheprovider -m gpu $files "$@"
