#!/usr/bin/env bash
# Installs a cargo tool once into the cache ($EDGE_INGEST_CACHE, default ~/.cache/edge-ingest)
# at the version given, and prints the directory of its binaries.
#
#   scripts/cargo-tool.sh CRATE VERSION [MINUTES]   MINUTES: how long the install takes, for the log
set -euo pipefail

crate="$1" version="$2" minutes="${3:-a few}"
cache="${EDGE_INGEST_CACHE:-$HOME/.cache/edge-ingest}"
root="$cache/$crate-$version"
if [ ! -x "$root/bin/$crate" ]; then
  echo "installing $crate $version (about $minutes minutes, once)" >&2
  CARGO_TARGET_DIR="$cache/$crate-build" cargo install "$crate" --version "$version" \
    --locked --root "$root" >&2
  rm -rf "$cache/$crate-build"
fi
echo "$root/bin"
