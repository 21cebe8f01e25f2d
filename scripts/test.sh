#!/usr/bin/env bash
# The whole test suite: installs the test services if needed (cached), starts them on free
# loopback ports, runs every test of the workspace against them and stops them again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/services.sh install
STATE="$(mktemp -d "${TMPDIR:-/tmp}/edge-ingest-services.XXXXXX")"
trap 'scripts/services.sh stop "$STATE"; rm -rf "$STATE"' EXIT
scripts/services.sh start "$STATE"
# shellcheck disable=SC1091
source "$STATE/env"

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
else
  cargo test --workspace --no-fail-fast "$@"
fi
