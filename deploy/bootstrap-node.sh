#!/usr/bin/env bash
# Turn a fresh Debian/Ubuntu host into a swerl exec node:
#   1. Docker (Debian's docker.io) installed, enabled and running,
#   2. a `swerl` system user in the docker group,
#   3. swerl[node] in /opt/swerl/venv (from a wheelhouse when given: no index needed),
#   4. /etc/swerl/exec.env from an env file (kept when already there: it holds the secrets),
#   5. the swerl-exec systemd unit installed, enabled, started, and checked for health,
#   6. optionally the dataset's images pre-pulled onto this node (`swerl images pull`).
#
#   sudo deploy/bootstrap-node.sh --env-file my-exec.env [--wheelhouse DIR] [--images images.txt]
#
# Options:
#   --env-file FILE     settings for /etc/swerl/exec.env (default: deploy/env/exec.env, which
#                       must then be edited: its secrets are placeholders)
#   --wheelhouse DIR    install from DIR only (`pip wheel` output; see deploy/build-wheelhouse.sh)
#   --package SPEC      what pip installs (default: swerl[node], or this checkout when run from it)
#   --images FILE       pre-pull these images (images.txt from `swerl data prepare`)
#   --mirror-prefix P   pull the images from registry mirror P and re-tag them
#   --dry-run           print every command instead of running it
# Idempotent: re-running upgrades the package and restarts the service, nothing else changes.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$HERE")"
PREFIX="${SWERL_PREFIX:-/opt/swerl}"
ETC="${SWERL_ETC:-/etc/swerl}"
UNIT_DIR="${SWERL_UNIT_DIR:-/etc/systemd/system}"
ENV_FILE="$HERE/env/exec.env"
WHEELHOUSE=""
PACKAGE=""
IMAGES=""
MIRROR=""
DRY_RUN=0

log() { printf '[bootstrap-node] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
run() {
  if [ "$DRY_RUN" = 1 ]; then printf '+ %s\n' "$*"; else "$@"; fi
}

# grpc.health.v1 Check of the whole server (plaintext; with TLS check by hand with grpcurl).
health_check() {
  "$PREFIX/venv/bin/python" - "$1" "$2" <<'PY' >/dev/null 2>&1
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

address, token = sys.argv[1], sys.argv[2]
metadata = [("authorization", f"Bearer {token}")] if token else []
with grpc.insecure_channel(address) as channel:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=3, metadata=metadata
    )
sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)
PY
}

while [ $# -gt 0 ]; do
  case "$1" in
    --env-file) ENV_FILE="$2"; shift 2 ;;
    --wheelhouse) WHEELHOUSE="$2"; shift 2 ;;
    --package) PACKAGE="$2"; shift 2 ;;
    --images) IMAGES="$2"; shift 2 ;;
    --mirror-prefix) MIRROR="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[ -f "$ENV_FILE" ] || die "env file $ENV_FILE not found"
[ -z "$IMAGES" ] || [ -f "$IMAGES" ] || die "image list $IMAGES not found"
[ -z "$WHEELHOUSE" ] || [ -d "$WHEELHOUSE" ] || die "wheelhouse $WHEELHOUSE not found"
if [ "$DRY_RUN" != 1 ] && [ "$(id -u)" -ne 0 ]; then die "run as root (or with sudo)"; fi
if [ -z "$PACKAGE" ]; then
  if [ -f "$REPO/pyproject.toml" ] && [ -z "$WHEELHOUSE" ]; then PACKAGE="$REPO[node]"; else PACKAGE="swerl[node]"; fi
fi

log "1/6 Docker"
if ! command -v dockerd >/dev/null 2>&1; then
  run env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  run env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io
fi
run systemctl enable --now docker.service

log "2/6 user swerl"
if ! id swerl >/dev/null 2>&1; then
  run useradd --system --home-dir /var/lib/swerl --shell /usr/sbin/nologin swerl
fi
run usermod -a -G docker swerl

log "3/6 swerl into $PREFIX/venv"
if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
  run env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
fi
[ -x "$PREFIX/venv/bin/python" ] || run python3 -m venv "$PREFIX/venv"
if [ -n "$WHEELHOUSE" ]; then
  run "$PREFIX/venv/bin/pip" install --quiet --no-index --find-links "$WHEELHOUSE" --upgrade "$PACKAGE"
else
  run "$PREFIX/venv/bin/pip" install --quiet --upgrade "$PACKAGE"
fi

log "4/6 $ETC/exec.env"
run install -d -m 0750 -o root -g swerl "$ETC"
if [ -f "$ETC/exec.env" ]; then
  log "keeping the existing $ETC/exec.env"
else
  grep -q 'change-me' "$ENV_FILE" && log "warning: $ENV_FILE still has placeholder secrets"
  run install -m 0640 -o root -g swerl "$ENV_FILE" "$ETC/exec.env"
fi

log "5/6 swerl-exec.service"
run install -m 0644 "$HERE/systemd/swerl-exec.service" "$UNIT_DIR/swerl-exec.service"
run systemctl daemon-reload
run systemctl enable swerl-exec.service
run systemctl restart swerl-exec.service

# shellcheck disable=SC1090
token="$( (set -a; . "$ENV_FILE"; [ -f "$ETC/exec.env" ] && . "$ETC/exec.env"; printf '%s' "${SWERL_EXEC_AUTH_TOKEN:-}") 2>/dev/null || true)"
port="$( (set -a; . "$ENV_FILE"; [ -f "$ETC/exec.env" ] && . "$ETC/exec.env"; printf '%s' "${SWERL_EXEC_PORT:-5000}") 2>/dev/null || echo 5000)"
if [ "$DRY_RUN" != 1 ]; then
  log "waiting for the node's health on 127.0.0.1:$port"
  healthy=0
  for _ in $(seq 1 60); do
    if health_check "127.0.0.1:$port" "$token"; then healthy=1; break; fi
    sleep 1
  done
  [ "$healthy" = 1 ] || die "swerl-exec is not SERVING: journalctl -u swerl-exec"
fi

log "6/6 images"
if [ -n "$IMAGES" ]; then
  # The token travels in the environment, never on a command line (ps shows those).
  export SWERL_TOKEN="$token"
  run "$PREFIX/venv/bin/swerl" images pull --images "$IMAGES" \
    --node "127.0.0.1:$port" ${MIRROR:+--mirror-prefix "$MIRROR"}
else
  log "no --images: nothing pre-pulled"
fi
log "done: swerl-exec serving on port $port"
