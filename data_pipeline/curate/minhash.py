"""MinHash signatures of character n-gram sets and their LSH band keys, vectorised over documents.

Shingles: a batch's texts are concatenated as UTF-32 code points and every window of ``ngram``
characters is hashed at once (a random linear form of the code points, top 32 bits), windows that
straddle two documents are masked out, and one sort gives each document its set of shingle hashes.
A hash of 0 is stored as 1: 0 was the fixed point of every permutation before they had an offset
``b_i``; it no longer is, but the shingle files already written keep their meaning (the merge costs
about 2**-32 per shingle). A text shorter than one shingle is padded with NUL, so every document has a shingle.

Permutations: ``h_i(x) = (a_i * x + b_i) mod 2**32`` with ``a_i`` odd is a bijection of 32-bit
values, and since ``x`` is already a hash, the minimum over a set behaves like a random
permutation's (the estimate's error is tested against exact Jaccard; without ``b_i`` it is biased
low). 32-bit arithmetic moves half the bytes of 64-bit, and the (permutations x shingles) block,
where all the time goes, is built in cache-sized pieces of documents and reduced with
``np.minimum.reduceat``.

Bands: the ``rows`` values of a band are folded into one 64-bit key with random odd multipliers
and the band number, so equal keys mean (up to 2**-64) equal bands in the same band.
"""

from __future__ import annotations

import numpy as np

from data_pipeline.curate.checks import within
from data_pipeline.curate.text_forms import composed

CHUNK = 4096  # shingles per (permutations x shingles) block: about 4 MB of uint32
# Beyond this many permutations the Jaccard estimate barely improves (its error falls as one over the
# square root), while each costs every worker CHUNK x 4 bytes of hashing block: 128 MiB at this bound.
MAX_PERMUTATIONS = 8192
MAX_NGRAM = 64
"""Longest character shingle: each text is hashed once per character of it, and at 2,000 a batch took
a second (at 100,000 the stage ran on for minutes, printing nothing); near-duplicate search uses 3-9."""


def parameter_problems(num_perm: int, ngram: int, bands: int, rows: int, seed: int) -> list[str]:
    """What makes these MinHash parameters unusable, as sentences naming the ``fuzzy_dedup`` fields."""
    problems = within("fuzzy_dedup.num_perm", num_perm, 1, MAX_PERMUTATIONS,
                      f"more permutations refine the estimate little and cost each worker {CHUNK * 4} bytes apiece")
    problems += within("fuzzy_dedup.ngram", ngram, 1, MAX_NGRAM, "characters a shingle holds")
    for name, value in (("bands", bands), ("rows", rows)):
        problems += within(f"fuzzy_dedup.{name}", value, 1)
    problems += within("fuzzy_dedup.seed", seed, 0)  # numpy's generators take no negative seed
    if not problems and bands * rows > num_perm:
        problems.append(f"fuzzy_dedup.bands: bands x rows ({bands} x {rows}) needs at most num_perm ({num_perm}) "
                        "permutations; lower fuzzy_dedup.bands or fuzzy_dedup.rows or raise fuzzy_dedup.num_perm")
    return problems


def candidate_probability(similarity: float, bands: int, rows: int) -> float:
    """The chance LSH makes a pair at Jaccard ``similarity`` a candidate: some band's rows all agree."""
    return 1 - (1 - similarity**rows) ** bands


MIN_THRESHOLD_RECALL = 0.5
"""Least chance the banding gives a pair at the threshold of being compared at all: 20 x 13 gives 0.68
at its 0.8; left at 20 x 13, a threshold of 0.7 compared 18% of the pairs there, without a word."""


def banding_for(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) within ``num_perm`` permutations that compare at least ``MIN_THRESHOLD_RECALL`` of
    the pairs at ``threshold`` and whose S-curve turns nearest it: the midpoint (1/bands)^(1/rows) (20
    x 13 in 260 turns at 0.79). A single row always qualifies."""
    options = [(num_perm // rows, rows) for rows in range(1, num_perm + 1)
               if candidate_probability(threshold, num_perm // rows, rows) >= MIN_THRESHOLD_RECALL]
    return min(options or [(num_perm, 1)], key=lambda br: abs((1 / br[0]) ** (1 / br[1]) - threshold))


def banding_problems(threshold: float, num_perm: int, bands: int, rows: int) -> list[str]:
    """The banding refused for a threshold it would compare too few pairs at, naming one that fits."""
    if not 0 < threshold <= 1 or candidate_probability(threshold, bands, rows) >= MIN_THRESHOLD_RECALL:
        return []
    fit_bands, fit_rows = banding_for(threshold, num_perm)
    return [f"fuzzy_dedup.threshold: {threshold:g} with bands {bands} x rows {rows} compares only "
            f"{candidate_probability(threshold, bands, rows):.0%} of the pairs at that similarity (the banding "
            f"turns at {(1 / bands) ** (1 / rows):.2f}); set --fuzzy_dedup.bands {fit_bands} --fuzzy_dedup.rows "
            f"{fit_rows} ({candidate_probability(threshold, fit_bands, fit_rows):.0%}) or another banding "
            "that turns near the threshold"]


class MinHasher:
    def __init__(self, num_perm: int = 260, ngram: int = 5, bands: int = 20, rows: int = 13, seed: int = 42):
        problems = parameter_problems(num_perm, ngram, bands, rows, seed)
        if problems:
            raise ValueError("; ".join(problems))
        rng = np.random.default_rng(seed)
        self.num_perm, self.ngram, self.bands, self.rows = num_perm, ngram, bands, rows
        self.perm = rng.integers(0, 2**32, num_perm, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
        self.offset = rng.integers(0, 2**32, num_perm, dtype=np.uint64).astype(np.uint32)
        self.window = rng.integers(0, 2**63, ngram, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.band_mul = rng.integers(0, 2**63, (bands, rows), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.band_salt = rng.integers(0, 2**63, bands, dtype=np.uint64)

    def shingles(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Each text's sorted unique shingle hashes (uint32), concatenated, and offsets (len(texts) + 1)."""
        n = self.ngram
        texts = [composed(t) for t in texts]  # one form of each accented letter (text_forms)
        texts = [t if len(t) >= n else t + "\0" * (n - len(t)) for t in texts]
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        if not len(texts):
            return np.zeros(0, np.uint32), np.zeros(1, np.int64)
        points = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
        windows = len(points) - n + 1
        h = points[:windows] * self.window[0]
        for k in range(1, n):
            h += points[k:k + windows] * self.window[k]
        valid = np.ones(windows, dtype=bool)
        straddling = (np.cumsum(lengths)[:, None] - np.arange(1, n)[None, :]).ravel()
        valid[straddling[straddling < windows]] = False
        doc = np.repeat(np.arange(len(texts), dtype=np.uint64), lengths - n + 1)
        keys = np.sort((doc << np.uint64(32)) | np.maximum(h[valid] >> np.uint64(32), np.uint64(1)), kind="stable")
        keys = keys[np.r_[True, keys[1:] != keys[:-1]]]  # np.unique, without its slower hashing path
        offsets = np.searchsorted(keys >> np.uint64(32), np.arange(len(texts) + 1, dtype=np.uint64))
        return (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32), offsets.astype(np.int64)

    def signatures(self, hashes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """(documents, num_perm) uint32 minima; every document must have at least one shingle."""
        docs = len(offsets) - 1
        sig = np.empty((self.num_perm, docs), dtype=np.uint32)
        block = np.empty((self.num_perm, CHUNK), dtype=np.uint32)
        a, b = self.perm[:, None], self.offset[:, None]
        d = 0
        while d < docs:
            e = max(d + 1, int(np.searchsorted(offsets, offsets[d] + CHUNK, side="right")) - 1)
            lo, hi = int(offsets[d]), int(offsets[e])
            if hi - lo > CHUNK:  # one document longer than a block: a running minimum over pieces
                m = np.full(self.num_perm, np.iinfo(np.uint32).max, dtype=np.uint32)
                for s in range(lo, hi, CHUNK):
                    piece = hashes[s:min(s + CHUNK, hi)]
                    np.multiply(a, piece[None, :], out=block[:, :len(piece)])
                    np.add(block[:, :len(piece)], b, out=block[:, :len(piece)])
                    np.minimum(m, block[:, :len(piece)].min(axis=1), out=m)
                sig[:, d] = m
            else:
                np.multiply(a, hashes[None, lo:hi], out=block[:, :hi - lo])
                np.add(block[:, :hi - lo], b, out=block[:, :hi - lo])
                sig[:, d:e] = np.minimum.reduceat(block[:, :hi - lo], offsets[d:e] - lo, axis=1)
            d = e
        return np.ascontiguousarray(sig.T)

    def band_keys(self, sig: np.ndarray) -> np.ndarray:
        """(documents, bands) uint64 keys; two documents share a band's key when they share its rows."""
        used = sig[:, :self.bands * self.rows].astype(np.uint64).reshape(len(sig), self.bands, self.rows)
        keys = (used * self.band_mul).sum(axis=2, dtype=np.uint64) + self.band_salt
        keys ^= keys >> np.uint64(31)
        keys *= np.uint64(0x9E3779B97F4A7C15)
        return keys ^ (keys >> np.uint64(29))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two sorted arrays of unique shingle hashes."""
    inter = np.intersect1d(a, b, assume_unique=True).size
    return inter / (len(a) + len(b) - inter)


def estimate(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """The MinHash estimate of Jaccard: the share of permutations whose minima agree."""
    return float(np.mean(sig_a == sig_b))
