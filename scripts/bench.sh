#!/usr/bin/env bash
# Benchmarks that need the test services: starts them (installing once, cached), runs the
# benchmark in release mode and stops them. Usage: scripts/bench.sh gateway|sink|agent [options]
# (agent needs no services).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
which=${1:-gateway}
shift || true
if [ "$which" = agent ]; then
  # All of loadtest's binaries: bench-agent runs the pipeline in loadtest-agent-worker.
  cargo build --release -p loadtest --bins
  exec cargo run --release -p loadtest -- bench-agent "$@"
fi
scripts/services.sh install
STATE="$(mktemp -d "${TMPDIR:-/tmp}/edge-ingest-bench.XXXXXX")"
trap 'scripts/services.sh stop "$STATE"; rm -rf "$STATE"' EXIT
scripts/services.sh start "$STATE"
# shellcheck disable=SC1091
source "$STATE/env"
case "$which" in
  gateway) cargo run --release -p loadtest -- bench-gateway --brokers "$EDGE_INGEST_KAFKA" "$@" ;;
  sink)
    # Kafka Connect's Iceberg sink runs beside the sink, into Apache Iceberg's REST catalog.
    EDGE_INGEST_CONNECT_JARS=$(scripts/services.sh install-connect)
    export EDGE_INGEST_CONNECT_JARS
    cargo run --release -p loadtest -- bench-sink --brokers "$EDGE_INGEST_KAFKA" "$@" ;;
  *) echo "unknown benchmark: $which (gateway, sink, agent)" >&2; exit 2 ;;
esac
