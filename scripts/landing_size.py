#!/usr/bin/env python3
"""Landed bytes per record of a landing directory against pyarrow writing the same rows.

Reads every Parquet file under DIR (leaving out hidden folders such as the sink's .staging/),
and writes each file's rows again with pyarrow: without a _content_hash column, sorted as the
sink states its row groups are sorted (their sorting_columns; --sort for files that state
none), zstd level 3 as the sink uses, under several encoding choices. Prints one JSON document: the records, the sink's bytes and
each pyarrow setting's bytes, and the sink's bytes over the smallest pyarrow's.
"""
import argparse
import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq


def landing_files(root):
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in sorted(names):
            if name.endswith(".parquet"):
                yield os.path.join(dirpath, name)


def settings(table):
    """pyarrow's writer options to try: dictionaries everywhere or for strings and integers,
    byte-stream-split for floats, delta encoding for timestamps and offsets."""
    fields = table.schema
    floats = [f.name for f in fields if pa.types.is_floating(f.type)]
    strings = [f.name for f in fields if pa.types.is_string(f.type)]
    ints = [f.name for f in fields if pa.types.is_integer(f.type) and f.name != "_offset"]
    deltas = [f.name for f in fields if pa.types.is_timestamp(f.type) or f.name == "_offset"]
    base = {"compression": "zstd", "compression_level": 3}
    split = {f: "BYTE_STREAM_SPLIT" for f in floats}
    delta = {f: "DELTA_BINARY_PACKED" for f in deltas}
    yield "dictionary", dict(base, use_dictionary=True)
    yield "dictionary, byte_stream_split floats", dict(
        base, use_dictionary=True, use_byte_stream_split=floats)
    yield "dictionary strings and integers, byte_stream_split floats, delta times and offsets", dict(
        base, use_dictionary=strings + ints, column_encoding=dict(split, **delta))
    yield "dictionary strings, integers and floats, delta times and offsets", dict(
        base, use_dictionary=strings + ints + floats, column_encoding=delta)
    yield "dictionary strings, byte_stream_split floats, delta integers and times", dict(
        base, use_dictionary=strings,
        column_encoding=dict(split, **delta, **{f: "DELTA_BINARY_PACKED" for f in ints
                                                if pa.types.is_int64(fields.field(f).type)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("dir")
    ap.add_argument("--sort", default="device_id,sensor,unit,ts",
                    help="columns to sort a file's rows by when it states no sorting_columns "
                         "(default: sensor_readings' series and time)")
    args = ap.parse_args()
    records, sink_bytes, hash_bytes = 0, 0, 0
    totals = {}
    for path in landing_files(args.dir):
        pf = pq.ParquetFile(path)
        sink_bytes += os.path.getsize(path)
        table = pf.read()
        records += table.num_rows
        if "_content_hash" in table.column_names:
            for g in range(pf.metadata.num_row_groups):
                rg = pf.metadata.row_group(g)
                for c in range(rg.num_columns):
                    if rg.column(c).path_in_schema == "_content_hash":
                        hash_bytes += rg.column(c).total_compressed_size
            table = table.drop_columns(["_content_hash"])
        stated = pf.metadata.row_group(0).sorting_columns if pf.metadata.num_row_groups else ()
        names = [pf.schema.column(c.column_index).path for c in stated or ()]
        names = names or [n for n in args.sort.split(",") if n in table.column_names]
        keys = [(name, "ascending", "at_start") for name in names]
        if keys:
            table = table.sort_by(keys)
        for name, options in settings(table):
            out = io.BytesIO()
            pq.write_table(table, out, **options)
            totals[name] = totals.get(name, 0) + out.tell()
    best = min(totals, key=totals.get)
    per = lambda b: b / records if records else 0.0
    print(json.dumps({
        "records": records,
        "sink_bytes": sink_bytes,
        "sink_bytes_per_record": per(sink_bytes),
        "sink_hash_column_bytes_per_record": per(hash_bytes),
        "pyarrow_bytes_per_record": {name: per(b) for name, b in totals.items()},
        "pyarrow_best": best,
        "sink_over_pyarrow_best": sink_bytes / totals[best] if totals.get(best) else None,
    }, indent=2))


if __name__ == "__main__":
    main()
