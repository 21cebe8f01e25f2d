#!/usr/bin/env bash
# Trino for the test suite: a single-node server (coordinator and worker) with only its Iceberg
# connector, from the trino-server tarball on Maven Central (about 820 MB once; 490 MB kept).
#
#   scripts/trino.sh install                    install into the cache (once); prints its folder
#   scripts/trino.sh run DIR PORT CATALOG_FILE  run the server in the foreground on 127.0.0.1:PORT
#                                               with DIR for its config and data; CATALOG_FILE is
#                                               the Iceberg catalog's properties, served as the
#                                               catalog `iceberg`. It prints "SERVER STARTED"
#                                               once it takes queries.
#
# Cache: $EDGE_INGEST_CACHE, default ~/.cache/edge-ingest. Java: Trino 476 needs Java 24 or
# later: $TRINO_JAVA_HOME, else a Temurin 25 under /usr/lib/jvm, else $JAVA_HOME, else java.
set -euo pipefail

VERSION=476
CACHE="${EDGE_INGEST_CACHE:-$HOME/.cache/edge-ingest}"
HOME_DIR="$CACHE/trino-$VERSION"
SERVER="$HOME_DIR/trino-server-$VERSION"

install() {
  if [ -f "$HOME_DIR/.installed" ]; then echo "$SERVER"; return; fi
  if ! command -v mvn >/dev/null 2>&1; then
    echo "trino.sh: Maven (mvn) fetches Trino and is not on the PATH (Debian: apt-get install maven)" >&2
    exit 1
  fi
  echo "trino.sh: installing Trino $VERSION from Maven Central into $HOME_DIR" >&2
  rm -rf "$HOME_DIR"
  mkdir -p "$HOME_DIR"
  mvn -q -B dependency:copy -Dartifact="io.trino:trino-server:$VERSION:tar.gz" \
    -DoutputDirectory="$HOME_DIR" >&2
  tar xzf "$HOME_DIR/trino-server-$VERSION.tar.gz" -C "$HOME_DIR"
  rm "$HOME_DIR/trino-server-$VERSION.tar.gz"
  # Only the Iceberg connector: the plugins share jars by hard links, so the kept ones stay.
  find "$SERVER/plugin" -mindepth 1 -maxdepth 1 ! -name iceberg -exec rm -rf {} +
  touch "$HOME_DIR/.installed"
  echo "$SERVER"
}

java_bin() {
  local j
  for j in "${TRINO_JAVA_HOME:-}" /usr/lib/jvm/temurin-25* "${JAVA_HOME:-}"; do
    if [ -n "$j" ] && [ -x "$j/bin/java" ]; then echo "$j/bin/java"; return; fi
  done
  echo java
}

run() {
  local dir=$1 port=$2 catalog=$3
  if [ ! -f "$HOME_DIR/.installed" ]; then
    echo "trino.sh: Trino $VERSION is not installed: run scripts/trino.sh install" >&2
    exit 1
  fi
  mkdir -p "$dir/etc/catalog" "$dir/data"
  cat >"$dir/etc/config.properties" <<CONF
coordinator=true
node-scheduler.include-coordinator=true
http-server.http.port=$port
discovery.uri=http://127.0.0.1:$port
plugin.dir=$SERVER/plugin
query.max-memory=512MB
query.max-memory-per-node=512MB
CONF
  cp "$catalog" "$dir/etc/catalog/iceberg.properties"
  cd "$dir"
  exec "$(java_bin)" -Xmx1g -XX:+UseG1GC -Djdk.attach.allowAttachSelf=true \
    -Dnode.environment=test -Dnode.data-dir="$dir/data" -Dconfig="$dir/etc/config.properties" \
    -Dcatalog.config-dir="$dir/etc/catalog" -cp "$SERVER/lib/*" io.trino.server.TrinoServer
}

case "${1:-}" in
  install) install ;;
  run) run "${2:?dir}" "${3:?port}" "${4:?catalog properties file}" ;;
  *) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
