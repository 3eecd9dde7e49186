#!/usr/bin/env bash
# Start (or stop) a REAL single-node Slurm on localhost, for CI and for trying the sbatch script.
#
#   scripts/slurm/ci_start_slurm.sh start [STATE_DIR]   # install if missing, start munged/slurmctld/slurmd
#   scripts/slurm/ci_start_slurm.sh stop  [STATE_DIR]   # stop what `start` started (by pid file only)
#   scripts/slurm/ci_start_slurm.sh env   [STATE_DIR]   # print `export SLURM_CONF=...`
#
# STATE_DIR defaults to $MOK_SLURM_DIR or /tmp/mok-slurm. Everything Slurm writes (config, state,
# spool, pid files, daemon logs) lives there. Clients find the cluster through
# SLURM_CONF=$STATE_DIR/slurm.conf (`start` prints the export line last).
#
# Needs root (the daemons run as root: SlurmUser=root, SlurmdUser=root) and, when Slurm is not
# installed yet, apt (Debian's slurm-wlm + munge). No systemd: the daemons are started directly.
# Layout: one node (this host, CPUs as `slurmd -C` reports them), one partition `debug`,
# proctrack/linuxproc, task/none, select/cons_tres with CR_CPU, no accounting, munge auth.
#
# Exit codes: 0 ok; 1 a daemon failed to start (its log tail is printed); 3 not root;
# 4 Slurm is missing and apt-get is unavailable; 5 apt-get install failed.
# Env knobs: MOK_SLURM_CTLD_PORT (default 6817), MOK_SLURM_SLURMD_PORT (6818),
# MOK_SLURM_CPUS (default: all CPUs of this host), MOK_SLURM_START_TIMEOUT (seconds, default 60).
set -uo pipefail

cmd="${1:-start}"
STATE="${2:-${MOK_SLURM_DIR:-/tmp/mok-slurm}}"
CONF="$STATE/slurm.conf"
CTLD_PORT="${MOK_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${MOK_SLURM_SLURMD_PORT:-6818}"
TIMEOUT="${MOK_SLURM_START_TIMEOUT:-60}"

log() { echo "[ci_start_slurm] $*" >&2; }
die() { local rc="$1"; shift; log "ERROR: $*"; exit "$rc"; }

tail_logs() {
  local f
  # the daemons' fatal lines first: they say why (the tails below are mostly noise)
  grep -h -E 'fatal:|error: (Error binding|Unable to|Invalid|Couldn.t find)' "$STATE"/*.log "$STATE"/*.stderr \
    2>/dev/null | tail -n 5 | sed 's/^/[ci_start_slurm] daemon says: /' >&2
  for f in "$STATE/slurmctld.log" "$STATE/slurmd.log" "$STATE/munged.log" "$STATE/slurmctld.stderr" \
           "$STATE/slurmd.stderr" "$STATE/munged.stderr"; do
    [[ -s "$f" ]] || continue
    echo "----- tail $f -----" >&2
    tail -n 40 "$f" >&2
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

do_stop() {
  if [[ -f "$CONF" ]] && command -v scancel >/dev/null && pid_alive "$(cat "$STATE/slurmctld.pid" 2>/dev/null)"; then
    SLURM_CONF="$CONF" timeout 10 scancel --full --quiet --partition=debug 2>/dev/null || true
  fi
  stop_pidfile "$STATE/slurmd.pid"
  stop_pidfile "$STATE/slurmctld.pid"
  # munged only if this script started it (otherwise it belongs to the host)
  [[ -f "$STATE/munged.started" ]] && { stop_pidfile "$STATE/munged.pid"; rm -f "$STATE/munged.started"; }
  return 0
}

install_slurm() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || die 4 "Slurm is not installed and apt-get is unavailable"
  log "installing slurm-wlm and munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  local pkgs=(slurm-wlm munge)
  if ! apt-get install -y -q --no-install-recommends "${pkgs[@]}" >"$STATE/apt.log" 2>&1; then
    apt-get update -q >>"$STATE/apt.log" 2>&1
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" >>"$STATE/apt.log" 2>&1 \
      || { tail -n 30 "$STATE/apt.log" >&2; die 5 "apt-get install ${pkgs[*]} failed (log: $STATE/apt.log)"; }
  fi
  command -v slurmctld >/dev/null || die 5 "slurmctld still missing after apt-get install"
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

write_conf() {
  local host hw
  host="$(hostname -s)"
  # The node line as the hardware reports it, so slurmd never drains itself for a mismatch.
  hw="$(slurmd -C 2>/dev/null | head -n 1)"
  [[ "$hw" == NodeName=* ]] || die 1 "slurmd -C gave no node line: $hw"
  hw="${hw#NodeName=* }"
  if [[ -n "${MOK_SLURM_CPUS:-}" ]]; then
    hw="$(sed -E "s/CPUs=[0-9]+/CPUs=${MOK_SLURM_CPUS}/" <<<"$hw")"
  fi
  cat >"$CONF" <<EOF
# generated by scripts/slurm/ci_start_slurm.sh
ClusterName=mokci
SlurmctldHost=${host}(127.0.0.1)
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
SlurmdPidFile=${STATE}/slurmd.pid
SlurmctldLogFile=${STATE}/slurmctld.log
SlurmdLogFile=${STATE}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
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
SlurmdTimeout=60
InactiveLimit=0
MailProg=/bin/true
Waittime=0
NodeName=${host} NodeAddr=127.0.0.1 ${hw} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_node_idle() {
  local i state=""
  for ((i = 0; i < TIMEOUT * 2; i++)); do
    state="$(SLURM_CONF="$CONF" sinfo -h -N -o '%T' 2>/dev/null | head -n 1)"
    case "$state" in
      idle|idle~|mixed|allocated) echo "$state"; return 0 ;;
      drain*|down*)
        SLURM_CONF="$CONF" scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 ;;
    esac
    pid_alive "$(cat "$STATE/slurmd.pid" 2>/dev/null)" || [[ $i -lt 4 ]] || break
    sleep 0.5
  done
  echo "${state:-unknown}"
  return 1
}

do_start() {
  [[ "$(id -u)" == 0 ]] || die 3 "must run as root (the daemons run as root)"
  mkdir -p "$STATE"
  install_slurm
  do_stop
  rm -rf "$STATE/ctld" "$STATE/spool"
  mkdir -p "$STATE/ctld" "$STATE/spool"
  rm -f "$STATE"/slurmctld.log "$STATE"/slurmd.log
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
  log "slurmctld up (pid $(cat "$STATE/slurmctld.pid" 2>/dev/null))"

  slurmd -f "$CONF" >"$STATE/slurmd.stderr" 2>&1 || { tail_logs; die 1 "slurmd exited with an error"; }
  local state
  if ! state="$(wait_node_idle)"; then
    tail_logs; die 1 "node did not become idle within ${TIMEOUT}s (state: $state)"
  fi
  log "slurmd up (pid $(cat "$STATE/slurmd.pid" 2>/dev/null)); node $(hostname -s) is $state"
  SLURM_CONF="$CONF" sinfo >&2
  echo "export SLURM_CONF=$CONF"
}

case "$cmd" in
  start) do_start ;;
  stop) do_stop; log "stopped (state dir $STATE)" ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) die 2 "usage: $0 {start|stop|env} [STATE_DIR]" ;;
esac
