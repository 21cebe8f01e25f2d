#!/usr/bin/env bash
# The whole test suite: installs the test services if needed (cached), starts them on free
# loopback ports, runs every test of the workspace against them and stops them again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# A build of the suite takes about 3 GB (more with incremental data): warn early when the disk
# is short of it, rather than fail half-way with "No space left on device".
target="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target"
free_kb=$(df -Pk "$target" | awk 'NR == 2 { print $4 }')
if [ "${free_kb:-0}" -lt $((5 * 1024 * 1024)) ]; then
  echo "test.sh: warning: only $((free_kb / 1024)) MiB free for $target ($(du -sh "$target" 2>/dev/null | cut -f1) in it): the build needs about 3 GB; 'cargo clean' frees what earlier builds left" >&2
fi

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
