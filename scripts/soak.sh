#!/usr/bin/env bash
# Soak of the whole path with crashes, by hand (minutes; not part of the test suite):
# `loadtest send` posts simulated readings at a steady rate to the gateway, which produces to a
# Kafka-protocol broker; a sink lands Parquet in moto's S3 and is killed with SIGKILL and
# restarted every 10-40 s, the gateway once (down for 15 s); at the end `loadtest verify`
# checks that every distinct reading landed exactly once. Exits with verify's status.
#
# With --agent the readings come from the edge: a writer appends them at a steady rate to a log
# file and renames it away every ROTATE lines (log rotation), an edge-agent tails it (read
# positions, dedupe window and spool on disk) and delivers to the gateway, and the kills
# alternate between the agent and the sink; the agent stays down 2-13 s, through rotations.
# With --agent-http `loadtest send` posts to the agent's local HTTP port (the gateway's API)
# instead, retrying with the same Idempotency-Key while the agent is down.
#
#   scripts/soak.sh [--agent | --agent-http] [READINGS [RATE [ROTATE]]]
#       defaults: 90000 readings at 1000 a second; with --agent, a rotation every 20000 lines
#
# The broker is librdkafka's mock cluster (`loadtest mock-broker`), in one process that starts
# at once; the suite's three-broker tests run the same path on Apache Kafka
# (loadtest/tests/kafka_cluster.rs). Logs and the report stay in the printed directory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODE=send
case "${1:-}" in
  --agent) MODE=file; shift ;;
  --agent-http) MODE=http; shift ;;
esac
AGENT=false
if [ "$MODE" != send ]; then AGENT=true; fi
READINGS=${1:-90000}
RATE=${2:-1000}
ROTATE=${3:-20000}
# The mock broker keeps about 80,000 readings of each partition (5 MiB of zstd record batches)
# and drops the oldest past that. A sink killed and restarted falls about 10 s behind (its
# restart and the rebalance), so the rate stays well under what a partition keeps; a sink that
# falls further behind reports the records dropped as an offset gap and stops there.
MAX_RATE=5000
if [ "$RATE" -gt "$MAX_RATE" ]; then
  echo "soak: at most $MAX_RATE readings a second: the mock broker keeps about 80,000 readings per partition, and a sink killed and restarted falls about 10 s behind" >&2
  exit 2
fi

cargo build --release -p ingest-gateway -p sink -p loadtest -p edge-agent
BIN="$PWD/target/release"
scripts/services.sh install
DIR="$(mktemp -d "${TMPDIR:-/tmp}/edge-ingest-soak.XXXXXX")"
# The services run as their own users where this runs as root: they must get through it.
chmod 755 "$DIR"
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
# Free ports, held open together while they are picked so that no two are the same.
read -r GATEWAY_PORT SINK_ADMIN_PORT AGENT_ADMIN_PORT AGENT_HTTP_PORT < <("$EDGE_INGEST_PYTHON" -c '
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')

ID="soak$(date +%s)"
"$EDGE_INGEST_PYTHON" scripts/read_landing.py --s3-endpoint "$EDGE_INGEST_S3" --bucket "$ID" --create-bucket
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
start_agent() {
  ("$BIN/edge-agent" run --config "$DIR/agent.toml" >> "$DIR/agent.log" 2>&1 & echo $! > "$DIR/agent.pid")
}
start_gateway
start_sink
sleep 2
send() { # gateway-url: posts the simulated fleet at RATE, keeping what it sent
  "$BIN/loadtest" send --gateway "$1" --records "$READINGS" --rate "$RATE" --batch-records 500 \
    --save "$DIR/sent.ndjson" > "$DIR/send.json" 2> "$DIR/send.err"
}
if $AGENT; then
  if [ "$MODE" = file ]; then
    source_toml="type = \"file\"
stream = \"sensor_readings\"
path = \"$DIR/in/readings.ndjson\"
follow = true
poll_ms = 100"
  else
    # The stream is in the request's path.
    source_toml="type = \"http\"
listen = \"127.0.0.1:$AGENT_HTTP_PORT\""
  fi
  cat > "$DIR/agent.toml" <<EOF
streams_dir = "$PWD/streams"
state_dir = "$DIR/agent-state"
admin_listen = "127.0.0.1:$AGENT_ADMIN_PORT"
[gateway]
url = "http://127.0.0.1:$GATEWAY_PORT"
max_backoff_ms = 2000
[batch]
max_records = 500
max_age_ms = 500
[[sources]]
$source_toml
EOF
fi
if [ "$MODE" = file ]; then
  # The readings, and a writer that appends them to a rotated log for the agent to tail.
  "$BIN/loadtest" generate --records "$READINGS" --out "$DIR/sent.ndjson"
  mkdir -p "$DIR/in"
  : > "$DIR/in/readings.ndjson"
  start_agent
  "$EDGE_INGEST_PYTHON" - "$DIR/sent.ndjson" "$DIR/in/readings.ndjson" "$RATE" "$ROTATE" \
    > "$DIR/writer.log" 2>&1 <<'EOF' &
import os, sys, time
src, dst, rate, rotate = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
out, written, rotations, start = open(dst, "a"), 0, 0, time.monotonic()
with open(src) as lines:
    for line in lines:
        out.write(line)
        written += 1
        if written % rotate == 0:
            out.close()
            rotations += 1
            os.rename(dst, f"{dst}.{rotations}")
            out = open(dst, "a")
        if written % max(rate // 10, 1) == 0:
            out.flush()
            time.sleep(max(0.0, start + written / rate - time.monotonic()))
out.close()
print(f"writer: {written} lines, {rotations} rotations", flush=True)
EOF
  FEED=$!
elif [ "$MODE" = http ]; then
  start_agent
  sleep 1
  send "http://127.0.0.1:$AGENT_HTTP_PORT" &
  FEED=$!
else
  send "http://127.0.0.1:$GATEWAY_PORT" &
  FEED=$!
fi
kills=0
while kill -0 "$FEED" 2>/dev/null; do
  sleep $((10 + RANDOM % 30))
  kill -0 "$FEED" 2>/dev/null || break
  kills=$((kills + 1))
  victim=sink
  if $AGENT && [ $((kills % 2)) -eq 1 ]; then victim=agent; fi
  kill -9 "$(cat "$DIR/$victim.pid")" 2>/dev/null || true
  # The agent stays down long enough for its log to be rotated meanwhile.
  down=1
  if [ "$victim" = agent ]; then down=$((2 + RANDOM % 12)); fi
  echo "soak: $(date +%T) $victim killed ($kills), down ${down}s" >&2
  sleep "$down"
  "start_$victim"
  if [ "$kills" -eq 3 ]; then
    kill -9 "$(cat "$DIR/gateway.pid")" 2>/dev/null || true
    echo "soak: $(date +%T) gateway killed, down 15s" >&2
    sleep 15
    start_gateway
  fi
done
if [ "$MODE" = file ]; then
  wait "$FEED" || echo "soak: the writer exited non-zero (see $DIR/writer.log)" >&2
  echo "soak: written ($(cat "$DIR/writer.log")); $kills kills; verifying" >&2
else
  wait "$FEED" || echo "soak: send exited non-zero (see $DIR/send.err)" >&2
  echo "soak: sent (summary in $DIR/send.json); $kills kills; verifying" >&2
fi
"$BIN/loadtest" verify --sent "$DIR/sent.ndjson" --s3-bucket "$ID" --s3-endpoint "$EDGE_INGEST_S3" \
  --s3-region us-east-1 --s3-path-style --wait 300 | tee "$DIR/verify.json" || status=$?
if grep -h "offset gap" "$DIR/sink.log" >&2; then
  echo "soak: the sink found offset gaps (above): the broker dropped records before a sink read them" >&2
fi
exit "${status:-0}"
