#!/usr/bin/env bash
# Freshness of the Iceberg table, by hand (minutes; not part of the test suite): `loadtest send`
# posts simulated readings at a steady rate to the gateway, which produces to librdkafka's mock
# cluster (`loadtest mock-broker`); a sink lands them in a local directory and commits them to a
# table in a SQLite catalog, with the shipped commit interval (60 s) and a rotation age of 30 s.
# `loadtest verify --table` then checks every distinct reading is in the table's current
# snapshot once and reports `send_to_landing_ms`: from a batch's first attempt to the commit of
# the snapshot that made its readings visible (p50, p99, max). Exits with verify's status.
#
#   scripts/freshness.sh [READINGS [RATE [COMMIT_INTERVAL_MS [MAX_AGE_MS]]]]
#       defaults: 120000 readings at 1000 a second, commits every 60000 ms, files closed at
#       30000 ms; the target is p99 <= COMMIT_INTERVAL_MS + MAX_AGE_MS + 5000
#
# EDGE_INGEST_BIN names a directory of built binaries to use instead of a release build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
READINGS=${1:-120000}
RATE=${2:-1000}
COMMIT_MS=${3:-60000}
MAX_AGE_MS=${4:-30000}

if [ -n "${EDGE_INGEST_BIN:-}" ]; then
  BIN="$(cd "$EDGE_INGEST_BIN" && pwd)"
else
  cargo build --release -p ingest-gateway -p sink -p loadtest
  BIN="$PWD/target/release"
fi
scripts/services.sh install
DIR="$(mktemp -d "${TMPDIR:-/tmp}/edge-ingest-freshness.XXXXXX")"
# The services run as their own users where this runs as root: they must get through it.
chmod 755 "$DIR"
echo "freshness: logs in $DIR" >&2
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  scripts/services.sh stop "$DIR/services" || true
}
trap cleanup EXIT
scripts/services.sh start "$DIR/services" >&2
# shellcheck disable=SC1091
source "$DIR/services/env"
read -r GATEWAY_PORT SINK_ADMIN_PORT < <("$EDGE_INGEST_PYTHON" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')

ID="fresh$(date +%s)"
"$BIN/loadtest" mock-broker --partitions 3 --topic-prefix "$ID." > "$DIR/broker.addr" 2> "$DIR/broker.log" &
PIDS+=($!)
for _ in $(seq 50); do [ -s "$DIR/broker.addr" ] && break; sleep 0.1; done
BROKERS=$(head -1 "$DIR/broker.addr")
cat > "$DIR/sink.toml" <<EOF
streams_dir = "$PWD/streams"
admin_listen = "127.0.0.1:$SINK_ADMIN_PORT"
[kafka]
brokers = "$BROKERS"
topic_prefix = "$ID."
group_id = "$ID"
[store]
type = "local"
path = "$DIR/landing"
[rotation]
max_age_ms = $MAX_AGE_MS
[upload]
staging_dir = "$DIR/staging"
[table]
catalog = "$DIR/catalog.db"
commit_interval_ms = $COMMIT_MS
EOF
export RUST_LOG=${RUST_LOG:-info}
INGEST_GATEWAY_LISTEN="127.0.0.1:$GATEWAY_PORT" INGEST_GATEWAY_STREAMS_DIR="$PWD/streams" \
  INGEST_GATEWAY_KAFKA__BROKERS="$BROKERS" INGEST_GATEWAY_KAFKA__TOPIC_PREFIX="$ID." \
  INGEST_GATEWAY_AUTH__ALLOW_ANONYMOUS=true \
  "$BIN/ingest-gateway" --config config/ingest-gateway.toml > "$DIR/gateway.log" 2>&1 &
PIDS+=($!)
"$BIN/sink" --config "$DIR/sink.toml" > "$DIR/sink.log" 2>&1 &
PIDS+=($!)
sleep 2
"$BIN/loadtest" send --gateway "http://127.0.0.1:$GATEWAY_PORT" --records "$READINGS" \
  --rate "$RATE" --batch-records 500 --save "$DIR/sent.ndjson" > "$DIR/send.json" 2> "$DIR/send.err"
echo "freshness: sent (summary in $DIR/send.json); verifying from the table" >&2
status=0
"$BIN/loadtest" verify --sent "$DIR/sent.ndjson" --landing "$DIR/landing" --table "$DIR/catalog.db" \
  --wait $(( (COMMIT_MS + MAX_AGE_MS) / 1000 + 120 )) | tee "$DIR/verify.json" || status=$?
echo "freshness: target p99 <= $(( COMMIT_MS + MAX_AGE_MS + 5000 )) ms" >&2
exit "$status"
