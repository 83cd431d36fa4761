#!/usr/bin/env bash
# Make the local machine ready to run swerl's sandboxes on Podman (rootful), beside dockerd:
#   1. install podman (Debian's 4.3), crun and catatonit when they are missing,
#   2. write swerl's containers.conf drop-in: rlimits this machine can grant, and the OCI
#      runtime its cgroups allow,
#   3. load the base image from dockerd into podman's storage when it is absent there,
#   4. start podman's Docker-compatible API service on $SWERL_PODMAN_SOCK when it does not
#      answer, and print the socket's URL (the exec node's --docker-host).
# Idempotent: re-running it on a ready machine does nothing but check. The service is left
# running in the background (log: $SWERL_PODMAN_LOG); containers outlive it (conmon holds them).
#
# Networking: a sandbox with network "none" gets none; one with "bridge" joins podman's own
# default network (netavark's bridge podman0, 10.88.0.0/16), so docker0 and docker's iptables
# chains are not touched.
set -euo pipefail

BASE_IMAGE="${SWERL_BASE_IMAGE:-swerl-base:bookworm}"
PODMAN_SOCK="${SWERL_PODMAN_SOCK:-/run/podman/podman.sock}"
PODMAN_LOG="${SWERL_PODMAN_LOG:-/tmp/swerl-podman.log}"
DROPIN="${SWERL_PODMAN_CONF:-/etc/containers/containers.conf.d/50-swerl.conf}"

LOG_TAG=podman-up
# shellcheck source=deploy/setup-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup-lib.sh"

# catatonit is the init of `init: true` (the node's containers): podman 4.3 looks for it at
# /usr/libexec/podman/catatonit and refuses the create without it ("container-init binary not
# found"); Debian's podman only recommends it, and apt may pick tini for the recommendation.
command -v podman >/dev/null 2>&1 && command -v crun >/dev/null 2>&1 \
  && [ -x /usr/libexec/podman/catatonit ] || apt_install podman crun catatonit
log "podman $(podman version --format '{{.Client.Version}}')"

# rlimits. Podman asks the OCI runtime for nofile and nproc of 1048576 unless containers.conf
# says otherwise, and a root without CAP_SYS_RESOURCE (this VM's bounding set lacks it) cannot
# raise a hard limit, so runc/crun refuse the container ("setrlimit RLIMIT_NOFILE: Operation
# not permitted"). Give containers the hard limits this shell has, which is what dockerd's
# containers inherit; podman 4.3 runs itself with nproc at most 32768 here, and asking more
# fails the same way.
nofile="$(ulimit -Hn)"
nproc="$(ulimit -Hu)"
[ "$nofile" = unlimited ] && nofile=1048576
{ [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; } && nproc=32768
# crun 1.8 refuses a hybrid cgroup hierarchy (v1 controllers plus /sys/fs/cgroup/unified:
# "cgroups in hybrid mode not supported"); runc runs on both, crun is preferred on pure v2.
if [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ]; then runtime=crun; else runtime=runc; fi
conf="$(cat <<CONF
# swerl's Podman settings (deploy/podman-up.sh; see docs/runtimes-findings.md).
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "$runtime"
CONF
)"
if [ "$(cat "$DROPIN" 2>/dev/null)" != "$conf" ]; then
  log "writing $DROPIN (nofile $nofile, nproc $nproc, runtime $runtime)"
  as_root mkdir -p "$(dirname "$DROPIN")"
  printf '%s\n' "$conf" | as_root tee "$DROPIN" >/dev/null
  # A running service read containers.conf when it started; it must start again to see this.
  restart_service=1
fi

# Nothing can be pulled here: the base image comes over from dockerd, where docker-up.sh
# builds it. Podman stores it as localhost/<name> and resolves the short name to it.
if ! podman image exists "$BASE_IMAGE"; then
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || {
    log "$BASE_IMAGE is in neither podman's storage nor dockerd's; run deploy/docker-up.sh first"
    exit 1
  }
  log "loading $BASE_IMAGE from dockerd into podman's storage"
  docker save "$BASE_IMAGE" | as_root podman load -q >/dev/null
fi
log "base image $BASE_IMAGE present ($(podman image inspect -f '{{.Id}}' "$BASE_IMAGE" | cut -c1-12))"

service_answers() { podman --url "unix://$PODMAN_SOCK" version >/dev/null 2>&1; }
service_pid() { pgrep -f "^podman system service --time=0 unix://$PODMAN_SOCK\$" || true; }

if [ -z "${restart_service:-}" ] && cwd_deleted "$(service_pid)"; then
  log "podman's API service runs in a deleted directory (conmon cannot start containers there)"
  restart_service=1
fi
if [ -n "${restart_service:-}" ] && [ -n "$(service_pid)" ]; then
  log "restarting podman's API service"
  stop_service service_pid
fi
if ! service_answers; then
  log "starting podman's API service on $PODMAN_SOCK (log: $PODMAN_LOG)"
  as_root mkdir -p "$(dirname "$PODMAN_SOCK")"
  run_from_root as_root setsid nohup podman system service --time=0 "unix://$PODMAN_SOCK" \
    >>"$PODMAN_LOG" 2>&1 </dev/null &
  for _ in $(seq 1 60); do service_answers && break; sleep 0.25; done
  service_answers || { log "podman's service did not come up; see $PODMAN_LOG"; tail -n 20 "$PODMAN_LOG" >&2; exit 1; }
fi
log "podman's API service answers (pid $(service_pid))"
echo "unix://$PODMAN_SOCK"
