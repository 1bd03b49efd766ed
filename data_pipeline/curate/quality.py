"""``quality``: a fastText classifier's score and MT-NLG's Pareto sampling.

The classifier is trained on word uni- and bigrams to tell curated text (``hq``: OpenWebText2,
Wikipedia, books) from raw web text (``lq``). A document with score ``s = P(hq)`` is kept when
``pareto(alpha) > 1 - s``, which keeps it with probability ``(2 - s) ** -alpha`` (numpy's Pareto is
the Lomax distribution): every good document, and an eighth of the worst at alpha = 3, so the
corpus keeps some variety instead of a hard cut (GPT-3 and MT-NLG do the same).

The draw comes from a generator seeded by (seed, document id), so whether a document survives
never depends on how the corpus was sharded or how many workers ran.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import struct
import tempfile
from dataclasses import dataclass
from typing import Optional

import numpy as np

from data_pipeline.curate.checks import within
from data_pipeline.curate.shards import BadRecords, input_documents, read_shard, write_shard
from data_pipeline.paths import empty_path_problem, file_in_the_way, listed_twice, written_whole

LABEL_PREFIX = "__label__"  # what fastText takes a word for a label by
HQ, LQ = LABEL_PREFIX + "hq", LABEL_PREFIX + "lq"
FASTTEXT_BUCKETS = 2_000_000
"""fastText's default count of hashed word-bigram rows. The model holds that many rows of ``dim`` floats
whatever its corpus (488 MiB at dim 64), and every quality task reads it whole: a classifier of a few
thousand documents is as large and as slow to load as one of millions, unless it asks for fewer."""
MIN_BUCKETS = 1 << 18
"""Fewer rows are refused: fastText reads its input matrix before it writes every row of it, which
is harmless only while the matrix comes fresh (zeroed) from the OS, as glibc's allocations over 32 MiB
do; a smaller one reuses freed heap memory and trained to NaN losses (measured, 29 runs of 30 after
freeing NaN-filled arrays at 4096 rows, none at 2**18)."""
HIST_BINS = 20  # score histogram in stats.json, for the report


@dataclass
class QualityConfig:
    model: Optional[str] = None  # a fastText model from `megazero curate train-quality`
    alpha: float = 3.0  # Pareto shape (MT-NLG); larger keeps fewer low-scoring documents
    seed: int = 0  # mixed with each document id to seed its draw

    def problems(self) -> list[str]:
        """Out-of-range options: numpy's Pareto needs alpha > 0, its generator a seed >= 0."""
        return (within("quality.alpha", self.alpha, 0, low_open=True,
                       meaning="it is the Pareto shape (MT-NLG: 3): larger keeps fewer low-scoring documents")
                + within("quality.seed", self.seed, 0))

    def file_problems(self) -> list[str]:
        """Load the model now, so a missing or wrong one fails before the stages ahead of this one run."""
        try:
            load_model(self.model)
        except ValueError as exc:
            return [str(exc)]
        return []


def _one_line(text: str) -> str:
    """One example a line, as fastText reads them; a word that begins with fastText's label prefix
    loses it: left in, a document's ``__label__lq`` made it an example of that label too in training
    (a new label where none had that name), and was taken out of its words in scoring."""
    words = text.replace("\0", " ").split()  # fastText ends a word at NUL too
    if LABEL_PREFIX not in text:
        return " ".join(words)
    return " ".join(word.replace(LABEL_PREFIX, "label__", 1) if word.startswith(LABEL_PREFIX) else word
                    for word in words)


def _fasttext():
    try:
        import fasttext
    except ImportError:
        raise ImportError("the quality stage needs fastText: pip install fasttext-numpy2") from None
    return fasttext


def load_model(path: Optional[str]):
    if not path:
        raise ValueError("quality.model: no classifier given; train one with `megazero curate train-quality "
                         "--hq FILES --lq FILES --output MODEL.bin` and set quality.model")
    if not os.path.isfile(path):
        raise ValueError(f"quality.model: {path}: no such file; train one with `megazero curate train-quality`")
    fasttext = _fasttext()

    _check_dictionary_fits(path)
    fasttext.FastText.eprint = lambda *args, **kwargs: None  # its load-time warning is noise here
    try:
        model = fasttext.load_model(path)
    except ValueError:
        raise ValueError(f"quality.model: {path} is not a fastText model; train one with "
                         "`megazero curate train-quality`") from None
    except RuntimeError:  # fastText's magic, then a header it cannot use (an unknown loss)
        raise ValueError(f"quality.model: {path} is a damaged fastText model; copy it again or train it again "
                         "with `megazero curate train-quality`") from None
    except MemoryError:  # sizes in a damaged header, or a model too large for this machine
        raise ValueError(f"quality.model: {path} does not fit in memory here: it is damaged (copy it again) or "
                         "too large for this machine") from None
    _check_matrices_fit(path, model)
    if HQ not in model.get_labels():
        raise ValueError(f"quality.model: {path} has labels {model.get_labels()}, not {HQ}; train it with "
                         "`megazero curate train-quality`")
    return model


FASTTEXT_MAGIC = 793712314
_HEADER = struct.Struct("<ii12id3iqq")
"""A fastText ``.bin``'s opening: magic, version, its 12 integer training arguments and a double,
then its dictionary's entry, word and label counts and token and prune-index counts."""


def _truncated(path: str, size: int, needed: int) -> ValueError:
    return ValueError(f"quality.model: {path} is truncated ({size} bytes where its header implies at least "
                      f"{needed}); copy it again or train it again with `megazero curate train-quality`")


def _check_dictionary_fits(path: str) -> None:
    """fastText reads a file cut short without an error: inside its dictionary it reads on forever,
    inside its matrices it leaves the rest unset (every document then scores about 0.5). Each of
    the dictionary's entries is a word, its NUL end, a count (8 bytes) and a type (1 byte), so the
    entries are walked to where the last one ends: a bound of 11 bytes an entry let a file cut
    inside the dictionary's longer words through, and fastText's load then never returned."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if head[:4] != struct.pack("<i", FASTTEXT_MAGIC):
            return  # not a fastText model at all: fastText's own refusal names it
        if len(head) < _HEADER.size:  # cut inside the header: fastText reads no labels, or allocates without end
            raise _truncated(path, size, _HEADER.size)
        entries = _HEADER.unpack(head)[15]
        if size < _HEADER.size + 11 * entries:  # each entry takes 11 bytes at least: refused without a walk
            raise _truncated(path, size, _HEADER.size + 11 * entries)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:  # pages of the dictionary only
            end = _HEADER.size
            for left in range(entries - 1, -1, -1):
                nul = data.find(b"\0", end)
                end = (size if nul < 0 else nul) + 10
                if end > size:  # the entries left need at least 11 bytes each
                    raise _truncated(path, size, end + 11 * left)


def _check_matrices_fit(path: str, model) -> None:
    """The file holds at least its two float matrices (a quantized model's are smaller: not checked)."""
    if model.f.isQuant():
        return
    needed = sum(4 * int(np.prod(memoryview(m).shape)) for m in (model.f.getInputMatrix(), model.f.getOutputMatrix()))
    size = os.path.getsize(path)
    if size < needed:
        raise _truncated(path, size, needed)


def scores(model, texts: list[str]) -> np.ndarray:
    """P(hq) for each text. Every label's probability is asked for (k=-1): with the top two only, a
    model of more labels than hq and lq left hq out for a document of a third class, which then
    scored 1 - P(lq), near 1, however low its P(hq)."""
    if not texts:
        return np.zeros(0)
    labels, probs = model.predict([_one_line(t) for t in texts], k=-1)
    return np.array([dict(zip(ls, ps)).get(HQ, 0.0) for ls, ps in zip(labels, probs)]).clip(0.0, 1.0)


def pareto_keep(doc_id: str, score: float, alpha: float, seed: int) -> bool:
    """MT-NLG's rule with a generator seeded by the document id: keep when pareto(alpha) > 1 - score."""
    key = int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest(), "little")
    return bool(np.random.default_rng([seed, key]).pareto(alpha) > 1.0 - score)


def keep_probability(score, alpha: float):
    """The closed form of ``pareto_keep``'s rate at a given score: (2 - s) ** -alpha."""
    return (2.0 - np.asarray(score, dtype=np.float64)) ** -alpha


def quality_shard(in_path: str, out_path: str, text_field: str, cfg: QualityConfig) -> dict:
    model = load_model(cfg.model)
    records = read_shard(in_path)
    s = scores(model, [r[text_field] for r in records])
    keep = [pareto_keep(r["id"], float(x), cfg.alpha, cfg.seed) for r, x in zip(records, s)]
    kept = [r for r, k in zip(records, keep) if k]
    write_shard(out_path, kept, like=in_path)
    size = lambda rs: sum(len(r[text_field].encode("utf-8")) for r in rs)  # noqa: E731
    edges = np.linspace(0.0, 1.0, HIST_BINS + 1)
    return {"docs_in": len(records), "docs_out": len(kept), "bytes_in": size(records), "bytes_out": size(kept),
            "dropped": {"pareto sample": len(records) - len(kept)} if len(kept) < len(records) else {},
            "score_histogram": np.histogram(s, edges)[0].tolist(),
            "kept_histogram": np.histogram(s[np.array(keep, dtype=bool)], edges)[0].tolist()}


def _check_each_file_once(hq: list[str], lq: list[str]) -> None:
    """A file given twice (however spelled) puts its documents in both the training and the held-out
    rows, so the accuracy reported measures memory; one given as both --hq and --lq teaches nothing."""
    repeat = listed_twice([*(("--hq", path) for path in hq), *(("--lq", path) for path in lq)])
    if repeat:
        raise ValueError(f"{repeat}; list each file once, under --hq or --lq")


def train_quality(hq: list[str], lq: list[str], output: str, text_field: str = "text", epoch: int = 5,
                  valid_fraction: float = 0.1, seed: int = 0, dim: int = 64, bucket: int = FASTTEXT_BUCKETS) -> dict:
    """Train the hq/lq classifier on word 1-2-grams, the bigrams hashed into ``bucket`` rows; returns
    counts and held-out accuracy. An existing ``output`` is refused (a quality stage that scored with
    it would be refused as changed, and the model lost), and so is one that names no file (empty, or
    ending in a separator), which failed only at the final rename, after training; the model is saved
    under a temporary name and renamed, so it is whole or absent."""
    empty = empty_path_problem(output, "model file", "give a path such as quality.bin")
    if empty:
        raise ValueError(f"--output: {empty}")
    if output.endswith(("/", os.sep)):
        raise ValueError(f"--output {output}: names a folder; give a file path inside it, e.g. "
                         f"{os.path.join(output, 'quality.bin')}")
    if bucket < MIN_BUCKETS:
        raise ValueError(f"bucket: {bucket} word-bigram rows, fewer than {MIN_BUCKETS} (fastText would train on "
                         "memory it never wrote)")
    if os.path.lexists(output):
        raise ValueError(f"--output {output}: already exists; give a new path or remove it first")
    blocking = file_in_the_way(output)
    if blocking:
        raise ValueError(f"--output {output}: {blocking} is a file, not a folder; give another path")
    _check_each_file_once(hq, lq)
    examples = [(HQ, t) for t in _texts(hq, text_field, "--hq")] + [(LQ, t) for t in _texts(lq, text_field, "--lq")]
    random.Random(seed).shuffle(examples)
    n_valid = int(len(examples) * valid_fraction) if len(examples) >= 10 else 0
    valid, train = examples[:n_valid], examples[n_valid:]
    fasttext = _fasttext()

    with tempfile.TemporaryDirectory() as tmp:
        train_file, valid_file = os.path.join(tmp, "train.txt"), os.path.join(tmp, "valid.txt")
        for path, rows in ((train_file, train), (valid_file, valid)):
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(f"{label} {_one_line(text)}\n" for label, text in rows)
        model = fasttext.train_supervised(input=train_file, wordNgrams=2, epoch=epoch, dim=dim, minCount=1,
                                          lr=0.5, thread=1, seed=seed, verbose=0, bucket=bucket)
        accuracy = model.test(valid_file)[1] if valid else float("nan")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with written_whole(output) as tmp:
        model.save_model(tmp)
    return {"hq": sum(1 for label, _ in examples if label == HQ), "lq": sum(1 for label, _ in examples if label == LQ),
            "held_out": len(valid), "accuracy": accuracy}


def _texts(paths: list[str], text_field: str, flag: str) -> list[str]:
    texts = [record[text_field] for path in paths
             for _, record in input_documents(path, text_field, "id", True, BadRecords(
                 fatal_because="the classifier trains on clean records only: fix or remove it"))]
    if not texts:
        raise ValueError(f"{flag}: no documents in {paths}; give jsonl or parquet files with a {text_field!r} field")
    return texts
