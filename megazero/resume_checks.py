"""Checks of the checkpoint a run will resume from, before it starts: that it is whole, of this model,
and that resuming would continue its run rather than silently start another (another data order,
other batches ahead, another learning rate, another tokenizer's ids, changed shards).

``megazero.preflight`` runs them with the checks of the device, data and directories; they live
apart because they compare two configs (the checkpoint's and this run's), which the other checks
never do.
"""

from __future__ import annotations

import os
from dataclasses import replace

from megazero.checkpoint import CheckpointError, earlier_instead, read_manifest, start_checkpoint, verify_file
from megazero.config import Config
from megazero.config.loader import config_to_dict
from megazero.errors import ConfigError


# Model fields that decide parameter shapes and meaning: a checkpoint cannot move across them
# (``rope_theta`` only where rotary embeddings use it).
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                       "seq_length", "position_embedding", "rope_theta", "norm", "norm_eps", "activation",
                       "tie_embeddings", "bias")


def checkpoint_problems(cfg: Config, every_file: bool = True) -> list[str]:
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
    missing = _meta_problem(meta)
    if missing:
        return [f"{where}: {ckpt}: its COMPLETE's meta {missing}, which a resume reads; it was not written by megazero "
                f"train or convert: convert it again{earlier_instead(ckpt, where)}"]
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
    head, allow = f"{where}: {ckpt} (step {meta['step']})", "checkpoint.allow_config_changes true"
    # Even at step 0 (a converted checkpoint, or one reset with --reset-step), which has no data order
    # or schedule to keep, the weights may have been trained on another tokenizer's ids; a change of
    # data order or schedule allowed is no leave to change what the ids mean.
    tokenizer = ([] if cfg.checkpoint.allow_tokenizer_change else
                 [f"{head} {problem}; train on data of the checkpoint's tokenizer, or set "
                  "checkpoint.allow_tokenizer_change true to change tokenizers on purpose"
                  for problem in _tokenizer_change(meta, cfg)])
    if cfg.checkpoint.allow_config_changes or meta.get("step", 0) == 0:
        return tokenizer
    problems = (_resume_changes(saved, cfg, meta["step"], meta.get("consumed", 0), meta.get("shards") or {},
                                meta.get("train_samples")) + _shard_changes(meta, cfg))
    return ([f"{head} {problem}; set it back, or set {allow} to resume anyway" for problem in problems] + tokenizer
            + [f"{head} {problem}; resume with the version that wrote it, or set {allow} to go on in the new order"
               for problem in _blend_rule_change(meta, cfg)])


def _meta_problem(meta: dict) -> str | None:
    """What of the fields a resume reads from a checkpoint's ``meta`` is missing or of another type
    (a record resealed by hand, or by a tool that got the format wrong): the run would otherwise pass
    its checks and stop at its start with a traceback."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(meta.get("layout"), dict):
        return f"has no layout record (layout {meta.get('layout')!r})"
    for key in ("step", "consumed", "skipped"):
        if key not in meta:
            return f"has no {key}"
        if not whole(meta[key]):
            return f"holds {key} {meta[key]!r}, not a whole number"
    for key in ("bad_in_row", "train_samples"):
        if not whole(meta.get(key, 0)):
            return f"holds {key} {meta.get(key)!r}, not a whole number"
    return None


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
    from megazero.data import shard_digests, shard_token_digests

    def changed(key: str, digests) -> list[str]:
        saved = meta.get(key) if isinstance(meta.get(key), dict) else {}
        return [path for path, digest in digests(cfg).items() if path in saved and saved[path] != digest]

    index_changed = changed("shards", shard_digests)
    tokens_changed = [path for path in changed("shard_tokens", shard_token_digests) if path not in index_changed]
    return ([f"was trained on other contents of {path} (its .idx changed since)" for path in index_changed]
            + [f"was trained on other contents of {path} (its tokens changed since, its .idx not: documents of "
               "equal lengths in another order?)" for path in tokens_changed])


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


def _resume_changes(saved: dict, cfg: Config, step: int, consumed: int, digests: dict | None = None,
                    built: int | None = None) -> list[str]:
    """How resuming from a checkpoint of ``step`` (``consumed`` samples; its run built its indices for
    ``built``, where it recorded that), written with config ``saved``, would silently differ from
    continuing its run: another data order (the samples consumed so far would no longer say where the
    run stands in it), other global batches ahead, or a jump in the learning rate (a longer
    ``train.train_steps`` stretches a decay that had ended, for one)."""
    from megazero.config.loader import build_dataclass, known_fields
    from megazero.training_schedules import build_lr_schedule

    try:  # a field of another version's (dropped since) must not turn the checks below off
        before = build_dataclass(Config, known_fields(Config, saved)[0], prefix="")
    except (ConfigError, KeyError, TypeError, ValueError):  # a config of another schema version
        data, now = saved.get("data") or {}, config_to_dict(cfg)["data"]
        changed = [f"data.{k}" for k in DATA_ORDER_FIELDS if data.get(k) != now[k]]
        return [f"was trained on another data order ({', '.join(changed)} changed)"] if changed else []
    problems = (_data_order_changes(before, cfg, digests or {}, (step, consumed, built))
                + batch_changes(before, cfg, consumed))
    old, new = (build_lr_schedule(c.optimizer, c.schedule, c.train) for c in (before, cfg))
    changed_at = next((s for s in _schedule_probes(before, step) if abs(new(s) - old(s)) > 1e-6 * max(abs(old(s)),
                                                                                                     abs(new(s)))), None)
    if changed_at is not None:
        was, will = old(changed_at), new(changed_at)
        now = config_to_dict(cfg)
        fields = sorted(f"{section}.{k}" for section in ("optimizer", "schedule", "train")
                        for k in ("lr", "min_lr", "warmup_steps", "decay_steps", "decay_style", "train_steps")
                        if k in now[section] and saved.get(section, {}).get(k) != now[section][k])
        decay = (before.train.train_steps or 0) - before.schedule.warmup_steps
        keep = (f"; to continue its decay, set schedule.decay_steps {decay}"
                if fields == ["train.train_steps"] and before.schedule.decay_steps is None and decay > 0 else "")
        problems.append(f"would change the learning rate of step {changed_at} from {was:.4g} to {will:.4g} "
                        f"({', '.join(fields) or 'the schedule'} changed{keep})")
    return problems


def _schedule_probes(before: Config, step: int) -> list[int]:
    """The steps ahead at which the resumed schedule must give the checkpoint's run's rates: the next
    one, the ends of its warm-up and decay, and 256 steps spread up to its last (or its decay's end,
    for a run by tokens). Resumed during warm-up, a changed floor, decay style or length showed at
    none of the next step's rate and passed, to change every rate after the warm-up; steps after the
    checkpoint's run would have ended are the resumed run's own, but for the next one: a finished run
    extended (its decay stretched, say) is compared at the rate it would have gone on with."""
    warmup, decay = before.schedule.warmup_steps, before.schedule.decay_steps
    last = before.train.train_steps or warmup + (decay or 0)
    marks = {step + 1, warmup, warmup + 1, *((warmup + decay, warmup + decay + 1) if decay else ())}
    spread = range(step + 1, last + 1, max(1, (last - step) // 256))
    return sorted(s for s in {*marks, *spread, last} if step < s <= max(last, step + 1))


def _data_order_changes(before: Config, cfg: Config, digests: dict,
                        at: tuple[int, int, int | None]) -> list[str]:
    """What changes the order of the training samples between the run that wrote a checkpoint
    (``before``; ``at``: its step, samples consumed and, where recorded, the samples it built its
    indices for) and this one: the datasets, weights, split or seed, or a sample count that changes
    a dataset's epochs (the counts each run builds its indices for, ``train_samples``). A dataset is
    its files, not the spelling of its path: the same path (whose contents ``_shard_changes``
    compares), or, where the checkpoint recorded its shards' ``.idx`` digests (``digests``, by real
    path), the same contents at another path (shards copied to another mount or cluster order the
    samples as before)."""
    from data_pipeline.blend import normalise_weights, parse_blend, resolve_blend
    from megazero.data import shard_digests, train_samples

    def datasets(c: Config, recorded: tuple[str, ...] = ()):
        weights, prefixes = parse_blend(resolve_blend(c.data.blend, c.data.blend_preset, c.data.blend_root))
        # where the checkpoint recorded its shards (by real path, in the blend's order), those paths:
        # a link in the blend since pointed elsewhere resolves, today, to where the run did not train
        paths = recorded if len(recorded) == len(prefixes) else [os.path.realpath(p) for p in prefixes]
        return [(round(float(w), 12), p) for w, p in zip(normalise_weights(weights), paths)]

    def moved(was: str, now: str, now_digests: dict) -> bool:  # another path, the recorded contents
        return digests.get(was) is not None and digests.get(was) == now_digests.get(now)

    try:
        old, new = datasets(before, tuple(digests)), datasets(cfg)
        if old != new and digests and len(old) == len(new):
            now_digests = shard_digests(cfg)
            if all(w == v and (p == q or moved(p, q, now_digests)) for (w, p), (v, q) in zip(old, new)):
                old = new
    except (ValueError, OSError):
        old, new = None, None  # a preset gone or broken: compare what the runs name
    relinked = []  # the blend as written, its entries leading elsewhere
    if old != new and old is not None and len(old) == len(new) and _named_data(before) == _named_data(cfg):
        relinked = [f"was trained on {p}, and the same blend entry now leads to {q}, other contents (a link in "
                    "its path changed?)" for (_, p), (_, q) in zip(old, new) if p != q]
    fields = ["data.split"] if _split_shares(before) != _split_shares(cfg) else []
    fields += ["data.seed"] if before.data.seed != cfg.data.seed else []
    if (old != new and not relinked) or (old is None and _named_data(before) != _named_data(cfg)):
        fields.insert(0, "data.blend")
    if fields or relinked:
        return relinked + ([f"was trained on another data order ({', '.join(fields)} changed)"] if fields else [])
    step, consumed, built = at
    n_old = built or train_samples(before)  # older checkpoints recorded no count: their config's
    n_new = train_samples(cfg, step, consumed, built)
    if n_old == n_new or new is None:
        return []
    for weight, prefix in new:
        if _epochs_change(prefix, weight, cfg, n_old, n_new):
            return [f"was trained on another data order: {n_new} training samples in all instead of {n_old} "
                    f"(train.train_steps, train_tokens or global_batch_size) take {prefix} through another number "
                    "of epochs, or another share of its last, which reshuffles every sample"]
    return []


def batch_changes(before: Config, cfg: Config, consumed: int) -> list[str]:
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
    while old != new and old.start is not None and at < old.rampup_samples:
        was, will = old.global_batch(at), new.global_batch(at)
        if was != will:
            layout = [f for f, a, b in (("parallel.dp", before.parallel.dp, cfg.parallel.dp),
                                        ("train.micro_batch_size", before.train.micro_batch_size,
                                         cfg.train.micro_batch_size)) if a != b]
            return [f"would train the step at sample {at} on a global batch of {will} instead of {was}: the batch "
                    f"ramp-up rounds each step's batch to a multiple of micro_batch_size x dp, and "
                    f"{' and '.join(layout)} changed"]
        # both sizes hold to the end of this stretch of the ramp: on to the first step at or past it
        # (a step at a time took a minute at every launch of a ramp over 1e8 samples)
        at += -(-(old.stretch_end(at) - at) // was) * was
    return []


RAMPUP_FIELDS = ("rampup_start_batch", "rampup_increment", "rampup_samples")


def _split_shares(c: Config):
    """The shares ``data.split`` gives train, validation and test, which alone place each split's
    documents (``split_ranges``): ``1`` and ``1,0,0`` are one split. A checkpoint's split with an empty
    part (``969,30,1,``), which versions before it was refused read without that part, is read so
    again. Its text where it does not parse."""
    from data_pipeline.gpt_samples import parse_split

    for split in (c.data.split, ",".join(part for part in c.data.split.replace("/", ",").split(",") if part.strip())):
        try:
            return parse_split(split)
        except ValueError:
            pass
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
    # a greedy share is within one of weight x n, and the plan only grows with the count, so the ends
    # of that range say whether any count in it differs
    spread = (0,) if weight == 1 else (-1, 1)
    plans = {epoch_plan(tokens, seq, max(int(weight * n) + d, 1)) for n in (n_old, n_new) for d in spread}
    return len(plans) > 1
