"""Which tokenizer made a shard: a small record beside its ``.bin`` and ``.idx``.

Token ids mean nothing without the tokenizer that produced them, and the indexed format (kept
readable by Megatron) has no room to say which one. A shard made with another tokenizer of the same
or a smaller vocabulary passes every other check and trains on garbage. So preprocessing writes
``PREFIX.tokenizer.json`` (the tokenizer file's SHA-256 and vocabulary size), merging carries it
over, and a run compares it with ``data.tokenizer``. Shards from elsewhere have no record and are
taken as they are. The record also holds the SHA-256 of the ``.idx`` it was written for: a shard
rewritten at the same prefix by another tool, which leaves the record behind, is refused instead of
vouched for.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Optional

from data_pipeline.paths import written_whole
from data_pipeline.shard_files import file_sha256, idx_path, idx_sha256, sha256_of


def origin_path(prefix: str) -> str:
    return f"{prefix}.tokenizer.json"


def tokenizer_identity(tokenizer) -> dict:
    """What a shard records of a loaded ``tokenizer`` (``data_pipeline.tokenizer``; its ``path`` is
    the file itself, a folder's ``tokenizer.json`` too): the file's digest, the vocabulary size, and
    the digest of its pieces in id order, which a rewrite of the same vocabulary keeps (the
    ``tokenizer.json`` that ``convert --to hf`` writes for a SentencePiece model, say)."""
    with open(tokenizer.path, "rb") as f:
        digest = sha256_of(f)
    pieces = hashlib.sha256("\0".join(tokenizer.pieces()).encode("utf-8", "surrogatepass"))
    return {"tokenizer_sha256": digest, "vocab_size": int(tokenizer.vocab_size),
            "tokenizer": os.path.basename(tokenizer.path), "pieces_sha256": pieces.hexdigest()}


def other_tokenizer(record: dict, tokenizer) -> Optional[dict]:
    """The loaded ``tokenizer``'s identity where it is not the one ``record`` describes (neither the
    same file nor, where the record has it, the same pieces); None where it is."""
    mine = tokenizer_identity(tokenizer)
    return None if same_tokenizer(record, mine) else mine


def same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two records describe one tokenizer: the same file, or the same pieces where both
    record them (records written before the pieces were recorded compare by file alone)."""
    pieces = a.get("pieces_sha256")
    return a["tokenizer_sha256"] == b["tokenizer_sha256"] or (pieces is not None and pieces == b.get("pieces_sha256"))


def write_origin(prefix: str, identity: dict, idx_file: Optional[str] = None) -> None:
    """Record ``identity`` for the shard at ``prefix``, with the digest of its ``.idx`` (``idx_file``
    where the ``.idx`` is still under a writer's temporary name), atomically: a half-written record
    would read as damaged."""
    try:
        digest = file_sha256(idx_path(prefix) if idx_file is None else idx_file)[0]
        with written_whole(origin_path(prefix)) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump({**identity, "idx_sha256": digest}, f)
    except OSError as exc:
        raise OSError(f"{origin_path(prefix)}: the shard's tokenizer record cannot be written ({exc.strerror or exc}); "
                      "free space there or give another output prefix") from None


def read_origin(prefix: str) -> Optional[dict]:
    """The shard's tokenizer identity, or None where it has no record (made elsewhere); a damaged
    record, or one written for another ``.idx`` than the shard's now, is an error."""
    path = origin_path(prefix)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        if not isinstance(record.get("tokenizer_sha256"), str) or not isinstance(record.get("vocab_size"), int):
            raise ValueError("missing fields")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: damaged record of the shard's tokenizer ({exc}); delete it to use the shard "
                         "unchecked, or preprocess again") from None
    written_for = record.pop("idx_sha256", None)  # absent from records older than the digest
    if written_for is not None and written_for != idx_sha256(prefix)[0]:
        raise ValueError(f"{path}: was written for another {idx_path(prefix)} (the shard was rewritten since), so it "
                         "does not say which tokenizer made this one; preprocess the shard again, or delete the "
                         "record to use the shard unchecked")
    return record


def describe(record: dict) -> str:
    return f"{record.get('tokenizer', 'a tokenizer')} ({record['vocab_size']} tokens, sha256 {record['tokenizer_sha256'][:12]})"


def common_origin(prefixes: Iterable[str]) -> Optional[tuple[str, dict]]:
    """(the first shard with a record, the tokenizer record all of ``prefixes`` that have one share),
    or None if none has one; shards recorded with two different tokenizers are an error naming both."""
    first: Optional[tuple[str, dict]] = None
    for prefix in prefixes:
        record = read_origin(prefix)
        if record is None:
            continue
        if first is None:
            first = (prefix, record)
        elif not same_tokenizer(record, first[1]):
            raise ValueError(f"{prefix} was tokenized with {describe(record)}, {first[0]} with {describe(first[1])}: "
                             "shards of one run or merge must share a tokenizer")
    return first


def merged_origin(prefixes: list[str]) -> Optional[dict]:
    """The record a merge of ``prefixes`` carries: the tokenizer they all record, or None where none
    records one. Where only some do, the merged record would vouch for documents whose tokenizer
    nobody knows, so that is an error naming the first shard without a record."""
    origin = common_origin(prefixes)
    if origin is None:
        return None
    for prefix in prefixes:
        if read_origin(prefix) is None:
            raise ValueError(f"{prefix} records no tokenizer but {origin[0]} records {describe(origin[1])}: "
                             "the merged record would claim that tokenizer for its documents too; preprocess it "
                             "again with that tokenizer, or merge only unrecorded shards")
    return origin[1]


def tokenizer_mismatch(prefix: str, record: dict, tokenizer) -> Optional[str]:
    """Why the shard at ``prefix`` (recorded as ``record``) was not made with the loaded ``tokenizer``;
    None if it was."""
    mine = other_tokenizer(record, tokenizer)
    if mine is None:
        return None
    return (f"{prefix} was tokenized with {describe(record)}, not with {tokenizer.path} (sha256 "
            f"{mine['tokenizer_sha256'][:12]}); use the tokenizer it was made with, or preprocess it again")
