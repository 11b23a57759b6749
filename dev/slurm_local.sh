#!/usr/bin/env bash
# A one-node SLURM on this machine, for tests/test_slurm.py and for trying launch.py before a real
# cluster (docs/cluster.md): installs Debian's slurm-wlm and munge where missing, writes a slurm.conf
# naming this host with its real CPUs and memory (slurmd -C), every daemon addressed on 127.0.0.1
# whatever the host name resolves to, starts munged, slurmctld and slurmd, and waits until sinfo
# shows the node idle. Idempotent: a second run with the daemons up and the same config does nothing.
# Needs root (or sudo). Short MinJobAge, KillWait and timeouts, so tests do not wait on the scheduler.
#
#   dev/slurm_local.sh          # then: sinfo; python launch.py --cluster=slurm --gpus_per_node=0 ...
#   dev/slurm_local.sh --stop   # stop the three daemons
set -euo pipefail
SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo "sudo -n")  # -n: never a password prompt (CI)
CONF=/etc/slurm/slurm.conf
STATE=/var/lib/slurm-local  # slurmctld's state and slurmd's spool, this script's own
LOGS=/var/log/slurm-local

daemon_up() {  # a pid file whose process is alive
    [ -f "$1" ] && $SUDO kill -0 "$($SUDO cat "$1")" 2>/dev/null
}

if [ "${1:-}" = --stop ]; then
    for pidfile in /run/slurmd-local.pid /run/slurmctld-local.pid /run/munge/munged.pid; do
        daemon_up "$pidfile" && $SUDO kill "$($SUDO cat "$pidfile")"
    done
    exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    echo "slurm_local: installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 ||
        { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q slurm-wlm munge >/dev/null; }
fi

HOST=$(hostname -s)
# slurmd -C: this machine as slurmd sees it (CPUs, sockets, cores, threads, RealMemory); its UpTime line is not config
NODE=$(slurmd -C | grep '^NodeName=' | sed "s/^NodeName=[^ ]*/NodeName=$HOST NodeAddr=127.0.0.1 NodeHostname=$HOST/")
CONFIG="# written by dev/slurm_local.sh: a one-node SLURM on $HOST
ClusterName=nanodepth
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# a requeued job waits this long before it may start again (the default 120 s; the tests requeue)
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=/run/slurmctld-local.pid
SlurmdPidFile=/run/slurmd-local.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=5
KillWait=5
InactiveLimit=0
Waittime=0
SlurmdTimeout=60
MessageTimeout=10
$NODE State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP"

changed=0
if ! [ -f "$CONF" ] || [ "$($SUDO cat "$CONF")" != "$CONFIG" ]; then
    $SUDO mkdir -p /etc/slurm
    printf '%s\n' "$CONFIG" | $SUDO tee "$CONF.tmp" >/dev/null && $SUDO mv "$CONF.tmp" "$CONF"
    changed=1
fi
$SUDO mkdir -p "$STATE/ctld" "$STATE/d" "$LOGS" /run/munge
$SUDO chown munge:munge /run/munge

if ! daemon_up /run/munge/munged.pid; then
    [ -f /etc/munge/munge.key ] || $SUDO mungekey --create --keyfile=/etc/munge/munge.key
    $SUDO chown munge:munge /etc/munge/munge.key && $SUDO chmod 600 /etc/munge/munge.key
    $SUDO -u munge munged --force 2>/dev/null || $SUDO runuser -u munge -- munged --force
fi
if [ "$changed" = 1 ]; then  # a new config: restart whatever runs on the old one
    for pidfile in /run/slurmd-local.pid /run/slurmctld-local.pid; do
        if daemon_up "$pidfile"; then
            pid=$($SUDO cat "$pidfile")
            $SUDO kill "$pid"
            while $SUDO kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
        fi
    done
fi
daemon_up /run/slurmctld-local.pid || $SUDO slurmctld
daemon_up /run/slurmd-local.pid || $SUDO slurmd

for _ in $(seq 120); do
    state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)
    case "$state" in
        idle|mix|alloc) echo "slurm_local: node $HOST $state ($(echo "$NODE" | grep -o 'CPUs=[0-9]*') $(echo "$NODE" | grep -o 'RealMemory=[0-9]*') MB)"; exit 0 ;;
        down*|drain*) $SUDO scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.5
done
echo "slurm_local: node $HOST is not idle after 60 s (sinfo: ${state:-no answer}); see $LOGS" >&2
exit 1
