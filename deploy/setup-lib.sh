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
