#!/usr/bin/env bash
# Checks the dependency tree with cargo-deny against deny.toml: duplicate majors and banned
# crates (bans), licenses, and where crates come from (sources). cargo-deny is installed once
# into the cache ($EDGE_INGEST_CACHE, default ~/.cache/edge-ingest). The advisory database is
# not checked here: it needs a fetch from GitHub, which CI does not have.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CARGO_DENY="$(scripts/cargo-tool.sh cargo-deny 0.20.2 4)/cargo-deny"
"$CARGO_DENY" --locked check bans licenses sources "$@"
