"""A shard's two files, and the digest of its index, hashed once per process and file version.

The reader (``indexed``) keys cached sample indices by the ``.idx`` digest; the tokenizer record
(``shard_origin``) holds the digest of the ``.idx`` it was written for; a checkpoint records each
training shard's (``megazero.data.shard_digests``). A run's start-up asks for the same digest from
each of them, rank 0 up to five times a shard (the record's check, the resume's comparison, the
checkpoint's record, the train and validation indices), and a corpus of hundreds of millions of
documents has an ``.idx`` of gigabytes: seconds each. Both modules import this one (``indexed``
imports ``shard_origin`` to merge shards, so neither can hold it for the other).
"""

from __future__ import annotations

import hashlib
import os
from typing import Hashable

from data_pipeline.paths import file_identity


def bin_path(prefix: str) -> str:
    return f"{prefix}.bin"


def idx_path(prefix: str) -> str:
    return f"{prefix}.idx"


def shard_identity(prefix: str) -> Hashable:
    """One value per shard, links followed: its ``.bin``'s identity (``paths.file_identity``). Two
    prefixes whose ``.bin`` files are one (a folder or the files linked, hard or symbolic) name the
    same tokens."""
    return file_identity(bin_path(prefix))


def file_version(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one version of a file from another: a rewrite in place changes the size or the
    modification time, a replacement the inode."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def sha256_of(f) -> str:
    """sha256 of what is left to read of the binary file ``f``, a MiB at a time."""
    digest = hashlib.sha256()
    while block := f.read(1 << 20):
        digest.update(block)
    return digest.hexdigest()


_DIGESTS: dict[tuple, str] = {}  # file version (a .bin's tokens: ("tokens", version)) -> sha256, this process


def idx_sha256(prefix: str) -> tuple[str, tuple[int, int, int, int]]:
    """sha256 of the shard's ``.idx`` bytes and the version of the file it is of (``file_version``)."""
    return file_sha256(idx_path(prefix))


def file_sha256(path: str) -> tuple[str, tuple[int, int, int, int]]:
    """sha256 of the file at ``path`` and its version, read only the first time this process asks for
    that version. The version names the file (device and inode) wherever it is: a writer's temporary
    ``.idx``, hashed for its record, is not read again once renamed into place."""
    with open(path, "rb") as f:
        version = file_version(os.fstat(f.fileno()))
        if version not in _DIGESTS:
            _DIGESTS[version] = sha256_of(f)
    return _DIGESTS[version], version


COMPARED_BLOCKS = 64
"""Blocks of a ``.bin`` that ``tokens_digest`` reads, evenly spread: shards of the same ``.idx`` whose
tokens differ (a corpus re-tokenized at equal lengths, or in another order of equal-length
documents) differ in nearly every block, while hashing the whole file would cost a pass over
terabytes."""


def tokens_digest(prefix: str, block: int = 4096) -> str:
    """sha256 of the shard's ``.bin`` size and of ``COMPARED_BLOCKS`` blocks spread over it: what the
    ``.idx`` digest cannot tell (that file holds document sizes, not tokens)."""
    with open(bin_path(prefix), "rb") as f:
        st = os.fstat(f.fileno())
        key = ("tokens", *file_version(st))  # asked by the blend's check, the resume's and the checkpoint's
        if key not in _DIGESTS:
            digest = hashlib.sha256(st.st_size.to_bytes(8, "little"))
            for k in range(COMPARED_BLOCKS):
                digest.update(os.pread(f.fileno(), block, st.st_size * k // COMPARED_BLOCKS))
            _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]
