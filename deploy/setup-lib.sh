# Shared by the machine set-up scripts (deploy/docker-up.sh, podman-up.sh, gvisor-up.sh): their
# log line, root for a step, and a quiet apt install whose log is shown when it fails.
# Sourced after the script sets LOG_TAG (its name in each line) and `set -euo pipefail`.

log() { printf '[%s] %s\n' "$LOG_TAG" "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# apt's own lines (debconf's "delaying package configuration", needrestart's) go to a log, shown
# when a step fails: scripts/demo prints swerl's lines only.
APT_LOG="${SWERL_APT_LOG:-/tmp/swerl-apt.log}"
apt_install() {
  log "installing Debian packages: $* (log: $APT_LOG)"
  if ! {
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
      && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
  } >"$APT_LOG" 2>&1; then
    log "installing $* failed; see $APT_LOG"
    tail -n 20 "$APT_LOG" >&2
    exit 1
  fi
}

# A daemon started from a checkout keeps it as its working directory; when that checkout is
# deleted (a fresh clone made in its place), Podman's conmon fails every container start
# ("Failed to get working directory", seen by the client as "write child: broken pipe"). The
# daemons are started from / (run_from_root) and a running one whose directory is gone is
# restarted (cwd_deleted PID).
run_from_root() { (cd / && "$@"); }
cwd_deleted() { [ -n "$1" ] && readlink "/proc/$1/cwd" 2>/dev/null | grep -q ' (deleted)$'; }

# Stops a service by SIGTERM and waits (10 s at most) for it to be gone; its argument is the
# function that prints its pids (each script's service_pid).
stop_service() {
  local pids_of="$1"
  as_root kill -TERM $("$pids_of")
  for _ in $(seq 1 40); do [ -z "$("$pids_of")" ] && break; sleep 0.25; done
}
