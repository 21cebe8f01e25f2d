#!/usr/bin/env python3
"""Independent reader of landing files: reads every Parquet file under a local directory or an
S3 prefix with pyarrow and prints one JSON document: the files, each file's schema and key-value
metadata, and every row (timestamps as epoch microseconds). DuckDB reads the same files as one
hive-partitioned table too ("duckdb": its row count, non-null count of every column and sum of
_offset)."""
import argparse
import io
import json
import os
import sys
import tempfile

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq


def local_files(root):
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # a sink stages files in .staging/
        for name in sorted(names):
            if name.endswith(".parquet"):
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    yield os.path.relpath(path, root), f.read()


def s3_files(endpoint, bucket, prefix):
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            if obj["Key"].endswith(".parquet"):
                body = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
                yield obj["Key"], body


def to_json_value(v):
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, list):
        return [to_json_value(x) for x in v]
    if isinstance(v, dict):
        return {k: to_json_value(x) for k, x in v.items()}
    return v


def row_group_sorted(pf, g):
    """Whether row group g's rows are in the order its sorting_columns state."""
    columns = pf.metadata.row_group(g).sorting_columns or ()
    if not columns:
        return True
    names = [pf.schema.column(c.column_index).path for c in columns]
    table = pf.read_row_group(g, columns=names)
    keys = [tuple((v is not None, v) for v in values) for values in zip(*(table.column(n).to_pylist() for n in names))]
    return all(a <= b for a, b in zip(keys, keys[1:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir")
    ap.add_argument("--s3-endpoint")
    ap.add_argument("--bucket")
    ap.add_argument("--prefix", default="")
    ap.add_argument("--create-bucket", action="store_true", help="create --bucket and exit")
    args = ap.parse_args()
    if args.create_bucket:
        import boto3

        boto3.client("s3", endpoint_url=args.s3_endpoint).create_bucket(Bucket=args.bucket)
        return
    files = local_files(args.dir) if args.dir else s3_files(args.s3_endpoint, args.bucket, args.prefix)
    out = {"files": [], "rows": []}
    copies = tempfile.TemporaryDirectory()
    for key, data in files:
        copy = os.path.join(copies.name, key)
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        with open(copy, "wb") as f:
            f.write(data)
        pf = pq.ParquetFile(io.BytesIO(data))
        table = pf.read()
        meta = {k.decode(): v.decode() for k, v in (pf.metadata.metadata or {}).items() if not k.startswith(b"ARROW:")}
        out["files"].append({
            "key": key,
            "rows": table.num_rows,
            "schema": {f.name: str(f.type) for f in table.schema},
            "nullable": {f.name: f.nullable for f in table.schema},
            # Codec, encodings and whether statistics were written, of each column chunk of the
            # first row group, by column path.
            "columns": {
                c.path_in_schema: {
                    "compression": c.compression,
                    "encodings": list(c.encodings),
                    "statistics": c.is_stats_set,
                }
                for c in (pf.metadata.row_group(0).column(i) for i in range(pf.metadata.num_columns))
            } if pf.metadata.num_row_groups else {},
            "metadata": meta,
            # The columns each row group says it is sorted by (names), and whether its rows are
            # in that order as read (nulls first).
            "sorting_columns": [
                [pf.schema.column(c.column_index).path for c in (pf.metadata.row_group(g).sorting_columns or ())]
                for g in range(pf.metadata.num_row_groups)
            ],
            "sorted_as_stated": all(row_group_sorted(pf, g) for g in range(pf.metadata.num_row_groups)),
        })
        # Timestamps as epoch microseconds, independent of pyarrow's Python datetime handling.
        for i, field in enumerate(table.schema):
            if pa.types.is_timestamp(field.type):
                table = table.set_column(i, field.name, table.column(i).cast(pa.int64()))
        for row in table.to_pylist():
            if "tags" in row and isinstance(row["tags"], list):
                row["tags"] = dict(row["tags"])
            out["rows"].append(to_json_value(row))
    out["duckdb"] = read_with_duckdb(copies.name) if out["files"] else None
    json.dump(out, sys.stdout)


def read_with_duckdb(root):
    """DuckDB's view of the files under root: one table with union_by_name (files with and
    without a column), hive partitions (date=, hour=) as columns."""
    source = f"read_parquet('{root}/**/*.parquet', hive_partitioning=true, union_by_name=true)"
    return duckdb_counts(duckdb.connect(), source)


def duckdb_counts(db, source):
    """The row count, sum of _offset (of offset where there is none) and non-null count of every
    column of DuckDB's `source`."""
    columns = [r[0] for r in db.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()]
    counts = ", ".join(f'count("{c}")' for c in columns)
    offset = "_offset" if "_offset" in columns else "offset"
    row = db.execute(f'SELECT count(*), sum("{offset}"), {counts} FROM {source}').fetchone()
    return {"rows": row[0], "offset_sum": int(row[1] or 0),
            "non_null": dict(zip(columns, row[2:]))}


if __name__ == "__main__":
    main()
