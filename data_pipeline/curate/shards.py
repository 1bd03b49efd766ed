"""Shards: the files every curation stage reads and writes, and how raw inputs become them.

A shard is one file of documents (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` or ``.parquet``), each a
record with a stable string ``id`` and the text field. Ingesting gives every document its id once
(the input's id field, else ``FILE:LINE``) so that everything downstream (duplicate audits, the
Pareto draw, decontamination hits) names documents the same way whatever the worker count.

Files are written to a temporary name and renamed, so a killed stage leaves either a whole shard
or none; the runner's completion markers say which whole shards are final.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field

from data_pipeline.paths import written_whole
from data_pipeline.sources import (NOT_UTF8, BadRecord, iter_lines, no_documents_problem, parquet_record_batches,
                                   parquet_schema, parse_record, record_texts, string_columns)

FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet")
TRUNCATED = "truncated file"
NOT_AN_ID = "not an id"
MAX_EXAMPLES = 20  # bad-record locations kept per stage in stats.json; the count is always complete


def list_shards(directory: str) -> list[str]:
    """The shards of a stage directory, in document order: by input file number, then shard number.
    Not by name: the numbers are five digits wide until they outgrow them, and then the 100000th
    input file's shards sorted between the 10000th's and the 10001st's."""
    return sorted((p for fmt in FORMATS for p in glob.glob(os.path.join(directory, f"shard-*.{fmt}"))),
                  key=_shard_numbers)


def _shard_numbers(path: str) -> tuple:
    """(input file number, shard number) of ``shard-FFFFF-SSSSS.FORMAT``, then the name."""
    name = os.path.basename(path)
    numbers = name.split(".")[0].split("-")[1:]
    return tuple(int(n) if n.isdigit() else -1 for n in numbers), name


def read_shard(path: str) -> list[dict]:
    """A stage's shard, as its records. Shards are this pipeline's own output, so one that does not
    read is damaged (a disk that failed, an edit by hand): said naming it, with the way out."""
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        records = [json.loads(line) for _, line in iter_lines(path)]
        if not all(isinstance(record, dict) for record in records):
            raise ValueError("a line is not a JSON object")
        return records
    except (ValueError, OSError) as exc:  # JSON's, UTF-8's and pyarrow's errors are ValueErrors or OSErrors
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        words = (str(exc).splitlines() or [type(exc).__name__])[0].removeprefix(f"{path}: ")
        raise ValueError(f"{path}: damaged ({words}); delete its stage directory (and the stages after it) "
                         "and run again") from None


def write_shard(path: str, records: list[dict], like: str | None = None) -> None:
    """Write atomically and byte-reproducibly (gzip without a timestamp, parquet without statistics drift).
    ``like``: the shard the records came from; a parquet one gives its schema to the output, so a
    shard whose kept values of a field are all null (a null column), or that kept no document (no
    columns), still reads as one dataset with the others (Arrow refused to cast such a shard's
    column, and the datasets library an empty one)."""
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        # every record's fields, in the order first seen: from_pylist takes the first record's alone,
        # and a field that record lacks (metadata present in some documents) was dropped from them all
        names = dict.fromkeys(name for record in records for name in record)
        try:
            table = pa.Table.from_pydict({name: [record.get(name) for record in records] for name in names})
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ValueError(f"{path}: {_mixed_field(records) or exc}; give the field one type in the input, or set "
                             "output.format to jsonl") from None
        if like is not None and like.endswith(".parquet"):
            table = conformed(table, pq.read_schema(like))
        with written_whole(path) as tmp:
            pq.write_table(table, tmp)
    else:
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        if path.endswith(".gz"):
            buf = io.BytesIO()
            with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, filename="") as f:
                f.write(data)
            data = buf.getvalue()
        elif path.endswith(".zst"):
            import zstandard

            data = zstandard.ZstdCompressor(level=3).compress(data)
        _atomic_write(path, [data], binary=True)


def _mixed_field(records: list[dict]) -> str | None:
    """The first field whose values are of more than one kind (None aside; ints with floats are
    numbers to Arrow), said with its kinds and the first record of the second kind: a Parquet
    column holds one type, and Arrow's own message names neither."""
    kinds: dict[str, str] = {}
    for i, record in enumerate(records):
        for key, value in record.items():
            kind = "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__
            if value is not None and kinds.setdefault(key, kind) != kind:
                return f"field {key!r} is {kinds[key]} in an earlier document and {kind} in document {record.get('id', i)}"
    return None


def unified_schema(paths: list[str]):
    """Every field of the parquet shards ``paths``, in the order first seen, each of the type the shards
    give it. Nulls are no type: a column of them, or a list or struct holding only them (``list<null>``
    where a shard's lists were all empty), takes the others' type. A ValueError names the first field
    that two shards hold in different types: each shard is written from its own documents, whose types
    agree (``write_shard``), but one type in one shard and another in the next make a dataset no reader
    takes as one (Arrow refuses int64 beside string, and beside double)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    merged, typed_in = pa.schema([]), {}  # and the shard that gave each field its type
    for path in paths:
        schema = pq.read_schema(path)
        both = _merged([merged, schema])
        if both is None:
            column = next(c for c in schema if c.name in merged.names
                          and _merged([pa.schema([merged.field(c.name)]), pa.schema([c])]) is None)
            raise ValueError(f"field {column.name!r} is {merged.field(column.name).type} in {typed_in[column.name]} "
                             f"and {column.type} in {path}")
        for column in schema:
            if column.name not in merged.names or pa.types.is_null(merged.field(column.name).type):
                typed_in[column.name] = path
        merged = both
    return merged.remove_metadata()


def _merged(schemas: list):
    """The schemas as one, nulls taking the other's type at any depth; None where a field's types clash."""
    import pyarrow as pa

    try:
        return pa.unify_schemas(schemas, promote_options="default")
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        return None


def conformed(table, schema):
    """``table`` with ``schema``'s columns first, of its types (a field the table lacks, all null), then
    any other column the table has."""
    import pyarrow as pa

    columns = [table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(len(table), f.type)
               for f in schema]
    extra = [name for name in table.column_names if name not in schema.names]
    return pa.table(columns + [table[name] for name in extra], names=schema.names + extra)


def conform_shards(paths: list[str], schema) -> None:
    """Rewrite the parquet shards whose schema is not ``schema`` (their ``unified_schema``), so that
    every later stage, which writes each shard in its input's schema, writes one dataset."""
    import pyarrow.parquet as pq

    for path in paths:
        if not pq.read_schema(path).equals(schema):
            table = conformed(pq.read_table(path), schema)
            with written_whole(path) as tmp:
                pq.write_table(table, tmp)


def atomic_write_text(path: str, text) -> None:
    """Write a string, or an iterable of strings as they come (an audit file need not exist whole in memory)."""
    _atomic_write(path, [text] if isinstance(text, str) else text, binary=False)


def atomic_write_bytes(path: str, chunks) -> None:
    """Write an iterable of byte strings, to a temporary name renamed at the end."""
    _atomic_write(path, chunks, binary=True)


def _atomic_write(path: str, chunks, binary: bool) -> None:
    with written_whole(path) as tmp, open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8") as f:
        f.writelines(chunks)


@dataclass
class BadRecords:
    """Records that could not become documents: counted by reason, the first few located by file and line."""

    counts: Counter = field(default_factory=Counter)
    examples: list = field(default_factory=list)
    # why a bad record is fatal, said after it: a curation run's --strict, or a caller's own reason
    fatal_because: str = ("--strict makes any bad record fatal; without it such records are counted in stats.json "
                          "and left out")

    def add(self, reason: str, where: str, detail: str, strict: bool) -> None:
        if strict:
            raise ValueError(f"{where}: {detail} ({self.fatal_because})")
        self.counts[reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {detail}")


def input_documents(path: str, text_field: str, id_field: str, strict: bool, bad: BadRecords):
    """(id, record) for each good document of one input file; bad records go to ``bad``."""
    default_id = os.path.basename(path)
    if path.endswith(".parquet"):
        yield from _parquet_documents(path, text_field, id_field, strict, bad, default_id)
        return
    lineno = 0
    try:
        for lineno, line in iter_lines(path):
            try:
                record = parse_record(line, (text_field,))
                _check_other_fields(record, text_field)
                doc_id = _doc_id(record, id_field, f"{default_id}:{lineno}")
            except BadRecord as exc:
                bad.add(exc.reason, f"{path}:{lineno}", exc.detail, strict)
                continue
            yield doc_id, record
    except OSError as exc:
        if not os.path.exists(path) or strict:
            raise
        bad.add(TRUNCATED, f"{path}:{lineno + 1}", str(exc), strict)


def _check_other_fields(record: dict, text_field: str) -> None:
    """A JSON escape can put an unpaired surrogate in any field; the shard written could not hold it
    as UTF-8, and the whole stage would fail at the write, naming no record. (Parquet's strings are
    UTF-8 already.)"""
    for key, value in record.items():
        if key != text_field and not isinstance(value, (int, float, bool, type(None))):
            try:
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise BadRecord(NOT_UTF8, f"field {key!r} holds an unpaired surrogate, which is not UTF-8") from None


def _parquet_documents(path, text_field, id_field, strict, bad, default_id):
    schema = parquet_schema(path)
    if text_field not in schema.names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {schema.names}); set input.text_field")
    strings = string_columns(schema)
    for first, records in parquet_record_batches(path, 1024):
        for row, record in enumerate(records, first):
            try:
                record_texts(record, (text_field,))
                for key, value in record.items():  # another string column's value that is not UTF-8
                    if isinstance(value, bytes) and key in strings:
                        raise BadRecord(NOT_UTF8, f"field {key!r} is not UTF-8")
                doc_id = _doc_id(record, id_field, f"{default_id}:{row}")
            except BadRecord as exc:
                bad.add(exc.reason, f"{path}: row {row}", exc.detail, strict)
            else:
                yield doc_id, record


UNREADABLE = "unreadable"
"""The stats key under which ``ingest_file`` says why not one of a file's records is a document."""

DEFAULT_ID_FIELD = "id"
"""``input.id_field``'s default: a record without it gets the id FILE:LINE (FILE:ROW for parquet). A
field named otherwise is the user's choice, so a file where no record has it is a misspelling."""


def _doc_id(record: dict, id_field: str, default: str) -> str:
    """The record's id: its ``id_field`` as a string; ``default`` where it has none (missing, null, or
    NaN, which is how pandas writes a missing integer). A whole float is its integer (pandas writes an
    integer column with a gap as floats: 1001.0 is 1001); any other value (a fraction, a boolean, an
    object) is a bad record: replaced by FILE:LINE, the user's id was lost without a word."""
    value = record.get(id_field)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BadRecord(NOT_AN_ID, f"field {id_field!r} holds {value!r}, not an id (a string or an integer)")
    return str(value)


def ingest_file(path: str, file_index: int, out_dir: str, fmt: str, text_field: str, id_field: str,
                shard_docs: int, strict: bool) -> dict:
    """Split one input file into shards ``shard-FFFFF-SSSSS`` of ``shard_docs`` documents, ids attached.
    A file that holds records, none of them good, says why under ``UNREADABLE`` in its stats, for the
    stage to refuse, strict or not, once every file is read."""
    bad = BadRecords()
    records, shard, docs, nbytes, with_id, keys, clash = [], 0, 0, 0, 0, None, None

    def flush():
        nonlocal records, shard
        write_shard(os.path.join(out_dir, f"shard-{file_index:05d}-{shard:05d}.{fmt}"), records)
        records, shard = [], shard + 1

    for doc_id, record in input_documents(path, text_field, id_field, strict, bad):
        with_id += id_field in record
        keys = keys or sorted(record)
        if id_field != "id" and "id" in record and str(record["id"]) != doc_id and clash is None:
            clash = (f"{path}: the record of {id_field} {doc_id!r} also has a field 'id' ({record['id']!r}), which the "
                     "output's 'id' (the document id) would replace; rename that field in the input, or set "
                     "input.id_field id")
        record = {"id": doc_id, **{k: v for k, v in record.items() if k != "id"}}
        records.append(record)
        docs += 1
        nbytes += len(record[text_field].encode("utf-8"))
        if len(records) == shard_docs:
            flush()
    if docs and not with_id and id_field != DEFAULT_ID_FIELD:  # a misspelt field: ids silently FILE:LINE
        raise ValueError(f"{path}: input.id_field {id_field!r} is in none of its records (their keys: {keys}); "
                         "fix input.id_field")
    if clash:  # a record's own id, lost without a word
        raise ValueError(clash)
    if records or shard == 0:
        flush()
    stats = {"docs_in": docs, "docs_out": docs, "bytes_in": nbytes, "bytes_out": nbytes,
             "bad_records": dict(bad.counts), "bad_examples": bad.examples}
    if not docs and bad.counts:  # a file of another shape, not a few bad records: the stage refuses it
        stats[UNREADABLE] = no_documents_problem(path, bad.counts, (text_field,), "set input.text_field")
    return stats
