#!/usr/bin/env bash
# A real two-node Slurm cluster on this one host, for the tests and the slurm-local site:
# our own munged, slurmctld, and one slurmd per node (n1 at 127.0.0.2, n2 at 127.0.0.3).
#
#   scripts/slurm_cluster.sh start    # install (apt) when missing, start, wait until both nodes are idle
#   scripts/slurm_cluster.sh status   # exit 0 when both nodes answer, 3 when the cluster is not up
#   scripts/slurm_cluster.sh stop     # cancel its jobs, stop only the daemons this script started
#   scripts/slurm_cluster.sh env      # the line to point Slurm's commands at it: export SLURM_CONF=...
#
# Everything lives in $HPCML_SLURM_DIR (default /tmp/hpcml-slurm): slurm.conf, munge socket,
# spool, logs, pid files. Idempotent: start on a running cluster and stop on a stopped one do
# nothing. Needs root (slurmd runs jobs as their users). Why each setting: docs/sites/slurm-local.md.
set -euo pipefail

STATE=${HPCML_SLURM_DIR:-/tmp/hpcml-slurm}
CONF=$STATE/slurm.conf
CTLD_PORT=${HPCML_SLURM_PORT:-6817}
NODES=(n1 n2)
ADDRS=(127.0.0.2 127.0.0.3)
PORTS=(17001 17002)
CPUS=${HPCML_SLURM_CPUS:-4}   # per node: more than this host's cores, as the tests oversubscribe
export SLURM_CONF=$CONF

say() { echo "[slurm-cluster] $*" >&2; }
die() { say "error: $*"; exit 1; }

alive() {  # alive PIDFILE: the process named in it runs
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
    local missing=()
    for cmd in slurmctld slurmd sbatch munged; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "${HPCML_SKIP_APT:-0}" = 1 ] && die "missing ${missing[*]} and HPCML_SKIP_APT=1"
    [ "$(id -u)" -eq 0 ] || die "missing ${missing[*]}: run as root to apt-get install them"
    say "apt-get install slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1 || {
        apt-get update -qq  # a fresh machine may have no package lists yet
        apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
    }
    [ -s /etc/munge/munge.key ] || die "no /etc/munge/munge.key after installing munge (create one with mungekey)"
}

write_conf() {
    mkdir -p "$STATE/munge" "$STATE/ctld"
    chown slurm:slurm "$STATE/ctld"
    chown munge:munge "$STATE/munge"
    chmod 755 "$STATE/munge"  # slurmctld runs as slurm and must reach the socket
    local mem
    mem=$(awk '/MemTotal/ {print int($2 / 1024 / 4)}' /proc/meminfo)  # MiB per node: a quarter each
    {
        echo "# Written by scripts/slurm_cluster.sh: two nodes on one host (docs/sites/slurm-local.md)."
        echo "ClusterName=hpcmltest"
        echo "SlurmctldHost=localhost"
        echo "SlurmctldPort=$CTLD_PORT"
        echo "SlurmUser=slurm"
        echo "AuthType=auth/munge"
        # cred_expire: a requeued job may start again this many seconds after it ended (default 120)
        echo "AuthInfo=socket=$STATE/munge/munge.socket,cred_expire=${HPCML_SLURM_CRED_EXPIRE:-10}"
        echo "CredType=cred/munge"
        echo "StateSaveLocation=$STATE/ctld"
        echo "SlurmdSpoolDir=$STATE/slurmd-%n"
        echo "SlurmctldPidFile=$STATE/slurmctld.pid"
        echo "SlurmdPidFile=$STATE/slurmd-%n.pid"
        echo "SlurmctldLogFile=$STATE/ctld/slurmctld.log"
        echo "MailProg=/bin/true"
        echo "SlurmdLogFile=$STATE/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "MpiDefault=pmi2"
        echo "ReturnToService=1"  # a node the tests set DOWN stays down until state=resume
        echo "SchedulerType=sched/backfill"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "SlurmdParameters=config_overrides"
        # Fast turnaround for tests: react to lost nodes and finished jobs within seconds.
        echo "SlurmdTimeout=30"
        echo "MinJobAge=300"
        echo "KillWait=10"
        echo "SchedulerParameters=defer_batch=0,sched_interval=2,bf_interval=2"
        for i in "${!NODES[@]}"; do
            echo "NodeName=${NODES[$i]} NodeHostname=${NODES[$i]} NodeAddr=${ADDRS[$i]} Port=${PORTS[$i]}" \
                 "CPUs=$CPUS RealMemory=$mem State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
    } >"$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
    chmod 644 "$CONF"
}

start_munge() {
    alive "$STATE/munge/munged.pid" && return 0
    rm -f "$STATE/munge/munge.socket" "$STATE/munge/munge.socket.lock"
    runuser -u munge -- munged --socket="$STATE/munge/munge.socket" --pid-file="$STATE/munge/munged.pid" \
        --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/munged.seed" --force
    for _ in $(seq 50); do [ -S "$STATE/munge/munge.socket" ] && return 0; sleep 0.1; done
    die "munged did not start: $(tail -n 3 "$STATE/munge/munged.log" 2>/dev/null)"
}

nodes_idle() {  # both nodes answer and are schedulable (idle, mixed or allocated)
    local states
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
    for n in "${NODES[@]}"; do
        grep -Eq "^$n (idle|mix|alloc)$" <<<"$states" || return 1
    done
}

start() {
    [ "$(id -u)" -eq 0 ] || die "start needs root (slurmd runs jobs as their users)"
    install_packages
    if alive "$STATE/slurmctld.pid" && nodes_idle; then
        say "already up ($CONF)"
        return 0
    fi
    write_conf
    start_munge
    if ! alive "$STATE/slurmctld.pid"; then
        rm -f "$STATE/ctld/slurmctld.log"
        slurmctld -i -f "$CONF"  # -i: forget jobs of an earlier cluster in this directory
    fi
    for n in "${NODES[@]}"; do
        mkdir -p "$STATE/slurmd-$n"
        alive "$STATE/slurmd-$n.pid" || slurmd -N "$n" -f "$CONF"
    done
    for _ in $(seq 120); do
        if nodes_idle; then
            say "up: nodes ${NODES[*]} idle ($CONF)"
            return 0
        fi
        # a node left down by an earlier run (state=down in the tests) comes back
        for n in "${NODES[@]}"; do
            if sinfo -h -n "$n" -o '%t' 2>/dev/null | grep -Eq '^(down|drain|drng)'; then
                scontrol update nodename="$n" state=resume 2>/dev/null || true
            fi
        done
        sleep 0.5
    done
    sinfo -N >&2 || true
    die "nodes not idle after 60 s; logs in $STATE"
}

stop() {
    if alive "$STATE/slurmctld.pid"; then
        scancel --full --quiet --user "$(id -un)" 2>/dev/null || true
        for _ in $(seq 40); do [ -z "$(squeue -h -t R,CG 2>/dev/null)" ] && break; sleep 0.5; done
    fi
    local f
    for f in "$STATE"/slurmd-*.pid "$STATE/slurmctld.pid" "$STATE/munge/munged.pid"; do
        [ -e "$f" ] || continue
        if alive "$f"; then
            local pid
            pid=$(cat "$f")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$f"
    done
    say "stopped"
}

status() {
    if alive "$STATE/slurmctld.pid" && nodes_idle; then
        sinfo -N
        return 0
    fi
    say "not up"
    return 3
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
