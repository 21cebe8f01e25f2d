#!/usr/bin/env bash
# Checks the dependency tree with cargo-deny against deny.toml: duplicate majors and banned
# crates (bans), licenses, and where crates come from (sources). cargo-deny is installed once
# into the cache ($EDGE_INGEST_CACHE, default ~/.cache/edge-ingest). The advisory database is
# not checked here: it needs a fetch from GitHub, which CI does not have.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CARGO_DENY_VERSION=0.20.2
CACHE="${EDGE_INGEST_CACHE:-$HOME/.cache/edge-ingest}"
CARGO_DENY="$CACHE/cargo-deny-$CARGO_DENY_VERSION/bin/cargo-deny"

if [ ! -x "$CARGO_DENY" ]; then
  echo "deny: installing cargo-deny $CARGO_DENY_VERSION (about 4 minutes, once)" >&2
  CARGO_TARGET_DIR="$CACHE/cargo-deny-build" cargo install cargo-deny \
    --version "$CARGO_DENY_VERSION" --locked --root "$CACHE/cargo-deny-$CARGO_DENY_VERSION" >&2
  rm -rf "$CACHE/cargo-deny-build"
fi
"$CARGO_DENY" --locked check bans licenses sources "$@"
