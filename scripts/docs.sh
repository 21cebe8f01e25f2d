#!/usr/bin/env bash
# Builds the docs book (docs/) with mdBook into docs/book/, installing mdBook once into the
# cache ($EDGE_INGEST_CACHE, default ~/.cache/edge-ingest). The suite's `docs` tests check the
# book's links, summary and config-key coverage; this checks that it builds.
#
#   scripts/docs.sh          build docs/book/
#   scripts/docs.sh serve    serve it on http://127.0.0.1:3000, rebuilt on every change
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

MDBOOK="$(scripts/cargo-tool.sh mdbook 0.5.4 3)/mdbook"
case "${1:-build}" in
  build) "$MDBOOK" build docs ;;
  serve) "$MDBOOK" serve docs ;;
  *) echo "docs.sh: build or serve" >&2; exit 2 ;;
esac
