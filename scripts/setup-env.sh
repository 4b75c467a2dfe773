#!/usr/bin/env bash
# Sourced by the other scripts: a project venv in .venv with the package installed (editable).
# Idempotent: a second run installs nothing new.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HPC_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
stamp="$venv/.hpc-installed-$(cat "$root/setup.cfg" "$root/pyproject.toml" | sha256sum | cut -c1-16)-${1:-run}"
step() { echo "setup-env: $* ($(( SECONDS - started )) s)" >&2; }
if [ ! -f "$stamp" ]; then
  started=$SECONDS
  # torch first and alone. PyPI's Linux torch wheel is the CUDA build: with the nvidia-* libraries it
  # pulls in, about 5 GB, which the CPU path runs without a GPU. Where PyTorch's own CPU index is
  # reachable, HPC_TORCH_INDEX=https://download.pytorch.org/whl/cpu installs the ~200 MB CPU build.
  step "installing torch from ${HPC_TORCH_INDEX:-PyPI (the CUDA build, about 5 GB on a first install: minutes)}"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check ${HPC_TORCH_INDEX:+--index-url "$HPC_TORCH_INDEX"} \
    "torch>=2.11,<2.15" 2>&1 | grep -v '^WARNING: Location' || true
  step "installing the package and its dependencies${1:+ ($1 extras)}"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root${1:+[$1]}" 2>&1 | grep -v '^WARNING: Location' || true
  step "checking that everything imports"
  # -W ignore: megatron-core warns on import that Transformer Engine and Apex are absent
  "$venv/bin/python" -W ignore -c "import hpc, torch, h5py, yaml, mpi4py, submitit, megatron.core, tokenizers, safetensors"
  if [ "${1:-}" = test ]; then
    "$venv/bin/python" -c "import pytest, xdist, transformers, pandas, openai"
    step "installing h5py 3.12 (HDF5 1.14) beside the venv, for the readers' test"
    # an older h5py (HDF5 1.14) beside the venv's, for tests/test_hdf5_readers.py: it must read our files too
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --upgrade --target "$venv/old-h5py" \
      h5py==3.12.1 2>&1 | grep -v '^WARNING: Location' || true
    PYTHONPATH="$venv/old-h5py" "$venv/bin/python" -c "import h5py; assert h5py.version.hdf5_version.startswith('1.14')"
  fi
  touch "$stamp"
  step "done"
fi
export PATH="$venv/bin:$PATH"
