"""GPT training samples cut from an indexed dataset, with Megatron GPTDataset semantics.

Documents are concatenated (in a shuffled order, once per epoch) into one long token stream and
cut into samples of ``seq_len + 1`` tokens: inputs are the first ``seq_len``, labels the last
``seq_len``. Consecutive samples share their boundary token (sample ``i`` ends on the token where
sample ``i+1`` starts), so no token is lost as a target. Three arrays describe this:

- document index: the order of documents over all epochs;
- sample index: ``[n+1, 2]`` of (position in the document index, token offset) where each sample
  starts; sample ``i`` runs to the start of ``i+1`` inclusive;
- shuffle index: the order samples are served in.

They are built with vectorised numpy (a ``searchsorted`` over the cumulative token counts, never a
per-token loop), cached as ``.npy`` and reproducible from (data, split, seq_len, samples, seed).
They depend on the data only through its document sizes, so the cache is keyed on the ``.idx``
fingerprint: a shard preprocessed again with documents in another order gets new indices, and a
shard with the same ``.idx`` under another path reuses them rightly.
"""

from __future__ import annotations

from itertools import pairwise

import math

import numpy as np

from data_pipeline.index_cache import cached_arrays, default_cache_dir
from data_pipeline.indexed import IndexedDataset

# Megatron shuffles a final epoch separately when fewer than this share of it is used, so that the
# samples drawn from the partial epoch do not crowd the front of the shuffled order.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
INDEX_VERSION = 3  # 2: keyed on the .idx fingerprint, not on path and counts; 3: int64 document numbers past int32
SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised proportions of train, validation and test (missing ones are 0).
    An empty part is refused, not skipped: ``"98,,2"`` would otherwise give validation the 2."""
    try:
        parts = [float(p) for p in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"split {split!r} must be comma-separated numbers such as '969,30,1'") from None
    if not 1 <= len(parts) <= 3 or not all(0 <= p < math.inf for p in parts) or sum(parts) <= 0:
        raise ValueError(f"split {split!r} needs one to three finite non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) document ranges for train, validation and test."""
    bounds = np.rint(np.cumsum([0.0] + parse_split(split)) * num_documents).astype(np.int64)
    bounds[-1] = num_documents
    return [(int(a), int(b)) for a, b in pairwise(bounds)]


def samples_in(num_tokens: int, seq_len: int) -> int:
    """Samples ``num_tokens`` can give: every sample needs ``seq_len`` new tokens plus one shared."""
    return max(num_tokens - 1, 0) // seq_len


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """The documents of every epoch, shuffled: int32 as Megatron's, int64 where a document number
    exceeds int32 (a shard of over 2**31 documents), which int32 would wrap to negative numbers that
    index other documents from the end."""
    if separate_final_epoch and num_epochs > 1:
        return np.concatenate([build_document_index(documents, num_epochs - 1, rng, False),
                               build_document_index(documents, 1, rng, False)])
    fits32 = int(np.max(documents, initial=0)) <= np.iinfo(np.int32).max
    index = np.tile(documents.astype(np.int32 if fits32 else np.int64), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_len: int) -> np.ndarray:
    """Where each sample starts: (position in ``document_index``, offset into that document).

    Sample ``i`` starts at stream position ``i * seq_len``; the document holding a position is the
    last one whose cumulative start is <= it, which skips empty documents for free.
    """
    starts = np.zeros(len(document_index) + 1, dtype=np.int64)
    np.cumsum(sizes[document_index], dtype=np.int64, out=starts[1:])
    n = samples_in(int(starts[-1]), seq_len)
    positions = np.arange(n + 1, dtype=np.int64) * seq_len
    doc = np.searchsorted(starts, positions, side="right") - 1
    index = np.stack([doc, positions - starts[doc]], axis=1)
    fits32 = max(len(document_index), int(sizes.max(initial=0))) <= np.iinfo(np.int32).max
    return index.astype(np.int32 if fits32 else np.int64)


def build_shuffle_index(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``range(total)`` that shuffles ``[0, num_first)`` and the rest apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max else np.int64
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    rest = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(rest)
    return np.concatenate([first, rest])


def epoch_plan(tokens_per_epoch: int, seq_len: int, num_samples: int) -> tuple[int, bool]:
    """(epochs over the documents, whether the last one is shuffled apart) for ``num_samples``: with
    the documents and the seed, what the sample order depends on. Asking for more samples keeps the
    order while this stays the same, and reshuffles every sample when it changes."""
    per_epoch = samples_in(tokens_per_epoch, seq_len)
    if per_epoch == 0:
        raise ValueError(f"{tokens_per_epoch} tokens are too few for one sample of {seq_len}+1 tokens")
    # the fewest epochs whose tokens give num_samples samples: (E T - 1) // seq_len >= N, i.e. E T >= N seq_len + 1
    num_epochs = max(1, -(-(num_samples * seq_len + 1) // tokens_per_epoch))
    sans_final = samples_in((num_epochs - 1) * tokens_per_epoch, seq_len)
    return num_epochs, num_epochs > 1 and num_samples - sans_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)


INDEX_BYTES_PER_SAMPLE = 50
"""Host memory the sample indices take per sample while they are built: the blend's dataset and
sample numbers (10 bytes), and each dataset's sample starts, shuffle and the int64 temporaries they
are computed from (about 40). The data does not bound it: samples repeat over epochs."""


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int | None,
                      seed: int) -> dict:
    """The three index arrays for ``num_samples`` samples (``None``: one epoch's worth)."""
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    per_epoch = samples_in(tokens_per_epoch, seq_len)
    if per_epoch == 0:
        raise ValueError(f"{len(documents)} documents hold {tokens_per_epoch} tokens, too few for one sample "
                         f"of {seq_len}+1 tokens")
    num_samples = per_epoch if num_samples is None else num_samples
    num_epochs, separate = epoch_plan(tokens_per_epoch, seq_len, num_samples)
    sans_final = samples_in((num_epochs - 1) * tokens_per_epoch, seq_len)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = build_sample_index(sizes, document_index, seq_len)
    total = len(sample_index) - 1
    shuffle_index = build_shuffle_index(sans_final if separate else total, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


class GPTSamples:
    """``seq_len + 1``-token samples of one split of one indexed dataset, in shuffled order.

    ``len()`` may exceed the requested sample count: the last epoch is used whole, as in Megatron.
    """

    def __init__(self, data: IndexedDataset, seq_len: int, num_samples: int | None, seed: int,
                 split: str = "1", which: str = "train", cache_dir: str | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if which not in SPLIT_NAMES:
            raise ValueError(f"which must be one of {SPLIT_NAMES}, not {which!r}")
        self.data, self.seq_len = data, seq_len
        if len(data) == 0:
            raise ValueError(f"{data.prefix}: holds no documents; preprocess it again")
        start, end = split_ranges(split, len(data))[SPLIT_NAMES.index(which)]
        if end <= start:
            raise ValueError(f"{data.prefix}: split {split!r} leaves no documents for {which} "
                             f"({len(data)} documents in all); change data.split")
        self.documents = range(start, end)  # the split's documents
        description = {"version": INDEX_VERSION, "idx_sha256": data.fingerprint, "range": [start, end],
                       "seq_len": seq_len, "num_samples": num_samples, "seed": seed}
        arrays = cached_arrays(cache_dir or default_cache_dir(data.prefix), f"gpt-{which}", description,
                               ("document_index", "sample_index", "shuffle_index"),
                               lambda: self._build(start, end, num_samples, seed))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def _build(self, start: int, end: int, num_samples: int | None, seed: int) -> dict:
        try:
            return build_gpt_indices(self.data.sizes, np.arange(start, end), self.seq_len, num_samples, seed)
        except ValueError as exc:
            raise ValueError(f"{self.data.prefix}: {exc}") from None

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def samples_per_epoch(self) -> int:
        """The distinct samples the split's documents give (past them, samples repeat)."""
        documents = self.documents
        return samples_in(int(self.data.sizes[documents.start:documents.stop].astype(np.int64).sum()), self.seq_len)

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i`` of the shuffled order as ``seq_len + 1`` int64 tokens."""
        j = int(self.shuffle_index[i])
        (d0, off0), (d1, off1) = self.sample_index[j], self.sample_index[j + 1]
        if d0 == d1:
            tokens = self.data.get(int(self.document_index[d0]), int(off0), int(off1 - off0 + 1))
            return tokens.astype(np.int64)
        parts = [self.data.get(int(self.document_index[d0]), int(off0))]
        parts += [self.data.get(int(self.document_index[d])) for d in range(int(d0) + 1, int(d1))]
        parts.append(self.data.get(int(self.document_index[d1]), 0, int(off1) + 1))
        return np.concatenate(parts).astype(np.int64)
