#!/usr/bin/env bash
# System packages the project needs beyond Python: a C++ compiler, Debian's Open MPI (the reward
# pool; the mpi4py wheel loads its libmpi) and Slurm with accounting (munge, MariaDB, slurmdbd) for
# the cluster tests. Installed with apt where missing; idempotent.
set -euo pipefail
missing=()
command -v g++ >/dev/null || missing+=(g++)
# the results files' kill-point sweep (tests/test_results_journal.py) injects SIGKILL through strace
command -v strace >/dev/null || missing+=(strace)
# HDF5 1.10's own h5dump and h5ls: the tests open every kind of results file with them
command -v h5dump >/dev/null || missing+=(hdf5-tools)
command -v mpirun >/dev/null || missing+=(openmpi-bin libopenmpi-dev)
ls /usr/lib/*/libpmix.so.2 >/dev/null 2>&1 || missing+=(libpmix2)
# a real single-node Slurm for the tests and the templates (scripts/local-slurm.sh)
command -v slurmctld >/dev/null || missing+=(slurm-wlm)
command -v slurmdbd >/dev/null || missing+=(slurmdbd)
command -v mariadbd >/dev/null || missing+=(mariadb-server)
command -v munged >/dev/null || missing+=(munge)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "error: missing system packages: ${missing[*]} (install them, or run this as root on Debian)" >&2
    exit 1
  fi
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
