"""Where documents come from: jsonl (plain, .gz, .zst), parquet, or a Hugging Face dataset.

Every source yields *batches*, and a batch is either a list of raw jsonl lines (bytes) or a list
of parsed records. Raw lines are passed on unparsed on purpose: json decoding then happens in the
tokenizing workers, in parallel, rather than in the one process that reads the file. A batch also
carries its file and each document's position in it (jsonl: 1-based line; parquet: row;
datasets: index, both 0-based), so a worker that meets a bad record can say where it is.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import json
import logging
import os
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
PARQUET_SUFFIXES = (".parquet",)
BATCH_BYTES = 1 << 20  # work units of at most about 1 MB of jsonl keep the pipe and the workers busy

# Why a record cannot become a document; --skip-bad-records counts skipped records under these.
NOT_UTF8, MALFORMED_JSON, NOT_OBJECT, NOT_TEXT = "not UTF-8", "malformed JSON", "not a JSON object", "not text"


class BadRecord(ValueError):
    """One record that cannot become a document: ``reason`` (one of the four above) and ``detail``.

    Raised without a location; the caller, who knows the file and the position, adds it.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


class _ZstdReader(io.RawIOBase):
    """Streams every zstd frame of ``raw`` in turn and raises EOFError on a frame cut short.

    zstandard's own ``stream_reader`` ends quietly at a truncated frame, which would turn a
    half-copied file into a silently shorter corpus. What a cut frame yields before the error is
    what zstd can decode of it: its whole blocks. A block (at most 128 KiB of text) decodes only
    whole, so the lines of the block the cut falls in are lost, and a file of a single block (any
    file under 128 KiB of text) cut anywhere yields no line, though gzip would give up the lines
    before the cut.
    """

    def __init__(self, raw, decompressor) -> None:
        self._raw, self._dctx = raw, decompressor
        self._frame = None  # the decompressor of the frame being read
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self._pos == len(self._out):
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("compressed file ended before the end of its last zstd frame; zstd decodes "
                                   "only whole blocks of up to 128 KiB of text, so the lines of the block cut "
                                   "short are lost")
                return 0
            self._out, self._pos = self._decompress(chunk), 0
        n = min(len(buf), len(self._out) - self._pos)
        buf[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame is None or self._frame.eof:
                self._frame = self._dctx.decompressobj()
            out.append(self._frame.decompress(data))
            data = self._frame.unused_data if self._frame.eof else b""
        return b"".join(out)

    def close(self) -> None:
        self._raw.close()
        super().close()


def open_binary(path: str):
    """A binary stream of the file, decompressing ``.gz`` and ``.zst`` on the fly."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ImportError(f"{path}: reading .zst files needs the zstandard package (pip install zstandard)") from None
        return io.BufferedReader(_ZstdReader(open(path, "rb"), zstandard.ZstdDecompressor()), 1 << 20)
    return open(path, "rb")


def _decompression_errors() -> tuple:
    errors = [EOFError, OSError, zlib.error]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def iter_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) for every non-blank line of a (possibly compressed) text file.

    A truncated or corrupt file ends in one OSError naming it and the last good line, not in
    a traceback from deep inside gzip or zstandard. A UTF-8 byte-order mark is dropped.
    """
    lineno = 0
    with open_binary(path) as f:  # a missing file is its own error, raised here
        try:
            for lineno, line in enumerate(f, 1):
                if lineno == 1 and line.startswith(codecs.BOM_UTF8):
                    line = line[len(codecs.BOM_UTF8):]
                if line.strip():
                    yield lineno, line
        except _decompression_errors() as exc:
            raise OSError(f"{path}: the file is truncated or corrupt (read {lineno} lines, then "
                          f"{type(exc).__name__}: {exc})") from None


@dataclass
class Batch:
    """Documents to tokenize: raw jsonl ``lines`` still to be parsed, or parsed ``records``.

    ``numbers`` holds each document's position in ``path``, counted in ``unit``s.
    """

    path: str
    unit: str  # "line" (1-based), "row" or "index" (0-based)
    numbers: Sequence[int]
    lines: list | None = None
    records: list | None = None

    def __len__(self) -> int:
        return len(self.numbers)

    def where(self, number: int) -> str:
        return f"{self.path}:{number}" if self.unit == "line" else f"{self.path}: {self.unit} {number}"

    def documents(self, keys: tuple[str, ...], skip_bad: bool) -> tuple[list[tuple[str, ...]], Counter]:
        """The texts of ``keys`` for every good document, and how many bad ones were skipped, by reason.

        A bad record is an error naming its file and position, unless ``skip_bad``.
        """
        read = parse_line if self.lines is not None else record_texts
        good, skipped = [], Counter()
        for number, item in zip(self.numbers, self.lines if self.lines is not None else self.records):
            try:
                good.append(read(item, keys))
            except BadRecord as bad:
                if not skip_bad:
                    other_field = ", choose another field with --json-keys" if bad.reason == NOT_TEXT else ""
                    raise ValueError(f"{self.where(number)}: {bad.detail}; fix the record{other_field}, or skip "
                                     "such records with --skip-bad-records") from None
                skipped[bad.reason] += 1
        return good, skipped


def input_files(path: str, hf_split: str | None = None) -> list[str]:
    """What reading the input ``path`` reads, listed once and before anything is written: the files of a
    folder of .jsonl/.parquet files in name order, else ``path`` itself (a file, a saved dataset or a
    hub name). Listed later, a folder that is to receive this run's output would hold its temporary
    files by then, and would no longer read file by file (``plain_data_files``)."""
    files = plain_data_files(path)
    if files is None:
        return [path]
    if hf_split is not None:
        raise ValueError(f"{path}: a folder of .jsonl/.parquet files, read file by file, has no splits for "
                         f"--hf-split {hf_split} to choose from; leave --hf-split out")
    return files


def iter_batches(path: str, keys: tuple[str, ...], batch_size: int = 256,
                 hf_split: str | None = None) -> Iterator[Batch]:
    """Batches of documents from one input file, saved dataset or hub name (one of ``input_files``),
    chosen by its suffix (a directory or name means ``datasets``; ``hf_split`` picks its split,
    ``train`` when None). The caller has checked every input with ``check_input`` before reading the
    first."""
    if path.endswith(JSONL_SUFFIXES):
        yield from _jsonl_batches(path, batch_size)
    elif path.endswith(PARQUET_SUFFIXES):
        yield from _parquet_batches(path, keys, batch_size)
    else:
        yield from _hf_batches(path, keys, batch_size, hf_split)


def check_input(path: str, keys: tuple[str, ...]) -> None:
    """What can be known of an input before any input is read, so that a typo in the last of many is
    found before hours of tokenizing the first: a file that is missing or of an unknown type, a
    compressed file that is not, a folder the datasets reader would not read whole, a parquet file
    without the columns (its footer alone is read)."""
    if path.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES) and not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such input file")
    if os.path.isfile(path) and not path.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES):
        raise ValueError(f"{path}: unknown input type; use .jsonl/.json (optionally .gz or .zst), .parquet, "
                         "or a Hugging Face dataset directory or name")
    check_compression(path)
    check_json_lines(path)
    problem = _folder_problem(path)
    if problem:
        raise ValueError(f"{path}: {problem}")
    missing, columns = missing_columns(path, keys)
    if missing:
        raise ValueError(f"{path}: no column {missing} (columns: {columns}); choose with --json-keys")
    for name in plain_data_files(path) or ():
        check_input(name, keys)


def check_json_lines(path: str) -> None:
    """Refuse a ``.json``/``.jsonl`` file holding one JSON array, not JSON lines. Printed one element a
    line, every line but the last (without its comma) is malformed JSON: where bad records are
    skipped, that one record was the file's only document, the rest counted as skipped, status 0."""
    if not (path.endswith(JSONL_SUFFIXES) and os.path.isfile(path)):
        return
    for lineno, line in iter_lines(path):
        if line.lstrip().startswith(b"["):
            raise ValueError(f"{path}:{lineno}: starts a JSON array, not JSON lines (one JSON object per line); "
                             "write each record on a line of its own")
        return


def missing_columns(path: str, keys: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The ``keys`` a parquet input lacks and the columns it has, from its footer alone (none for an
    input of another kind, whose fields show only as its records are read)."""
    if not path.endswith(PARQUET_SUFFIXES):
        return [], []
    columns = parquet_schema(path).names
    return [k for k in keys if k not in columns], columns


def check_compression(path: str) -> None:
    """A file whose first bytes contradict its name. A ``.gz`` or ``.zst`` file that does not open as
    one (plain jsonl given a compressed name, or the other compressor's output): read, it ends on its
    first bytes as "truncated or corrupt", and every document in it is lost to one bad-record count.
    An empty file reads as no lines; one of fewer bytes than a header that begins as one is cut short.
    A text or jsonl file that opens as gzip or zstd (a compressed file that lost its suffix) would be
    read as text, its bytes one or two bad records, its documents lost alike. A folder, a pipe or a
    hub name is left to its own reader; a parquet file, to its footer's check."""
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        head = f.read(4)
    named = [entry for entry in _COMPRESSIONS if path.endswith(entry[0])]
    for suffix, name, usual, opens in named:
        if head and not opens(head + usual[len(head):]):
            raise ValueError(f"{path}: not {name} data (it starts with {head!r}), though named {suffix}; "
                             "rename it to match what it holds")
        if 0 < len(head) < 4:
            raise ValueError(f"{path}: only {len(head)} byte(s), too short for {name} data; the file is truncated")
    if named or path.endswith(PARQUET_SUFFIXES) or len(head) < 4:
        return
    for suffix, name, _, opens in _COMPRESSIONS:
        if opens(head):
            raise ValueError(f"{path}: {name} data (it starts with {head!r}), though not named {suffix}, so it would "
                             f"be read as text; rename it {os.path.basename(path)}{suffix}")


_COMPRESSIONS = (  # suffix, name, a usual first 4 bytes, and whether 4 bytes open such a file
    (".gz", "gzip", b"\x1f\x8b\x08\x00", lambda head: head[:2] == b"\x1f\x8b"),
    # a zstd file may open with a skippable frame (magic 0x184D2A50 to 0x184D2A5F)
    (".zst", "zstd", b"\x28\xb5\x2f\xfd",
     lambda head: head == b"\x28\xb5\x2f\xfd" or (head[1:] == b"\x2a\x4d\x18" and head[0] >> 4 == 5)),
)


def reads_as_dataset(path: str) -> bool:
    """Whether ``iter_batches`` reads ``path`` through ``datasets`` (a saved folder or a hub name)
    rather than as jsonl or parquet files (which ``--hf-split`` does not apply to)."""
    return (not path.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES) and not os.path.isfile(path)
            and plain_data_files(path) is None)


def plain_data_files(path: str) -> list[str] | None:
    """The files of a folder that holds only .jsonl/.json(.gz/.zst) and .parquet files (a README and
    hidden files aside), in name order, which megazero reads file by file with its own readers; None
    for anything else. ``datasets`` would read such a folder as one table, converting a later file's
    values to the first file's column type: a number or an object in a text field became text."""
    files = _folder_files(path)
    data = [name for name in files if name.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)]
    return data if data and len(data) == len(files) else None


def _folder_files(path: str) -> list[str]:
    """The files under a folder that is not a ``save_to_disk`` dataset, in name order, a README, a
    LICENSE and hidden files aside (not data); none for anything else."""
    if not os.path.isdir(path) or any(os.path.isfile(os.path.join(path, name))
                                      for name in ("dataset_info.json", "dataset_dict.json", "state.json")):
        return []
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [os.path.join(root, name) for name in names
                  if not name.startswith(".") and name.lower() not in ("readme.md", "license")]
    return sorted(files)


def _folder_problem(path: str) -> str | None:
    """Why a folder the ``datasets`` reader would read cannot be read whole; None where it can. That
    reader takes one kind of file from a folder and leaves the others out without a word (``a.jsonl``
    beside ``b.csv`` read as ``a.jsonl`` alone), and reads ``.txt`` one line per document."""
    kinds: dict[str, list[str]] = {}
    for name in _folder_files(path):
        kinds.setdefault(_file_kind(name), []).append(os.path.relpath(name, path))
    if set(kinds) <= {"jsonl", "parquet"}:  # read file by file (``plain_data_files``), or nothing to read
        return None
    if len(kinds) > 1:
        found = "; ".join(f"{kind}: {', '.join(names[:2])}{', ...' if len(names) > 2 else ''}"
                          for kind, names in sorted(kinds.items()))
        return (f"a folder of mixed kinds of file ({found}), of which the datasets reader would read one kind and "
                "leave the others out; give a folder of .jsonl/.json(.gz/.zst) and .parquet files, or of one kind")
    [kind] = kinds
    if kind.startswith(".txt"):
        return (f"a folder of {kind} files, which would be read one line per document (every document's lines torn "
                "apart); give .jsonl or .parquet files, or a save_to_disk directory")
    if kind.startswith((".jsonl.", ".json.")):
        return (f"a folder of {kind} files, which megazero reads only plain, .gz or .zst (the datasets reader would "
                "read them as one table, turning a number in a text field into text); recompress them as .gz or .zst")
    return None


OTHER_COMPRESSIONS = (".bz2", ".xz", ".lz4", ".gz", ".zst", ".zip")  # the datasets reader decompresses by these


def _file_kind(name: str) -> str:
    """What the folder readers take a file for: jsonl (plain, .gz or .zst), parquet, or its suffix,
    with the one under a compression's (``.txt.gz``, ``.jsonl.bz2``)."""
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    stem, suffix = os.path.splitext(name.lower())
    if suffix in OTHER_COMPRESSIONS:
        return (os.path.splitext(stem)[1] or "no suffix") + suffix
    return suffix or "no suffix"


def _jsonl_batches(path: str, batch_size: int) -> Iterator[Batch]:
    """Batches close at ``batch_size`` lines or BATCH_BYTES, so long documents still spread over workers."""
    numbers, lines, nbytes = [], [], 0
    for lineno, line in iter_lines(path):
        numbers.append(lineno)
        lines.append(line)
        nbytes += len(line)
        if len(lines) == batch_size or nbytes >= BATCH_BYTES:
            yield Batch(path, "line", numbers, lines=lines)
            numbers, lines, nbytes = [], [], 0
    if lines:
        yield Batch(path, "line", numbers, lines=lines)


def _parquet_batches(path: str, keys: tuple[str, ...], batch_size: int) -> Iterator[Batch]:
    for row, records in parquet_record_batches(path, batch_size, list(keys)):
        yield Batch(path, "row", range(row, row + len(records)), records=records)


def parquet_schema(path: str):
    """A Parquet file's schema, from its footer alone."""
    import pyarrow.parquet as pq

    with _parquet_errors(path, "its footer"):
        return pq.ParquetFile(path).schema_arrow


def string_columns(schema) -> set[str]:
    import pyarrow as pa

    return {f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)}


def parquet_record_batches(path: str, batch_size: int, columns: list[str] | None = None
                           ) -> Iterator[tuple[int, list[dict]]]:
    """(first row, the rows as dicts) for each batch of a Parquet file (of ``columns``, or all); a
    damaged file is an error naming it and the rows where the damage was found."""
    import pyarrow.parquet as pq

    with _parquet_errors(path, "its footer"):
        batches = pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=columns)
    row = 0
    while True:
        with _parquet_errors(path, f"the rows from {row}"):
            batch = next(batches, None)
            records = parquet_rows(batch) if batch is not None else None
        if batch is None:
            return
        yield row, records
        row += len(records)


def parquet_rows(record_batch) -> list[dict]:
    """A Parquet batch's rows as dicts. A string column may hold bytes that are not UTF-8, on which
    pyarrow's conversion fails for the whole batch, naming no row: those columns are then read as
    bytes and decoded value by value, and a value that is not UTF-8 stays bytes, for
    ``record_texts`` to refuse as that row's own bad record."""
    import pyarrow as pa

    try:
        return record_batch.to_pylist()
    except UnicodeDecodeError:
        strings = string_columns(record_batch.schema)
        schema = pa.schema([pa.field(f.name, pa.binary()) if f.name in strings else f for f in record_batch.schema])
        rows = pa.Table.from_batches([record_batch]).cast(schema).to_pylist()
        return [{key: _text_if_utf8(value) if key in strings else value for key, value in row.items()} for row in rows]


def _text_if_utf8(value: bytes | None):
    try:
        return value.decode("utf-8") if value is not None else None
    except UnicodeDecodeError:
        return value


@contextlib.contextmanager
def _parquet_errors(path: str, what: str):
    """pyarrow's errors on a damaged file ("Corrupt snappy compressed data") name neither file nor row."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: cannot read {what} as Parquet ({detail}); the file is damaged or not Parquet") \
            from None


def _hf_batches(path: str, keys: tuple[str, ...], batch_size: int, split: str | None) -> Iterator[Batch]:
    """A dataset saved with ``save_to_disk`` (read offline), else anything ``load_dataset`` accepts."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{path}: reading Hugging Face datasets needs the datasets package") from None
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_info.json")):
        if split is not None:
            raise ValueError(f"{path}: a saved dataset of one split, which --hf-split {split} cannot choose from; "
                             "leave --hf-split out")
        ds = datasets.load_from_disk(path)
    elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = datasets.load_from_disk(path)
        if (split or "train") not in splits:
            raise ValueError(f"{path}: no split {split or 'train'!r} (its splits: {', '.join(splits)}); choose one "
                             "with --hf-split")
        ds = splits[split or "train"]
    else:
        with _read_by_datasets(path), _hub_retries_unlogged():
            ds = datasets.load_dataset(path, split=split or "train", streaming=True)
    columns = ds.column_names  # None for a streamed dataset whose columns are not known up front
    missing = [k for k in keys if columns is not None and k not in columns]
    if missing:
        raise ValueError(f"{path}: no column {missing} (columns: {columns}); choose with --json-keys")
    rows, start = [], 0
    with _read_by_datasets(path):  # a streamed dataset reads, and fails, as it is iterated
        for row in ds:
            rows.append({k: row[k] for k in keys if k in row})
            if len(rows) == batch_size:
                yield Batch(path, "index", range(start, start + len(rows)), records=rows)
                rows, start = [], start + len(rows)
    if rows:
        yield Batch(path, "index", range(start, start + len(rows)), records=rows)


@contextlib.contextmanager
def _read_by_datasets(path: str):
    """What the ``datasets`` library raises while guessing a plain directory's or a name's format (its
    own, pyarrow's or the hub client's exceptions, often about a column or a parse position) as one
    ``ValueError`` saying what the input was taken for and what megazero reads."""
    try:
        yield
    except (FileNotFoundError, ValueError) as exc:
        if str(exc).startswith(path):
            raise  # ours, already naming the input
        raise _not_readable(path, exc) from None
    except Exception as exc:  # noqa: BLE001 - a third-party reader's many exception types
        raise _not_readable(path, exc) from None


@contextlib.contextmanager
def _hub_retries_unlogged():
    """Finding a hub dataset logs a warning for every retry of a request that cannot be made: offline,
    ten lines over half a minute before the error that says the hub cannot be reached, which then
    reads as one line (``_read_by_datasets``). Only warnings are held back; the error still ends the run."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _not_readable(path: str, exc: Exception) -> ValueError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    return ValueError(f"{path}: read as a Hugging Face dataset (a directory or name without a .jsonl or .parquet "
                      f"suffix), which failed: {first}; give .jsonl/.json(.gz/.zst) or .parquet files, a directory "
                      "written by save_to_disk, or a hub dataset name")


def no_documents_problem(path: str, skipped: Counter, fields: tuple[str, ...], choose_field: str) -> str:
    """What to say of an input file that holds records of which not one is a document (``skipped``
    counts them by reason). Bad records are counted and left out so that one broken line in a million
    does not stop a run, but a whole file lost is no such line: it is most often a file in another
    shape, a JSON array or objects printed over several lines, each line of which is malformed JSON,
    or a text field named wrong (``fields``; ``choose_field`` says how the user names another)."""
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
    if MALFORMED_JSON in skipped or NOT_OBJECT in skipped:
        fix = ("it is likely not JSON lines: one JSON document per line (a JSON array, or an object printed over "
               "several lines, is not); write each record on a line of its own")
    elif set(skipped) == {NOT_TEXT}:
        fix = f"no record holds {' and '.join(map(repr, fields))} as a string; {choose_field}"
    else:
        fix = "fix the file, or leave it out of the inputs"
    return f"{path}: not one of its {sum(skipped.values())} records could be read ({reasons}): {fix}"


def decode_line(line: bytes) -> str:
    """One line as text: UTF-8 without NUL bytes (valid UTF-8, but no text file holds one, and a
    binary file's bytes can pass for text once mapped into ASCII)."""
    nul = line.find(b"\0")
    if nul >= 0:
        raise BadRecord(NOT_TEXT, f"a NUL byte at {nul}: binary data, not text")
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRecord(NOT_UTF8, f"not UTF-8 (byte {exc.start} is {line[exc.start:exc.start + 1]!r})") from None


def parse_line(line: bytes, keys: tuple[str, ...]) -> tuple[str, ...]:
    """The texts of ``keys`` in one jsonl line; BadRecord says why there are none."""
    return record_texts(parse_record(line, keys), keys)


def parse_record(line: bytes, keys: tuple[str, ...]) -> dict:
    """One jsonl line as a JSON object whose ``keys`` hold text; BadRecord says why it is not one."""
    text = decode_line(line)
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRecord(MALFORMED_JSON, f"malformed JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise BadRecord(MALFORMED_JSON, "malformed JSON (nested deeper than Python's recursion limit)") from None
    except ValueError as exc:  # an integer of more digits than Python converts, and the like
        raise BadRecord(MALFORMED_JSON, f"malformed JSON ({str(exc).split(';')[0]})") from None
    if not isinstance(record, dict):
        raise BadRecord(NOT_OBJECT, f"a JSON {type(record).__name__}, not an object with a {keys[0]!r} field")
    record_texts(record, keys)
    return record


def record_texts(record: dict, keys: tuple[str, ...]) -> tuple[str, ...]:
    """The texts of ``keys`` in one record: each must be a string (empty is fine) that UTF-8 can encode."""
    texts = []
    for key in keys:
        if key not in record:
            raise BadRecord(NOT_TEXT, f"no key {key!r} (keys: {sorted(record)})")
        text = record[key]
        if isinstance(text, bytes):  # a Parquet value that is not UTF-8 (``parquet_rows``), or a binary column's
            try:
                text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise BadRecord(NOT_UTF8, f"field {key!r} is not UTF-8 (byte {exc.start} is "
                                          f"{text[exc.start:exc.start + 1]!r})") from None
        if not isinstance(text, str):
            raise BadRecord(NOT_TEXT, f"field {key!r} is {_describe(text)}, not a string")
        nul = text.find("\0")
        if nul >= 0:  # a JSON escape or a parquet string can carry one that no raw text line may
            raise BadRecord(NOT_TEXT, f"field {key!r} holds a NUL character at {nul}: binary data, not text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRecord(NOT_UTF8, f"field {key!r} holds an unpaired surrogate at character {exc.start}, "
                                      "which is not UTF-8") from None
        texts.append(text)
    return tuple(texts)


def _describe(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"
