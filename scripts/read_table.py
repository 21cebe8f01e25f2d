#!/usr/bin/env python3
"""Independent reader of a stream's Iceberg table: opens the sink's SQL catalog with pyiceberg's
SqlCatalog, scans the table's current snapshot (no listing of folders) and prints one JSON
document: every row (timestamps as epoch microseconds), the table's schema (field ids, names,
types), its partition spec, its snapshots and the summary of the current one. For a table in a
local directory it also gives each data file's partition value and column bounds as the manifests
state them next to the true minimum and maximum of each column in the file ("file_stats"), and
with --row-filter, the files a scan with that filter plans and the rows it returns ("filtered").
DuckDB's iceberg extension reads the same snapshot ("duckdb": its row count, non-null count of
every column and sum of _offset)."""
import argparse
import glob
import json
import os
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyiceberg.catalog.rest import RestCatalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.conversions import from_bytes
from pyiceberg.types import PrimitiveType

from read_landing import duckdb_counts, to_json_value


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--catalog", required=True, help="the catalog: a SQLite file, a postgres:// URL or a REST catalog's http:// URL, "
                   "as the sink's table.catalog (a REST catalog's client credentials from SINK_TABLE__CREDENTIAL)")
    p.add_argument("--catalog-name", default="edge_ingest")
    p.add_argument("--namespace", default="landing")
    p.add_argument("--table", required=True)
    p.add_argument("--s3-endpoint", help="S3 endpoint of the table's files (moto in the tests)")
    p.add_argument("--files-only", action="store_true", help="list the files, do not read them")
    p.add_argument("--row-filter", help="a pyiceberg row filter, for example \"ts >= '2026-01-01T00:00:00+00:00'\"")
    args = p.parse_args()
    if args.catalog.startswith(("http://", "https://")):
        uri = None
    elif args.catalog.startswith(("postgres://", "postgresql://")):
        uri = "postgresql+psycopg2://" + args.catalog.split("://", 1)[1]
    else:
        uri = args.catalog if "://" in args.catalog else f"sqlite:///{args.catalog}"
    props = {"uri": uri}
    if args.s3_endpoint:
        props.update({"s3.endpoint": args.s3_endpoint, "s3.region": "us-east-1",
                      "s3.access-key-id": "test", "s3.secret-access-key": "test"})
    if uri is None:
        props["uri"] = args.catalog
        if os.environ.get("SINK_TABLE__CREDENTIAL"):
            props["credential"] = os.environ["SINK_TABLE__CREDENTIAL"]
        catalog = RestCatalog(args.catalog_name, **props)
    else:
        catalog = SqlCatalog(args.catalog_name, **props)
    table = catalog.load_table(f"{args.namespace}.{args.table}")
    data = table.scan().to_arrow() if not args.files_only else pa.table({})
    for i, field in enumerate(data.schema):
        if pa.types.is_timestamp(field.type):
            data = data.set_column(i, field.name, data.column(i).cast(pa.int64()))
    rows = []
    for row in data.to_pylist():
        if "tags" in row and isinstance(row["tags"], list):
            row["tags"] = dict(row["tags"])
        rows.append(to_json_value(row))
    current = table.current_snapshot()
    files = [task.file.file_path for task in table.scan().plan_files()]
    out = {
        "rows": rows,
        "files": files,
        "schema": [{"id": f.field_id, "name": f.name, "type": str(f.field_type), "required": f.required}
                   for f in table.schema().fields],
        "sort_order": [table.schema().find_column_name(f.source_id) for f in table.sort_order().fields],
        "snapshots": len(table.metadata.snapshots),
        "summary": dict(current.summary.additional_properties) if current else {},
        "manifests": len(current.manifests(table.io)) if current else 0,
        "metadata_log": len(table.metadata.metadata_log),
        "metadata_location": table.metadata_location,
        "partition_spec": [{"name": f.name, "source": table.schema().find_column_name(f.source_id),
                            "transform": str(f.transform)} for f in table.spec().fields],
    }
    if not args.files_only and not args.s3_endpoint:
        out["file_stats"] = file_stats(table)
    if args.row_filter:
        scan = table.scan(row_filter=args.row_filter)
        out["filtered"] = {"files": len(list(scan.plan_files())), "rows": scan.to_arrow().num_rows}
    # DuckDB reads S3 through its httpfs extension, which is not on PyPI: local tables only.
    if not args.files_only and not args.s3_endpoint:
        out["duckdb"] = read_with_duckdb(table.metadata_location)
    json.dump(out, sys.stdout)


def bound(field_type, raw):
    value = from_bytes(field_type, raw)
    return value if not isinstance(value, bytes) else value.hex()


def file_stats(table):
    """Per data file: its partition, the bounds its manifest entry gives by column name, and the
    true minimum and maximum of each column with bounds, read from the file by pyarrow."""
    schema = table.schema()
    # A column may have another name in the files (the name mapping's other names).
    mapping = json.loads(table.properties.get("schema.name-mapping.default", "[]"))
    names = {entry["field-id"]: entry["names"] for entry in mapping}
    out = []
    for task in table.scan().plan_files():
        f = task.file
        columns = {}
        for field_id in set(f.lower_bounds or {}) | set(f.upper_bounds or {}):
            field = schema.find_field(field_id)
            columns[field.name] = {"id": field_id}
            for side, bounds in (("lower", f.lower_bounds or {}), ("upper", f.upper_bounds or {})):
                if field_id in bounds:
                    columns[field.name][side] = bound(field.field_type, bounds[field_id])
        data = pq.read_table(f.file_path.removeprefix("file://"))
        for name in columns:
            in_file = [n for n in names.get(columns[name]["id"], [name]) if n in data.column_names]
            column = data.column(in_file[0] if in_file else name)
            if pa.types.is_timestamp(column.type):
                column = column.cast(pa.int64())
            if isinstance(schema.find_field(name).field_type, PrimitiveType):
                extremes = pc.min_max(column)
                columns[name]["min"] = to_json_value(extremes["min"].as_py())
                columns[name]["max"] = to_json_value(extremes["max"].as_py())
        partition = {field.name: to_json_value(f.partition[i]) for i, field in enumerate(table.spec().fields)}
        out.append({"path": f.file_path, "partition": partition, "columns": columns,
                    "value_counts": {schema.find_column_name(k): v for k, v in (f.value_counts or {}).items()},
                    "null_counts": {schema.find_column_name(k): v for k, v in (f.null_value_counts or {}).items()}})
    return out


def read_with_duckdb(metadata_location):
    """DuckDB's view of the table's current snapshot, with the avro and iceberg extensions of the
    PyPI packages (no download)."""
    import duckdb
    import duckdb_extension_avro
    import duckdb_extension_iceberg

    db = duckdb.connect()
    for package in (duckdb_extension_avro, duckdb_extension_iceberg):
        root = os.path.join(os.path.dirname(package.__file__), "extensions")
        db.execute(f"LOAD '{glob.glob(os.path.join(root, '*', '*.duckdb_extension'))[0]}'")
    return duckdb_counts(db, f"iceberg_scan('{metadata_location}')")


if __name__ == "__main__":
    main()
