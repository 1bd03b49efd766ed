"""Blending several sample sets by weight, greedily, so every prefix keeps every dataset's share.

Sample ``i`` of the blend goes to the dataset furthest below its target ``weight * i`` (ties to the
first such dataset); this is Megatron's rule, so a blend here picks the same datasets in the same
order as Megatron's for the same weights. A dataset of weight 0 is never drawn: at sample 1 every
error is 0, and Megatron's helper, taking the first, gives one sample to a weight-0 dataset listed
first (a source switched off would still be opened and trained on). At every prefix of ``N``
samples each dataset's count stays within about one sample of ``weight * N``. The rule is
sequential by nature (each choice depends on every earlier one) and does not vectorise, so it runs
as a small C loop, compiled on first use into the user's cache directory and called through ctypes,
as fast as megatron-core's helper; without a working C compiler the same loop runs in Python (about
30x slower, identical output) and says so in one line on stderr, once per process, naming the
compiler it looked for.

Config: ``data.blend: [[weight, prefix], ...]``, or ``data.blend_preset: NAME`` with
``data.blend_root`` for a named preset in ``configs/blends/NAME.yaml``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

import numpy as np

from data_pipeline.gpt_samples import GPTSamples
from data_pipeline.index_cache import cached_arrays, default_cache_dir
from data_pipeline.indexed import IndexedDataset
from data_pipeline.paths import listed_twice
from data_pipeline.shard_files import idx_sha256, shard_identity, tokens_digest
from data_pipeline.typed_config import coerce
from data_pipeline.yaml_files import read_yaml_mapping

BLEND_RULE = 2  # 2: a dataset of weight 0 is never drawn (1 gave one listed first a sample)
MAX_DATASETS = np.iinfo(np.int16).max + 1
"""Datasets a blend can name: ``dataset_index`` is int16 (Megatron's format), so more would wrap."""
PRESET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "blends")


def normalise_weights(weights) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0 or not np.isfinite(w).all():
        raise ValueError(f"blend weights must be a non-empty list of non-negative numbers with a positive sum, got {list(weights)}")
    return w / w.sum()


_BLEND_C = r"""
#include <stdint.h>
void greedy_blend(const double *w, int64_t n, int64_t size, int16_t *dataset_index, int64_t *sample_index,
                  int64_t *counts) {
    for (int64_t i = 0; i < size; i++) {
        double x = i > 1 ? (double)i : 1.0;
        int64_t best = -1;
        double best_err = 0.0;
        for (int64_t d = 0; d < n; d++) {
            if (w[d] <= 0.0) continue;
            double err = w[d] * x - (double)counts[d];
            if (best < 0 || err > best_err) { best = d; best_err = err; }
        }
        dataset_index[i] = (int16_t)best;
        sample_index[i] = counts[best];
        counts[best] += 1;
    }
}
"""


def greedy_blend(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``size`` samples: which dataset it comes from, and that dataset's sample number."""
    w = normalise_weights(weights)
    helper = compiled_blend()
    if helper is None:
        return greedy_blend_python(w, size)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    counts = np.zeros(len(w), dtype=np.int64)
    helper(np.ascontiguousarray(w, dtype=np.float64), len(w), size, dataset_index, sample_index, counts)
    return dataset_index, sample_index


def greedy_blend_python(w: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The same loop in Python, for machines without a C compiler."""
    w = [float(x) for x in w]
    n = len(w)
    counts = [0] * n
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    drawn = [d for d in range(n) if w[d] > 0]
    for i in range(size):
        x = float(i) if i > 1 else 1.0
        best, best_err = -1, 0.0
        for d in drawn:
            err = w[d] * x - counts[d]
            if best < 0 or err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


@functools.cache
def compiled_blend():
    """The C loop as a ctypes function, or None (after one warning line) where no C compiler works.

    Built with ``-ffp-contract=off`` so ``w * x - count`` rounds twice, as Python's arithmetic does
    (a fused multiply-add could break a tie differently). The library is named by the source's hash
    and written under a temporary name, so concurrent first uses (every rank) cannot collide.
    """
    name = os.environ.get("CC", "cc")
    compiler = shutil.which(name)
    if compiler is None:
        _warn_python_fallback(f"no C compiler {name!r} on PATH (install gcc or set CC)")
        return None
    tag = hashlib.sha256(_BLEND_C.encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megazero")
    library = os.path.join(cache, f"blend-{tag}.so")
    try:
        if not os.path.isfile(library):
            os.makedirs(cache, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                source, built = os.path.join(tmp, "blend.c"), os.path.join(tmp, "blend.so")
                with open(source, "w") as f:
                    f.write(_BLEND_C)
                subprocess.run([compiler, "-O3", "-ffp-contract=off", "-shared", "-fPIC", "-o", built, source],
                               check=True, capture_output=True, timeout=60)
                os.replace(built, library)
        fn = ctypes.CDLL(library).greedy_blend
    except (OSError, subprocess.SubprocessError) as exc:
        detail = exc.stderr.decode(errors="replace").strip().splitlines() if getattr(exc, "stderr", None) else []
        _warn_python_fallback(f"the C compiler {compiler} failed ({detail[0] if detail else exc})")
        return None
    array = np.ctypeslib.ndpointer
    fn.argtypes = [array(np.float64, flags="C"), ctypes.c_int64, ctypes.c_int64, array(np.int16, flags="C"),
                   array(np.int64, flags="C"), array(np.int64, flags="C")]
    fn.restype = None
    return fn


def _warn_python_fallback(why: str) -> None:
    """Say that the slow loop will run, and why; once per process, since ``compiled_blend`` is cached."""
    print(f"megazero: warning: {why}; the blend index is built by the Python loop instead, about 30x slower "
          "(about 1 s per million samples and 15 datasets, paid once and cached)", file=sys.stderr)


class BlendedSamples:
    """Samples drawn from several ``GPTSamples`` in the greedy blend order."""

    def __init__(self, datasets: list, dataset_index: np.ndarray, sample_index: np.ndarray) -> None:
        self.datasets = datasets
        self.dataset_index = dataset_index
        self.sample_index = sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]


def build_blended_samples(blend: list, seq_len: int, num_samples: int, seed: int, split: str = "1",
                          which: str = "train", cache_dir: str | None = None) -> BlendedSamples:
    """``blend`` is ``[[weight, prefix], ...]``; each dataset gets exactly the samples the blend takes.
    The indices are cached in ``cache_dir``, by default beside the first dataset drawn from (one of
    weight 0 is never read, and its folder may not exist)."""
    weights, prefixes = parse_blend(blend)
    cache_dir = cache_dir or default_cache_dir(next(p for w, p in zip(weights, prefixes) if w > 0))
    description = {"rule": BLEND_RULE, "weights": [float(w) for w in normalise_weights(weights)], "size": num_samples}
    arrays = cached_arrays(cache_dir, "blend", description, ("dataset_index", "sample_index"),
                           lambda: dict(zip(("dataset_index", "sample_index"), greedy_blend(weights, num_samples))))
    counts = np.bincount(arrays["dataset_index"], minlength=len(prefixes))
    datasets = [GPTSamples(IndexedDataset(p), seq_len, int(c), seed, split, which, cache_dir) if c else None
                for p, c in zip(prefixes, counts)]
    return BlendedSamples(datasets, arrays["dataset_index"], arrays["sample_index"])


def parse_blend(blend: list) -> tuple[list[float], list[str]]:
    """Validate ``[[weight, prefix], ...]`` and split it into weights and prefixes."""
    if not isinstance(blend, (list, tuple)) or not blend:
        raise ValueError(f"data.blend must be a non-empty list of [weight, prefix] pairs, got {blend!r}")
    if len(blend) > MAX_DATASETS:
        raise ValueError(f"data.blend lists {len(blend)} datasets, more than {MAX_DATASETS} (a sample's dataset is "
                         "stored in 16 bits, as Megatron's); join small datasets first (`megazero preprocess --merge`)")
    weights, prefixes = [], []
    for entry in blend:
        pair = isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str)
        weight = blend_weight(entry[0]) if pair else None
        if weight is None:
            raise ValueError(f"data.blend entry {entry!r} must be [weight, prefix], its weight a number (unquoted), "
                             "e.g. [0.3, data/web_text_document]")
        weights.append(weight)
        prefixes.append(entry[1])
    repeat = listed_twice((("data.blend entry", prefix) for prefix in prefixes), key=shard_identity)
    if repeat:  # the same data twice: each entry would serve every sample again
        raise ValueError(f"{repeat}; give it once, with the weights summed")
    normalise_weights(weights)
    return weights, prefixes


def copied_dataset(prefixes: list[str]) -> str | None:
    """``"B holds the tokens of A"`` for the first dataset that is a byte copy of an earlier one (a
    shard copied under another name, which ``parse_blend``'s check of the files' identity cannot
    see): like an entry listed twice, it would serve every sample of its order again. Only shards of
    a ``.bin`` size another shares are read, each once: its ``.idx`` digest (which the run's start-up
    reads anyway) and ``tokens_digest``."""
    sizes: dict[str, int] = {}
    for prefix in prefixes:
        try:
            sizes[prefix] = os.path.getsize(f"{prefix}.bin")
        except OSError:
            continue  # its own check names it
    shared = Counter(sizes.values())
    first_of: dict[tuple, str] = {}
    for prefix, size in sizes.items():
        if shared[size] < 2:
            continue
        try:
            key = (size, idx_sha256(prefix)[0], tokens_digest(prefix))
        except OSError:
            continue
        if key in first_of:
            return f"{prefix} holds the tokens of {first_of[key]}"
        first_of[key] = prefix
    return None


def blend_weight(value) -> float | None:
    """A blend entry's weight as a float, or None where it is no number, as for every float field of
    the config (``coerce``): YAML 1.1's string ``5e-1`` counts, a quoted ``"1"`` does not."""
    try:
        return coerce(value, float, "weight")
    except ValueError:
        return None


def resolve_blend(blend: list | None, preset: str | None, root: str | None) -> list:
    """The ``[[weight, prefix], ...]`` a run trains on, from ``data.blend`` or ``data.blend_preset``."""
    if (blend is None) == (preset is None):
        raise ValueError("set exactly one of data.blend ([[weight, prefix], ...]) and data.blend_preset (e.g. mtnlg530b)")
    if preset is not None:
        if not root:
            raise ValueError(f"data.blend_preset {preset!r} needs data.blend_root, the directory holding its datasets")
        blend = load_blend_preset(preset, root)
    parse_blend(blend)
    return [[float(w), p] for w, p in blend]


def load_blend_preset(name: str, root: str) -> list:
    """A preset's ``[[weight, prefix], ...]`` with each dataset name placed under ``root``; a preset
    that is not such a list is an error naming the file and the entry."""
    path = name if name.endswith((".yaml", ".yml")) else os.path.join(PRESET_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".yaml")) if os.path.isdir(PRESET_DIR) else []
        raise ValueError(f"blend preset {name!r} not found (looked for {path}); known presets: {known}")
    entries = read_yaml_mapping(path, "with a 'datasets' list of [weight, name] pairs").get("datasets")
    if not entries or not isinstance(entries, list):
        raise ValueError(f"{path}: a blend preset needs a 'datasets' list of [weight, name] pairs")
    blend = []
    for i, entry in enumerate(entries):
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)
        weight = blend_weight(entry[0]) if ok else None
        if weight is None or not weight > 0:
            raise ValueError(f"{path}: datasets[{i}] is {entry!r}; each entry is [weight, name] with a "
                             "positive weight (a number, unquoted) and a dataset name")
        blend.append([weight, os.path.join(root, entry[1])])
    return blend
