#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for testing lingua.stool (run as root; idempotent).
#
#   sudo bash setup/slurm_local.sh        # installs slurmctld/slurmd/munge if missing, starts them
#
# The node declares more CPUs than the machine has (SLURM_LOCAL_CPUS, default 8) with
# SlurmdParameters=config_overrides, so a 3-task job runs on a 2-core machine. One partition,
# `debug`, the default, without a time limit. Requeue is on (JobRequeue=1) so preemption can be tested.
# Daemons are started directly (containers have no systemd) and left running.
set -euo pipefail

CPUS="${SLURM_LOCAL_CPUS:-8}"
PARTITION="${SLURM_LOCAL_PARTITION:-debug}"
WAIT_S="${SLURM_LOCAL_WAIT_S:-60}"
CONF=/etc/slurm/slurm.conf

die() { echo "slurm_local.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts slurmctld/slurmd/munged)."

# ---- packages ----
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
    || ! command -v sbatch >/dev/null; then
    command -v apt-get >/dev/null || die "slurm is not installed and apt-get is not available to install it."
    export DEBIAN_FRONTEND=noninteractive
    pkgs="slurmctld slurmd slurm-client munge"
    # Try without refreshing the package lists first; refresh once if that fails.
    apt-get install -y --no-install-recommends $pkgs >/dev/null 2>&1 \
        || { apt-get update >/dev/null && apt-get install -y --no-install-recommends $pkgs >/dev/null; } \
        || die "apt-get install $pkgs failed."
fi

HOST="$(hostname -s)"
getent hosts "$HOST" >/dev/null || die "hostname '$HOST' does not resolve; add it to /etc/hosts."
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))

# ---- slurm.conf (rewritten only when it changes, so a second run does not restart anything) ----
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm
chown slurm:slurm /var/spool/slurmctld /var/log/slurm
NEW_CONF="$(cat <<EOF
# Written by lingua setup/slurm_local.sh: a one-node test cluster.
ClusterName=lingua
SlurmctldHost=${HOST}
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
JobRequeue=1
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=30
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=60
SlurmdTimeout=60
NodeName=${HOST} CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN
PartitionName=${PARTITION} Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP
EOF
)"
CONF_CHANGED=0
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$NEW_CONF" ]; then
    printf '%s\n' "$NEW_CONF" > "$CONF"
    CONF_CHANGED=1
fi

# ---- munge: key owned by munge, daemon running as the munge user ----
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge /etc/munge/munge.key
chmod 700 /etc/munge
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
chmod 755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    # --force: a stale socket left by a killed munged must not block the restart.
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 1 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.5; done
    munge -n | unmunge >/dev/null || die "munged did not start; see /var/log/munge/munged.log."
fi

# ---- slurmctld / slurmd ----
pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop_daemon() {  # by pid file only: never by name, other people's processes live on this machine
    local pidfile=$1
    if pid_alive "$pidfile"; then
        local pid; pid="$(cat "$pidfile")"
        kill "$pid"
        for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
        die "daemon $pid ($pidfile) did not stop."
    fi
}
if [ "$CONF_CHANGED" = 1 ]; then
    stop_daemon /run/slurm/slurmd.pid
    stop_daemon /run/slurm/slurmctld.pid
fi
pid_alive /run/slurm/slurmctld.pid || slurmctld || die "slurmctld failed to start; see /var/log/slurm/slurmctld.log."
for _ in $(seq 1 40); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.5; done
scontrol ping | grep -q UP || die "slurmctld is not answering; see /var/log/slurm/slurmctld.log."
pid_alive /run/slurm/slurmd.pid || slurmd || die "slurmd failed to start; see /var/log/slurm/slurmd.log."

# ---- wait for the node (bounded) ----
state=""
for _ in $(seq 1 $(( WAIT_S * 2 ))); do
    state="$(sinfo -h -n "$HOST" -o %t 2>/dev/null | head -1)"
    case "$state" in
        idle|mix|alloc|comp) break ;;
        down*|drain*|drng*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
done
case "$state" in
    idle|mix|alloc|comp) echo "slurm_local.sh: node $HOST is $state in partition $PARTITION ($CPUS CPUs declared)." ;;
    *) die "node $HOST is '${state:-unknown}' after ${WAIT_S}s; see /var/log/slurm/slurmd.log and slurmctld.log." ;;
esac
