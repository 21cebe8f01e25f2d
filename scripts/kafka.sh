#!/usr/bin/env bash
# Apache Kafka for the test suite, the benchmarks and the walk-through, run from its Maven jars
# (no distribution tarball): the version is pinned in scripts/kafka/pom.xml.
#
#   scripts/kafka.sh install             install the jars into the cache (once); prints their folder
#   scripts/kafka.sh run CONFIG          format CONFIG's log.dirs if they are new, then run the
#                                        broker in the foreground (KRaft; this process becomes it)
#   scripts/kafka.sh TOOL ARGS...        one of Kafka's command-line tools, named as its
#                                        kafka-TOOL.sh: topics, consumer-groups, delete-records,
#                                        acls, configs, metadata-quorum, get-offsets, storage,
#                                        console-consumer, console-producer
#
# Cache: $EDGE_INGEST_CACHE, default ~/.cache/edge-ingest. Java: $JAVA_HOME/bin/java, else java
# (Kafka 4 needs Java 17 or later). Environment of `run`: KAFKA_CLUSTER_ID (nodes of one cluster
# share it; a fixed id by default), KAFKA_FORMAT_ARGS (more `kafka-storage format` arguments, such
# as --add-scram SCRAM-SHA-512=[name=u,password=p]), KAFKA_HEAP_OPTS (default -Xmx1g),
# KAFKA_JVM_OPTS.
set -euo pipefail

CACHE="${EDGE_INGEST_CACHE:-$HOME/.cache/edge-ingest}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$HERE/kafka/pom.xml")
LIBS="$CACHE/kafka-$VERSION/libs"
JAVA="${JAVA_HOME:+$JAVA_HOME/bin/}java"

install() {
  local stamp="$CACHE/kafka-$VERSION/pom.xml"
  if [ -d "$LIBS" ] && cmp -s "$HERE/kafka/pom.xml" "$stamp"; then echo "$LIBS"; return; fi
  if ! command -v mvn >/dev/null 2>&1; then
    echo "kafka.sh: Maven (mvn) installs Apache Kafka's jars and is not on the PATH (Debian: apt-get install maven)" >&2
    exit 1
  fi
  echo "kafka.sh: installing Apache Kafka $VERSION from Maven Central into $LIBS" >&2
  rm -rf "$LIBS"
  mvn -q -B -f "$HERE/kafka/pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$LIBS" >&2
  cp "$HERE/kafka/pom.xml" "$stamp"
  echo "$LIBS"
}

java_of() { # main class, args...
  if [ ! -d "$LIBS" ]; then
    echo "kafka.sh: Apache Kafka $VERSION is not installed: run scripts/kafka.sh install" >&2
    exit 1
  fi
  if ! command -v "$JAVA" >/dev/null 2>&1; then
    echo "kafka.sh: no Java to run Kafka ($JAVA); Kafka $VERSION needs Java 17 or later" >&2
    exit 1
  fi
  local main=$1
  shift
  # shellcheck disable=SC2086
  exec "$JAVA" ${KAFKA_HEAP_OPTS:--Xmx1g} ${KAFKA_JVM_OPTS:-} -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$HERE/kafka/log4j2.properties" -cp "$LIBS/*" "$main" "$@"
}

run() {
  local config=$1 dirs
  dirs=$(sed -n 's/^log\.dirs *= *//p' "$config" | tail -n 1)
  if [ -z "$dirs" ]; then echo "kafka.sh: $config sets no log.dirs" >&2; exit 2; fi
  if [ ! -f "${dirs%%,*}/meta.properties" ]; then
    local extra=()
    read -r -a extra <<<"${KAFKA_FORMAT_ARGS:-}"
    # A JVM of its own that exits: the broker below replaces this shell.
    (KAFKA_HEAP_OPTS=-Xmx256m KAFKA_JVM_OPTS=-XX:TieredStopAtLevel=1 java_of kafka.tools.StorageTool \
      format --ignore-formatted -t "${KAFKA_CLUSTER_ID:-ZWRnZS1pbmdlc3QtdGVzdA}" -c "$config" \
      "${extra[@]}") >/dev/null
  fi
  java_of kafka.Kafka "$config"
}

tool() {
  local class
  case "$1" in
    topics) class=org.apache.kafka.tools.TopicCommand ;;
    consumer-groups) class=org.apache.kafka.tools.consumer.group.ConsumerGroupCommand ;;
    delete-records) class=org.apache.kafka.tools.DeleteRecordsCommand ;;
    acls) class=org.apache.kafka.tools.AclCommand ;;
    configs) class=org.apache.kafka.tools.ConfigCommand ;;
    metadata-quorum) class=org.apache.kafka.tools.MetadataQuorumCommand ;;
    get-offsets) class=org.apache.kafka.tools.GetOffsetShell ;;
    storage) class=kafka.tools.StorageTool ;;
    console-consumer) class=org.apache.kafka.tools.consumer.ConsoleConsumer ;;
    console-producer) class=org.apache.kafka.tools.ConsoleProducer ;;
    *) echo "usage: $0 install | run CONFIG | TOOL ARGS... (see the head of this script)" >&2; exit 2 ;;
  esac
  shift
  KAFKA_HEAP_OPTS="${KAFKA_HEAP_OPTS:--Xmx256m}" KAFKA_JVM_OPTS="${KAFKA_JVM_OPTS:--XX:TieredStopAtLevel=1}" \
    java_of "$class" "$@"
}

case "${1:-}" in
  install) install ;;
  run) run "${2:?config file}" ;;
  ""|-h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) tool "$@" ;;
esac
