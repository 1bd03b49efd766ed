"""Tokenize documents into ``PREFIX_{key}_document.bin/.idx`` shards with worker processes.

The reading process only splits the input into batches and writes what comes back; the workers
parse json, tokenize, append the end-of-document token and pack each batch into one numpy array,
so the work that costs time runs in parallel and the pipe carries compact arrays, not lists.
Output order equals input order for any number of workers, so a shard is reproducible.

A record whose field is not a string, a malformed json line or one that is not UTF-8 stops the
run with an error naming the file and the record; with ``skip_bad_records`` it is left out and
counted by reason instead. Either way it never becomes a document. An input file that holds
records but not one good one is an error even then: that is a file of another shape, not a few
bad records (``no_documents_problem``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from data_pipeline.indexed import IndexedDatasetWriter, token_dtype
from data_pipeline.paths import listed_twice
from data_pipeline.shard_origin import tokenizer_identity
from data_pipeline.sources import Batch, check_input, input_files, iter_batches, no_documents_problem
from data_pipeline.tokenizer import load_tokenizer, require_eod
from data_pipeline.worker_pool import WorkerPool

_tokenizer = None  # one per worker process, loaded by _init_worker


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    seconds: float = 0.0
    skipped: Counter = field(default_factory=Counter)  # bad records left out, by reason

    @property
    def bad_records(self) -> int:
        return sum(self.skipped.values())

    @property
    def docs_per_s(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    @property
    def mb_per_s(self) -> float:
        return self.text_bytes / 1e6 / max(self.seconds, 1e-9)

    def skipped_summary(self) -> str:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        plural = "" if self.bad_records == 1 else "s"
        return f"skipped {self.bad_records} bad record{plural} ({reasons})" if self.skipped else "no bad records"

    def summary(self) -> str:
        text = (f"{self.documents} documents, {self.tokens} tokens, {self.text_bytes / 1e6:.1f} MB of text "
                f"in {self.seconds:.1f} s: {self.docs_per_s:.0f} docs/s, {self.mb_per_s:.2f} MB/s")
        return f"{text}; {self.skipped_summary()}" if self.skipped else text


def output_prefix_for(prefix: str, key: str) -> str:
    """Megatron's naming: one shard per json key, ``PREFIX_text_document`` for the usual key."""
    return f"{prefix}_{key}_document"


def _init_worker(tokenizer_path: str) -> None:
    global _tokenizer
    _tokenizer = load_tokenizer(tokenizer_path)


@dataclass
class EncodedBatch:
    """Per key: (all tokens of the batch's documents as one array, per-document lengths)."""

    path: str  # the input file the batch was read from
    arrays: dict
    documents: int
    text_bytes: int
    skipped: Counter  # bad records left out, by reason


@dataclass
class _InputTally:
    """Documents and skipped records of the input file being read, batch by batch (a file's batches
    come back together and in order), so that a file of which not one record was a document is
    refused by name once it has been read, never counted as bad records and passed over."""

    keys: tuple[str, ...]  # the fields read, named when no record holds them
    path: str | None = None
    documents: int = 0
    skipped: Counter = field(default_factory=Counter)

    def add(self, encoded: EncodedBatch) -> None:
        if encoded.path != self.path:
            self.check()
            self.path, self.documents, self.skipped = encoded.path, 0, Counter()
        self.documents += encoded.documents
        self.skipped.update(encoded.skipped)

    def check(self) -> None:
        if self.path is not None and not self.documents and self.skipped:
            raise ValueError(no_documents_problem(self.path, self.skipped, self.keys,
                                                  "choose the field with --json-keys"))


def encode_batch(batch: Batch, keys: tuple[str, ...], append_eod: bool, skip_bad: bool = False) -> EncodedBatch:
    """Tokenize the batch's good documents; a bad record is an error unless ``skip_bad``."""
    documents, skipped = batch.documents(keys, skip_bad)
    dtype = token_dtype(_tokenizer.vocab_size)
    out, nbytes = {}, 0
    for k, key in enumerate(keys):
        texts = [doc[k] for doc in documents]
        nbytes += sum(len(t.encode("utf-8")) for t in texts)
        ids = _tokenizer.encode_batch(texts)
        if append_eod:
            for doc in ids:
                doc.append(_tokenizer.eod_id)
        lengths = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))
        tokens = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
        out[key] = (tokens, lengths)
    return EncodedBatch(batch.path, out, len(documents), nbytes, skipped)


def _encode_in_worker(args) -> EncodedBatch:
    return encode_batch(*args)


def _encoded(batches: Iterable[Batch], tokenizer_path: str, keys, append_eod: bool, skip_bad: bool,
             workers: int) -> Iterator[EncodedBatch]:
    """Encoded batches in input order; one worker runs in this process (no pipe at all)."""
    jobs = ((b, keys, append_eod, skip_bad) for b in batches)
    if workers <= 1:
        _init_worker(tokenizer_path)
        yield from map(_encode_in_worker, jobs)
        return
    with WorkerPool(workers, _init_worker, (tokenizer_path,)) as pool:
        yield from pool.imap(_encode_in_worker, jobs, "a batch of documents")


def preprocess(inputs: list[str], output_prefix: str, tokenizer_path: str, keys: tuple[str, ...] = ("text",),
               workers: int = 1, batch_size: int = 256, append_eod: bool = True, hf_split: str | None = None,
               progress: bool = False, skip_bad_records: bool = False) -> PreprocessStats:
    """Tokenize every input, in order, into one shard per key; returns throughput and skip counts.

    A record that is not text (null, number, object, list, missing key), malformed json or not
    UTF-8 raises a ValueError naming its file and position, or with ``skip_bad_records`` is left
    out of every key's shard and counted in ``stats.skipped``; an input file of records none of
    which is good raises a ValueError naming the file either way.
    """
    tokenizer = load_tokenizer(tokenizer_path)
    vocab_size, identity = tokenizer.vocab_size, tokenizer_identity(tokenizer)  # before any work
    if append_eod:
        require_eod(tokenizer, "to end each document with (--no-eod writes none, and needs none)")
    for path in inputs:
        check_input(path, keys)
    reads = [name for path in inputs for name in input_files(path, hf_split)]  # before the writers' files exist
    repeat = listed_twice(("input file", name) for name in reads)
    if repeat:  # a folder holding two links to one file, or a file beside a link to it in a folder
        raise ValueError(f"{repeat}, one file under two names; its documents would be trained on twice (read it "
                         "once)")
    writers: dict[str, IndexedDatasetWriter] = {}
    stats, tally = PreprocessStats(), _InputTally(keys)
    bar = _progress_bar(progress)
    start = time.perf_counter()
    try:
        for k in keys:  # one at a time inside the try: a key whose writer fails leaves no other's files
            # never replacing: the caller checked the names were free, another run may have taken them since
            writers[k] = IndexedDatasetWriter(output_prefix_for(output_prefix, k), token_dtype(vocab_size),
                                              replace=False)
        batches = chain.from_iterable(iter_batches(name, keys, batch_size, hf_split) for name in reads)
        for encoded in _encoded(batches, tokenizer_path, keys, append_eod, skip_bad_records, workers):
            for key, (tokens, lengths) in encoded.arrays.items():
                writers[key].add_documents(tokens, lengths)
            stats.documents += encoded.documents
            stats.tokens += sum(int(lengths.sum()) for _, lengths in encoded.arrays.values())
            stats.text_bytes += encoded.text_bytes
            stats.skipped.update(encoded.skipped)
            tally.add(encoded)
            if bar is not None:
                bar.update(encoded.documents)
                bar.set_postfix_str(f"{stats.text_bytes / 1e6 / (time.perf_counter() - start):.2f} MB/s", refresh=False)
        tally.check()
        if stats.documents == 0:
            raise ValueError(f"no documents in {inputs} ({stats.skipped_summary()}): nothing to write "
                             "(megatron-core cannot even open an empty shard)")
        # every key's files sealed before any is put in place: a key whose shard cannot be written
        # (a full disk) leaves no other key's shard, which would block the next attempt as existing
        for w in writers.values():
            w.seal()
        for w in writers.values():  # each record before its shard (``record_origin``)
            w.record_origin(identity)
        for w in writers.values():
            w.publish()
    except BaseException:
        for w in reversed(writers.values()):  # the first made the folders: it removes them once they are empty
            w.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    stats.seconds = time.perf_counter() - start
    return stats


def _progress_bar(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(unit=" docs", desc="tokenizing", mininterval=1.0)
