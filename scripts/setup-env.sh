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
if [ ! -f "$stamp" ]; then
  # torch==2.13.0 first and alone: it resolves to the CPU wheel on local disk where there is one.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch>=2.11,<2.15" 2>&1 | grep -v '^WARNING: Location' || true
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root${1:+[$1]}" 2>&1 | grep -v '^WARNING: Location' || true
  # -W ignore: megatron-core warns on import that Transformer Engine and Apex are absent
  "$venv/bin/python" -W ignore -c "import hpc, torch, h5py, yaml, mpi4py, submitit, megatron.core, tokenizers, safetensors"
  if [ "${1:-}" = test ]; then
    "$venv/bin/python" -c "import pytest, xdist, transformers, openai"
    # an older h5py (HDF5 1.14) beside the venv's, for tests/test_hdf5_readers.py: it must read our files too
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --upgrade --target "$venv/old-h5py" \
      h5py==3.12.1 2>&1 | grep -v '^WARNING: Location' || true
    PYTHONPATH="$venv/old-h5py" "$venv/bin/python" -c "import h5py; assert h5py.version.hdf5_version.startswith('1.14')"
  fi
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
