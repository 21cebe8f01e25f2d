#!/usr/bin/env bash
# Soak of the whole path with crashes, by hand (minutes; not part of the test suite):
# `loadtest send` posts simulated readings at a steady rate to the gateway, which produces to a
# Kafka-protocol broker; a sink lands Parquet in moto's S3 and is killed with SIGKILL and
# restarted every 10-40 s, the gateway once; at the end `loadtest verify` checks that every
# distinct reading landed exactly once. Exits with verify's status.
#
#   scripts/soak.sh [READINGS [RATE]]     defaults: 90000 readings at 1000 a second
#
# The broker is librdkafka's mock cluster (`loadtest mock-broker`): tansu 0.6, the suite's
# broker, keeps a killed member's partitions from the others and answers a fetch inside a
# record batch with the next batch, which loses records for any consumer that resumes from a
# commit in the middle of a batch (README, "Tests"). Logs and the report stay in the printed
# directory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
READINGS=${1:-90000}
RATE=${2:-1000}

cargo build --release -p ingest-gateway -p sink -p loadtest
BIN="$PWD/target/release"
scripts/services.sh install
DIR="$(mktemp -d "${TMPDIR:-/tmp}/edge-ingest-soak.XXXXXX")"
echo "soak: logs in $DIR" >&2
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}" $(cat "$DIR"/*.pid 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
  scripts/services.sh stop "$DIR/services" || true
}
trap cleanup EXIT
scripts/services.sh start "$DIR/services"
# shellcheck disable=SC1091
source "$DIR/services/env"
free_port() { "$EDGE_INGEST_PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

ID="soak$(date +%s)"
"$EDGE_INGEST_PYTHON" scripts/read_landing.py --s3-endpoint "$EDGE_INGEST_S3" --bucket "$ID" --create-bucket
"$BIN/loadtest" mock-broker --partitions 3 --topic-prefix "$ID." > "$DIR/broker.addr" 2> "$DIR/broker.log" &
PIDS+=($!)
for _ in $(seq 50); do [ -s "$DIR/broker.addr" ] && break; sleep 0.1; done
BROKERS=$(head -1 "$DIR/broker.addr")
GATEWAY_PORT=$(free_port)
cat > "$DIR/sink.toml" <<EOF
streams_dir = "$PWD/streams"
admin_listen = "127.0.0.1:$(free_port)"
[kafka]
brokers = "$BROKERS"
topic_prefix = "$ID."
group_id = "$ID"
session_timeout_ms = 6000
[store]
type = "s3"
bucket = "$ID"
endpoint = "$EDGE_INGEST_S3"
region = "us-east-1"
force_path_style = true
[rotation]
idle_ms = 2000
max_records = 3000
[upload]
staging_dir = "$DIR/staging"
EOF
export RUST_LOG=${RUST_LOG:-info} RUST_BACKTRACE=0
start_gateway() {
  (INGEST_GATEWAY_LISTEN="127.0.0.1:$GATEWAY_PORT" INGEST_GATEWAY_STREAMS_DIR="$PWD/streams" \
    INGEST_GATEWAY_KAFKA__BROKERS="$BROKERS" INGEST_GATEWAY_KAFKA__TOPIC_PREFIX="$ID." \
    INGEST_GATEWAY_AUTH__ALLOW_ANONYMOUS=true \
    "$BIN/ingest-gateway" --config config/ingest-gateway.toml >> "$DIR/gateway.log" 2>&1 &
    echo $! > "$DIR/gateway.pid")
}
# In a subshell, so that the shell does not report each killed process.
start_sink() {
  ("$BIN/sink" --config "$DIR/sink.toml" >> "$DIR/sink.log" 2>&1 & echo $! > "$DIR/sink.pid")
}
start_gateway
start_sink
sleep 2
"$BIN/loadtest" send --gateway "http://127.0.0.1:$GATEWAY_PORT" --records "$READINGS" \
  --rate "$RATE" --batch-records 500 --save "$DIR/sent.ndjson" > "$DIR/send.json" 2> "$DIR/send.err" &
SEND=$!
kills=0
while kill -0 "$SEND" 2>/dev/null; do
  sleep $((10 + RANDOM % 30))
  kill -0 "$SEND" 2>/dev/null || break
  kill -9 "$(cat "$DIR/sink.pid")" 2>/dev/null || true
  kills=$((kills + 1))
  echo "soak: $(date +%T) sink killed ($kills)" >&2
  sleep 1
  start_sink
  if [ "$kills" -eq 3 ]; then
    kill -9 "$(cat "$DIR/gateway.pid")" 2>/dev/null || true
    echo "soak: $(date +%T) gateway killed" >&2
    sleep 1
    start_gateway
  fi
done
wait "$SEND" || echo "soak: send exited non-zero (see $DIR/send.err)" >&2
echo "soak: sent (summary in $DIR/send.json); $kills sink kills; verifying" >&2
"$BIN/loadtest" verify --sent "$DIR/sent.ndjson" --s3-bucket "$ID" --s3-endpoint "$EDGE_INGEST_S3" \
  --s3-region us-east-1 --s3-path-style --wait 300 | tee "$DIR/verify.json"
