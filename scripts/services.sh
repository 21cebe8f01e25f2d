#!/usr/bin/env bash
# Test services on loopback: Apache Kafka (one KRaft node, from Maven Central by scripts/kafka.sh),
# an S3 server (moto), an MQTT broker (mosquitto, from Debian), a PostgreSQL server (Debian; table
# catalogs), Prometheus and docker-compose (from Debian, for the monitoring test) and the Python
# tools of the test suite (pyarrow, boto3, confluent-kafka, pyspark, with Iceberg's Spark runtime
# from Maven Central), Apache Iceberg's REST catalog server (its test fixture, from Maven
# Central; a JdbcCatalog on SQLite behind it) and Trino (installed; a test starts it). Installs
# once into a cache and reuses
# it; every start picks free ports, so parallel runs do not collide.
#
#   scripts/services.sh install          install what is missing (cached)
#   scripts/services.sh start STATE_DIR  start the services; writes STATE_DIR/env (export lines)
#   scripts/services.sh stop STATE_DIR   stop what `start` started
#   scripts/services.sh install-connect  install Kafka Connect with Iceberg's sink connector
#                                        (for scripts/bench.sh sink); prints its jars' folder
#
# Cache: $EDGE_INGEST_CACHE, default ~/.cache/edge-ingest.
set -euo pipefail

CACHE="${EDGE_INGEST_CACHE:-$HOME/.cache/edge-ingest}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$CACHE/venv"
PY="$VENV/bin/python"

log() { echo "services: $*" >&2; }

install_kafka() {
  "$HERE/kafka.sh" install >/dev/null
}

# Trino (scripts/trino.sh): a test starts a server of its own.
install_trino() {
  "$HERE/trino.sh" install >/dev/null
}

# One KRaft node (broker and controller) in $1/kafka, clients on port $2, its controller on $3,
# with the suite's settings (scripts/kafka/test.properties).
start_kafka() {
  local dir=$1/kafka port=$2 cport=$3
  mkdir -p "$dir"
  cat >"$dir/server.properties" <<CONF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
controller.listener.names=CONTROLLER
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$dir/data
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
CONF
  cat "$HERE/kafka/test.properties" >>"$dir/server.properties"
  "$HERE/kafka.sh" run "$dir/server.properties" >"$1/kafka.log" 2>&1 &
  echo $! >"$1/kafka.pid"
}

# The runtime jars of the pom scripts/$1/pom.xml in the folder $2 ($3 says what they are),
# installed again when the pom changes.
install_jars() {
  local pom="$HERE/$1/pom.xml" dir=$2
  if [ -d "$dir" ] && cmp -s "$pom" "$dir/.pom.xml"; then return; fi
  log "installing $3 from Maven Central into $dir"
  rm -rf "$dir"
  mvn -q -B -f "$pom" dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$dir" >&2
  cp "$pom" "$dir/.pom.xml"
}

SPARK_JARS="$CACHE/spark-jars"
install_spark_jars() {
  install_jars spark "$SPARK_JARS" "Iceberg's Spark runtime and JDBC drivers"
}

CONNECT_JARS="$CACHE/kafka-connect-jars"

ICEBERG_REST_JARS="$CACHE/iceberg-rest-jars"
install_iceberg_rest() {
  install_jars iceberg-rest "$ICEBERG_REST_JARS" "Apache Iceberg's REST catalog server"
}

# Apache Iceberg's REST catalog server on port $2: a JdbcCatalog on SQLite in $1/iceberg-rest
# (tests take a namespace of their own; the tables' files are where their metadata says).
start_iceberg_rest() {
  local dir=$1/iceberg-rest port=$2
  mkdir -p "$dir"
  CATALOG_WAREHOUSE="file://$dir/warehouse" CATALOG_URI="jdbc:sqlite:$dir/catalog.db" \
    CATALOG_REST_PORT="$port" "${JAVA_HOME:+$JAVA_HOME/bin/}java" -Xmx384m \
    -cp "$ICEBERG_REST_JARS/*" org.apache.iceberg.rest.RESTCatalogServer >"$1/iceberg-rest.log" 2>&1 &
  echo $! >"$1/iceberg-rest.pid"
}

install_python() {
  local stamp="$VENV/.requirements"
  if [ -x "$PY" ] && cmp -s "$HERE/requirements-test.txt" "$stamp"; then return; fi
  log "installing Python test tools into $VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install --quiet --disable-pip-version-check -r "$HERE/requirements-test.txt" >&2
  cp "$HERE/requirements-test.txt" "$stamp"
}

# Node.js clients (scripts/npm/package.json, pinned by its lock file) into $CACHE/npm.
install_npm() {
  local dir="$CACHE/npm"
  if cmp -s "$HERE/npm/package-lock.json" "$dir/package-lock.json" && [ -d "$dir/node_modules" ]; then return; fi
  log "installing Node.js test clients into $dir"
  mkdir -p "$dir"
  cp "$HERE/npm/package.json" "$HERE/npm/package-lock.json" "$dir/"
  (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >&2)
}

# Debian packages: mosquitto (MQTT broker), prometheus (server and promtool, for the
# monitoring test), docker-compose (only to validate docker-compose.yml), systemd (only
# systemd-analyze, to check the agent's unit file), tinyproxy (a forward proxy, started by
# the agent's proxy tests themselves), postgresql (a table catalog database), chromium
# (headless, to load the agent's status page), Java 17 with Maven for Apache Kafka, and
# Node.js with npm (a schema registry client of its own).
install_debian() {
  local missing=()
  command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || missing+=(mosquitto)
  command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
  command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
  command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
  command -v tinyproxy >/dev/null 2>&1 || [ -x /usr/bin/tinyproxy ] || missing+=(tinyproxy)
  [ -n "$(pg_bin)" ] || missing+=(postgresql)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v java >/dev/null 2>&1 || [ -n "${JAVA_HOME:-}" ] || missing+=(openjdk-17-jre-headless)
  command -v mvn >/dev/null 2>&1 || missing+=(maven)
  command -v node >/dev/null 2>&1 || missing+=(nodejs)
  command -v npm >/dev/null 2>&1 || missing+=(npm)
  if [ ${#missing[@]} -eq 0 ]; then return; fi
  log "installing ${missing[*]} (Debian packages)"
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
  $sudo apt-get install -y --no-install-recommends "${missing[@]}" >&2 \
    || { $sudo apt-get update >&2 && $sudo apt-get install -y --no-install-recommends "${missing[@]}" >&2; }
}

# The newest PostgreSQL server's bin directory (Debian keeps it off the PATH).
pg_bin() {
  ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1
}

# Runs a PostgreSQL command as the `postgres` user when this is root (the server refuses
# root), else as this user.
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# A PostgreSQL server of its own in $1/postgres on port $2, trusting local connections.
start_postgres() {
  local dir=$1/postgres port=$2 bin
  bin=$(pg_bin)
  mkdir -p "$dir"
  if [ "$(id -u)" = 0 ]; then
    # The server's user must get through the state directory (mktemp makes it 0700).
    chmod a+x "$1"
    chown postgres "$dir"
    if ! as_pg test -x "$dir"; then
      echo "services: the postgres user cannot reach $dir: give the directories above it a+x" >&2
      return 1
    fi
  fi
  as_pg "$bin/initdb" -D "$dir/data" -U postgres --auth=trust >"$1/postgres-init.log" 2>&1 \
    || { cat "$1/postgres-init.log" >&2; return 1; }
  as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-h 127.0.0.1 -p $port -k $dir" start >&2 || { cat "$dir/server.log" >&2; return 1; }
}

mosquitto_bin() {
  command -v mosquitto 2>/dev/null || echo /usr/sbin/mosquitto
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_for_port() { # port name seconds
  local port=$1 name=$2 secs=$3
  for _ in $(seq 1 $((secs * 10))); do
    if python3 -c "import socket,sys; s=socket.socket(); s.settimeout(0.2); sys.exit(s.connect_ex(('127.0.0.1', $port)))" 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  log "$name did not open port $port within ${secs}s"
  return 1
}

# Waits for a Kafka node's log ($1) to say that it started (its port opens a little earlier).
wait_for_kafka() {
  local log=$1 secs=$2
  for _ in $(seq 1 $((secs * 10))); do
    if grep -q "Kafka Server started" "$log"; then return 0; fi
    sleep 0.1
  done
  cat "$log" >&2
  log "kafka did not start within ${secs}s"
  return 1
}

start() {
  local state=$1
  mkdir -p "$state"
  local kport kcport sport mport pport rport
  kport=$(free_port)
  kcport=$(free_port)
  sport=$(free_port)
  mport=$(free_port)
  pport=$(free_port)
  rport=$(free_port)
  # In-memory sessions; the broker's default in-flight limit (20 per client) is kept on purpose.
  cat >"$state/mosquitto.conf" <<CONF
listener $mport 127.0.0.1
allow_anonymous true
persistence false
CONF
  "$(mosquitto_bin)" -c "$state/mosquitto.conf" >"$state/mosquitto.log" 2>&1 &
  echo $! >"$state/mosquitto.pid"
  start_kafka "$state" "$kport" "$kcport"
  start_iceberg_rest "$state" "$rport"
  "$VENV/bin/moto_server" -H 127.0.0.1 -p "$sport" >"$state/moto.log" 2>&1 &
  echo $! >"$state/moto.pid"
  wait_for_port "$kport" kafka 120 || { cat "$state/kafka.log" >&2; return 1; }
  wait_for_kafka "$state/kafka.log" 120
  wait_for_port "$sport" moto_server 60 || { cat "$state/moto.log" >&2; return 1; }
  wait_for_port "$mport" mosquitto 30 || { cat "$state/mosquitto.log" >&2; return 1; }
  start_postgres "$state" "$pport"
  wait_for_port "$rport" iceberg-rest 120 || { cat "$state/iceberg-rest.log" >&2; return 1; }
  cat >"$state/env" <<ENV
export EDGE_INGEST_KAFKA=127.0.0.1:$kport
export EDGE_INGEST_S3=http://127.0.0.1:$sport
export EDGE_INGEST_MQTT=127.0.0.1:$mport
export EDGE_INGEST_POSTGRES=postgres://postgres@127.0.0.1:$pport/postgres
export EDGE_INGEST_MOSQUITTO=$(mosquitto_bin)
export EDGE_INGEST_PYTHON=$PY
export EDGE_INGEST_NODE=$(command -v node)
export EDGE_INGEST_NODE_MODULES=$CACHE/npm/node_modules
export EDGE_INGEST_KAFKA_SH=$HERE/kafka.sh
export EDGE_INGEST_SPARK_JARS=$SPARK_JARS
export EDGE_INGEST_ICEBERG_REST=http://127.0.0.1:$rport
export EDGE_INGEST_PROMETHEUS=$(command -v prometheus)
export EDGE_INGEST_PROMTOOL=$(command -v promtool)
export EDGE_INGEST_DOCKER_COMPOSE=$(command -v docker-compose)
export EDGE_INGEST_SYSTEMD_ANALYZE=$(command -v systemd-analyze)
export EDGE_INGEST_CHROMIUM=$(command -v chromium)
export EDGE_INGEST_TINYPROXY=$(command -v tinyproxy || echo /usr/bin/tinyproxy)
export AWS_ACCESS_KEY_ID=test
export AWS_SECRET_ACCESS_KEY=test
export AWS_REGION=us-east-1
export AWS_EC2_METADATA_DISABLED=true
ENV
  log "Apache Kafka on 127.0.0.1:$kport, moto_server on 127.0.0.1:$sport, mosquitto on 127.0.0.1:$mport, postgres on 127.0.0.1:$pport, Iceberg's REST catalog on 127.0.0.1:$rport (logs in $state)"
}

stop() {
  local state=$1
  # Each is waited for (Kafka writes its files while it shuts down), so that the state
  # directory can be removed right after; one that takes over 30 s is killed.
  for name in kafka iceberg-rest moto mosquitto; do
    if [ -f "$state/$name.pid" ]; then
      local pid
      pid=$(cat "$state/$name.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 300); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$state/$name.pid"
    fi
  done
  if [ -d "$state/postgres/data" ]; then
    as_pg "$(pg_bin)/pg_ctl" -D "$state/postgres/data" -m fast stop >/dev/null 2>&1 || true
  fi
}

case "${1:-}" in
  install) install_debian; install_kafka; install_spark_jars; install_iceberg_rest; install_trino; install_python; install_npm ;;
  start) start "${2:?state dir}" ;;
  stop) stop "${2:?state dir}" ;;
  install-connect) install_jars kafka-connect "$CONNECT_JARS" "Kafka Connect with Iceberg's sink connector"; echo "$CONNECT_JARS" ;;
  *) echo "usage: $0 install | start STATE_DIR | stop STATE_DIR | install-connect" >&2; exit 2 ;;
esac
