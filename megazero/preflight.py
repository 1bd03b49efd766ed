"""Checks of what a run is about to meet -- device and its memory, data, tokenizer, directories -- before it starts.

``megazero.config.validate`` judges a config on its own; these checks look at the machine and the
files it names, so they live apart. They run in ``megazero train --check`` and at the start of every
run, before any process group exists, and report every problem at once: a launch that would fail
at its first step, or worse train on data that does not fit the model, fails here instead, before
the run directory is touched and before hours of compute are spent.

The one expensive check (the largest token id in the data, a pass over every shard cached on disk)
runs on one rank only: the data is shared, and a failing rank ends the whole launch anyway.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from data_pipeline.paths import nearest_existing

from megazero.config import Config
from megazero.errors import ConfigError
from megazero.resume_checks import checkpoint_problems


@dataclass(frozen=True)
class DataFacts:
    """What the checks learned about the data, for the caller to report."""

    prefixes: tuple[str, ...]
    largest_token_id: Optional[int]  # None where the scan was not run (on ranks other than the checker)
    tokenizer_vocab: Optional[int]


def check_run(cfg: Config, *, scan_data: bool = True, checkpoint_files: bool = True, locks: bool = True,
              own_job: Optional[str] = None, ranks_per_node: Optional[int] = None) -> DataFacts:
    """Raise one ``ConfigError`` listing every problem with the device, its memory, data, tokenizer
    and directories of ``cfg`` (resolved: ``parallel.dp`` set); ``scan_data`` also reads every shard's
    tokens (cached) to check the largest id against the model's vocabulary; ``checkpoint_files``
    looks at every file of the checkpoint to resume (the ranks that report do, one a node, as
    ``--check`` does: every rank looking at every rank's file would load a shared filesystem with
    world² requests); ``locks`` asks whether another live job holds the run or checkpoint directory
    (the reporting ranks ask: the checkpoint checks they would run next would speak of that job's
    run). ``own_job`` is given on ranks other than 0 (``run_lock.job_identity``): they take no lock
    and may find their own rank 0's, which is not another's; and another job's lock only skips their
    checkpoint checks, for rank 0 decides whether it is in use (a dead holder on rank 0's host is
    taken over at once, where another host waits out its heartbeat);
    ``ranks_per_node`` keeps the suggested layout's tensor groups within a node."""
    busy = _busy_problems(cfg, own_job) if locks else []
    problems = list(busy) if own_job is None else []  # a copy: busy is asked again below
    problems += _device_problems(cfg) + _stop_problems(cfg) + _index_problems(cfg)
    problems += _memory_problems(cfg, ranks_per_node) + _offload_problems(cfg, ranks_per_node)
    problems += _recompute_problems(cfg)
    prefixes, data_problems = _data_prefixes(cfg)
    problems += data_problems
    tokenizer, tokenizer_problems = _tokenizer(cfg)
    problems += tokenizer_problems + _tokenizer_origin_problems(cfg, prefixes, tokenizer)
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    largest = None
    if scan_data and prefixes and not data_problems:
        largest, scan_problems = _largest_token_id(cfg, prefixes, tokenizer)
        problems += scan_problems
    problems += _directory_problems(cfg)
    if not busy:  # else the checkpoint is the live job's, and its checks would speak of that job's run
        problems += checkpoint_problems(cfg, every_file=checkpoint_files)
    problems += _logger_problems(cfg)
    if problems:
        raise ConfigError("\n".join(problems))
    return DataFacts(tuple(prefixes), largest, vocab)


def _stop_problems(cfg: Config) -> list[str]:
    """A run given ``train_tokens`` with ``train_steps`` also set stops at whichever comes first and
    decays its learning rate over the steps; ``train_steps`` has a default, so a run meant to go by
    tokens stopped at step 100. Checked for a run only: a checkpoint of such a run still converts."""
    t = cfg.train
    if t.train_steps is None or t.train_tokens is None:
        return []
    return [f"train.train_tokens: {t.train_tokens} is set and so is train.train_steps ({t.train_steps}); the run "
            "would stop at whichever comes first and decay its learning rate over train_steps; to train by tokens "
            "set train.train_steps null (and schedule.decay_steps), else unset train.train_tokens"]


def _index_problems(cfg: Config) -> list[str]:
    """A run whose sample indices cannot fit the host's memory: the data does not bound them
    (samples repeat over epochs), so a step count typed with too many zeros ended, after every
    other check, in a numpy allocation traceback; so did ``train.eval_steps``, whose validation
    index is built alike."""
    from megazero.data import eval_samples, train_samples

    t = cfg.train
    counts = {(f"train.train_steps: {t.train_steps} steps of train.global_batch_size {t.global_batch_size}"
               if t.train_steps is not None else f"train.train_tokens: {t.train_tokens} tokens"): train_samples(cfg)}
    if t.eval_interval:
        counts[f"train.eval_steps: {t.eval_steps} batches of {t.global_batch_size}"] = eval_samples(cfg)
    have = _host_memory()
    return [f"{field} are {samples:,} samples, whose index needs about {_index_bytes(samples) / 2**30:,.0f} GiB of "
            f"host memory, more than this host's {have / 2**30:,.0f} GiB; give a shorter run"
            for field, samples in counts.items() if _index_bytes(samples) > have]


def _index_bytes(samples: int) -> int:
    from data_pipeline.gpt_samples import INDEX_BYTES_PER_SAMPLE

    return samples * INDEX_BYTES_PER_SAMPLE


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _logger_problems(cfg: Config) -> list[str]:
    """The optional loggers' packages, looked up without importing them (the logger itself says the
    same, but only once the model is built)."""
    import importlib.util

    from megazero.metrics import missing_logger

    wanted = {"logging.wandb": (cfg.logging.wandb, "wandb"), "logging.tensorboard": (cfg.logging.tensorboard, "tensorboard")}
    return [missing_logger(field, package) for field, (on, package) in wanted.items()
            if on and importlib.util.find_spec(package) is None]


def _device_problems(cfg: Config) -> list[str]:
    if cfg.train.device != "cuda":
        return []
    import torch

    if torch.cuda.is_available():
        return []
    return ["train.device: is 'cuda' but no CUDA device is visible here; use --train.device cpu (or auto), or run "
            "on a machine whose GPUs this process can see (check CUDA_VISIBLE_DEVICES)"]


def _memory_problems(cfg: Config, ranks_per_node: Optional[int]) -> list[str]:
    """A layout the planner predicts cannot fit the device memory fails here, not at its first step."""
    if _device_problems(cfg):
        return []
    from megazero.planner.fit import memory_problem

    problem = memory_problem(cfg, ranks_per_node)
    return [problem] if problem else []


def _offload_problems(cfg: Config, ranks_per_node: Optional[int]) -> list[str]:
    """The optimizer states offloaded by the ranks of one node (``ranks_per_node``; one where the
    launch does not say) against this host's memory."""
    from megazero.planner.memory import offloaded_bytes

    ranks = ranks_per_node or 1
    need, have = offloaded_bytes(cfg) * ranks, _host_memory()
    if need <= have:
        return []
    return [f"zero.offload_optimizer: the optimizer states offloaded by {ranks} rank(s) of a node need about "
            f"{need / 2**30:,.1f} GiB of host memory (fp32 master, its gradient and two Adam moments), more than "
            f"this host's {have / 2**30:,.1f} GiB; add data-parallel ranks (each holds a 1/dp share) or use "
            "hosts with more memory"]


def _recompute_problems(cfg: Config) -> list[str]:
    """A recompute the engine would refuse once the blocks are built (after the process group and
    the data have started) is refused here, with the engine's message."""
    if _device_problems(cfg):
        return []
    import torch

    from megazero.engine import RECOMPUTE_REPLAY_PROBLEM
    from megazero.planner.search import recompute_refused

    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    return [RECOMPUTE_REPLAY_PROBLEM] if recompute_refused(cfg, on_cuda=on_cuda) else []


def _data_prefixes(cfg: Config) -> tuple[list[str], list[str]]:
    """The prefixes of the shards the run samples from, each opened (which checks its header and
    sizes). A dataset of weight 0 is never read (``blend``), so nothing of it is checked: neither
    its files, nor its tokenizer record, nor its token ids could change the run."""
    from data_pipeline.blend import copied_dataset, parse_blend, resolve_blend
    from data_pipeline.gpt_samples import parse_split
    from data_pipeline.indexed import IndexedDataset

    d = cfg.data
    if d.blend is None and d.blend_preset is None:
        return [], ["data.blend: no training data; give [[weight, prefix], ...] of preprocessed datasets "
                    "(megazero preprocess) or data.blend_preset with data.blend_root"]
    if d.blend_preset is not None and d.blend_root and not os.path.isdir(d.blend_root):  # one line, not one a dataset
        return [], [f"data.blend_root: {d.blend_root} is not a directory; give the directory holding the datasets "
                    f"of data.blend_preset {d.blend_preset}"]
    try:
        weights, prefixes = parse_blend(resolve_blend(d.blend, d.blend_preset, d.blend_root))
    except (ValueError, OSError) as exc:
        return [], [f"data.blend: {exc}"]
    problems = []
    try:
        shares = parse_split(d.split)
        if shares[0] == 0:
            problems.append(f"data.split: {d.split!r} leaves no documents for training; give the first (training) "
                            "share a positive weight, e.g. 969,30,1")
        if shares[1] == 0 and cfg.train.eval_interval:
            problems.append(f"data.split: {d.split!r} leaves no documents for validation, and train.eval_interval "
                            f"{cfg.train.eval_interval} evaluates; give the second share a positive weight, e.g. "
                            "969,30,1, or set train.eval_interval 0")
    except ValueError as exc:
        problems.append(f"data.split: {exc}")
    sampled = [(prefix, used) for prefix, used in zip(prefixes, _splits_sampled(weights, cfg)) if used]
    for prefix, used in sampled:
        try:
            problems += _split_problems(IndexedDataset(prefix), cfg, used)
        except (ValueError, OSError) as exc:
            problems.append(f"data.blend: {exc}")
    copy = copied_dataset([prefix for prefix, _ in sampled])
    if copy:
        problems.append(f"data.blend: {copy} (a copy: the same index, the same tokens); list it once, with the "
                        "weights summed")
    return [prefix for prefix, _ in sampled], problems


def _splits_sampled(weights: list[float], cfg: Config) -> list[tuple[str, ...]]:
    """The splits the run draws samples from, per dataset of the blend: training where its weight is
    positive, and validation where the evaluation's blend (``eval_steps`` batches) takes any of it."""
    from data_pipeline.blend import greedy_blend
    from megazero.data import eval_samples

    valid = set()
    if cfg.train.eval_interval and _index_bytes(eval_samples(cfg)) > _host_memory():  # _index_problems says so
        valid = {i for i, w in enumerate(weights) if w > 0}
    elif cfg.train.eval_interval:
        valid = set(greedy_blend(weights, eval_samples(cfg))[0].tolist())
    return [(("train",) if w > 0 else ()) + (("valid",) if i in valid else ()) for i, w in enumerate(weights)]


def _split_problems(data, cfg: Config, used: tuple[str, ...]) -> list[str]:
    """Each split the run samples from (``used``) must hold documents, and one sample of
    ``seq_length + 1`` tokens; found here rather than while the run builds its indices, after its
    launch (an evaluation split left empty by the split's rounding on a small dataset, say)."""
    from data_pipeline.gpt_samples import SPLIT_NAMES, parse_split, samples_in, split_ranges

    seq = cfg.model.seq_length
    try:
        ranges, shares = dict(zip(SPLIT_NAMES, split_ranges(cfg.data.split, len(data)))), parse_split(cfg.data.split)
    except ValueError:
        return []  # data.split itself is reported by its own check
    if len(data) == 0:  # no split can help: megazero never writes one, another tool may have
        return [f"data.blend: {data.prefix} holds no documents; preprocess it again, or leave it out of the blend"]
    problems = []
    for which in used:
        start, end = ranges[which]
        if end <= start and shares[SPLIT_NAMES.index(which)] > 0:  # a share of 0 is reported once, for all
            problems.append(f"data.split: {cfg.data.split!r} leaves {data.prefix} no documents for {which} "
                            f"({len(data)} documents in all); give that split more of data.split, or leave the "
                            "dataset out of the blend" + ("" if which == "train" else " (or train.eval_interval 0)"))
        tokens = int(data.sizes[start:end].sum(dtype="int64"))
        if end > start and samples_in(tokens, seq) == 0:
            problems.append(f"model.seq_length: a sample of {seq} needs {seq}+1 tokens, and {data.prefix}'s {which} "
                            f"split holds {tokens} ({end - start} documents); lower it, or give that split more of "
                            "data.split")
    return problems


def _tokenizer_origin_problems(cfg: Config, prefixes: list[str], tokenizer) -> list[str]:
    """The shards must share the tokenizer they record (``shard_origin``), and be of ``data.tokenizer``
    (``tokenizer``, loaded; None when unset or unreadable) when it is set: ids of another tokenizer
    within the vocabulary pass every other check. The model must hold that tokenizer's vocabulary."""
    from data_pipeline.shard_origin import common_origin, describe, tokenizer_mismatch

    try:
        origin = common_origin(prefixes)
    except (ValueError, OSError) as exc:
        return [f"data.blend: {exc}"]
    mismatch = tokenizer_mismatch(*origin, tokenizer) if origin is not None and tokenizer is not None else None
    problems = [f"data.tokenizer: {mismatch}"] if mismatch else []
    if origin is not None and origin[1]["vocab_size"] > cfg.model.vocab_size:  # caught here, not at generation
        problems.append(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the {origin[1]['vocab_size']} "
                        f"tokens of the tokenizer {origin[0]} records ({describe(origin[1])}); set "
                        f"model.vocab_size {origin[1]['vocab_size']}")
    return problems


def _tokenizer(cfg: Config) -> tuple:
    """(``data.tokenizer`` loaded, or None when unset or unreadable; its problems)."""
    path = cfg.data.tokenizer
    if path is None:
        return None, []
    from data_pipeline.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(path)
    except (ValueError, OSError) as exc:
        return None, [f"data.tokenizer: {exc}"]
    vocab = tokenizer.vocab_size
    if vocab > cfg.model.vocab_size:
        return tokenizer, [f"model.vocab_size: {cfg.model.vocab_size} is smaller than the {vocab} tokens of "
                           f"data.tokenizer {path}; set model.vocab_size {vocab} (or auto)"]
    return tokenizer, []


def _largest_token_id(cfg: Config, prefixes: list[str], tokenizer) -> tuple[Optional[int], list[str]]:
    """Each shard's largest id against the model's vocabulary, the tokenizer the shard records and
    ``data.tokenizer`` (``tokenizer``, loaded, or None): a model padded past its tokenizer (50,257
    tokens in 50,304 rows) would take ids no tokenizer made, and a shard rewritten after its record
    claims a tokenizer it was not made with."""
    from data_pipeline.token_range import largest_token_id
    from data_pipeline.shard_origin import describe, read_origin

    problems, largest = [], -1
    for prefix in prefixes:
        try:
            found = largest_token_id(prefix, cfg.data.cache_dir)
        except ValueError as exc:
            problems.append(f"data.blend: {exc}")
            continue
        except OSError as exc:  # the index cache beside read-only data cannot be written
            problems.append(f"data.cache_dir: cannot cache facts about {prefix} ({exc}); set data.cache_dir to "
                            "a writable directory")
            continue
        largest = max(largest, found)
        try:
            record = read_origin(prefix)
        except (ValueError, OSError):
            record = None  # a damaged or stale record: reported by the tokenizer-origin check
        if record is not None and found >= record["vocab_size"]:
            problems.append(f"data.blend: {prefix} holds token id {found} but records its tokenizer as "
                            f"{describe(record)}: the shard is not what its record says (rewritten since it was "
                            "made?); preprocess it again")
        elif tokenizer is not None and found >= tokenizer.vocab_size:
            problems.append(f"data.blend: {prefix} holds token id {found}, beyond the {tokenizer.vocab_size} tokens "
                            f"of data.tokenizer {cfg.data.tokenizer}; the data was tokenized with another "
                            "tokenizer: preprocess it with this one, or set data.tokenizer to the one it was made with")
        if found >= cfg.model.vocab_size:
            problems.append(f"data.blend: {prefix} holds token id {found} but model.vocab_size is "
                            f"{cfg.model.vocab_size}; the data was tokenized with a larger vocabulary: set "
                            f"model.vocab_size to at least {found + 1} (or auto with data.tokenizer), or "
                            "preprocess the data with this model's tokenizer")
    return largest, problems


def _busy_problems(cfg: Config, own_job: Optional[str]) -> list[str]:
    """The run's directories (``run_locks``) must not be held by another live job."""
    from megazero.run_lock import run_locks

    locks = run_locks(cfg.logging.run_dir, cfg.save_dir)
    return [message for message in (lock.busy(own_job) for lock in locks) if message]


def _directory_problems(cfg: Config) -> list[str]:
    """The run directory and the checkpoint directory must be writable before the first step: a
    read-only save_dir found at the first save loses all the training before it."""
    problems = []
    run_dir = cfg.logging.run_dir
    problem = _unwritable(run_dir)
    if problem:
        problems.append(f"logging.run_dir: {run_dir} {problem}; choose a directory this user can write")
    save_dir = cfg.checkpoint.save_dir
    if save_dir is not None:
        problem = _unwritable(save_dir)
        if problem:
            problems.append(f"checkpoint.save_dir: {save_dir} {problem}; choose a directory this user can write")
    return problems


def _unwritable(path: str) -> Optional[str]:
    """Why ``path`` cannot be a directory this process writes into, or None. Creates nothing: the
    nearest existing ancestor is checked when ``path`` does not exist yet."""
    probe = nearest_existing(path)
    if not os.path.isdir(probe):
        return f"cannot be created: {probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return "is not writable" if probe == os.path.abspath(path) else f"cannot be created ({probe} is not writable)"
    if _read_only_mount(probe):
        return f"is on a read-only filesystem ({probe})"
    return None


def _read_only_mount(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False
