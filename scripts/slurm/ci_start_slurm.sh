#!/usr/bin/env bash
# Start (or stop) a REAL two-node Slurm cluster on one machine, for CI and for trying the sbatch script.
#
#   scripts/slurm/ci_start_slurm.sh start [STATE_DIR]        # install if missing, start munged, slurmctld and
#                                                            # one slurmd per node, wait until all nodes are idle
#   scripts/slurm/ci_start_slurm.sh stop  [STATE_DIR]        # tear everything down (daemons, job processes,
#                                                            # namespaces, veths, bridge)
#   scripts/slurm/ci_start_slurm.sh env   [STATE_DIR]        # print `export SLURM_CONF=...`
#   scripts/slurm/ci_start_slurm.sh kill-node NODE [STATE_DIR]   # SIGKILL every process of that node: its slurmd,
#                                                                # slurmstepds and job tasks (a lost node)
#   scripts/slurm/ci_start_slurm.sh start-node NODE [STATE_DIR]  # start that node's slurmd again, wait until idle
#
# Layout. slurmctld runs on this host. Every node (mokn1, mokn2, ...) is its own network namespace
# (`ip netns`) with its own address on a private /24 that this script creates: a bridge on the host
# (<subnet>.1) and one veth pair per node (<subnet>.11, .12, ...). Each node's slurmd runs inside its
# namespace and, through `unshare --uts --mount`, with the node name as its hostname and
# /etc/netns/<ns>/hosts bind-mounted over /etc/hosts, so the node's job steps see hostname mokn<i>,
# resolve every node name to its address on the /24 and talk to each other only over the bridge. Only the addresses of this
# /24 are ever used. The file system (repo, run folders, checkpoints) is shared, as on a cluster.
#
# STATE_DIR defaults to $MOK_SLURM_DIR or /tmp/mok-slurm. Everything Slurm writes (config, state,
# spool, pid files, daemon logs: slurmctld.log, slurmd.<node>.log) lives there. Clients find the
# cluster through SLURM_CONF=$STATE_DIR/slurm.conf (`start` prints the export line last).
#
# Needs root (network namespaces; the daemons run as root) and, when Slurm is not installed yet, apt
# (Debian's slurm-wlm + munge; iproute2 and util-linux for `ip` and `unshare`). No systemd.
# slurm.conf: proctrack/linuxproc, task/none, select/cons_tres with CR_CPU, no accounting, munge
# auth, SlurmdParameters=config_overrides (each node declares MOK_SLURM_CPUS CPUs whatever the host has).
#
# Exit codes: 0 ok; 1 a daemon failed to start (its log tail is printed); 2 usage; 3 not root;
# 4 Slurm is missing and apt-get is unavailable; 5 apt-get install failed; 6 the network namespaces,
# veths or bridge could not be created (the message says which command failed and why).
# Env knobs: MOK_SLURM_NODES (default 2), MOK_SLURM_CPUS (CPUs per node, default 4),
# MOK_SLURM_SUBNET (first three octets of the private /24, default 10.238.38),
# MOK_SLURM_PREFIX (names of namespaces/links/nodes, default mok), MOK_SLURM_CTLD_PORT (default 6817),
# MOK_SLURM_SLURMD_PORT (6818), MOK_SLURM_START_TIMEOUT (seconds, default 60).
set -uo pipefail

cmd="${1:-start}"
NODE_ARG=""
if [[ "$cmd" == kill-node || "$cmd" == start-node ]]; then NODE_ARG="${2:-}"; shift; fi
STATE="${2:-${MOK_SLURM_DIR:-/tmp/mok-slurm}}"
CONF="$STATE/slurm.conf"
NNODES="${MOK_SLURM_NODES:-2}"
NODE_CPUS="${MOK_SLURM_CPUS:-4}"
SUBNET="${MOK_SLURM_SUBNET:-10.238.38}"
PFX="${MOK_SLURM_PREFIX:-mok}"
CTLD_PORT="${MOK_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${MOK_SLURM_SLURMD_PORT:-6818}"
TIMEOUT="${MOK_SLURM_START_TIMEOUT:-60}"
BRIDGE="${PFX}br0"
HOST_ADDR="${SUBNET}.1"

log() { echo "[ci_start_slurm] $*" >&2; }
die() { local rc="$1"; shift; log "ERROR: $*"; exit "$rc"; }

node_name() { echo "${PFX}n$1"; }           # node i (1-based): Slurm node name and hostname
node_ns() { echo "${PFX}-n$1"; }            # its network namespace
node_veth() { echo "${PFX}v$1"; }           # host end of its veth pair (the other end is eth0 inside)
node_addr() { echo "${SUBNET}.$((10 + $1))"; }
node_index() {                               # node name -> i
  local i
  for ((i = 1; i <= NNODES; i++)); do [[ "$(node_name "$i")" == "$1" ]] && { echo "$i"; return 0; }; done
  return 1
}

tail_logs() {
  local f
  # the daemons' fatal lines first: they say why (the tails below are mostly noise)
  grep -h -E 'fatal:|error: (Error binding|Unable to|Invalid|Couldn.t find)' "$STATE"/*.log "$STATE"/*.stderr \
    2>/dev/null | tail -n 5 | sed 's/^/[ci_start_slurm] daemon says: /' >&2
  for f in "$STATE/slurmctld.log" "$STATE"/slurmd.*.log "$STATE/munged.log" "$STATE"/*.stderr; do
    [[ -s "$f" ]] || continue
    echo "----- tail $f -----" >&2
    tail -n 30 "$f" >&2
  done
}

pid_alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }

# Stop one daemon by its pid file: SIGTERM, wait up to 10 s, then SIGKILL.
stop_pidfile() {
  local pf="$1" pid i
  [[ -f "$pf" ]] || return 0
  pid="$(cat "$pf" 2>/dev/null)"
  if pid_alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null
    for ((i = 0; i < 100; i++)); do pid_alive "$pid" || break; sleep 0.1; done
    pid_alive "$pid" && kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$pf"
}

# Every process inside a node's namespace (slurmd, slurmstepd, the job's tasks): all started by this
# cluster. SIG may be TERM (then KILL after 5 s) or KILL.
kill_ns_procs() {
  local ns="$1" sig="${2:-TERM}" pids i
  ip netns list 2>/dev/null | grep -qw "^$ns" || return 0
  pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
  [[ -n "${pids// /}" ]] || return 0
  # shellcheck disable=SC2086
  kill -"$sig" $pids 2>/dev/null
  if [[ "$sig" != KILL ]]; then
    for ((i = 0; i < 50; i++)); do
      pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
      [[ -n "${pids// /}" ]] || return 0
      sleep 0.1
    done
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null
  fi
  for ((i = 0; i < 50; i++)); do
    [[ -z "$(ip netns pids "$ns" 2>/dev/null)" ]] && return 0
    sleep 0.1
  done
  log "warning: processes still in namespace $ns: $(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
}

teardown_net() {
  local i ns
  for ((i = 1; i <= NNODES; i++)); do
    ns="$(node_ns "$i")"
    kill_ns_procs "$ns" TERM
    ip netns del "$ns" 2>/dev/null
    ip link del "$(node_veth "$i")" 2>/dev/null
    rm -rf "/etc/netns/$ns"
  done
  ip link del "$BRIDGE" 2>/dev/null
  return 0
}

do_stop() {
  if [[ -f "$CONF" ]] && command -v scancel >/dev/null && pid_alive "$(cat "$STATE/slurmctld.pid" 2>/dev/null)"; then
    SLURM_CONF="$CONF" timeout 10 scancel --full --quiet --partition=debug 2>/dev/null || true
  fi
  local i
  for ((i = 1; i <= NNODES; i++)); do stop_pidfile "$STATE/slurmd.$(node_name "$i").pid"; done
  command -v ip >/dev/null && teardown_net
  stop_pidfile "$STATE/slurmctld.pid"
  # munged only if this script started it (otherwise it belongs to the host)
  [[ -f "$STATE/munged.started" ]] && { stop_pidfile "$STATE/munged.pid"; rm -f "$STATE/munged.started"; }
  return 0
}

install_slurm() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null && command -v ip >/dev/null && command -v unshare >/dev/null \
     && command -v nsenter >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || die 4 "Slurm (or ip/unshare) is not installed and apt-get is unavailable"
  log "installing slurm-wlm, munge, iproute2 and util-linux with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  local pkgs=(slurm-wlm munge iproute2 util-linux)
  if ! apt-get install -y -q --no-install-recommends "${pkgs[@]}" >"$STATE/apt.log" 2>&1; then
    apt-get update -q >>"$STATE/apt.log" 2>&1
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" >>"$STATE/apt.log" 2>&1 \
      || { tail -n 30 "$STATE/apt.log" >&2; die 5 "apt-get install ${pkgs[*]} failed (log: $STATE/apt.log)"; }
  fi
  command -v slurmctld >/dev/null || die 5 "slurmctld still missing after apt-get install"
  command -v ip >/dev/null || die 5 "ip (iproute2) still missing after apt-get install"
}

munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_ok; then log "munged already running on this host; reusing it"; return 0; fi
  local user=munge
  id -u munge >/dev/null 2>&1 || user=root
  mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown "$user:" /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge 2>/dev/null
  chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key; chmod 0755 /run/munge
  local args=(--pid-file=/run/munge/munged.pid)
  if [[ "$user" == root ]]; then args+=(--force); fi
  if [[ "$user" == root ]]; then
    /usr/sbin/munged "${args[@]}" >"$STATE/munged.stderr" 2>&1
  else
    runuser -u munge -- /usr/sbin/munged "${args[@]}" >"$STATE/munged.stderr" 2>&1
  fi
  local rc=$? i
  for ((i = 0; i < 50; i++)); do munge_ok && break; sleep 0.1; done
  if ! munge_ok; then
    cp -f /var/log/munge/munged.log "$STATE/munged.log" 2>/dev/null
    tail_logs; die 1 "munged did not start (exit code $rc)"
  fi
  cp /run/munge/munged.pid "$STATE/munged.pid"; touch "$STATE/munged.started"
  log "munged started (pid $(cat "$STATE/munged.pid"))"
}

# Run a network setup command; on failure stop with exit code 6 and the command's own error.
net() {
  local err
  if ! err="$("$@" 2>&1)"; then
    log "ERROR: '$*' failed: ${err:-no message}"
    teardown_net
    die 6 "cannot build the private two-node network (network namespace / veth / bridge): '$*': ${err:-no message}"
  fi
}

setup_net() {
  [[ "$SUBNET" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die 2 "MOK_SLURM_SUBNET must be three octets like 10.238.38, got '$SUBNET'"
  # The /24 must be ours alone: refuse one that this machine already routes somewhere else.
  local route
  route="$(ip -4 route show to match "${SUBNET}.1" 2>/dev/null | grep -v '^default' | grep -v " dev $BRIDGE " | head -n 1)"
  [[ -z "$route" ]] || die 6 "the subnet ${SUBNET}.0/24 is already in use on this machine ($route): set MOK_SLURM_SUBNET"
  net ip link add "$BRIDGE" type bridge
  net ip addr add "${HOST_ADDR}/24" dev "$BRIDGE"
  net ip link set "$BRIDGE" up
  local i ns veth name hosts
  hosts="$(mktemp)"
  { cat /etc/hosts 2>/dev/null; echo "# mok Slurm test cluster"; echo "${HOST_ADDR} ${PFX}ctl"
    for ((i = 1; i <= NNODES; i++)); do echo "$(node_addr "$i") $(node_name "$i")"; done; } >"$hosts"
  for ((i = 1; i <= NNODES; i++)); do
    ns="$(node_ns "$i")"; veth="$(node_veth "$i")"; name="$(node_name "$i")"
    net ip netns add "$ns"
    net ip link add "$veth" type veth peer name "${veth}p"
    net ip link set "$veth" master "$BRIDGE"
    net ip link set "$veth" up
    net ip link set "${veth}p" netns "$ns"
    net ip -n "$ns" link set "${veth}p" name eth0
    net ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
    net ip -n "$ns" link set eth0 up
    net ip -n "$ns" link set lo up
    mkdir -p "/etc/netns/$ns" || die 6 "cannot create /etc/netns/$ns"
    cp "$hosts" "/etc/netns/$ns/hosts"
  done
  rm -f "$hosts"
  log "private network ${SUBNET}.0/24 up: bridge $BRIDGE ${HOST_ADDR}; $(for ((i = 1; i <= NNODES; i++)); do
    printf '%s=%s (netns %s) ' "$(node_name "$i")" "$(node_addr "$i")" "$(node_ns "$i")"; done)"
}

write_conf() {
  local host i nodes=""
  host="$(hostname -s)"
  for ((i = 1; i <= NNODES; i++)); do
    nodes+="NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") NodeHostname=$(node_name "$i") CPUs=${NODE_CPUS} Boards=1 SocketsPerBoard=1 CoresPerSocket=${NODE_CPUS} ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN"$'\n'
  done
  cat >"$CONF" <<EOF
# generated by scripts/slurm/ci_start_slurm.sh: ${NNODES} nodes, each a network namespace on ${SUBNET}.0/24
ClusterName=mokci
SlurmctldHost=${host}(${HOST_ADDR})
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again after cred_expire seconds (default 120)
AuthInfo=cred_expire=5
StateSaveLocation=${STATE}/ctld
SlurmdSpoolDir=${STATE}/spool/%n
SlurmctldPidFile=${STATE}/slurmctld.pid
SlurmdPidFile=${STATE}/slurmd.%n.pid
SlurmctldLogFile=${STATE}/slurmctld.log
SlurmdLogFile=${STATE}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
# the node lines below are the truth (the CPUs of the host are shared by all nodes)
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# start pending (e.g. requeued) jobs within seconds, not the default 30-60 s
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=120
InactiveLimit=0
MailProg=/bin/true
Waittime=0
${nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

# Start node i's slurmd inside its namespace, with the node name as hostname (own UTS namespace).
start_slurmd() {
  local i="$1" name ns
  name="$(node_name "$i")"; ns="$(node_ns "$i")"
  rm -rf "$STATE/spool/$name"; mkdir -p "$STATE/spool/$name"
  # nsenter --net (not `ip netns exec`, which remounts /sys without the cgroup mounts slurmd needs);
  # own mount namespace for the node's /etc/hosts, own UTS namespace for its hostname.
  nsenter --net="/run/netns/$ns" unshare --mount --uts -- /bin/sh -c \
    'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' sh "/etc/netns/$ns/hosts" "$name" \
    slurmd -f "$CONF" -N "$name" >"$STATE/slurmd.$name.stderr" 2>&1 \
    || { tail_logs; die 1 "slurmd of $name exited with an error"; }
}

node_state() { SLURM_CONF="$CONF" sinfo -h -n "$1" -N -o '%T' 2>/dev/null | head -n 1; }

# Wait until every node given is idle (or mixed/allocated); print "node=state ...".
wait_nodes_idle() {
  local i t name state ok all
  for ((t = 0; t < TIMEOUT * 2; t++)); do
    ok=1; all=""
    for i in "$@"; do
      name="$(node_name "$i")"; state="$(node_state "$name")"
      all+="$name=${state:-unknown} "
      case "$state" in
        idle|idle~|mixed|allocated) ;;
        drain*|down*)
          ok=0; SLURM_CONF="$CONF" scontrol update nodename="$name" state=resume >/dev/null 2>&1 ;;
        *) ok=0 ;;
      esac
      if (( t >= 4 )) && ! pid_alive "$(cat "$STATE/slurmd.$name.pid" 2>/dev/null)"; then
        echo "$all(slurmd of $name is not running)"; return 1
      fi
    done
    [[ $ok == 1 ]] && { echo "$all"; return 0; }
    sleep 0.5
  done
  echo "$all"
  return 1
}

do_start() {
  [[ "$(id -u)" == 0 ]] || die 3 "must run as root (network namespaces; the daemons run as root)"
  [[ "$NNODES" =~ ^[1-9]$ ]] || die 2 "MOK_SLURM_NODES must be 1..9, got '$NNODES'"
  mkdir -p "$STATE"
  install_slurm
  do_stop
  rm -rf "$STATE/ctld" "$STATE/spool"
  mkdir -p "$STATE/ctld" "$STATE/spool"
  rm -f "$STATE"/slurmctld.log "$STATE"/slurmd.*.log "$STATE"/*.stderr
  setup_net
  start_munge
  write_conf

  # -c: clear any previous state (fresh cluster), -i: ignore unreadable state files.
  slurmctld -f "$CONF" -c -i >"$STATE/slurmctld.stderr" 2>&1 \
    || { tail_logs; die 1 "slurmctld exited with an error"; }
  local i up=0
  for ((i = 0; i < TIMEOUT * 2; i++)); do
    # a daemon that died (fatal error) will not come up: stop waiting
    if (( i >= 2 )) && ! pid_alive "$(cat "$STATE/slurmctld.pid" 2>/dev/null)"; then break; fi
    if SLURM_CONF="$CONF" timeout 3 scontrol ping 2>/dev/null | grep -q 'is UP'; then up=1; break; fi
    sleep 0.5
  done
  [[ $up == 1 ]] || { tail_logs; die 1 "slurmctld is not answering 'scontrol ping' (it died or took over ${TIMEOUT}s)"; }
  log "slurmctld up (pid $(cat "$STATE/slurmctld.pid" 2>/dev/null)) on ${HOST_ADDR}:${CTLD_PORT}"

  local all=()
  for ((i = 1; i <= NNODES; i++)); do start_slurmd "$i"; all+=("$i"); done
  local states
  if ! states="$(wait_nodes_idle "${all[@]}")"; then
    tail_logs; die 1 "not every node became idle within ${TIMEOUT}s: $states"
  fi
  log "all nodes idle: $states"
  SLURM_CONF="$CONF" sinfo -N >&2
  echo "export SLURM_CONF=$CONF"
}

do_kill_node() {
  local i name
  i="$(node_index "$NODE_ARG")" || die 2 "unknown node '$NODE_ARG' (nodes: $(for ((i = 1; i <= NNODES; i++)); do printf '%s ' "$(node_name "$i")"; done))"
  name="$(node_name "$i")"
  log "killing node $name: SIGKILL to every process in namespace $(node_ns "$i") (slurmd, slurmstepd, tasks)"
  kill_ns_procs "$(node_ns "$i")" KILL
  rm -f "$STATE/slurmd.$name.pid"
}

do_start_node() {
  local i name states
  i="$(node_index "$NODE_ARG")" || die 2 "unknown node '$NODE_ARG'"
  name="$(node_name "$i")"
  ip netns list 2>/dev/null | grep -qw "^$(node_ns "$i")" || die 6 "namespace $(node_ns "$i") is missing: run start first"
  start_slurmd "$i"
  if ! states="$(wait_nodes_idle "$i")"; then
    tail_logs; die 1 "node $name did not become idle within ${TIMEOUT}s: $states"
  fi
  log "node $name is back: $states"
}

case "$cmd" in
  start) do_start ;;
  stop) do_stop; log "stopped (state dir $STATE)" ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  kill-node) do_kill_node ;;
  start-node) do_start_node ;;
  *) die 2 "usage: $0 {start|stop|env} [STATE_DIR] | $0 {kill-node|start-node} NODE [STATE_DIR]" ;;
esac
