"""``decontaminate``: cut evaluation-task 13-grams out of the training documents (GPT-3 / MT-NLG rules).

Text is compared as lower-cased words (runs of ``\\w`` and combining marks, so punctuation and
spacing do not matter; invisible format characters such as soft hyphens are skipped), in Unicode's
composed form (NFC): an accented letter written as a letter and a combining mark is the same word as
the precomposed letter, whichever form the task or the document uses. Task texts are searched as
written and as the clean stage's Unicode repair makes them. For every 13-gram of a document that
also occurs in a task, the match plus ``margin`` (200) characters on each side is removed; the
document falls apart into the pieces between removals, pieces under ``min_piece_chars`` (200) are
dropped, and a document split more than ``max_splits`` (10) times is dropped whole. 13-grams found
in ``max_doc_freq`` (10) or more training documents are common phrases rather than leaked test
items, and are ignored; counting them is the ``doc_freq`` sub-stage, which runs first over every
shard and also records each shard's hits, so the cutting pass splits into words only the documents
that have one.
"""

from __future__ import annotations

import functools
import json
import os
import unicodedata
from dataclasses import dataclass, field

import numpy as np

from data_pipeline.curate.checks import within
from data_pipeline.curate.clean import repair_unicode
from data_pipeline.curate.exact_dedup import save_array
from data_pipeline.curate.shards import BadRecords, input_documents, read_shard, write_shard
from data_pipeline.curate.text_forms import composed
from data_pipeline.paths import listed_twice, written_whole
from data_pipeline.sources import BadRecord, check_compression, iter_lines, record_texts

HIT = np.dtype([("row", np.int64), ("window", np.int64), ("key", np.uint64)])  # a task n-gram in a shard
BATCH_CHARS = 1 << 20  # characters hashed together: amortises numpy's per-call cost, bounds the arrays
MAX_NGRAM = 1000
"""Most words in a compared n-gram: a key costs a pass over the words per word of it (GPT-3 compared
13, others 8 to 50), and 1e12 asked for a table of terabytes before the first document."""


@dataclass
class DecontaminateConfig:
    tasks: list[str] = field(default_factory=list)  # jsonl/parquet files of evaluation texts, one task per file
    task_fields: list[str] = field(default_factory=lambda: ["text"])  # fields of a task record that hold text
    ngram: int = 13
    margin: int = 200  # characters removed on each side of a match
    min_piece_chars: int = 200  # shorter pieces left after removal are dropped
    max_splits: int = 10  # a document split more often is dropped
    max_doc_freq: int = 10  # n-grams in this many training documents or more are ignored

    def problems(self) -> list[str]:
        """Out-of-range options. A match is always in at least one document, so a max_doc_freq under
        2 ignores every match and the stage would remove nothing without a word."""
        problems = within("decontaminate.ngram", self.ngram, 1, MAX_NGRAM,
                          meaning="it is the words in a compared n-gram (GPT-3: 13)")
        for name in ("margin", "min_piece_chars", "max_splits"):
            problems += within(f"decontaminate.{name}", getattr(self, name), 0)
        problems += within("decontaminate.max_doc_freq", self.max_doc_freq, 2,
                           meaning="n-grams in this many training documents are ignored as common phrases, and "
                                   "every match is in one at least, so below 2 nothing would be removed")
        if not self.task_fields:
            problems.append("decontaminate.task_fields: empty; list the fields of a task record that hold its text")
        return problems

    def file_problems(self) -> list[str]:
        """Task files that are missing or empty, whose records lack the first task field (the one every
        record needs) or hold no text in a listed field, whose texts are all shorter than an n-gram,
        and further task fields no file has (a misspelling): each would leave the stage with less to
        look for than asked, and it would remove less without a word. A file listed twice (however
        spelled) is refused first: its hits went to the first entry and the report gave the second's
        none. Reads every record (evaluation sets are small), once for the fields and once for the texts."""
        if not self.tasks:
            return ["decontaminate.tasks: no task files; list jsonl or parquet files of evaluation texts "
                    "(their decontaminate.task_fields hold the text)"]
        repeat = listed_twice(("decontaminate.tasks:", path) for path in self.tasks)
        if repeat:
            return [f"{repeat}; list each task file once"]
        problems, seen = [], set()
        for path in self.tasks:
            if not os.path.isfile(path):
                problems.append(f"decontaminate.tasks: {path}: no such file; fix the path")
                continue
            try:  # a gzip file without .gz read as text: its record a bad line, the file said to hold none
                check_compression(path)
            except ValueError as exc:
                problems.append(f"decontaminate.tasks: {exc}")
                continue
            keys = _record_keys(path)
            if not keys:
                problems.append(f"decontaminate.tasks: {path} holds no records; give a file of evaluation texts")
                continue
            seen.update(keys)
            if self.task_fields[0] not in keys:
                problems.append(f"decontaminate.task_fields: {self.task_fields[0]} (the first, which every record "
                                f"needs) not in {path} (its records have {', '.join(sorted(keys))}); list the "
                                "fields that hold the task text")
                continue
            bad = BadRecords()
            records = list(task_texts(path, self.task_fields, bad))
            if bad.counts:
                problems.append(_bad_records_problem(path, len(records), bad))
            elif not records:
                problems.append(f"decontaminate.tasks: {path} holds no records; give a file of evaluation texts")
            elif not any(len(k) for _, k, _, _ in NgramKeys(self.ngram).batches([t for r in records for t in r])):
                problems.append(f"decontaminate.tasks: {path}: no text of {self.ngram} or more words, so nothing of it "
                                "could be found in the corpus; lower decontaminate.ngram or give longer task texts")
        unknown = [name for name in self.task_fields[1:] if seen and name not in seen]
        if unknown:
            problems.append(f"decontaminate.task_fields: {', '.join(unknown)} in no task file (they have "
                            f"{', '.join(sorted(seen))}); list the fields that hold the task text")
        return problems


def _bad_records_problem(path: str, good: int, bad: BadRecords) -> str:
    """One line for a task file's unusable records: how many, the first, and the two ways out."""
    n = sum(bad.counts.values())
    return (f"decontaminate.tasks: {path}: {n} of {good + n} records hold no usable task text (first: "
            f"{bad.examples[0]}); fix them, or list in decontaminate.task_fields the fields that hold the text "
            "(a string, or a list of strings)")


def _record_keys(path: str) -> set[str]:
    """The fields of a task file: a parquet file's columns, or the keys of all of a jsonl file's JSON
    objects (lines that are none are reported by ``task_texts``)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return set(pq.ParquetFile(path).schema_arrow.names)
    keys = set()
    for _, line in iter_lines(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            keys.update(record)
    return keys


def task_texts(path: str, fields: list, bad: BadRecords):
    """The texts of each usable record of one task file, a list per record: the first field's (a
    string every record has) and each further field's where the record has one, a string or a list
    of strings (multiple-choice options, reference answers). A record that is not JSON, lacks the
    first field or holds anything else in a listed field goes to ``bad``: its n-grams would otherwise
    be left out without a word."""
    for doc_id, record in input_documents(path, fields[0], None, False, bad):  # None: ids are NAME:LINE
        try:
            texts = list(record_texts(record, (fields[0],)))
            for name in fields[1:]:
                value = record.get(name)
                items = [] if value is None else value if isinstance(value, list) else [value]
                for item in items:
                    texts += record_texts({name: item}, (name,))
        except BadRecord as exc:
            bad.add(exc.reason, os.path.join(os.path.dirname(path), doc_id), exc.detail, False)  # as PATH:LINE
            continue
        yield texts


def _is_word_char(ch: str) -> bool:
    """A letter, digit or combining mark (the vowel signs and viramas of Indic scripts are parts of
    their letters, and would otherwise split every word in two). Not ``_``: markdown's ``_quick_`` and
    ``snake_case`` joins hid every 13-gram around them, and a task's text leaked through."""
    return ch.isalnum() or unicodedata.category(ch)[0] == "M"


def _lower(ch: str) -> int:
    """The lower-case code point (the first, where lower-casing gives several), with Greek's final
    sigma as sigma: lower-cased one character at a time, a capital word's last sigma is no final one
    (``ΕΛΛΑΔΟΣ`` gives ``ελλαδοσ``, the lower-case text ``ελλαδος``)."""
    low = ch.lower()[0]
    return ord("σ") if low == "ς" else ord(low)


def _is_invisible(ch: str) -> bool:
    """A format character (Unicode category Cf: the soft hyphen, zero-width spaces and joiners, the
    word joiner, a byte-order mark): it shows nothing, so it is in no word and splits none. Web text
    is full of soft hyphens (``&shy;``), which the clean stage keeps; taken as a break, one in any
    word of a leaked passage hid every 13-gram over it. The zero-width space too, though Unicode's
    word breaking takes it as a break: Thai, Khmer or Lao text marks its word boundaries with it or
    not at all, so a task written without it matches a document written with it only this way."""
    return unicodedata.category(ch) == "Cf"


@functools.cache
def _bmp_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each code point below 0x10000: is it a word character, its lower-case code point, and is it
    invisible (``_is_invisible``)."""
    chars = [chr(c) for c in range(0x10000)]
    return (np.array([_is_word_char(ch) for ch in chars]), np.array([_lower(ch) for ch in chars], dtype=np.uint64),
            np.array([_is_invisible(ch) for ch in chars]))


def _classify(cps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(is a word character, lower-case code point, is invisible) of each code point; the rare ones
    above the BMP are looked up one distinct value at a time."""
    is_word, lower, is_invisible = _bmp_tables()
    astral = cps > 0xFFFF
    index = np.where(astral, 0, cps)
    word, low, invisible = is_word[index], lower[index], is_invisible[index]
    if astral.any():
        values, inverse = np.unique(cps[astral], return_inverse=True)
        chars = [chr(c) for c in values.tolist()]
        word[astral] = np.array([_is_word_char(ch) for ch in chars])[inverse]
        low[astral] = np.array([_lower(ch) for ch in chars], dtype=np.uint64)[inverse]
        invisible[astral] = np.array([_is_invisible(ch) for ch in chars])[inverse]
    return word, low, invisible


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that spreads every input bit over the output."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class NgramKeys:
    """64-bit keys of lower-cased word n-grams, computed for many texts at once with numpy.

    A word is a run of ``\\w`` characters and combining marks (so punctuation and spacing never matter). Its
    hash sums its lower-cased code points times a per-position odd multiplier, mixed; an n-gram's key folds
    its words' hashes with fixed odd multipliers. Task texts and training documents go through this same
    function, so only a 64-bit collision could make a false match.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        rng = np.random.default_rng(13)
        self.mul = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)

    def words(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(hash, start, end) of every word of ``texts`` in order (start/end index that word's text),
        and each text's first word number (``len(texts) + 1`` entries). Texts are taken as given:
        ``batches`` and the cutting pass compose them first."""
        joined = "\n".join(texts)  # a separator that is not \\w: no word spans two texts
        cps = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        word, low, invisible = _classify(cps)
        seen = np.flatnonzero(~invisible) if invisible.any() else None  # words are read without them
        if seen is not None:
            word, low = word[seen], low[seen]
        bounds = np.flatnonzero(np.diff(np.concatenate([[False], word, [False]]).view(np.int8)))
        starts, ends = bounds[0::2], bounds[1::2]
        first = np.cumsum(np.concatenate([[0], ends - starts]))[:-1]  # each word's first character below
        position = np.arange(int(word.sum())) - np.repeat(first, ends - starts)
        terms = (low[word] + np.uint64(1)) * (_mix(position.astype(np.uint64)) | np.uint64(1))
        hashes = _mix(np.add.reduceat(terms, first)) if len(first) else np.zeros(0, np.uint64)
        if seen is not None:  # back to places in the texts as written
            starts, ends = seen[starts], seen[ends - 1] + 1
        text_starts = np.cumsum([0] + [len(t) + 1 for t in texts])
        offsets = np.searchsorted(starts, text_starts)
        text_of_word = np.repeat(np.arange(len(texts)), np.diff(offsets))
        shift = text_starts[:-1][text_of_word]
        return hashes, starts - shift, ends - shift, offsets

    def keys(self, word_hashes: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(key, text, window) of every n-gram that lies inside one text; window = its first word's
        number within the text."""
        windows = len(word_hashes) - self.n + 1
        if windows <= 0:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        key = word_hashes[:windows] * self.mul[0]
        for k in range(1, self.n):
            key += word_hashes[k:k + windows] * self.mul[k]
        text = np.searchsorted(offsets, np.arange(windows), side="right") - 1
        inside = np.arange(windows) + self.n <= offsets[text + 1]
        return key[inside], text[inside], (np.arange(windows) - offsets[text])[inside]

    def batches(self, texts: list[str]):
        """(first text number, keys, text, window) for consecutive batches of about BATCH_CHARS
        characters, of the texts ``composed``."""
        texts = [composed(t) for t in texts]
        begin = 0
        while begin < len(texts):
            end, size = begin, 0
            while end < len(texts) and (end == begin or size + len(texts[end]) <= BATCH_CHARS):
                size += len(texts[end])
                end += 1
            hashes, _, _, offsets = self.words(texts[begin:end])
            yield (begin, *self.keys(hashes, offsets))
            begin = end


def task_names(paths: list[str]) -> list[str]:
    """Each task file's name in the stats and report: its file name without extensions, led by as many
    of its folders as make the names distinct (``lambada/test`` and ``hellaswag/test``, where two
    ``test`` would merge their counts). Files of one folder and one name (``test.jsonl`` and
    ``test.parquet``) keep their extensions: no folder tells them apart, and one's counts replaced
    the other's."""
    stems = [os.path.splitext(os.path.basename(p).removesuffix(".gz").removesuffix(".zst"))[0] for p in paths]
    folders = [os.path.dirname(os.path.abspath(p)).strip(os.sep).split(os.sep) for p in paths]
    places = list(zip(map(tuple, folders), stems))
    names = [os.path.basename(p) if places.count(place) > 1 else stem for p, stem, place in zip(paths, stems, places)]
    for depth in range(1, max(map(len, folders), default=0) + 1):
        clash = {name for name in names if names.count(name) > 1}
        if not clash:
            break
        names = ["/".join(f[-depth:] + [name.rsplit("/", 1)[-1]]) if name in clash else name
                 for f, name in zip(folders, names)]
    return names


def build_task_ngrams(cfg: DecontaminateConfig, out_path: str) -> dict:
    """Every task's n-gram keys, sorted, with the tasks each came from (an n-gram several tasks share is
    every one's: a hit on it is a leak of each); returns per-task counts. A text
    the clean stage's Unicode repair would change (mojibake, ligatures, full-width letters, HTML
    entities) gives its n-grams in both forms: a corpus cleaned before this stage holds the repaired
    form of a passage copied into it, an uncleaned one the form as written."""
    ngrams = NgramKeys(cfg.ngram)
    keys, owner, names, short = [], [], task_names(cfg.tasks), {}
    for t, path in enumerate(cfg.tasks):
        bad = BadRecords()  # checked before the run (``file_problems``); changed since, the stage stops
        records = list(task_texts(path, cfg.task_fields, bad))
        if bad.counts:
            raise ValueError(_bad_records_problem(path, len(records), bad))
        texts = [text for record in records for text in record]
        written = len(texts)  # the texts as written, then their repaired forms
        texts += [fixed for text in texts if (fixed := repair_unicode(text)) != text]
        with_ngrams = 0
        for begin, k, text, _ in ngrams.batches(texts):
            keys.append(k)
            owner.append(np.full(len(k), t, np.int32))
            with_ngrams += int(np.count_nonzero(np.unique(text) + begin < written))
        short[names[t]] = written - with_ngrams
    keys, owner = np.concatenate(keys or [np.zeros(0, np.uint64)]), np.concatenate(owner or [np.zeros(0, np.int32)])
    order = np.lexsort((owner, keys))  # by key, then task (a quarter of np.unique(axis=0)'s time)
    keys, owner = keys[order], owner[order]
    new = np.ones(len(keys), bool)
    new[1:] = (keys[1:] != keys[:-1]) | (owner[1:] != owner[:-1])
    pair_keys, pair_tasks = keys[new], owner[new]
    unique_keys = pair_keys[np.r_[True, pair_keys[1:] != pair_keys[:-1]]] if len(pair_keys) else pair_keys
    with written_whole(out_path, ".npz") as tmp:
        np.savez(tmp, keys=unique_keys, pair_keys=pair_keys, pair_tasks=pair_tasks, names=np.array(names))
    return {"task_ngrams": len(unique_keys), "task_texts_shorter_than_ngram": short}


def _load_tasks(path: str):
    data = np.load(path)
    return data["keys"], (data["pair_keys"], data["pair_tasks"]), [str(n) for n in data["names"]]


def hits_per_task(hit_keys: np.ndarray, keys: np.ndarray, pairs: tuple[np.ndarray, np.ndarray],
                  tasks: int) -> np.ndarray:
    """How many hits each task's n-grams took (``keys``: every task n-gram once, sorted; ``pairs``: each
    (n-gram, task) once): a hit on an n-gram of several tasks counts for each."""
    pair_keys, pair_tasks = pairs
    per_key = np.bincount(np.searchsorted(keys, hit_keys), minlength=len(keys))
    return np.bincount(pair_tasks, weights=per_key[np.searchsorted(keys, pair_keys)], minlength=tasks).astype(np.int64)


def doc_freq_shard(in_path: str, tasks_path: str, out_prefix: str, text_field: str, n: int) -> dict:
    """The shard's task n-gram hits, once for both passes: OUT.hits.npy (row, window, key) and
    OUT.freq.npy (task n-gram key, number of this shard's documents containing it)."""
    keys, _, _ = _load_tasks(tasks_path)
    hits = []
    for begin, k, text, window in NgramKeys(n).batches([r[text_field] for r in read_shard(in_path)]):
        pos = np.searchsorted(keys, k).clip(0, max(len(keys) - 1, 0))
        hit = keys[pos] == k if len(keys) else np.zeros(len(k), bool)
        hits.append(np.rec.fromarrays([text[hit] + begin, window[hit], k[hit]], dtype=HIT))
    hits = np.concatenate(hits) if hits else np.zeros(0, HIT)
    save_array(f"{out_prefix}.hits.npy", hits)
    pairs = np.unique(np.stack([hits["key"], hits["row"].astype(np.uint64)], axis=1), axis=0)
    uniq, counts = np.unique(pairs[:, 0], return_counts=True)
    save_array(f"{out_prefix}.freq.npy", np.stack([uniq, counts.astype(np.uint64)], axis=1))
    return {"docs": 0}


def frequent_ngrams(freq_paths: list[str], max_doc_freq: int) -> np.ndarray:
    pairs = np.concatenate([np.load(p).reshape(-1, 2) for p in freq_paths])
    uniq, inverse = np.unique(pairs[:, 0], return_inverse=True)
    totals = np.bincount(inverse, weights=pairs[:, 1].astype(np.float64), minlength=len(uniq))
    return uniq[totals >= max_doc_freq]


def cut(text: str, starts: np.ndarray, ends: np.ndarray, hit_windows: np.ndarray,
        cfg: DecontaminateConfig) -> list[str] | None:
    """The pieces of ``text`` left after removing each hit window (words ``i .. i + ngram - 1``, by
    their character ``starts``/``ends``) plus the margin; None = drop it all."""
    removed = []
    for i in hit_windows.tolist():
        lo, hi = max(0, int(starts[i]) - cfg.margin), min(len(text), int(ends[i + cfg.ngram - 1]) + cfg.margin)
        if removed and lo <= removed[-1][1]:
            removed[-1][1] = max(removed[-1][1], hi)
        else:
            removed.append([lo, hi])
    if len(removed) > cfg.max_splits:
        return None
    bounds = [0] + [x for r in removed for x in r] + [len(text)]
    pieces = [text[bounds[k]:bounds[k + 1]].strip() for k in range(0, len(bounds), 2)]
    return [p for p in pieces if p and len(p) >= cfg.min_piece_chars]  # never an empty document


def decontaminate_shard(in_path: str, out_path: str, hits_path: str, tasks_path: str, ignored_path: str,
                        text_field: str, cfg: DecontaminateConfig) -> dict:
    """Cut the hits the ``doc_freq`` pass found, less the frequent n-grams; only documents with a hit
    are split into words again (for their character positions)."""
    keys, pairs, names = _load_tasks(tasks_path)
    hits = np.load(hits_path)
    hits = hits[~np.isin(hits["key"], np.load(ignored_path))]
    per_task = hits_per_task(hits["key"], keys, pairs, len(names))
    rows, first = np.unique(hits["row"], return_index=True)
    windows = dict(zip(rows.tolist(), np.split(hits["window"], first[1:]))) if len(hits) else {}
    ngrams = NgramKeys(cfg.ngram)
    records = read_shard(in_path)
    out, dropped, cut_docs, pieces_made = [], 0, 0, 0
    for row, record in enumerate(records):
        if row not in windows:
            out.append(record)
            continue
        text = composed(record[text_field])  # the form the doc_freq pass found its hits in
        _, starts, ends, _ = ngrams.words([text])
        pieces = cut(text, starts, ends, windows[row], cfg)
        if not pieces:
            dropped += 1
            continue
        cut_docs, pieces_made = cut_docs + 1, pieces_made + len(pieces)
        for j, piece in enumerate(pieces):
            out.append({**record, "id": f"{record['id']}#{j}" if len(pieces) > 1 else record["id"], text_field: piece})
    write_shard(out_path, out, like=in_path)
    size = lambda rs: sum(len(r[text_field].encode("utf-8")) for r in rs)  # noqa: E731
    return {"docs_in": len(records), "docs_out": len(out), "bytes_in": size(records), "bytes_out": size(out),
            "dropped": {"contaminated": dropped} if dropped else {}, "cut": cut_docs, "pieces": pieces_made,
            "hits": dict(zip(names, per_task.tolist()))}
