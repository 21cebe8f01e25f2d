#!/usr/bin/env python3
"""Independent reader of landing files: reads every Parquet file under a local directory or an
S3 prefix with pyarrow and prints one JSON document: the files, each file's schema and key-value
metadata, and every row (timestamps as epoch microseconds)."""
import argparse
import io
import json
import os
import sys

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
    for key, data in files:
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
        })
        # Timestamps as epoch microseconds, independent of pyarrow's Python datetime handling.
        for i, field in enumerate(table.schema):
            if pa.types.is_timestamp(field.type):
                table = table.set_column(i, field.name, table.column(i).cast(pa.int64()))
        for row in table.to_pylist():
            if "tags" in row and isinstance(row["tags"], list):
                row["tags"] = dict(row["tags"])
            out["rows"].append(to_json_value(row))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
