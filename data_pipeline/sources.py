"""Where documents come from: jsonl (plain, .gz, .zst), parquet, or a Hugging Face dataset.

Every source yields *batches*, and a batch is either a list of raw jsonl lines (bytes) or a list
of parsed records. Raw lines are passed on unparsed on purpose: json decoding then happens in the
tokenizing workers, in parallel, rather than in the one process that reads the file.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
PARQUET_SUFFIXES = (".parquet",)
BATCH_BYTES = 1 << 20  # work units of at most about 1 MB of jsonl keep the pipe and the workers busy


def open_binary(path: str):
    """A binary stream of the file, decompressing ``.gz`` and ``.zst`` on the fly."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ImportError(f"{path}: reading .zst files needs the zstandard package (pip install zstandard)") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True), 1 << 20)
    return open(path, "rb")


def open_text(path: str):
    return io.TextIOWrapper(open_binary(path), encoding="utf-8")


@dataclass
class Batch:
    """Documents to tokenize: raw jsonl ``lines`` still to be parsed, or parsed ``records``."""

    lines: list | None = None
    records: list | None = None

    def __len__(self) -> int:
        return len(self.lines if self.lines is not None else self.records)


def iter_batches(path: str, keys: tuple[str, ...], batch_size: int = 256, hf_split: str = "train") -> Iterator[Batch]:
    """Batches of documents from one input, chosen by its suffix (a directory or name means ``datasets``)."""
    if path.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES) and not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such input file")
    if path.endswith(JSONL_SUFFIXES):
        yield from _jsonl_batches(path, batch_size)
    elif path.endswith(PARQUET_SUFFIXES):
        yield from _parquet_batches(path, keys, batch_size)
    elif os.path.isfile(path):
        raise ValueError(f"{path}: unknown input type; use .jsonl/.json (optionally .gz or .zst), .parquet, "
                         "or a Hugging Face dataset directory or name")
    else:
        yield from _hf_batches(path, keys, batch_size, hf_split)


def _jsonl_batches(path: str, batch_size: int) -> Iterator[Batch]:
    """Batches close at ``batch_size`` lines or BATCH_BYTES, so long documents still spread over workers."""
    with open_binary(path) as f:
        lines, nbytes = [], 0
        for line in f:
            if not line.strip():
                continue
            lines.append(line)
            nbytes += len(line)
            if len(lines) == batch_size or nbytes >= BATCH_BYTES:
                yield Batch(lines=lines)
                lines, nbytes = [], 0
        if lines:
            yield Batch(lines=lines)


def _parquet_batches(path: str, keys: tuple[str, ...], batch_size: int) -> Iterator[Batch]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    missing = [k for k in keys if k not in pf.schema_arrow.names]
    if missing:
        raise ValueError(f"{path}: no column {missing} (columns: {pf.schema_arrow.names}); choose with --json-keys")
    for record_batch in pf.iter_batches(batch_size=batch_size, columns=list(keys)):
        yield Batch(records=record_batch.to_pylist())


def _hf_batches(path: str, keys: tuple[str, ...], batch_size: int, split: str) -> Iterator[Batch]:
    """A dataset saved with ``save_to_disk`` (read offline), else anything ``load_dataset`` accepts."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{path}: reading Hugging Face datasets needs the datasets package") from None
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_info.json")):
        ds = datasets.load_from_disk(path)
    elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_dict.json")):
        ds = datasets.load_from_disk(path)[split]
    else:
        ds = datasets.load_dataset(path, split=split, streaming=True)
    rows = []
    for row in ds:
        rows.append({k: row[k] for k in keys})
        if len(rows) == batch_size:
            yield Batch(records=rows)
            rows = []
    if rows:
        yield Batch(records=rows)


def parse_line(line: bytes, keys: tuple[str, ...]) -> dict:
    record = json.loads(line)
    try:
        return {k: record[k] for k in keys}
    except KeyError as exc:
        raise ValueError(f"json record has no key {exc} (keys: {sorted(record)}); choose with --json-keys") from None
