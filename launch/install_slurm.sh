#!/usr/bin/env bash
# A one-machine Slurm cluster from Debian's packages: to try `rlx submit` on a workstation, and for
# tests/test_slurm.py. Needs root and apt-get (Debian/Ubuntu).
#
#   bash launch/install_slurm.sh [DIR]         install slurmctld, slurmd, slurm-client and munge (apt) if
#                                             missing, and write DIR/slurm.conf and a munge key in DIR
#   bash launch/install_slurm.sh start [DIR]   start munged, slurmctld and slurmd (pid files in DIR) and
#                                             wait until the node is idle
#   bash launch/install_slurm.sh stop [DIR]    stop exactly those daemons, by their pid files
# DIR defaults to /tmp/rlx-slurm. Then:  export SLURM_CONF=DIR/slurm.conf; sinfo; rlx submit ...
# Idempotent: packages already installed and files already written are reused; start on a running
# cluster and stop on a stopped one do nothing. Nothing outside DIR is configured or started (the
# packages' own services are not enabled); ports: RLX_SLURMCTLD_PORT (6817) and RLX_SLURMD_PORT (6818).
set -euo pipefail

cmd=configure
case "${1:-}" in start|stop|configure) cmd=$1; shift ;; esac
DIR=$(realpath -m "${1:-/tmp/rlx-slurm}")
CTLD_PORT=${RLX_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${RLX_SLURMD_PORT:-6818}
NODE=$(hostname -s)
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF

log() { echo "[install_slurm] $*"; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
      && command -v munged >/dev/null; then
    return
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install_slurm.sh: installing Slurm needs root and apt-get (Debian/Ubuntu)" >&2
    exit 2
  fi
  log "installing slurmctld slurmd slurm-client munge from the distribution's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # policy-rc.d 101: the packages' services are not started (this script starts its own daemons).
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' > $policy; chmod +x $policy; made_policy=1; fi
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
  [ $made_policy = 1 ] && rm -f $policy
  true
}

configure() {
  mkdir -p "$DIR"/{state,spool,log,munge}
  chmod 700 "$DIR/munge"
  if [ ! -s "$DIR/munge/munge.key" ]; then
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$DIR/munge/munge.key"
  fi
  local cpus; cpus=$(nproc)
  cat > "$CONF.new" <<EOF
# One-machine Slurm cluster written by launch/install_slurm.sh (rlx). Everything lives in $DIR.
ClusterName=rlx
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (Slurm's default: 120 s);
# this one-node test cluster requeues preempted jobs after 10 s.
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# No cgroups (containers rarely allow them): processes are tracked by their parent chain.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# A pending job (a requeued one once cred_expire has passed) is looked at every 2 s, not every 30-60 s
# (Slurm's defaults: bf_interval 30, sched_interval 60): cheap with one node and a few jobs.
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
ReturnToService=2
KillWait=10
MinJobAge=600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  if ! cmp -s "$CONF.new" "$CONF"; then mv "$CONF.new" "$CONF"; else rm -f "$CONF.new"; fi
  log "configured a one-node cluster ($NODE, $cpus CPUs) in $DIR; export SLURM_CONF=$CONF"
}

running() {  # running NAME: the daemon whose pid file is DIR/NAME.pid is alive
  local pid; pid=$(cat "$DIR/$1.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

start() {
  [ -f "$CONF" ] || configure
  if ! running munged; then
    munged --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
      --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munge.seed" --force
  fi
  running slurmctld || slurmctld -f "$CONF"
  running slurmd || slurmd -f "$CONF" -N "$NODE"
  log "waiting for node $NODE"
  local state=""
  for _ in $(seq 60); do
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    case "$state" in
      idle*|mixed*|allocated*) log "node $NODE is $state: sbatch works (SLURM_CONF=$CONF)"; return 0 ;;
      down*|drain*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 1
  done
  echo "install_slurm.sh: node $NODE did not become idle within 60 s (state: ${state:-unknown}); see $DIR/log/" >&2
  exit 1
}

stop() {
  local name pid
  for name in slurmd slurmctld munged; do
    pid=$(cat "$DIR/$name.pid" 2>/dev/null) || continue
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
      log "stopped $name ($pid)"
    fi
    rm -f "$DIR/$name.pid"
  done
}

case $cmd in
  configure) install_packages; configure ;;
  start) install_packages; start ;;
  stop) stop ;;
esac
