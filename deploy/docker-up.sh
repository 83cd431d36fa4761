#!/usr/bin/env bash
# Make the local machine ready for swerl's integration tests and demo:
#   1. install Docker (Debian's docker.io) when dockerd is missing,
#   2. start dockerd in the background when it is not answering,
#   3. build the swerl base image offline (debootstrap + docker import) when it is absent.
# Idempotent: re-running it on a ready machine does nothing but check.
# Images cannot be pulled in the environments swerl is developed in, so the base image is
# assembled from Debian packages; on a normal machine any image with bash, git and python3 works.
set -euo pipefail

BASE_IMAGE="${SWERL_BASE_IMAGE:-swerl-base:bookworm}"
SUITE="${SWERL_BASE_SUITE:-bookworm}"
DOCKERD_LOG="${SWERL_DOCKERD_LOG:-/tmp/swerl-dockerd.log}"

LOG_TAG=docker-up
# shellcheck source=deploy/setup-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup-lib.sh"

if ! command -v dockerd >/dev/null 2>&1; then
  apt_install docker.io
fi

if ! docker info >/dev/null 2>&1; then
  log "starting dockerd (log: $DOCKERD_LOG)"
  run_from_root as_root bash -c "nohup dockerd >'$DOCKERD_LOG' 2>&1 &"
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { log "dockerd did not come up; see $DOCKERD_LOG"; tail -n 20 "$DOCKERD_LOG" >&2; exit 1; }
fi
log "dockerd is up: $(docker version --format '{{.Server.Version}}')"

if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  log "base image $BASE_IMAGE present"
  exit 0
fi

# One build at a time on a machine: two runs of this script (a test run beside a demo) would
# otherwise both debootstrap, and the second waits here and then finds the image made.
LOCK="${SWERL_DOCKER_UP_LOCK:-/tmp/swerl-docker-up.lock}"
exec 8>"$LOCK"
if ! flock -n 8; then
  log "another docker-up is building $BASE_IMAGE; waiting for it"
  flock 8
fi
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  log "base image $BASE_IMAGE present (built by the run we waited for)"
  exit 0
fi

command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
rootfs="$(mktemp -d /tmp/swerl-rootfs.XXXXXX)"
# debootstrap mounts the host's /proc (and may mount /sys) inside the tree while it installs and
# can leave them mounted when it is interrupted or raced: unmount whatever is mounted below the
# tree before it is packed or removed, so neither the image nor `rm` ever touches the host's.
unmount_below() {
  local mounts
  mounts="$(awk -v root="$rootfs/" 'index($2, root) == 1 { print $2 }' /proc/self/mounts | sort -r)"
  [ -z "$mounts" ] || as_root umount -l $mounts 2>/dev/null || true
}
trap 'unmount_below; as_root rm -rf --one-file-system "$rootfs"' EXIT
log "building $BASE_IMAGE with debootstrap ($SUITE, about a minute)"
as_root debootstrap --variant=minbase \
  --include=bash,git,python3,python3-pytest,ca-certificates,procps,patch \
  "$SUITE" "$rootfs" >/tmp/swerl-debootstrap.log 2>&1 \
  || { log "debootstrap failed; see /tmp/swerl-debootstrap.log"; tail -n 20 /tmp/swerl-debootstrap.log >&2; exit 1; }
unmount_below
as_root rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
as_root tar -C "$rootfs" --one-file-system -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  - "$BASE_IMAGE" >/dev/null
log "built $BASE_IMAGE ($(docker image inspect -f '{{.Size}}' "$BASE_IMAGE") bytes)"
