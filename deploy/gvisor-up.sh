#!/usr/bin/env bash
# Make gVisor (runsc) an isolation class on this machine, beside runc:
#   1. install runsc (Debian's package) when it is missing,
#   2. register it with the running dockerd as the runtime "runsc" (/etc/docker/daemon.json,
#      merged with what is there, then SIGHUP: runtimes are reloadable, dockerd is never
#      restarted, so the containers and the docker0 bridge other work uses are left alone),
#   3. register it with podman when podman is installed (a containers.conf drop-in), and start a
#      second podman API service whose default runtime is runsc (the exec node's socket for
#      gVisor on Podman; printed on the way out),
#   4. check that each runs the base image on gVisor's kernel ("Starting gVisor..." in dmesg).
# Idempotent: re-running it on a ready machine does nothing but check.
#
# The flags, and why (measured with runsc 0.0~20221219, docs/runtimes-findings.md):
#   --network=none   runsc's own netstack refuses a container in the host's network namespace,
#                    and podman hands it one for `--network none`; swerl's sandboxes are
#                    network-less by default. A bridge sandbox gets no network under runsc.
#   --host-fifo=open swerl's shell talks to its supervisor through FIFOs the node makes in a
#                    bind-mounted directory; gVisor refuses to open host FIFOs without it.
set -euo pipefail

BASE_IMAGE="${SWERL_BASE_IMAGE:-swerl-base:bookworm}"
RUNSC="${SWERL_RUNSC:-/usr/bin/runsc}"
DAEMON_JSON="${SWERL_DOCKER_DAEMON_JSON:-/etc/docker/daemon.json}"
PODMAN_DROPIN="${SWERL_PODMAN_RUNSC_CONF:-/etc/containers/containers.conf.d/50-swerl-runsc.conf}"
PODMAN_SWERL_CONF="${SWERL_PODMAN_CONF:-/etc/containers/containers.conf.d/50-swerl.conf}"
PODMAN_RUNSC_CONF="${SWERL_PODMAN_RUNSC_SERVICE_CONF:-/etc/swerl/podman-runsc.conf}"
PODMAN_RUNSC_SOCK="${SWERL_PODMAN_RUNSC_SOCK:-/run/podman/podman-runsc.sock}"
PODMAN_RUNSC_LOG="${SWERL_PODMAN_RUNSC_LOG:-/tmp/swerl-podman-runsc.log}"
# dockerd takes the flags as runtimeArgs, podman through a wrapper (podman 4.3 has runtime flags
# for all runtimes at once, not per runtime). SWERL_RUNSC_DOCKER_FLAGS sets dockerd's apart, for
# a machine whose dockerd others own (the one the findings were measured on).
read -ra RUNSC_FLAGS <<<"${SWERL_RUNSC_FLAGS:---network=none --host-fifo=open}"
read -ra DOCKER_RUNSC_FLAGS <<<"${SWERL_RUNSC_DOCKER_FLAGS:-${RUNSC_FLAGS[*]}}"
RUNSC_WRAPPER=/usr/local/bin/runsc-swerl

LOG_TAG=gvisor-up
# shellcheck source=deploy/setup-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup-lib.sh"

[ -x "$RUNSC" ] || apt_install runsc
log "runsc: $("$RUNSC" --version | head -n 1)"

# gVisor's kernel greets in its dmesg; runc's containers see the host's (or nothing). A start
# that fails is tried twice more, each failure's words logged: under load (CI sets this up beside
# the whole suite) Podman's conmon has failed an attach once ("write child: broken pipe") on a
# machine where the next try ran. A container that starts on runc fails at once, untried again.
check_gvisor() {
  local engine="$1" out try
  shift
  for try in 1 2 3; do
    if out="$("$@" 2>&1)"; then
      if grep -q "Starting gVisor" <<<"$out"; then
        log "$engine: runs $BASE_IMAGE on gVisor ($(head -n 1 <<<"$out"))"
        return 0
      fi
      log "$engine: $BASE_IMAGE started, but not on gVisor's kernel:"
      printf '%s\n' "$out" | tail -n 5 >&2
      exit 1
    fi
    log "$engine: $BASE_IMAGE did not start on gVisor (try $try of 3):"
    printf '%s\n' "$out" | tail -n 5 >&2
    [ "$try" -eq 3 ] || sleep 2
  done
  exit 1
}

# -- dockerd ------------------------------------------------------------------------------
docker_has_runsc() {
  docker info --format '{{json .Runtimes}}' 2>/dev/null | python3 -c '
import json, sys
runtimes = json.load(sys.stdin)
sys.exit(0 if "runsc" in runtimes and runtimes["runsc"].get("runtimeArgs") == sys.argv[1:] else 1)
' "${DOCKER_RUNSC_FLAGS[@]}"
}

if docker info >/dev/null 2>&1; then
  if ! docker_has_runsc; then
    log "registering runsc with dockerd ($DAEMON_JSON, then SIGHUP)"
    as_root mkdir -p "$(dirname "$DAEMON_JSON")"
    # Merged, not overwritten: whatever else the file says stays.
    as_root python3 - "$DAEMON_JSON" "$RUNSC" "${DOCKER_RUNSC_FLAGS[@]}" <<'PY'
import json, os, sys
path, runsc, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
config = {}
if os.path.exists(path):
    with open(path) as f:
        config = json.load(f)
config.setdefault("runtimes", {})["runsc"] = {"path": runsc, "runtimeArgs": flags}
tmp = path + ".swerl-tmp"
with open(tmp, "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
os.replace(tmp, path)
PY
    dockerd_pids="$(pgrep -x dockerd || true)"
    [ "$(wc -w <<<"$dockerd_pids")" -eq 1 ] || {
      log "expected one dockerd, found: ${dockerd_pids:-none}; register runsc by hand"
      exit 1
    }
    as_root kill -HUP "$dockerd_pids"
    for _ in $(seq 1 20); do
      docker_has_runsc && break
      sleep 0.25
    done
    docker_has_runsc || {
      log "dockerd did not reload its runtimes on SIGHUP (see its log); not restarting it"
      exit 1
    }
  fi
  log "dockerd runtimes: $(docker info --format '{{json .Runtimes}}')"
  check_gvisor docker docker run --rm --label swerl.probe=1 --runtime runsc "$BASE_IMAGE" dmesg
else
  log "dockerd is not answering; skipped registering runsc with it"
fi

# -- podman -------------------------------------------------------------------------------
# Podman 4.3's Docker-compatible API ignores a create's HostConfig.Runtime (the container runs on
# the service's default runtime; inspect says "oci"), so the exec node gets gVisor from a second
# API service whose default runtime is runsc, on its own socket, over the same storage and
# images. `podman --runtime runsc` on the command line works too (the drop-in).
if command -v podman >/dev/null 2>&1; then
  wrapper="$(printf '#!/bin/sh\n# runsc with the flags swerl needs (deploy/gvisor-up.sh).\nexec %s %s "$@"\n' \
    "$RUNSC" "${RUNSC_FLAGS[*]}")"
  if [ "$(cat "$RUNSC_WRAPPER" 2>/dev/null)" != "$wrapper" ]; then
    printf '%s\n' "$wrapper" | as_root tee "$RUNSC_WRAPPER" >/dev/null
    as_root chmod 755 "$RUNSC_WRAPPER"
  fi
  dropin="$(printf '# gVisor for swerl (deploy/gvisor-up.sh): `podman --runtime runsc`.\n[engine.runtimes]\nrunsc = ["%s"]\n' "$RUNSC_WRAPPER")"
  if [ "$(cat "$PODMAN_DROPIN" 2>/dev/null)" != "$dropin" ]; then
    log "registering runsc with podman ($PODMAN_DROPIN)"
    as_root mkdir -p "$(dirname "$PODMAN_DROPIN")"
    printf '%s\n' "$dropin" | as_root tee "$PODMAN_DROPIN" >/dev/null
  fi
  check_gvisor "podman (CLI)" podman run --rm --label swerl.probe=1 --runtime runsc "$BASE_IMAGE" dmesg

  # CONTAINERS_CONF replaces the system's files and their drop-ins: the service's whole
  # configuration is this file, rlimits copied from podman-up.sh's drop-in.
  rlimits="$(grep '^default_ulimits' "$PODMAN_SWERL_CONF" 2>/dev/null || true)"
  [ -n "$rlimits" ] || { log "no rlimits in $PODMAN_SWERL_CONF: run deploy/podman-up.sh first"; exit 1; }
  conf="$(printf '# podman with gVisor as its default runtime (deploy/gvisor-up.sh).\n[containers]\n%s\n\n[engine]\nruntime = "runsc"\n\n[engine.runtimes]\nrunsc = ["%s"]\n' \
    "$rlimits" "$RUNSC_WRAPPER")"
  service_pid() { pgrep -f "^podman system service --time=0 unix://$PODMAN_RUNSC_SOCK\$" || true; }
  stale=""
  if [ "$(cat "$PODMAN_RUNSC_CONF" 2>/dev/null)" != "$conf" ]; then
    as_root mkdir -p "$(dirname "$PODMAN_RUNSC_CONF")"
    printf '%s\n' "$conf" | as_root tee "$PODMAN_RUNSC_CONF" >/dev/null
    stale="it read the old $PODMAN_RUNSC_CONF when it started"
  elif cwd_deleted "$(service_pid)"; then
    stale="it runs in a deleted directory (conmon cannot start containers there)"
  fi
  if [ -n "$stale" ] && [ -n "$(service_pid)" ]; then
    log "restarting podman's gVisor API service: $stale"
    stop_service service_pid
  fi
  answers() { podman --url "unix://$PODMAN_RUNSC_SOCK" version >/dev/null 2>&1; }
  if ! answers; then
    log "starting podman's gVisor API service on $PODMAN_RUNSC_SOCK (log: $PODMAN_RUNSC_LOG)"
    as_root mkdir -p "$(dirname "$PODMAN_RUNSC_SOCK")"
    run_from_root as_root env CONTAINERS_CONF="$PODMAN_RUNSC_CONF" setsid nohup \
      podman system service --time=0 "unix://$PODMAN_RUNSC_SOCK" >>"$PODMAN_RUNSC_LOG" 2>&1 </dev/null &
    for _ in $(seq 1 60); do answers && break; sleep 0.25; done
    answers || { log "the service did not come up; see $PODMAN_RUNSC_LOG"; exit 1; }
  fi
  check_gvisor "podman (API, $PODMAN_RUNSC_SOCK)" podman --url "unix://$PODMAN_RUNSC_SOCK" \
    run --rm --label swerl.probe=1 "$BASE_IMAGE" dmesg
  echo "unix://$PODMAN_RUNSC_SOCK"
else
  log "podman is not installed; skipped (deploy/podman-up.sh installs it)"
fi
