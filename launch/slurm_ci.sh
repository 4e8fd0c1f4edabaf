#!/usr/bin/env bash
# launch/slurm_ci.sh: a real, throwaway SLURM cluster on this one Debian host, for tests/test_slurm.py.
#   bash launch/slurm_ci.sh up | down | status | run CMD...    (run = up, CMD, down; exits with CMD's status)
# Debian's slurm-wlm and munge run as plain background processes: munged,
# slurmctld and MCP_SLURM_NODES slurmd, each its own "node" on its own port, all on 127.0.0.1. No cgroups,
# no accounting database: proctrack/linuxproc, task/none; finished jobs stay visible to `scontrol show job`
# for an hour (MinJobAge), which is where their exit codes are read. Must run as root.
# System changes only with MCP_ALLOW_SYSTEM_CHANGES=1 (.ci/run sets it): installing slurm-wlm and munge with
# apt-get where they are missing (they stay installed) and adding the node names to /etc/hosts (removed by
# `down`); without it `up` exits 3 where it would need either.
# Env: MCP_SLURM_DIR   state, config and logs (default /tmp/mcp-slurm-ci; keep it short: munge's socket path)
#      MCP_SLURM_NODES number of nodes (default 2), named mcpci1, mcpci2, ... (added to /etc/hosts, see above)
#      MCP_SLURM_CPUS  CPUs each node claims (default 2; may exceed the real cores)
#      MCP_SLURM_PORT  slurmctld's port; node i listens on PORT + i (default 17917)
#      MCP_SLURM_WAIT  seconds to wait for a daemon to come up or go down (default 60)
# Clients: export SLURM_CONF=$MCP_SLURM_DIR/slurm.conf. Exit status 3 from `up`: SLURM cannot run here (not
# root, SLURM missing and no apt-get or apt-get failed, /etc/hosts not writable, a system change needed without
# MCP_ALLOW_SYSTEM_CHANGES=1), so callers can skip.
# `down` stops only what `up` started: the PIDs recorded in $MCP_SLURM_DIR/pids, and slurmstepd processes
# that carry this cluster's marker in their environment (slurmd hands its environment to them).
set -euo pipefail
D=${MCP_SLURM_DIR:-/tmp/mcp-slurm-ci}
NODES=${MCP_SLURM_NODES:-2}
CPUS=${MCP_SLURM_CPUS:-2}
PORT=${MCP_SLURM_PORT:-17917}
WAIT=${MCP_SLURM_WAIT:-60}
export SLURM_CONF=$D/slurm.conf
MARK="MCP_SLURM_CI=$D"                 # environment marker of every daemon we start
HOSTS_TAG="# mcp-slurm-ci $D"

log() { echo "slurm_ci: $*" >&2; }
node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "mcpci$i"; done; }

# alive, not a zombie, and started by us (its environment carries our marker)
is_ours() {
  local pid=${1:-}
  [[ -n $pid && -r /proc/$pid/environ ]] || return 1
  [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]] || return 1
  tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF "$MARK"
}

start() {   # start NAME CMD...: in the background with our marker, PID recorded
  local name=$1; shift
  env "$MARK" "$@" >"$D/log/$name.stdout" 2>&1 </dev/null &
  echo $! >"$D/pids/$name"
}

wait_until() {   # wait_until DESCRIPTION CMD...: poll CMD every 0.5 s for up to $WAIT s
  local what=$1 i; shift
  for ((i = 0; i < WAIT * 2; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
  log "gave up waiting for $what"; return 1
}

install_slurm() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return 0
  if [[ ${MCP_ALLOW_SYSTEM_CHANGES:-0} != 1 ]]; then
    log "slurm-wlm/munge missing; set MCP_ALLOW_SYSTEM_CHANGES=1 to let this install them with apt-get"; return 3
  fi
  if [[ $(id -u) != 0 ]]; then log "slurm-wlm/munge missing and not root: cannot install"; return 3; fi
  if ! command -v apt-get >/dev/null; then log "slurm-wlm/munge missing and no apt-get: cannot install"; return 3; fi
  log "installing slurm-wlm and munge (apt-get)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           slurm-wlm munge; } >"${TMPDIR:-/tmp}/mcp-slurm-ci-apt.log" 2>&1; then
    tail -n 20 "${TMPDIR:-/tmp}/mcp-slurm-ci-apt.log" >&2; log "apt-get failed: cannot install"; return 3
  fi
}

write_conf() {
  local mem i=0 n
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / NODES ))
  cat >"$SLURM_CONF" <<EOF
# Written by launch/slurm_ci.sh: a one-host test cluster, everything under $D.
ClusterName=mcpci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.sock
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
# plain processes: no cgroups in a container, so no cgroup tracking, binding or accounting
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# nodes claim CPUs and memory the host may not have (several slurmd share it)
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=5
MailProg=/bin/true
EOF
  for n in $(node_names); do
    i=$((i + 1)); mkdir -p "$D/spool/$n"
    echo "NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$CPUS" \
         "RealMemory=$mem State=UNKNOWN" >>"$SLURM_CONF"
  done
  echo "PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$SLURM_CONF"
}

add_hosts() {   # job scripts use node names as MASTER_ADDR: they must resolve
  local missing=() n
  for n in $(node_names); do getent hosts "$n" >/dev/null || missing+=("$n"); done
  ((${#missing[@]} == 0)) && return 0
  if [[ ${MCP_ALLOW_SYSTEM_CHANGES:-0} != 1 ]]; then
    log "${missing[*]} do not resolve; set MCP_ALLOW_SYSTEM_CHANGES=1 to let this add them to /etc/hosts"; return 3
  fi
  if ! echo "127.0.0.1 ${missing[*]} $HOSTS_TAG" 2>/dev/null >>/etc/hosts; then
    log "cannot add ${missing[*]} to /etc/hosts (read-only?): node names would not resolve"; return 3
  fi
}

remove_hosts() {   # rewrite in place: /etc/hosts may be a bind mount that cannot be replaced
  grep -qF "$HOSTS_TAG" /etc/hosts 2>/dev/null || return 0
  local kept; kept=$(grep -vF "$HOSTS_TAG" /etc/hosts || true)
  printf '%s\n' "$kept" >/etc/hosts
}

all_idle() { [[ $(sinfo -h -t idle -o %D 2>/dev/null) == "$NODES" ]]; }

up() {
  if [[ $(id -u) != 0 ]]; then log "must run as root (slurmd runs jobs as any user; /etc/hosts)"; return 3; fi
  install_slurm || return $?
  if is_ours "$(cat "$D/pids/slurmctld" 2>/dev/null)"; then log "already up ($D)"; return 0; fi
  down >/dev/null 2>&1 || true                 # leftovers of an interrupted run in the same directory
  rm -rf "$D"
  mkdir -p "$D"/{munge,log,pids,run,state,spool}
  chmod 755 "$D" "$D/munge"                    # munged refuses a group/world-writable socket directory
  head -c 1024 /dev/urandom >"$D/munge/munge.key"; chmod 600 "$D/munge/munge.key"
  write_conf
  add_hosts || return $?
  start munged munged --foreground --socket="$D/munge/munge.sock" --key-file="$D/munge/munge.key" \
    --pid-file="$D/run/munged.pid" --seed-file="$D/munge/seed" --log-file="$D/log/munged.log"
  if ! wait_until munged munge -n -S "$D/munge/munge.sock"; then
    cat "$D/log/munged.stdout" "$D/log/munged.log" >&2 2>/dev/null || true; down; return 1
  fi
  start slurmctld slurmctld -D -i -f "$SLURM_CONF"
  for n in $(node_names); do start "slurmd-$n" slurmd -D -f "$SLURM_CONF" -N "$n"; done
  if ! wait_until "$NODES idle nodes" all_idle; then
    tail -n 30 "$D"/log/*.log >&2 || true; sinfo -N >&2 || true; down; return 1
  fi
  sinfo -N
}

down() {
  [[ -d $D/pids ]] || return 0
  local name pid i
  if is_ours "$(cat "$D/pids/slurmctld" 2>/dev/null)"; then   # jobs first: slurmstepd ends their tasks
    scancel --partition=ci >/dev/null 2>&1 || true
    wait_until "the queue to drain" test -z "$(squeue -h 2>/dev/null)" || true
  fi
  # slurmd before slurmctld before munged: each stops while what it talks to is still up
  for name in $(ls "$D/pids" | sort -r); do
    pid=$(cat "$D/pids/$name"); is_ours "$pid" || continue
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < WAIT * 5; i++)); do is_ours "$pid" || break; sleep 0.2; done
    if is_ours "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  # a slurmstepd of ours that outlived its slurmd (it inherited slurmd's environment, marker included)
  for pid in $(pgrep -x slurmstepd || true); do
    if is_ours "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  rm -f "$D"/pids/*
  remove_hosts
}

status() {
  local f
  for f in "$D"/pids/*; do
    [[ -e $f ]] || continue
    if is_ours "$(cat "$f")"; then echo "$(basename "$f"): up, pid $(cat "$f")"; else echo "$(basename "$f"): down"; fi
  done
  sinfo -N 2>/dev/null || true
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) status ;;
  run)
    shift; (($#)) || { echo "usage: $0 run CMD..." >&2; exit 2; }
    up || exit $?
    trap down EXIT
    rc=0; "$@" || rc=$?
    exit "$rc" ;;
  *) echo "usage: $0 up|down|status|run CMD..." >&2; exit 2 ;;
esac
