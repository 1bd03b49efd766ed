"""``fuzzy-dedup``: MinHash-LSH candidates, verified by exact Jaccard, one document kept per component.

Sub-stages exchange files, so memory is bounded by a shard (or a partition of about a shard's
size), never by the corpus:

``signatures`` (per shard)   shingle sets (uint32, with offsets) and LSH band keys (documents x bands),
                             the keys grouped by hash partition (``partitioned``)
``buckets`` (per partition)  documents sharing a band key, as candidate pairs of global numbers,
                             grouped by the partition that verifies them
``edges`` (per partition)    candidates whose exact Jaccard on the shingle sets is >= threshold,
                             each set read from its shard's shingle file on its own
``components``               connected components of the edges; every member but the lowest
                             global number (the first in document order) is removed. Writes
                             ``edges.jsonl`` (id_a, id_b, jaccard) and ``removed.jsonl`` (id, kept,
                             component_size) so a user can audit what was dropped
``filter`` (per shard)       the shard without the removed documents
"""

from __future__ import annotations

import json
import os
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from data_pipeline.curate import partitioned
from data_pipeline.curate.checks import within
from data_pipeline.curate.exact_dedup import ROW_BITS, load_keyed, save_array, save_drops, save_keyed
from data_pipeline.curate.minhash import MinHasher, banding_problems, jaccard, parameter_problems
from data_pipeline.curate.shards import atomic_write_text, read_shard

BATCH = 256  # documents hashed together: large enough to amortise numpy's per-call cost
EDGE = np.dtype([("a", np.int64), ("b", np.int64), ("jaccard", np.float32)])


@dataclass
class FuzzyDedupConfig:
    num_perm: int = 260  # MinHash permutations (MT-NLG, NeMo Curator)
    bands: int = 20  # LSH bands ...
    rows: int = 13  # ... of this many rows: candidates at Jaccard s with probability 1 - (1 - s^13)^20
    ngram: int = 5  # character shingles
    threshold: float = 0.8  # exact Jaccard a candidate pair needs to be an edge
    seed: int = 42  # of the permutations and the shingle hash
    max_bucket_pairs: int = 64  # a bucket with more documents pairs each with the first and the previous
    partitions: int = 0  # hash partitions for buckets and edges (0 = one per shard)

    def problems(self) -> list[str]:
        """Out-of-range options: the MinHash parameters' own rules, and a threshold that is a Jaccard
        similarity (above 1 nothing would be removed, below 0 every candidate pair would)."""
        problems = parameter_problems(self.num_perm, self.ngram, self.bands, self.rows, self.seed)
        return (problems + within("fuzzy_dedup.threshold", self.threshold, 0, 1,
                                  "it is the exact Jaccard similarity at which a candidate pair counts as near duplicates")
                + ([] if problems else banding_problems(self.threshold, self.num_perm, self.bands, self.rows))
                + within("fuzzy_dedup.max_bucket_pairs", self.max_bucket_pairs, 1)
                + within("fuzzy_dedup.partitions", self.partitions, 0, meaning="0 gives one per shard"))

    def hasher(self) -> MinHasher:
        return MinHasher(self.num_perm, self.ngram, self.bands, self.rows, self.seed)


def signature_shard(in_path: str, out_prefix: str, text_field: str, cfg: FuzzyDedupConfig, parts: int) -> dict:
    """Write OUT.shingles.npy, OUT.offsets.npy, the band keys grouped by partition (OUT.bands.part) and
    OUT.ids.json for one shard."""
    hasher = cfg.hasher()
    records = read_shard(in_path)
    shingles, offsets, bands = [], [np.zeros(1, np.int64)], []
    for i in range(0, len(records), BATCH):
        hashes, offs = hasher.shingles([r[text_field] for r in records[i:i + BATCH]])
        bands.append(hasher.band_keys(hasher.signatures(hashes, offs)))
        offsets.append(offs[1:] + offsets[-1][-1])
        shingles.append(hashes)
    save_array(f"{out_prefix}.shingles.npy", np.concatenate(shingles) if shingles else np.zeros(0, np.uint32))
    save_array(f"{out_prefix}.offsets.npy", np.concatenate(offsets))
    bands = np.concatenate(bands) if bands else np.zeros((0, cfg.bands), np.uint64)
    save_keyed(f"{out_prefix}.bands", [bands.ravel()], np.repeat(np.arange(len(bands)), cfg.bands), parts)
    atomic_write_text(f"{out_prefix}.ids.json", json.dumps([r["id"] for r in records]))
    return {"docs": len(records)}


def bucket_partition(prefixes: list[str], part: int, parts: int, out_path: str, max_bucket_pairs: int) -> dict:
    """Candidate pairs (a < b, global numbers) among documents whose band keys fall in this partition,
    written grouped by the partition that verifies them (``_pair_partition``)."""
    keys, gids = [], []
    for shard, prefix in enumerate(prefixes):
        (band_keys,), rows = load_keyed(f"{prefix}.bands", part)
        keys.append(band_keys)
        gids.append((np.int64(shard) << ROW_BITS) | rows)
    keys, gids = np.concatenate(keys), np.concatenate(gids)
    order = np.lexsort((gids, keys))
    keys, gids = keys[order], gids[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    sizes = np.diff(np.r_[starts, len(keys)])
    pairs = [np.stack([gids[starts[sizes == 2]], gids[starts[sizes == 2] + 1]], axis=1)]
    for s, size in zip(starts[sizes > 2], sizes[sizes > 2]):
        pairs.append(_bucket_pairs(gids[s:s + size], max_bucket_pairs))
    pairs = np.unique(np.concatenate(pairs), axis=0)  # a pair that shares several bands, once
    pairs = pairs.astype(np.int64).reshape(-1, 2)
    partitioned.save(out_path, _pair_partition(pairs, parts), [pairs[:, 0], pairs[:, 1]], parts)
    # the pairs are counted where verified: one sharing bands whose keys fall in several partitions is
    # found by each of them, and summed here it counted once a partition
    return {"buckets": int((sizes >= 2).sum())}


def _bucket_pairs(members: np.ndarray, max_pairs: int) -> np.ndarray:
    """All pairs of a small bucket; a big one (usually many copies of one text) pairs each member
    with the first and with its predecessor, which keeps it connected at linear cost."""
    if len(members) <= max_pairs:
        i, j = np.triu_indices(len(members), k=1)
        return np.stack([members[i], members[j]], axis=1)
    star = np.stack([np.full(len(members) - 1, members[0]), members[1:]], axis=1)
    chain = np.stack([members[1:-1], members[2:]], axis=1)
    return np.concatenate([star, chain])


def _pair_partition(pairs: np.ndarray, parts: int) -> np.ndarray:
    mixed = pairs[:, 0].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ pairs[:, 1].astype(np.uint64)
    return (mixed ^ (mixed >> np.uint64(31))) % np.uint64(parts)


def verify_partition(bucket_paths: list[str], prefixes: list[str], part: int, threshold: float,
                     out_path: str) -> dict:
    """Edges: this partition's share of the candidate pairs whose exact Jaccard is >= threshold."""
    pairs = [np.stack(partitioned.load(path, part), axis=1) for path in bucket_paths]
    pairs = np.unique(np.concatenate(pairs), axis=0) if pairs else np.zeros((0, 2), np.int64)
    edges = []
    with ShingleReader(prefixes) as reader:
        for a, b in pairs.tolist():
            j = jaccard(reader.shingle_set(a), reader.shingle_set(b))
            if j >= threshold:
                edges.append((a, b, j))
    save_array(out_path, np.array(edges, dtype=EDGE))
    return {"candidate_pairs": len(pairs), "edges": len(edges)}


def _npy_data_offset(fd: int, path: str) -> int:
    """Where a ``.npy`` file's data starts, from its fixed-size preamble (magic, version, header
    length: 2 bytes in format 1, 4 in formats 2 and 3), without parsing the header itself: a
    verification task opens every shard's files, so this runs shards x partitions times."""
    preamble = os.pread(fd, 12, 0)
    if preamble[:6] != b"\x93NUMPY":
        raise ValueError(f"{path}: not a .npy file; delete the stage's folder and run it again")
    if preamble[6] == 1:
        return 10 + int.from_bytes(preamble[8:10], "little")
    return 12 + int.from_bytes(preamble[8:12], "little")


class ShingleReader:
    """Shingle sets of single documents, read with ``pread`` from the shards' files.

    Reads, not a memory map: a partition's candidates touch documents of every shard, and mapped
    pages would stay resident, so the task's memory would grow with the corpus. For the same reason
    a document's bounds are read from the offsets file rather than loading every shard's offsets,
    and at most ``max_open`` shards' files are held open (the least recently used is closed).
    """

    def __init__(self, prefixes: list[str], max_open: int = 64) -> None:
        self.prefixes = prefixes
        self.max_open = max_open
        self.files: OrderedDict = OrderedDict()  # shard -> (shingles fd, its data offset, offsets fd, its offset)

    def _open(self, shard: int) -> tuple:
        if shard in self.files:
            self.files.move_to_end(shard)
            return self.files[shard]
        if len(self.files) >= self.max_open:
            for fd in self.files.popitem(last=False)[1][::2]:
                os.close(fd)
        opened = []
        for name in ("shingles", "offsets"):
            path = f"{self.prefixes[shard]}.{name}.npy"
            fd = os.open(path, os.O_RDONLY)
            opened += [fd, _npy_data_offset(fd, path)]
        self.files[shard] = tuple(opened)
        return self.files[shard]

    def shingle_set(self, gid: int) -> np.ndarray:
        shard, row = gid >> ROW_BITS, gid & ((1 << ROW_BITS) - 1)
        fd, data_offset, offsets_fd, offsets_offset = self._open(shard)
        lo, hi = np.frombuffer(os.pread(offsets_fd, 16, offsets_offset + 8 * row), dtype=np.int64).tolist()
        return np.frombuffer(os.pread(fd, 4 * (hi - lo), data_offset + 4 * lo), dtype=np.uint32)

    def __enter__(self) -> "ShingleReader":
        return self

    def __exit__(self, *exc) -> None:
        for fd, _, offsets_fd, _ in self.files.values():
            os.close(fd)
            os.close(offsets_fd)
        self.files.clear()


def connected_components(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, root of each node) for an edge list; a root is the smallest node of its component.

    Min-label propagation with pointer jumping, vectorised: each round every edge pulls both ends'
    roots to the smaller one, so the rounds needed grow with the log of a component's diameter. A
    round carries a component's smallest node at least one edge further, so no component needs more
    rounds than it has nodes: the loop is bounded by that, and a round rule that stopped making
    progress fails here instead of hanging a dedup run.
    """
    nodes, inverse = np.unique(np.concatenate([a, b]), return_inverse=True)
    ea, eb = inverse[:len(a)], inverse[len(a):]
    root = np.arange(len(nodes))
    for _ in range(len(nodes) + 1):
        ra, rb = root[ea], root[eb]
        if (ra == rb).all():
            return nodes, nodes[root]
        low = np.minimum(ra, rb)
        np.minimum.at(root, ra, low)
        np.minimum.at(root, rb, low)
        while not (root[root] == root).all():
            root = root[root]
    raise RuntimeError(f"connected components did not settle in {len(nodes) + 1} rounds over {len(nodes)} nodes")


def components(edge_paths: list[str], prefixes: list[str], out_dir: str) -> dict:
    """Write removed.drops (the removed documents, ``exact_dedup.save_drops``) and the audit files;
    returns cluster-size counts."""
    edges = np.concatenate([np.load(p) for p in edge_paths]) if edge_paths else np.zeros(0, EDGE)
    edges = np.sort(edges, order=("a", "b"))
    nodes, roots = connected_components(edges["a"], edges["b"])
    removed = nodes[nodes != roots]
    save_drops(os.path.join(out_dir, "removed.drops"), removed, len(prefixes))
    ids = _ids_of(np.concatenate([nodes, edges["a"], edges["b"]]), prefixes)
    root_of = dict(zip(nodes.tolist(), roots.tolist()))
    size = Counter(roots.tolist())
    atomic_write_text(os.path.join(out_dir, "edges.jsonl"), (
        json.dumps({"id_a": ids[int(a)], "id_b": ids[int(b)], "jaccard": round(float(j), 4)}) + "\n"
        for a, b, j in edges))
    atomic_write_text(os.path.join(out_dir, "removed.jsonl"), (
        json.dumps({"id": ids[g], "kept": ids[root_of[g]], "component_size": size[root_of[g]]}) + "\n"
        for g in removed.tolist()))
    return {"edges": len(edges), "components": len(size), "removed": len(removed),
            "cluster_sizes": {str(k): v for k, v in sorted(Counter(size.values()).items())}}


def _ids_of(gids: np.ndarray, prefixes: list[str]) -> dict:
    """Document ids of the given global numbers, reading only the shards they live in."""
    out = {}
    gids = np.unique(gids)
    for shard in np.unique(gids >> ROW_BITS).tolist():
        with open(f"{prefixes[shard]}.ids.json", encoding="utf-8") as f:
            shard_ids = json.load(f)
        for g in gids[(gids >> ROW_BITS) == shard].tolist():
            out[g] = shard_ids[g & ((1 << ROW_BITS) - 1)]
    return out
