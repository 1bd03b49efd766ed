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
from dataclasses import dataclass, replace
from typing import Optional

from data_pipeline.paths import nearest_existing

from megazero.checkpoint import CheckpointError, earlier_instead, read_manifest, start_checkpoint, verify_file
from megazero.config import Config
from megazero.config.loader import config_to_dict
from megazero.errors import ConfigError


@dataclass(frozen=True)
class DataFacts:
    """What the checks learned about the data, for the caller to report."""

    prefixes: tuple[str, ...]
    largest_token_id: Optional[int]  # None where the scan was not run (on ranks other than the checker)
    tokenizer_vocab: Optional[int]


def check_run(cfg: Config, *, scan_data: bool = True, checkpoint_files: bool = True,
              ranks_per_node: Optional[int] = None) -> DataFacts:
    """Raise one ``ConfigError`` listing every problem with the device, its memory, data, tokenizer
    and directories of ``cfg`` (resolved: ``parallel.dp`` set); ``scan_data`` also reads every shard's
    tokens (cached) to check the largest id against the model's vocabulary; ``checkpoint_files``
    looks at every file of the checkpoint to resume (the ranks that report do, one a node, as
    ``--check`` does: every rank looking at every rank's file would load a shared filesystem with
    world² requests); ``ranks_per_node`` keeps the suggested layout's tensor groups within a node."""
    problems = _device_problems(cfg) + _stop_problems(cfg) + _index_problems(cfg)
    problems += _memory_problems(cfg, ranks_per_node) + _recompute_problems(cfg)
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
    problems += _checkpoint_problems(cfg, every_file=checkpoint_files)
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
    other check, in a numpy allocation traceback."""
    from data_pipeline.gpt_samples import INDEX_BYTES_PER_SAMPLE
    from megazero.data import train_samples

    samples = train_samples(cfg)
    need, have = samples * INDEX_BYTES_PER_SAMPLE, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need <= have:
        return []
    t = cfg.train
    field = (f"train.train_steps: {t.train_steps} steps of train.global_batch_size {t.global_batch_size}"
             if t.train_steps is not None else f"train.train_tokens: {t.train_tokens} tokens")
    return [f"{field} are {samples:,} samples, whose index needs about {need / 2**30:,.0f} GiB of host memory, "
            f"more than this host's {have / 2**30:,.0f} GiB; give a shorter run"]


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
    """The training shards' prefixes, each opened (which checks its header and sizes)."""
    from data_pipeline.blend import parse_blend, resolve_blend
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
    for prefix, used in zip(prefixes, _splits_sampled(weights, cfg)):
        try:
            problems += _split_problems(IndexedDataset(prefix), cfg, used)
        except (ValueError, OSError) as exc:
            problems.append(f"data.blend: {exc}")
    return prefixes, problems


def _splits_sampled(weights: list[float], cfg: Config) -> list[tuple[str, ...]]:
    """The splits the run draws samples from, per dataset of the blend: training where its weight is
    positive, and validation where the evaluation's blend (``eval_steps`` batches) takes any of it."""
    from data_pipeline.blend import greedy_blend

    valid = set()
    if cfg.train.eval_interval:
        valid = set(greedy_blend(weights, cfg.train.eval_steps * cfg.train.global_batch_size)[0].tolist())
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
    from data_pipeline.indexed import largest_token_id
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


# Model fields that decide parameter shapes and meaning: a checkpoint cannot move across them
# (``rope_theta`` only where rotary embeddings use it).
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                       "seq_length", "position_embedding", "rope_theta", "norm", "norm_eps", "activation",
                       "tie_embeddings", "bias")


def _checkpoint_problems(cfg: Config, every_file: bool = True) -> list[str]:
    """The checkpoint the run will resume from must be complete, intact in its record, hold every file
    it lists at its recorded size (with ``every_file``, a stat each, so that ``--check`` finds a file
    cut short or gone, as the load would), and be of this model; its files' checksums are verified
    as they are loaded."""
    try:
        ckpt, where = start_checkpoint(cfg.checkpoint.load, cfg.save_dir)
    except CheckpointError as exc:  # it names the setting
        return [str(exc)]
    if ckpt is None:
        return []
    try:
        manifest = read_manifest(ckpt)
        for name, entry in manifest["files"].items() if every_file else ():
            verify_file(ckpt, name, entry, sha256=False)
        meta = manifest["meta"]
        saved = meta["config"]
        saved_model = saved["model"]
    except CheckpointError as exc:
        return [f"{where}: {exc}{earlier_instead(ckpt, where)}"]
    except (KeyError, TypeError):
        return [f"{where}: {ckpt} records no training config (its COMPLETE has no meta.config); it was not written "
                "by megazero train or convert: convert it again"]
    now = config_to_dict(cfg)
    rope = "rope" in (saved_model.get("position_embedding"), now["model"]["position_embedding"])
    saved_built, now_built = _as_built(saved_model, cfg), _as_built(now["model"], cfg)
    # a field is changed if it is written differently and builds differently (an unset width that a
    # changed hidden size moves is the hidden size's change, not its own)
    changed = sorted(k for k in ARCHITECTURE_FIELDS if saved_model.get(k) != now["model"][k]
                     and saved_built.get(k) != now_built[k] and (rope or k != "rope_theta"))
    if changed:
        return [f"{where}: {ckpt} was trained with a different model ({', '.join(f'model.{k}' for k in changed)}); "
                "resume with the same model section, or "
                + ("start a new run in another checkpoint.save_dir" if where == "checkpoint.save_dir"
                   else "load another checkpoint")]
    if cfg.checkpoint.allow_config_changes:
        return []
    # At step 0 (a converted checkpoint, or one reset with --reset-step) there is no data order or
    # schedule to keep, but its weights may still have been trained on another tokenizer's ids.
    if meta.get("step", 0) == 0:
        problems, older_code = _tokenizer_change(meta, cfg), []
    else:
        problems = (_resume_changes(saved, cfg, meta["step"], meta.get("consumed", 0)) + _tokenizer_change(meta, cfg)
                    + _shard_changes(meta, cfg))
        older_code = _blend_rule_change(meta, cfg)
    head, allow = f"{where}: {ckpt} (step {meta['step']})", "checkpoint.allow_config_changes true"
    return ([f"{head} {problem}; set it back, or set {allow} to resume anyway" for problem in problems]
            + [f"{head} {problem}; resume with the version that wrote it, or set {allow} to go on in the new order"
               for problem in older_code])


def _as_built(model: dict, cfg: Config) -> dict:
    """A recorded model section with an unset MLP width or key-value head count replaced by the value
    the model is built with: an imported checkpoint records both, and a config that leaves them unset
    builds the same model."""
    shape = {k: model.get(k) for k in ("hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "activation")}
    if None in (shape["hidden_size"], shape["num_heads"], shape["activation"]):
        return model  # too little recorded to build: compared as written
    built = replace(cfg.model, **shape)
    return {**model, "ffn_hidden_size": built.ffn_size, "num_kv_heads": built.kv_heads}


def _tokenizer_change(meta: dict, cfg: Config) -> list[str]:
    """Training on from a checkpoint with data of another tokenizer feeds its embedding ids that meant
    other pieces; the checkpoint records its tokenizer (``megazero.data.tokenizer_record``), and the
    data's, where the run's data names one, must be the same."""
    from data_pipeline.shard_origin import describe, same_tokenizer
    from megazero.data import recorded_tokenizer, tokenizer_record

    recorded = recorded_tokenizer(meta)
    if recorded is None:
        return []
    try:
        now = tokenizer_record(cfg)
    except ConfigError:
        return []  # reported by the data and tokenizer checks
    if now is None or same_tokenizer(recorded, now):
        return []
    return [f"was trained on ids of {describe(recorded)}, and this run's data is of {describe(now)}"]


def _shard_changes(meta: dict, cfg: Config) -> list[str]:
    """Shards the checkpoint's run trained on whose contents changed since (preprocessed again at the
    same path): its samples consumed would count through other documents. Checkpoints written
    before shards were recorded, and shards this run no longer uses, are not compared."""
    from megazero.data import shard_digests

    saved = meta.get("shards") or {}
    changed = [path for path, digest in shard_digests(cfg).items() if path in saved and saved[path] != digest]
    return [f"was trained on other contents of {path} (its .idx changed since)" for path in changed]


def _blend_rule_change(meta: dict, cfg: Config) -> list[str]:
    """A checkpoint whose run drew its blend by an older rule (``data_pipeline.blend.BLEND_RULE``;
    one without a record is of rule 1) where the rules draw differently: rule 1 gave a weight-0
    dataset listed first one sample, so every later sample of the blend sits elsewhere under rule 2,
    and the samples consumed would count through another order."""
    from data_pipeline.blend import BLEND_RULE, parse_blend, resolve_blend

    if meta.get("blend_rule", 1) == BLEND_RULE:
        return []
    try:
        weights, prefixes = parse_blend(resolve_blend(cfg.data.blend, cfg.data.blend_preset, cfg.data.blend_root))
    except (ValueError, OSError):
        return []  # the data checks name it
    if weights[0] != 0:
        return []
    return [f"drew its blend by an older rule, which took one sample of {prefixes[0]} (weight 0, listed first) "
            "and this version takes none, so every later sample comes in another order"]


def _resume_changes(saved: dict, cfg: Config, step: int, consumed: int) -> list[str]:
    """How resuming from a checkpoint of ``step`` (``consumed`` samples), written with config ``saved``,
    would silently differ from continuing its run: another data order (the samples consumed so far
    would no longer say where the run stands in it), other global batches ahead, or a jump in the
    learning rate (a longer ``train.train_steps`` stretches a decay that had ended, for one)."""
    from megazero.config.loader import build_dataclass
    from megazero.training_schedules import build_lr_schedule

    try:
        before = build_dataclass(Config, saved, prefix="")
    except (ConfigError, KeyError, TypeError, ValueError):  # a config of another schema version
        data, now = saved.get("data") or {}, config_to_dict(cfg)["data"]
        changed = [f"data.{k}" for k in DATA_ORDER_FIELDS if data.get(k) != now[k]]
        return [f"was trained on another data order ({', '.join(changed)} changed)"] if changed else []
    problems = _data_order_changes(before, cfg) + _batch_changes(before, cfg, consumed)
    was = build_lr_schedule(before.optimizer, before.schedule, before.train)(step + 1)
    will = build_lr_schedule(cfg.optimizer, cfg.schedule, cfg.train)(step + 1)
    if abs(will - was) > 1e-6 * max(abs(was), abs(will)):
        now = config_to_dict(cfg)
        fields = sorted(f"{section}.{k}" for section in ("optimizer", "schedule", "train")
                        for k in ("lr", "min_lr", "warmup_steps", "decay_steps", "decay_style", "train_steps")
                        if k in now[section] and saved.get(section, {}).get(k) != now[section][k])
        decay = (before.train.train_steps or 0) - before.schedule.warmup_steps
        keep = (f"; to continue its decay, set schedule.decay_steps {decay}"
                if fields == ["train.train_steps"] and before.schedule.decay_steps is None and decay > 0 else "")
        problems.append(f"would change the learning rate of step {step + 1} from {was:.4g} to {will:.4g} "
                        f"({', '.join(fields) or 'the schedule'} changed{keep})")
    return problems


def _data_order_changes(before: Config, cfg: Config) -> list[str]:
    """What changes the order of the training samples between the run that wrote a checkpoint
    (``before``) and this one: the datasets (compared by their files, not the spelling of their
    paths), weights, split or seed, or a sample count that changes a dataset's epochs."""
    from data_pipeline.blend import normalise_weights, parse_blend, resolve_blend
    from megazero.data import train_samples

    def datasets(c: Config):
        weights, prefixes = parse_blend(resolve_blend(c.data.blend, c.data.blend_preset, c.data.blend_root))
        return [(round(float(w), 12), os.path.realpath(p)) for w, p in zip(normalise_weights(weights), prefixes)]

    try:
        old, new = datasets(before), datasets(cfg)
    except (ValueError, OSError):
        old, new = None, None  # a preset gone or broken: compare what the runs name
    fields = ["data.split"] if _split_shares(before) != _split_shares(cfg) else []
    fields += ["data.seed"] if before.data.seed != cfg.data.seed else []
    if old != new or (old is None and _named_data(before) != _named_data(cfg)):
        fields.insert(0, "data.blend")
    if fields:
        return [f"was trained on another data order ({', '.join(fields)} changed)"]
    n_old, n_new = train_samples(before), train_samples(cfg)
    if n_old == n_new or new is None:
        return []
    for weight, prefix in new:
        if _epochs_change(prefix, weight, cfg, n_old, n_new):
            return [f"was trained on another data order: {n_new} training samples in all instead of {n_old} "
                    f"(train.train_steps, train_tokens or global_batch_size) take {prefix} through another number "
                    "of epochs, or another share of its last, which reshuffles every sample"]
    return []


def _batch_changes(before: Config, cfg: Config, consumed: int) -> list[str]:
    """The first step ahead whose global batch differs between the run that wrote the checkpoint
    (``before``) and this one with the same batch settings: a ramp-up rounds each step's batch to a
    multiple of micro_batch_size x dp, so another layout mid ramp-up groups the samples ahead into
    other steps (a changed batch or ramp setting is a change the config states). The sizes are
    followed to the ramp's end."""
    from megazero.training_schedules import build_batch_schedule

    settings = [("train", "global_batch_size")] + [("schedule", k) for k in RAMPUP_FIELDS]
    if any(getattr(getattr(before, sec), k) != getattr(getattr(cfg, sec), k) for sec, k in settings):
        return []
    try:
        old = build_batch_schedule(before.schedule, before.train, before.parallel.dp or 1)
        new = build_batch_schedule(cfg.schedule, cfg.train, cfg.parallel.dp or 1)
    except ConfigError:
        return []  # the config's own check names it
    at = consumed
    while old.start is not None and at < old.rampup_samples:
        was, will = old.global_batch(at), new.global_batch(at)
        if was != will:
            layout = [f for f, a, b in (("parallel.dp", before.parallel.dp, cfg.parallel.dp),
                                        ("train.micro_batch_size", before.train.micro_batch_size,
                                         cfg.train.micro_batch_size)) if a != b]
            return [f"would train the step at sample {at} on a global batch of {will} instead of {was}: the batch "
                    f"ramp-up rounds each step's batch to a multiple of micro_batch_size x dp, and "
                    f"{' and '.join(layout)} changed"]
        at += was
    return []


RAMPUP_FIELDS = ("rampup_start_batch", "rampup_increment", "rampup_samples")


def _split_shares(c: Config):
    """The shares ``data.split`` gives train, validation and test, which alone place each split's
    documents (``split_ranges``): ``1`` and ``1,0,0`` are one split. Its text where it does not parse."""
    from data_pipeline.gpt_samples import parse_split

    try:
        return parse_split(c.data.split)
    except ValueError:
        return c.data.split


# The data fields a run's sample order follows (with its total sample count).
DATA_ORDER_FIELDS = ("blend", "blend_preset", "blend_root", "split", "seed")


def _named_data(c: Config) -> tuple:
    """The blend as the config names it (split and seed are compared on their own)."""
    return tuple(getattr(c.data, k) for k in DATA_ORDER_FIELDS if k not in ("split", "seed"))


def _epochs_change(prefix: str, weight: float, cfg: Config, n_old: int, n_new: int) -> bool:
    """Whether ``weight``'s share of ``n_old`` and of ``n_new`` training samples (exact for one
    dataset; a blend's greedy shares are within one of it) take the dataset at ``prefix`` through
    different epochs. A dataset the run does not sample, or cannot open (its own check says why),
    changes nothing here."""
    from data_pipeline.gpt_samples import SPLIT_NAMES, epoch_plan, samples_in, split_ranges
    from data_pipeline.indexed import IndexedDataset

    seq = cfg.model.seq_length
    try:
        data = IndexedDataset(prefix)
        start, end = split_ranges(cfg.data.split, len(data))[SPLIT_NAMES.index("train")]
    except (ValueError, OSError):
        return False
    tokens = int(data.sizes[start:end].sum(dtype="int64"))
    if weight == 0 or samples_in(tokens, seq) == 0:
        return False
    spread = (0, 0) if weight == 1 else (-1, 2)
    plans = {epoch_plan(tokens, seq, max(int(weight * n) + d, 1)) for n in (n_old, n_new) for d in spread}
    return len(plans) > 1
