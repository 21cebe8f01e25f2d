#!/usr/bin/env python3
"""Apache Spark with Apache Iceberg's runtime, run against a table that sinks are committing to:
Iceberg's maintenance procedures and other writers' operations, one after another, each after the
sinks committed again since the one before. Prints one JSON document: what each step did, the
counts Spark read and, at the end, Spark's count of the table's rows and of distinct records, the
rows of a tag and of a branch taken midway (rows, and distinct Kafka offsets, which is the rows when none is there twice), and whether the tag and the branch outlived the
sinks' snapshot expiry.

Steps (--steps, comma-separated, in this order by default):
  rewrite_data_files   CALL system.rewrite_data_files (every file, into files of 512 MB at most)
  rewrite_manifests    CALL system.rewrite_manifests
  expire_snapshots     CALL system.expire_snapshots(older_than => now, retain_last => 1)
  remove_orphan_files  CALL system.remove_orphan_files (files older than --orphan-age-s; Spark
                       refuses less than a day, which keeps the files sinks landed and have not
                       committed yet)
  delete               another writer's two rows appended, then deleted one at a time by
                       merge-on-read DELETEs (position-delete files)
  tag_and_branch       CREATE TAG audit, CREATE BRANCH wap at the same snapshot and a row
                       written to the branch only;
                       then waits for --expiry-commits commits of the sinks, past their expiry
The catalog is the sinks' table.catalog: a SQLite file, a postgres:// URL or a REST catalog's
http:// URL. Jars (Iceberg's Spark runtime, JDBC drivers) come from --jars (a folder). When
--done-file is given, the final counts wait until that file exists (the caller's records all
landed), and --steps-done-file is created once the steps are over."""
import argparse
import glob
import json
import os
import sys
import time
from datetime import datetime, timedelta, timezone


def log(*args):
    print("spark_maintenance:", *args, file=sys.stderr, flush=True)


def session(args):
    from pyspark.sql import SparkSession

    name = args.catalog_name
    jars = sorted(glob.glob(os.path.join(args.jars, "*.jar")))
    if not jars:
        sys.exit(f"spark_maintenance: no jars in {args.jars} (scripts/services.sh install)")
    prefix = f"spark.sql.catalog.{name}"
    b = (SparkSession.builder.master("local[2]").appName("edge-ingest-maintenance")
         .config("spark.jars", ",".join(jars))
         .config("spark.sql.extensions", "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions")
         .config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.driver.memory", "1g")
         .config(prefix, "org.apache.iceberg.spark.SparkCatalog"))
    catalog = args.catalog
    if catalog.startswith(("http://", "https://")):
        b = b.config(f"{prefix}.type", "rest").config(f"{prefix}.uri", catalog)
        if os.environ.get("SINK_TABLE__CREDENTIAL"):
            b = b.config(f"{prefix}.credential", os.environ["SINK_TABLE__CREDENTIAL"])
    else:
        if catalog.startswith(("postgres://", "postgresql://")):
            rest = catalog.split("://", 1)[1]
            user, _, hostpath = rest.rpartition("@")
            user, _, password = user.partition(":")
            uri = f"jdbc:postgresql://{hostpath}"
            b = b.config(f"{prefix}.jdbc.user", user or "postgres")
            if password:
                b = b.config(f"{prefix}.jdbc.password", password)
        else:
            uri = f"jdbc:sqlite:{os.path.abspath(catalog)}"
        b = (b.config(f"{prefix}.type", "jdbc").config(f"{prefix}.uri", uri)
             .config(f"{prefix}.warehouse", args.warehouse))
    return b.getOrCreate()


class Table:
    def __init__(self, spark, args):
        self.spark = spark
        self.catalog = args.catalog_name
        self.ident = f"{args.namespace}.{args.table}"
        self.name = f"{args.catalog_name}.{self.ident}"

    def sql(self, text):
        log(text)
        return self.spark.sql(text).collect()

    def call(self, procedure, params, attempts=5):
        """A procedure, run again when its commit lost to the sinks' commits, as an operator
        would run it again (a failed procedure changes nothing): Iceberg retries a commit 4
        times by itself, and a rewrite that takes longer than the sinks' commit interval can
        lose them all (CommitFailedException); rewrite_manifests also gives up when a sink
        merged the manifests it rewrote meanwhile (ValidationException: "Deleted manifest ...
        could not be found in the latest snapshot")."""
        for attempt in range(1, attempts + 1):
            try:
                return self.sql(f"CALL {self.catalog}.system.{procedure}(table => '{self.ident}'{params})")
            except Exception as e:  # py4j's error carries the Java exception's text
                lost = "CommitFailedException" in str(e) or "could not be found in the latest snapshot" in str(e)
                if not lost or attempt == attempts:
                    raise
                log(f"{procedure}: its commit lost to newer ones (attempt {attempt}); running it again")

    def sequence(self):
        """The sequence number of the table's newest metadata (it grows with every commit)."""
        self.spark.sql(f"REFRESH TABLE {self.name}")
        rows = self.spark.sql(
            f"SELECT max(latest_sequence_number) AS s FROM {self.name}.metadata_log_entries").collect()
        return rows[0]["s"] or 0

    def wait_for_commits(self, n, timeout):
        start = self.sequence()
        deadline = time.time() + timeout
        while self.sequence() < start + n:
            if time.time() > deadline:
                sys.exit(f"spark_maintenance: the sinks did not commit {n} times in {timeout} s")
            time.sleep(1)
        return self.sequence()

    def counts(self, version=None):
        at = f" VERSION AS OF '{version}'" if version else ""
        row = self.sql(f"SELECT count(*) AS rows, count(DISTINCT struct(_kafka_partition, _offset)) AS distinct_offsets "
                       f"FROM {self.name}{at}")[0]
        return {"rows": row["rows"], "distinct_offsets": row["distinct_offsets"]}


def foreign_row(t, sensor):
    """A row as another writer appends it: device 'spark-writer', the given sensor, the other
    required columns filled with placeholders (a binary column as long as the table's values)."""
    from pyspark.sql import types as T

    columns, values = [], []
    for f in t.spark.table(t.name).schema.fields:
        columns.append(f.name)
        if f.name == "device_id":
            values.append("'spark-writer'")
        elif f.name == "sensor":
            values.append(f"'{sensor}'")
        elif f.nullable:
            values.append("NULL")
        elif isinstance(f.dataType, T.StringType):
            values.append("'x'")
        elif isinstance(f.dataType, (T.DoubleType, T.FloatType)):
            values.append("0.0")
        elif isinstance(f.dataType, (T.LongType, T.IntegerType)):
            values.append("-1")
        elif isinstance(f.dataType, (T.TimestampType, T.TimestampNTZType)):
            values.append("TIMESTAMP '2026-01-01 00:00:00 UTC'")
        elif isinstance(f.dataType, T.BooleanType):
            values.append("false")
        elif isinstance(f.dataType, T.BinaryType):
            n = t.sql(f"SELECT max(length({f.name})) AS n FROM {t.name}")[0]["n"]
            values.append("X'" + "00" * n + "'")
        else:
            values.append("NULL")
    return ", ".join(values), columns


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--catalog", required=True)
    p.add_argument("--catalog-name", default="edge_ingest")
    p.add_argument("--namespace", default="landing")
    p.add_argument("--table", default="sensor_readings")
    p.add_argument("--warehouse", required=True, help="the warehouse location a JDBC catalog needs (file:/… or s3://…)")
    p.add_argument("--jars", required=True, help="folder of the jars: Iceberg's Spark runtime and the JDBC drivers")
    p.add_argument("--steps", default="rewrite_data_files,rewrite_manifests,expire_snapshots,remove_orphan_files,delete,tag_and_branch")
    p.add_argument("--commits-between", type=int, default=3, help="sink commits to wait for after each step")
    p.add_argument("--expiry-commits", type=int, default=70, help="sink commits to wait for after the tag and branch")
    p.add_argument("--orphan-age-s", type=int, default=3 * 86400)
    p.add_argument("--timeout", type=int, default=300, help="seconds to wait for the sinks' commits, each time")
    p.add_argument("--steps-done-file")
    p.add_argument("--done-file")
    args = p.parse_args()
    spark = session(args)
    spark.sparkContext.setLogLevel("WARN")
    t = Table(spark, args)
    report = {"steps": []}
    t.wait_for_commits(1, args.timeout)
    for step in [s for s in args.steps.split(",") if s]:
        started = time.time()
        entry = {"step": step}
        if step == "rewrite_data_files":
            rows = t.call("rewrite_data_files", ", options => map('rewrite-all', 'true', 'max-file-group-size-bytes', '536870912')")
            entry["rewritten_files"] = rows[0]["rewritten_data_files_count"]
            entry["added_files"] = rows[0]["added_data_files_count"]
        elif step == "rewrite_manifests":
            rows = t.call("rewrite_manifests", "")
            entry["rewritten_manifests"] = rows[0]["rewritten_manifests_count"]
            entry["added_manifests"] = rows[0]["added_manifests_count"]
        elif step == "expire_snapshots":
            now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
            rows = t.call("expire_snapshots", f", older_than => TIMESTAMP '{now} UTC', retain_last => 1")
            entry["deleted_data_files"] = rows[0]["deleted_data_files_count"]
            entry["deleted_manifest_lists"] = rows[0]["deleted_manifest_lists_count"]
        elif step == "remove_orphan_files":
            before = (datetime.now(timezone.utc) - timedelta(seconds=args.orphan_age_s)).strftime("%Y-%m-%d %H:%M:%S")
            rows = t.call("remove_orphan_files", f", older_than => TIMESTAMP '{before} UTC'")
            entry["removed"] = len(rows)
        elif step == "delete":
            # Two rows in one file, deleted one at a time: each DELETE writes a position-delete
            # file (a DELETE that covers whole files would drop them instead).
            rows = [foreign_row(t, sensor) for sensor in ("deleted-1", "deleted-2")]
            t.sql(f"INSERT INTO {t.name} ({', '.join(rows[0][1])}) VALUES ({rows[0][0]}), ({rows[1][0]})")
            t.sql(f"ALTER TABLE {t.name} SET TBLPROPERTIES ('write.delete.mode' = 'merge-on-read')")
            for sensor in ("deleted-1", "deleted-2"):
                t.sql(f"DELETE FROM {t.name} WHERE device_id = 'spark-writer' AND sensor = '{sensor}'")
            left = t.sql(f"SELECT count(*) AS n FROM {t.name} WHERE device_id = 'spark-writer'")[0]["n"]
            files = t.sql(f"SELECT count(*) AS n FROM {t.name}.delete_files")[0]["n"]
            entry.update({"foreign_rows_left": left, "delete_files": files})
        elif step == "tag_and_branch":
            t.sql(f"ALTER TABLE {t.name} CREATE TAG audit")
            tagged = t.sql(f"SELECT snapshot_id FROM {t.name}.refs WHERE name = 'audit'")[0]["snapshot_id"]
            t.sql(f"ALTER TABLE {t.name} CREATE BRANCH wap AS OF VERSION {tagged}")
            values, columns = foreign_row(t, "branch")
            t.sql(f"INSERT INTO {t.name}.branch_wap ({', '.join(columns)}) VALUES ({values})")
            entry["tag"] = t.counts("audit")
            entry["branch"] = t.counts("wap")
            entry["sequence_after"] = t.wait_for_commits(args.expiry_commits, args.timeout)
        else:
            sys.exit(f"spark_maintenance: no step {step}")
        entry["seconds"] = round(time.time() - started, 1)
        report["steps"].append(entry)
        log(json.dumps(entry))
        t.wait_for_commits(args.commits_between, args.timeout)
    if args.steps_done_file:
        open(args.steps_done_file, "w").close()
    if args.done_file:
        while not os.path.exists(args.done_file):
            time.sleep(1)
    t.sequence()
    report["final"] = t.counts()
    report["foreign_rows"] = t.sql(f"SELECT count(*) AS n FROM {t.name} WHERE device_id = 'spark-writer'")[0]["n"]
    refs = {r["name"]: r["type"] for r in t.sql(f"SELECT name, type FROM {t.name}.refs")}
    report["refs"] = refs
    if "audit" in refs:
        report["tag"] = t.counts("audit")
    if "wap" in refs:
        report["branch"] = t.counts("wap")
    report["snapshots"] = t.sql(f"SELECT count(*) AS n FROM {t.name}.snapshots")[0]["n"]
    report["delete_files"] = t.sql(f"SELECT count(*) AS n FROM {t.name}.delete_files")[0]["n"]
    print(json.dumps(report))
    spark.stop()


if __name__ == "__main__":
    main()
