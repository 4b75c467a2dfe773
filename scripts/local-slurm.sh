#!/usr/bin/env bash
# A real single-node Slurm on this machine, for tests and trying the templates: munge, MariaDB,
# slurmdbd (accounting: submitit needs sacct), slurmctld and slurmd, all with their state, logs
# and configs under one folder. Needs root and Debian's slurm-wlm, slurmdbd, mariadb-server and
# munge: `up` installs them with scripts/system-deps.sh when one is missing.
#
#   eval "$(scripts/local-slurm.sh up [DIR])"   start everything (idempotent) and point this shell at
#                                              it: `up` prints `export SLURM_CONF=...` on stdout
#   scripts/local-slurm.sh down [DIR]           stop everything this script started in DIR
#
# DIR defaults to $HPC_SLURM_DIR or /tmp/hpc-slurm. The node advertises this machine's CPUs
# (HPC_SLURM_CPUS overrides: the tests ask for 8, to place 4-rank MPI jobs on 2 cores; they time
# nothing) and 2 GPUs (device nodes standing in for GPUs: GRES bookkeeping and
# CUDA_VISIBLE_DEVICES only).
set -euo pipefail
cmd="${1:-}"
dir="$(realpath -m "${2:-${HPC_SLURM_DIR:-/tmp/hpc-slurm}}")"
conf="$dir/etc/slurm.conf"
munge_socket="$dir/munge/munge.socket"   # a munged per instance: several instances run side by side

log() { echo "local-slurm: $*" >&2; }

wait_for() {   # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2; shift 2
    for _ in $(seq $((limit * 10))); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    log "timed out waiting for $what"
    return 1
}

stop_pidfile() {
    local f=$1
    [ -f "$f" ] || return 0
    local pid
    pid=$(cat "$f" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

write_configs() {
    mkdir -p "$dir"/{etc,state,spool,log,run,db,gres}
    local mem
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
    for i in 0 1; do
        [ -e "$dir/gres/fakegpu$i" ] || mknod "$dir/gres/fakegpu$i" c 1 3
    done
    cat >"$conf" <<EOF
ClusterName=hpc
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5,socket=$munge_socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=${HPC_SLURMCTLD_PORT:-6817}
SlurmdPort=${HPC_SLURMD_PORT:-6818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=${HPC_SLURMDBD_PORT:-6819}
AccountingStoragePass=$munge_socket
JobCompType=jobcomp/none
DependencyParameters=kill_invalid_depend
KillOnBadExit=1
MinJobAge=300
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 CPUs=${HPC_SLURM_CPUS:-$(nproc)} RealMemory=$mem Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$dir/etc/gres.conf" <<EOF
AutoDetect=off
Name=gpu File=$dir/gres/fakegpu[0-1]
EOF
    cat >"$dir/etc/mpi.conf" <<EOF
PMIxCliTmpDirBase=$dir/run
EOF
    cat >"$dir/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$munge_socket
DbdHost=localhost
DbdPort=${HPC_SLURMDBD_PORT:-6819}
SlurmUser=root
PidFile=$dir/run/slurmdbd.pid
LogFile=$dir/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=${HPC_MARIADB_PORT:-13306}
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$dir/etc/slurmdbd.conf"
}

start_munge() {   # its own socket, named in the configs (AuthInfo), so one instance's down never cuts off another
    munge -n --socket="$munge_socket" 2>/dev/null | unmunge --socket="$munge_socket" >/dev/null 2>&1 && return 0
    mkdir -p "$dir/munge"   # munged runs as munge: its files live where that user can reach them
    chown munge:munge "$dir/munge"
    chmod 755 "$dir/munge"
    runuser -u munge -- munged --socket="$munge_socket" --pid-file="$dir/munge/munged.pid" \
        --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" --force
    wait_for 10 munge sh -c "munge -n --socket='$munge_socket' | unmunge --socket='$munge_socket'"
    cp "$dir/munge/munged.pid" "$dir/run/munged.pid"
}

start_mariadb() {
    [ -f "$dir/run/mariadb.pid" ] && kill -0 "$(cat "$dir/run/mariadb.pid")" 2>/dev/null && return 0
    # its temporary files in a folder of its own: the caller's TMPDIR may be private to root
    mkdir -p "$dir/db/tmp"
    chown -R mysql:mysql "$dir/db"
    if [ ! -d "$dir/db/data/mysql" ]; then
        mkdir -p "$dir/db/data"
        chown mysql:mysql "$dir/db/data"
        TMPDIR="$dir/db/tmp" mariadb-install-db --user=mysql --datadir="$dir/db/data" \
            --auth-root-authentication-method=socket >"$dir/log/mariadb-install.log" 2>&1
    fi
    (TMPDIR="$dir/db/tmp" setsid mariadbd --user=mysql --datadir="$dir/db/data" --tmpdir="$dir/db/tmp" \
        --socket="$dir/db/mysqld.sock" \
        --pid-file="$dir/db/mariadb.pid" --port="${HPC_MARIADB_PORT:-13306}" --bind-address=127.0.0.1 \
        --log-error="$dir/log/mariadb.log" --skip-name-resolve </dev/null >/dev/null 2>&1 &)
    wait_for 60 mariadb mariadb --socket="$dir/db/mysqld.sock" -e "select 1"
    cp "$dir/db/mariadb.pid" "$dir/run/mariadb.pid"
    mariadb --socket="$dir/db/mysqld.sock" <<EOF
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF
}

up() {
    [ "$(id -u)" -eq 0 ] || { log "needs root"; exit 1; }
    for tool in munged mariadbd slurmdbd slurmctld slurmd; do
        if ! command -v "$tool" >/dev/null; then
            log "$tool is missing: installing the system packages (scripts/system-deps.sh)"
            bash "$(dirname "${BASH_SOURCE[0]}")/system-deps.sh" >&2
            command -v "$tool" >/dev/null || { log "still missing $tool after scripts/system-deps.sh"; exit 1; }
        fi
    done
    write_configs
    chmod 755 "$dir"
    if ! runuser -u mysql -- test -x "$dir/db"; then
        log "the mysql user cannot reach $dir (a parent folder is private): choose another DIR"
        exit 1
    fi
    export SLURM_CONF="$conf"
    start_munge
    start_mariadb
    if ! { [ -f "$dir/run/slurmdbd.pid" ] && kill -0 "$(cat "$dir/run/slurmdbd.pid")" 2>/dev/null; }; then
        slurmdbd   # reads slurmdbd.conf next to $SLURM_CONF
        wait_for 30 slurmdbd sacctmgr -i list cluster
    fi
    if ! { [ -f "$dir/run/slurmctld.pid" ] && kill -0 "$(cat "$dir/run/slurmctld.pid")" 2>/dev/null; }; then
        slurmctld -f "$conf"
        wait_for 30 slurmctld scontrol ping
    fi
    if ! { [ -f "$dir/run/slurmd.pid" ] && kill -0 "$(cat "$dir/run/slurmd.pid")" 2>/dev/null; }; then
        slurmd -f "$conf" -N localhost
    fi
    wait_for 60 "a job step to run" srun -t 1 -N 1 true
    log "up: $dir"
    echo "export SLURM_CONF=$conf"
}

down() {
    export SLURM_CONF="$conf"
    [ -f "$conf" ] && scancel --state=PENDING,RUNNING -u root >/dev/null 2>&1 || true
    stop_pidfile "$dir/run/slurmd.pid"
    stop_pidfile "$dir/run/slurmctld.pid"
    stop_pidfile "$dir/run/slurmdbd.pid"
    stop_pidfile "$dir/run/mariadb.pid"
    stop_pidfile "$dir/run/munged.pid"
    log "down: $dir"
}

case "$cmd" in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down [DIR]" >&2; exit 2 ;;
esac
