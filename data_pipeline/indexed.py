"""Megatron-compatible indexed datasets: token documents in a ``.bin``, their layout in an ``.idx``.

The format is Megatron's "MMIDIDX" memory-map layout, byte for byte, so shards written here load
in megatron-core and theirs load here:

``.idx``  magic ``MMIDIDX\\x00\\x00`` | u64 version (1) | u8 dtype code | u64 sequence count |
          u64 document-index count (documents + 1) | int32 sequence lengths | int64 byte pointers
          into ``.bin`` | int64 document indices (0, end of doc 0, ..., sequence count)
``.bin``  every sequence's tokens back to back, no header.

All integers are little-endian. In a pretraining corpus one sequence is one document, so the
document index is simply ``0..n``; the writer still keeps the two apart because Megatron does.

Writes are atomic: both files are written under temporary names and renamed only once complete,
``.bin`` first (an ``.idx`` being replaced is removed before it), the shard's tokenizer record
before both, so an ``.idx`` on disk always describes a whole ``.bin`` beside its record. A writer
told not to replace (what ``megazero preprocess`` and its merge use) links instead of renaming, so
of two runs on one prefix the second to finish stops rather than replace the first's shard. A writer killed outright leaves its temporaries; the next writer of the
prefix removes them (``remove_stale_temporaries``), also an ``.idx`` left by one killed between its
two renames. A live writer's are kept by the lock it takes on each as it makes it (and writes it
through: ``file_locks.create_locked`` says why); a ``.bin`` one removed in the moment before that
lock is made again under a new name (its ``.idx`` one, made later, is kept by the ``.bin``'s lock).

A shard's ``fingerprint`` (sha256 of its ``.idx``) keys everything derived from it and cached on
disk: the GPT sample indices and ``token_range.largest_token_id``.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import struct
from array import array
from collections.abc import Iterable
from typing import BinaryIO

import numpy as np

from data_pipeline import file_locks
from data_pipeline.paths import make_folders, put_new, remove_made, temp_name
from data_pipeline.shard_files import bin_path, file_version, idx_path, idx_sha256

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count

DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype Megatron uses for this vocabulary: uint16 below 65500 tokens, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedDatasetWriter:
    """Append documents, then ``finish()``; used as a context manager it cleans up on failure.

    Tokens stream straight to the temporary ``.bin``; only the per-document lengths stay in memory
    (4 bytes a document), so a billion-token shard needs no more memory than its index.

    ``replace``: whether publishing may replace files already at the final paths. Without it, a file
    that has appeared there since the caller checked (another run writing the same prefix) stops
    this one when it publishes, and is left as it is (``put_new``).
    """

    def __init__(self, prefix: str, dtype, replace: bool = True) -> None:
        self.prefix = prefix
        self.replace = replace
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"{prefix}: dtype {self.dtype} has no code in the indexed format; "
                             f"use one of {sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())}")
        _refuse_folders_in_the_way(prefix)
        try:  # the folders this writer created, outermost first: an abort removes them
            self._made = make_folders(os.path.dirname(os.path.abspath(prefix)))
        except OSError as exc:
            raise OSError(f"{prefix}: cannot create {exc.filename} ({exc.strerror}); give another output "
                          "prefix") from None
        # the final paths it has put files at, each with its file's identity: an abort removes a path
        # only while it still holds that file, never one another run has put there since
        self._published: list[tuple[str, tuple[int, int]]] = []
        self._recorded = False  # whether this writer wrote the shard's tokenizer record (an abort removes it)
        self._sealed = False
        remove_stale_temporaries(prefix)
        self._sizes = array("i")  # int32 lengths, appended without a numpy object per document
        self._ends = array("q", [0])  # the document index: 0, then each document's end, in sequences
        # a descriptor of each temporary it has made, holding its lock (what keeps it from a sweep) and
        # the one its bytes are written through, with the file's identity
        self._held: list[tuple[int, tuple[int, int]]] = []
        try:  # the last step: once it returns, the caller holds a writer that can abort
            self._claim_temporaries()
        except BaseException as exc:
            # an interrupt (SIGTERM, Ctrl-C) handled as a file is made comes after it exists; a failed
            # creation made none, and its name may not even be valid (too long)
            with contextlib.suppress(OSError):
                os.unlink(self._bin_tmp)
            self._unlock()
            remove_made(self._made)
            if isinstance(exc, OSError):
                raise _not_written(prefix, exc) from None
            raise

    def _claim_temporaries(self) -> None:
        """Name this writer's temporaries and make its ``.bin`` one, locked
        (``file_locks.create_locked``), to stream the tokens into. Where another writer's sweep removed
        the file before its lock was taken, the name is given up for a new one: written on, the file
        would be unlinked, and the shard lost as it was published."""
        while True:
            self._bin_tmp, self._idx_tmp = _temporaries(self.prefix, temp_name(bin_path(self.prefix)))
            with contextlib.suppress(file_locks.Swept):
                self._bin = open(self._hold_new(self._bin_tmp), "wb", closefd=False)
                return

    def _write_tokens(self, tokens) -> int:
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._write(tokens.data)
        return tokens.size

    def _write(self, data) -> None:
        try:
            self._bin.write(data)
        except OSError as exc:
            raise _not_written(self.prefix, exc) from None

    def add_document(self, tokens) -> None:
        self._sizes.append(self._write_tokens(tokens))
        self._ends.append(len(self._sizes))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Several documents at once: ``tokens`` is their concatenation, ``lengths`` their sizes."""
        lengths = np.asarray(lengths, dtype=np.int32)
        if int(lengths.sum(dtype=np.int64)) != np.size(tokens):
            raise ValueError(f"{self.prefix}: lengths sum to {int(lengths.sum(dtype=np.int64))} but "
                             f"{np.size(tokens)} tokens were given")
        self._write_tokens(tokens)
        first = len(self._sizes)
        self._sizes.frombytes(lengths.tobytes())
        self._ends.frombytes(np.arange(first + 1, len(self._sizes) + 1, dtype=np.int64).tobytes())

    def add_shard(self, other: IndexedDataset) -> None:
        """Append every document of an existing shard, copying its ``.bin`` in large blocks, and its
        document index as it is, offset (as Megatron merges): a document of several sequences
        (Megatron's ``--split-sentences``) stays one, and an empty one (two equal entries) stays."""
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {other.prefix} ({other.dtype}) into {self.prefix} ({self.dtype}): "
                             "every shard must use the same token dtype (same tokenizer)")
        with open(bin_path(other.prefix), "rb") as src:
            while block := src.read(64 << 20):
                self._write(block)
        offset = len(self._sizes)
        self._sizes.frombytes(np.asarray(other.sizes, dtype=np.int32).tobytes())
        ends = np.asarray(other.document_indices[1:], dtype=np.int64) + offset
        self._ends.frombytes(ends.tobytes())

    def seal(self) -> None:
        """Close the ``.bin`` and write the ``.idx``, both still under temporary names: the step a full
        disk can fail, done for every shard of a run before any is put in place (``publish``)."""
        if self._sealed:
            return
        try:
            self._bin.close()
            # locked before the .bin is put in place: from then on the .bin's lock is on the shard's own
            # file, which no sweep looks at, and this one keeps the .idx temporary from the sweep
            with open(self._hold_new(self._idx_tmp), "wb", closefd=False) as f:
                write_index(f, self.dtype, np.frombuffer(self._sizes, dtype=np.int32), np.frombuffer(self._ends, np.int64))
        except OSError as exc:
            raise _not_written(self.prefix, exc) from None
        self._sealed = True

    def publish(self) -> None:
        """Put the sealed files at their final paths (renames, or links where nothing may be replaced),
        the ``.idx`` last (``record_origin``)."""
        _refuse_folders_in_the_way(self.prefix)  # one made since the writer started
        self._retire_old_index()
        for tmp, final in ((self._bin_tmp, bin_path(self.prefix)), (self._idx_tmp, idx_path(self.prefix))):
            if any(path == final for path, _ in self._published):
                continue
            try:
                # counted as put in place before it is: an interrupt raised as the link or rename
                # returns would otherwise leave a file the abort does not know of (a .bin without its
                # .idx, blocking the next run); the identity keeps the abort off a file not this one
                self._published.append((final, _identity(tmp)))
                if self.replace:
                    os.replace(tmp, final)
                else:
                    put_new(tmp, final)
            except FileExistsError:
                raise FileExistsError(f"{final}: appeared while this run was writing it (another run on the same "
                                      "output prefix?); it is left as it is and this run keeps none of its files: "
                                      "give a new output prefix") from None
            except OSError as exc:
                raise _not_written(self.prefix, exc) from None
        self._unlock()  # nothing of this writer's is left under a temporary name

    def _retire_old_index(self) -> None:
        """Replacing, the old ``.idx`` goes before any new file is put in place: a writer killed then
        would leave the new ``.bin`` (or record) beside the old ``.idx``, which reads it with the old
        document boundaries wherever the two ``.bin`` files are of a size; without an ``.idx`` the
        shard is refused instead."""
        if self.replace and not self._published:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(idx_path(self.prefix))

    def _hold_new(self, tmp: str) -> int:
        """Make the temporary ``tmp`` and return the descriptor to write it through, holding its lock
        (``file_locks.create_locked``) until this writer has published or aborted."""
        fd = file_locks.create_locked(tmp)
        identity = _fd_identity(fd)
        _HELD_HERE.add(identity)
        self._held.append((fd, identity))
        return fd

    def _unlock(self) -> None:
        while self._held:
            fd, identity = self._held.pop()
            _HELD_HERE.discard(identity)
            os.close(fd)

    def record_origin(self, identity: dict) -> None:
        """Write the sealed shard's tokenizer record (``shard_origin``) before ``publish``, whose ``.idx``
        comes last: a writer killed in between leaves the record beside no shard, or beside a ``.bin``
        that no reader takes without its ``.idx``; never a shard without its record, which a training
        takes for one made elsewhere and uses unchecked. Replacing, the old ``.idx`` goes first. The
        record is counted before it is written, so an abort removes it."""
        from data_pipeline.shard_origin import write_origin

        self._retire_old_index()
        self._recorded = True
        write_origin(self.prefix, identity, self._idx_tmp)

    def finish(self) -> None:
        """``seal`` and ``publish`` (what is done already is not done again); a failure on the way
        undoes everything (``abort``)."""
        try:
            self.seal()
            self.publish()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Undo what this writer did: its temporary files (which would keep the space a full disk's
        next attempt needs), any file it had put in place, and the folders it created where they are
        still empty. Closing flushes what is still buffered, which fails again on the full disk that
        failed the write; the file is closed all the same, and is removed."""
        from data_pipeline.shard_origin import origin_path

        with contextlib.suppress(OSError):
            self._bin.close()
        record = [origin_path(self.prefix)] if self._recorded else []
        for path in (*record, self._bin_tmp, self._idx_tmp):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for path, identity in self._published:
            with contextlib.suppress(FileNotFoundError):
                if _identity(path) == identity:
                    os.unlink(path)
        self._published.clear()
        self._recorded = False
        self._unlock()
        remove_made(self._made)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()


def _refuse_folders_in_the_way(prefix: str) -> None:
    """Refuse a folder at the shard's ``.bin`` or ``.idx`` path, which no writer can put its file at (a
    rename onto it, or removing it to replace it, fails with a bare "Is a directory"): checked as the
    writer starts, before it writes a token, and again as it publishes."""
    for path in (bin_path(prefix), idx_path(prefix)):
        if os.path.isdir(path):
            raise FileExistsError(f"{path}: is a folder, where the shard's file goes; remove the folder or give a "
                                  "new output prefix")


def _temporaries(prefix: str, tmp: str) -> tuple[str, str]:
    """The ``.bin`` and ``.idx`` temporaries of the writer whose temporary (either) is ``tmp``: they
    share its tag (``.tmp-PID-RANDOM``), so a sweep finds each from the other."""
    tag = "".join(tmp.rpartition(".tmp-")[1:])
    return bin_path(prefix) + tag, idx_path(prefix) + tag


# the temporaries this process's writers hold, by identity: where a file system keeps locks per process
# (NFS takes flock as a POSIX record lock), this process's own sweep would take a lock it holds, and
# closing the sweep's descriptor would drop it; the sweep passes these by without opening them
_HELD_HERE: set[tuple[int, int]] = set()


def _held_here(tmp: str) -> bool:
    """Whether a writer of this process holds the temporary ``tmp`` (``_HELD_HERE``)."""
    try:
        return _identity(tmp) in _HELD_HERE
    except FileNotFoundError:
        return False


def remove_stale_temporaries(prefix: str) -> None:
    """Remove the temporary files that writers of ``prefix`` killed outright (SIGKILL, the OOM killer,
    a crash) left behind: no cleanup of theirs ran, and nothing else would ever remove them, while a
    large shard's ``.bin`` keeps its size on the disk. A live writer holds a lock on each temporary
    it has made (``file_locks.lock``, on this node or, where the file system shares locks, another),
    so one whose lock can be taken belongs to no running writer, or to one that has only just made it
    and then takes a new name (``file_locks.create_locked``).

    A ``.bin`` temporary is judged by its own lock, and takes its ``.idx`` with it: while the ``.bin``
    is there, its writer may have just made the ``.idx``, not yet locked, and no new name can be
    taken for it alone (the pair shares a tag). An ``.idx`` temporary left without its ``.bin`` (put
    in place by a writer killed before the ``.idx``'s rename) is judged by its own: its writer locked
    it before putting the ``.bin`` in place. A tokenizer record's temporary goes once no ``.bin`` or
    ``.idx`` one is left: a writer writes its record while it holds both (``record_origin``)."""
    from data_pipeline.shard_origin import origin_path

    for bin_tmp in glob.glob(glob.escape(bin_path(prefix)) + ".tmp-*"):
        _remove_unlocked(bin_tmp, _temporaries(prefix, bin_tmp))
    for idx_tmp in glob.glob(glob.escape(idx_path(prefix)) + ".tmp-*"):
        if not os.path.lexists(_temporaries(prefix, idx_tmp)[0]):
            _remove_unlocked(idx_tmp, (idx_tmp,))
    if not any(glob.glob(glob.escape(path) + ".tmp-*") for path in (bin_path(prefix), idx_path(prefix))):
        for record_tmp in glob.glob(glob.escape(origin_path(prefix)) + ".tmp-*"):
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(record_tmp)


def _remove_unlocked(tmp: str, paths: Iterable[str]) -> None:
    """Remove ``paths`` where the lock on the temporary ``tmp`` can be taken: no live writer holds it
    (one of this process's holds it here already: ``_held_here``)."""
    if not _held_here(tmp):
        file_locks.remove_abandoned(tmp, paths)


def _identity(path: str) -> tuple[int, int]:
    """Which file ``path`` holds (device and inode), followed through a rename."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _fd_identity(fd: int) -> tuple[int, int]:
    """Which file the descriptor ``fd`` is open on (device and inode)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _not_written(prefix: str, exc: OSError) -> OSError:
    """A write error naming the shard (a full disk's ``[Errno 28]`` alone names no file)."""
    return OSError(f"{prefix}: the shard cannot be written ({exc.strerror or exc}); free space there or give "
                   "another output prefix")


def write_index(f: BinaryIO, dtype: np.dtype, sizes: np.ndarray, document_indices: np.ndarray | None = None) -> None:
    """The ``.idx`` for sequences of the given lengths, written into the open file ``f``: one document
    per sequence, or the documents ``document_indices`` (each one's first sequence, then the count)."""
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    doc_idx = np.arange(len(sizes) + 1, dtype=np.int64) if document_indices is None else document_indices
    f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[np.dtype(dtype)], len(sizes), len(doc_idx)))
    f.write(sizes.tobytes())
    f.write(pointers.tobytes())
    f.write(doc_idx.tobytes())


class IndexedDataset:
    """A memory-mapped, validated view of one ``PREFIX.bin/.idx`` pair.

    ``ds[i]`` is document ``i`` as a numpy array (a view into the map, no copy);
    ``ds.get(i, offset, length)`` reads part of one, which is all GPT samples need.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx, binf = idx_path(prefix), bin_path(prefix)
        for path in (idx, binf):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: no such file (expected a .bin/.idx pair for prefix {prefix!r}; "
                                        f"{_fix_for_missing(prefix)})")
        idx_size = os.path.getsize(idx)
        if idx_size < HEADER.size:
            raise ValueError(f"{idx}: truncated index ({idx_size} bytes, the header alone is {HEADER.size})")
        with open(idx, "rb") as f:
            magic, version, code, n_seq, n_doc = HEADER.unpack(f.read(HEADER.size))
            self._idx_version = file_version(os.fstat(f.fileno()))
        if magic != MAGIC:
            raise ValueError(f"{idx}: not a Megatron indexed dataset (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise ValueError(f"{idx}: index version {version} is not supported (only {VERSION})")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER.size + n_seq * 4 + n_seq * 8 + n_doc * 8
        if idx_size != expected:
            raise ValueError(f"{idx}: index is {idx_size} bytes but its header ({n_seq} sequences, "
                             f"{n_doc} document entries) needs {expected}; the file is truncated or corrupt")
        self._idx_map = np.memmap(idx, mode="r", dtype=np.uint8)
        off = HEADER.size
        self.sizes = np.frombuffer(self._idx_map, np.int32, n_seq, off)
        self.pointers = np.frombuffer(self._idx_map, np.int64, n_seq, off + 4 * n_seq)
        self.document_indices = np.frombuffer(self._idx_map, np.int64, n_doc, off + 12 * n_seq)
        bin_size = os.path.getsize(binf)
        self._validate(binf, bin_size)
        self._bin_map = np.memmap(binf, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)

    def _validate(self, binf: str, bin_size: int) -> None:
        """Sizes, pointers and the ``.bin`` length must agree, or reads would return garbage."""
        itemsize = self.dtype.itemsize
        if len(self.sizes) and (self.sizes < 0).any():
            raise ValueError(f"{idx_path(self.prefix)}: negative sequence length in the index")
        expected_ptr = np.zeros_like(self.pointers)
        np.cumsum(self.sizes[:-1].astype(np.int64) * itemsize, out=expected_ptr[1:])
        if not np.array_equal(expected_ptr, self.pointers):
            bad = int(np.flatnonzero(expected_ptr != self.pointers)[0])
            raise ValueError(f"{idx_path(self.prefix)}: pointer of sequence {bad} is {int(self.pointers[bad])}, "
                             f"expected {int(expected_ptr[bad])} from the sequence lengths; the index is corrupt")
        data_bytes = int(self.sizes.astype(np.int64).sum()) * itemsize
        if data_bytes != bin_size:
            what = "truncated" if bin_size < data_bytes else "longer than its index"
            raise ValueError(f"{binf}: {bin_size} bytes but the index describes {data_bytes} "
                             f"({int(self.sizes.sum())} tokens of {self.dtype}); the .bin is {what} "
                             "or the .idx dtype does not match it")
        docs = self.document_indices
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(self.sizes) or (np.diff(docs) < 0).any():
            raise ValueError(f"{idx_path(self.prefix)}: document index must rise from 0 to {len(self.sizes)}")

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.astype(np.int64).sum())

    @property
    def fingerprint(self) -> str:
        """sha256 of the ``.idx`` bytes, which hold the dtype and every document's size and pointer.

        Reordered, added or removed documents change it, so it keys indices cached from this shard
        where path and counts could not. For a 1M-document (20 MB) ``.idx`` in the page cache it took
        12 ms on an idle 2-core CPU with SHA instructions, 20-40 ms on a loaded one, 60-100 ms with the
        SHA instructions masked off; a process computes it once per version of the file
        (``shard_files.idx_sha256``), however many readers ask. Of the file as this reader opened it:
        one rewritten since is hashed from this reader's own map."""
        digest, version = idx_sha256(self.prefix)
        return digest if version == self._idx_version else hashlib.sha256(self._idx_map).hexdigest()

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: document {i} has {size} tokens; cannot read [{offset}, {offset + length})")
        start = int(self.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, self.dtype, length, start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)


def _fix_for_missing(prefix: str) -> str:
    """What to do where ``prefix`` names no shard: a prefix written with its file's suffix
    (``web_text_document.bin``) names a shard that is there, and preprocessing it again is not the fix."""
    stem, suffix = os.path.splitext(prefix)
    if suffix in (".bin", ".idx") and os.path.isfile(bin_path(stem)) and os.path.isfile(idx_path(stem)):
        return f"give the prefix without {suffix}: {stem}"
    return "write one with `megazero preprocess`"


def merge_shards(prefixes: Iterable[str], output_prefix: str, replace: bool = True) -> IndexedDataset:
    """Join shards, in the given order, into one; each must use the same token dtype, and record the
    same tokenizer (``shard_origin``), which the merged shard then records, or all record none.
    ``replace`` as in ``IndexedDatasetWriter``."""
    from data_pipeline.shard_origin import merged_origin, origin_path

    shards = [IndexedDataset(p) for p in prefixes]
    if not shards:
        raise ValueError("merge needs at least one input shard")
    other = next((s for s in shards if s.dtype != shards[0].dtype), None)
    if other is not None:  # before any shard is copied
        raise ValueError(f"cannot merge {other.prefix} ({other.dtype}) with {shards[0].prefix} ({shards[0].dtype}): "
                         "every shard must use the same token dtype (same tokenizer)")
    origin = merged_origin([s.prefix for s in shards])
    with IndexedDatasetWriter(output_prefix, shards[0].dtype, replace) as writer:
        for shard in shards:
            writer.add_shard(shard)
        writer.seal()
        # before the shard is put in place (``record_origin``), inside the writer: a record that cannot
        # be written (or an interrupt) takes the shard with it
        if origin is not None:
            writer.record_origin(origin)
        elif os.path.exists(origin_path(output_prefix)):
            os.unlink(origin_path(output_prefix))  # a record left by an earlier shard of this name
        writer.publish()
    return IndexedDataset(output_prefix)
