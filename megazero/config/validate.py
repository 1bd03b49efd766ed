"""Checks that a config describes a run that can work, before any process group exists.

Each problem becomes one sentence naming the dotted field and what to change; all problems are
reported together so a user fixes a config in one pass rather than one error per launch.

The rules that belong to a part of the system live in that part and are imported here: the choice
lists from the modules that dispatch on them, tensor-parallel divisibility from
``models.parallelize``, the pipeline split from ``parallel.pipeline.partition``. What stays here is
about the config as a whole: ranges, and how the run fits the world it is launched on.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

from megazero.config.auto import TP_COMM_AUTO, graph_blockers
from megazero.config.schema import Config
from megazero.errors import ConfigError
from megazero.metrics import WANDB_MODES
from megazero.training_schedules import DECAY_STYLES, build_batch_schedule, build_lr_schedule
from models.embedding import POSITION_EMBEDDINGS, VOCAB_MULTIPLE, padded_vocab_size
from models.init import MAX_ROWS
from models.mlp import ACTIVATIONS
from models.norms import NORM_KINDS
from models.parallelize import RECOMPUTE_MODES, tp_layout_problems
from parallel.data_parallel import STAGES
from parallel.launch import DEVICES
from parallel.tensor_parallel.overlap import MODES as TP_COMM_MODES
from parallel.pipeline.partition import split_problem
from parallel.pipeline.schedule import (INTERLEAVED, TRAINING_SCHEDULES, default_schedule, forwards_first,
                                        schedule_problem)
from parallel.topology import ORDERS

CHOICES = {
    "model.position_embedding": POSITION_EMBEDDINGS,
    "model.norm": NORM_KINDS,
    "model.activation": ACTIVATIONS,
    "parallel.order": ORDERS,
    "parallel.recompute": RECOMPUTE_MODES,
    "parallel.tp_comm": (TP_COMM_AUTO, *TP_COMM_MODES),
    "parallel.pipeline_schedule": TRAINING_SCHEDULES,
    "zero.stage": STAGES,
    "precision.dtype": ("fp32", "bf16", "fp16"),
    "optimizer.name": ("adamw",),
    "schedule.decay_style": DECAY_STYLES,
    "train.device": DEVICES,
    "logging.wandb_mode": WANDB_MODES,
}

POSITIVE = [
    "model.num_layers", "model.hidden_size", "model.num_heads", "model.num_kv_heads",
    "model.ffn_hidden_size", "model.vocab_size", "model.seq_length", "model.norm_eps",
    "model.rope_theta", "model.init_std",
    "parallel.tp", "parallel.pp", "parallel.dp", "parallel.virtual_stages", "parallel.recompute_every",
    "zero.bucket_size_mb", "zero.prefetch_depth",
    "precision.initial_loss_scale", "precision.loss_scale_window", "precision.hysteresis",
    "precision.min_loss_scale",
    "optimizer.lr", "optimizer.eps",
    "schedule.rampup_start_batch", "schedule.rampup_increment",
    "train.micro_batch_size", "train.global_batch_size", "train.train_steps", "train.train_tokens",
    "train.max_wall_seconds", "train.eval_steps", "train.max_bad_steps", "train.steps_ahead", "train.collective_timeout_s",
    "checkpoint.keep_last", "logging.log_interval",
]

LARGEST = {
    "model.num_layers": 10_000, "model.hidden_size": 1 << 20, "model.num_heads": 1 << 16,
    "model.ffn_hidden_size": 1 << 22,
}
"""Sizes far past any model trained (GPT-3 has 96 layers of width 12,288): a larger one is a typo,
which the checks' own arithmetic did not survive (``model.num_layers 1e29`` hung the planner's
estimate; ``model.hidden_size 1e29`` passed ``--check`` and failed allocating)."""

COUNT_MAX = 2 ** 63 - 1
"""The largest count (steps, tokens, samples) the data's int64 indices hold: the checks divide them,
and a count of hundreds of digits ended in an OverflowError (the checks of absurd run lengths below
it say how long the run would be)."""

STEPS_AHEAD_MAX = 8
"""More steps in flight only delay stops and NaN checks: a host that needs more is the bound."""

COLLECTIVE_TIMEOUT_S = (1e-3, 1e9)
"""The timeouts torch's process groups can hold: below a millisecond the store's deadline is 0 ms and
every rendezvous fails at once (reported as an unreachable MASTER_ADDR); above about 30 years its
nanosecond deadlines overflow (1e10 s fails the same way, 1e300 s raised OverflowError)."""

BUCKET_MB_MAX = float(1 << 40)
"""A bucket of an exbibyte holds any model's gradients whole (a larger one is the same one bucket):
past about 1e302 MiB the size in bytes overflowed to infinity, which ``--check`` passed and the
engine could not round to elements, stopping the run's start on a traceback."""

LOSS_SCALE_MAX = 3.4028234663852886e38
"""float32's largest value: the loss scale (over a step's micro-batches) seeds the backward as an
fp32 tensor, so a larger ``precision.initial_loss_scale`` failed at the first backward with a
traceback where the micro-batches did not bring it below, and overflowed every gradient where they did."""

EMPTY_REFUSED = ("checkpoint.save_dir", "data.cache_dir")
"""Folder fields whose empty value is refused: the code reads it as unset (null, the default), so a
script's unset variable (``--checkpoint.save_dir $CKPT``) would save somewhere the user never named."""

NON_NEGATIVE = [
    "model.dropout", "model.attention_dropout", "zero.persistence_threshold",
    "optimizer.min_lr", "optimizer.weight_decay", "optimizer.clip_grad",
    "schedule.warmup_steps", "schedule.decay_steps", "schedule.rampup_samples",
    "train.eval_interval", "checkpoint.save_interval",
]


def get(cfg: Config, dotted: str):
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def validate_config(cfg: Config, world_size: Optional[int] = None, local_world_size: Optional[int] = None) -> None:
    """Raise one ``ConfigError`` listing every problem; ``world_size`` enables the layout checks."""
    problems = _value_problems(cfg)
    if not problems:  # shape arithmetic on invalid values would only add noise
        problems += _shape_problems(cfg)
    if not problems:
        problems += _layout_problems(cfg, world_size, local_world_size)
    if problems:
        raise ConfigError("\n".join(problems))


def validate_without_layout(cfg: Config) -> None:
    """Raise one ``ConfigError`` listing the problems no parallel layout changes: the values, and the
    model's own shape. ``megazero plan`` checks these before it searches, and each layout it tries
    whole with ``validate_config``: the config's own tp, pp, virtual stages, schedule and sequence
    parallelism are only where the search starts (a held one need not be valid with the config's
    others), so holding ``--parallel.virtual_stages 2`` on a config of pp 1 was refused as needing
    pp > 1, though the search had layouts of pp > 1 to offer."""
    problems = _value_problems(cfg) or _model_problems(cfg.model)
    if problems:
        raise ConfigError("\n".join(problems))


def resolve_config(cfg: Config, world_size: int, local_world_size: Optional[int] = None) -> Config:
    """Validate for this world and fill the derived fields (``parallel.dp``)."""
    validate_config(cfg, world_size, local_world_size)
    dp = world_size // (cfg.parallel.tp * cfg.parallel.pp)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=dp))


def _non_finite(cfg: Config) -> list[str]:
    """Every float field holding NaN or inf: they compare false with every bound, so no range check
    below would catch them, and a NaN learning rate trains to NaN without another word."""
    found = []
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                found.append(f"{section.name}.{f.name}: must be a finite number, got {value}")
    return found


def _value_problems(cfg: Config) -> list[str]:
    problems = _non_finite(cfg)
    if problems:
        return problems
    for name, allowed in CHOICES.items():
        value = get(cfg, name)
        if value not in allowed:
            problems.append(f"{name}: {value!r} is not one of {', '.join(map(str, allowed))}")
    for name in POSITIVE:
        value = get(cfg, name)
        if value is not None and value <= 0:
            problems.append(f"{name}: must be positive, got {value}")
    for name, largest in LARGEST.items():
        value = get(cfg, name)
        if value is not None and value > largest:
            problems.append(f"{name}: {value} is more than {largest:,}, far past any model trained; check the value")
    for name in POSITIVE + NON_NEGATIVE:
        value = get(cfg, name)
        if isinstance(value, int) and name not in LARGEST and value > COUNT_MAX:
            problems.append(f"{name}: {value} is more than int64's largest, {COUNT_MAX}; check the value")
    if 0 < cfg.model.rope_theta <= 1:  # 1e-320 passed, and the run diverged with advice about the learning rate
        problems.append(f"model.rope_theta: {cfg.model.rope_theta:g} must be more than 1 (the rotary base: 10000 in "
                        "GPT-NeoX and Llama 2, 500000 in Llama 3)")
    for name in NON_NEGATIVE:
        value = get(cfg, name)
        if value is not None and value < 0:
            problems.append(f"{name}: must be zero or more, got {value}")
    for name in ("model.dropout", "model.attention_dropout"):
        if get(cfg, name) >= 1:
            problems.append(f"{name}: must be below 1, got {get(cfg, name)}")
    if 0 < cfg.optimizer.lr < cfg.optimizer.min_lr:
        problems.append(f"optimizer.min_lr: {cfg.optimizer.min_lr} exceeds optimizer.lr {cfg.optimizer.lr}; lower it")
    for name in ("optimizer.beta1", "optimizer.beta2"):
        if not 0 <= get(cfg, name) < 1:
            problems.append(f"{name}: must be in [0, 1), got {get(cfg, name)} (typical: beta1 0.9, beta2 0.95)")
    problems += _profile_problems(cfg)
    if not cfg.logging.run_dir.strip():  # an unset variable in a script: "" would be the current directory
        problems.append("logging.run_dir: is empty, which would write the run's config, metrics and checkpoints "
                        "into the current directory; name a folder (e.g. runs/NAME) or leave the field out")
    for name in EMPTY_REFUSED:
        if get(cfg, name) is not None and not get(cfg, name).strip():
            problems.append(f"{name}: is empty, which names no folder (its default is null); name one, or leave the "
                            "field out")
    for name in ("logging.run_dir", *EMPTY_REFUSED):
        folder = get(cfg, name)
        if folder is not None and folder.startswith("~"):  # YAML never expands it, nor a shell after "="
            problems.append(f"{name}: {folder!r} would make a folder named '~' in the current one; give the path "
                            f"with the home folder spelled out, e.g. {os.path.expanduser(folder)}")
    t = cfg.train
    if t.steps_ahead > STEPS_AHEAD_MAX:
        problems.append(f"train.steps_ahead: {t.steps_ahead} is more than {STEPS_AHEAD_MAX}; more steps in flight only "
                        "delay stops and NaN checks")
    low, high = COLLECTIVE_TIMEOUT_S
    if t.collective_timeout_s > 0 and not low <= t.collective_timeout_s <= high:
        problems.append(f"train.collective_timeout_s: {t.collective_timeout_s:g} is outside {low:g} to {high:g} s, "
                        "the timeouts torch's process groups can hold; give seconds such as 600")
    if t.train_steps is None and t.train_tokens is None:
        problems.append("train.train_steps: is null and so is train.train_tokens; give one of them to say when "
                        "training ends")
    if not 0 <= cfg.data.seed < 2**32:
        problems.append(f"data.seed: {cfg.data.seed} is outside 0 to 2**32 - 1, the seeds numpy's generator takes")
    if not 0 <= t.seed < 2**32:  # offsets per tensor rank and stage are added to it, within torch's 64 bits
        problems.append(f"train.seed: {t.seed} is outside 0 to 2**32 - 1")
    if cfg.zero.bucket_size_mb > BUCKET_MB_MAX:
        problems.append(f"zero.bucket_size_mb: {cfg.zero.bucket_size_mb:g} is more than {BUCKET_MB_MAX:g} MiB, which "
                        "holds any model's gradients in one bucket; give a size in MiB (the default: 200)")
    prec = cfg.precision
    if prec.dtype == "fp16" and prec.initial_loss_scale > LOSS_SCALE_MAX:
        problems.append(f"precision.initial_loss_scale: {prec.initial_loss_scale:g} is above float32's largest value "
                        f"{LOSS_SCALE_MAX:g}; give a power of two such as 65536")
    elif prec.dtype == "fp16" and prec.min_loss_scale > prec.initial_loss_scale:
        problems.append(f"precision.min_loss_scale: {prec.min_loss_scale} exceeds precision.initial_loss_scale "
                        f"{prec.initial_loss_scale}; the run would stop at its first overflows as diverging")
    if not problems:
        try:
            build_lr_schedule(cfg.optimizer, cfg.schedule, cfg.train)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def config_notes(cfg: Config) -> list[str]:
    """Settings that are valid but rarely meant, said once at the start of a run: a short smoke run of
    a full config, say, whose warm-up outlasts it (refusing it would refuse every such run; saying
    nothing leaves a learning rate that never reached its peak unexplained)."""
    t, s, c = cfg.train, cfg.schedule, cfg.checkpoint
    notes = []
    if t.train_steps is not None and s.warmup_steps > t.train_steps:
        notes.append(f"schedule.warmup_steps {s.warmup_steps} is more than train.train_steps {t.train_steps}: the "
                     f"learning rate ends at {t.train_steps / s.warmup_steps:.2g} of optimizer.lr, in warm-up")
    if cfg.parallel.recompute_every != 1 and cfg.parallel.recompute != "full":
        notes.append(f"parallel.recompute_every {cfg.parallel.recompute_every} applies to parallel.recompute full "
                     f"only; with {cfg.parallel.recompute!r} it changes nothing")
    if cfg.data.blend_root and cfg.data.blend_preset is None:  # not a root for data.blend's prefixes
        notes.append(f"data.blend_root {cfg.data.blend_root} applies to data.blend_preset only; data.blend's "
                     "prefixes are read as written, so it changes nothing")
    if not c.save_on_exit and not c.save_interval:
        limit = " or reaches train.max_wall_seconds" if t.max_wall_seconds is not None else ""
        notes.append(f"checkpoint.save_on_exit is false and checkpoint.save_interval 0: this run saves a checkpoint "
                     f"only if it is preempted{limit}")
    return notes + _all_forwards_first(cfg)


def _all_forwards_first(cfg: Config) -> list[str]:
    """An interleaved schedule runs every forward of a step first where its micro-batches are not a
    multiple of pp, or are pp (``interleaved_warmup``): all of them in flight at once, GPipe's memory
    and not 1F1B's, whether at the full batch or in the steps of a batch ramp-up."""
    p, t = cfg.parallel, cfg.train
    name = default_schedule(p.pp, p.virtual_stages) if p.pipeline_schedule == "auto" else p.pipeline_schedule
    if p.pp < 2 or name not in INTERLEAVED or not p.dp or t.global_batch_size % (t.micro_batch_size * p.dp):
        return []
    counts = build_batch_schedule(cfg.schedule, t, p.dp).micro_batch_counts()
    ahead = [m for m in counts if forwards_first(p.pp, m)]
    bound = f"a multiple of parallel.pp {p.pp} above {p.pp}"
    if counts[-1] in ahead:
        return [f"{name} runs every forward of a step first at {counts[-1]} micro-batches a pipeline (train."
                f"global_batch_size / (micro_batch_size x dp)): all {counts[-1]} x {p.virtual_stages} chunks' "
                f"activations at once; {bound} keeps 1F1B's bound"]
    if ahead:
        return [f"{name} runs every forward of a step first in the batch ramp-up's steps whose micro-batches a "
                f"pipeline are not {bound} (between {ahead[0]} and {ahead[-1]}): all their chunks' activations at "
                "once, which the start-up memory estimate counts"]
    return []


def _cuda_graph_problems(cfg: Config) -> list[str]:
    """Why ``train.cuda_graphs true`` cannot run (null leaves graphs off where they cannot)."""
    if cfg.train.cuda_graphs is not True:
        return []
    return [f"train.cuda_graphs: cannot replay blocks as CUDA graphs with {what}; set train.cuda_graphs false"
            for what in graph_blockers(cfg)]


def _model_problems(m) -> list[str]:
    """The model's shape on its own, whatever the layout."""
    problems = []
    if m.hidden_size % m.num_heads:
        problems.append(f"model.hidden_size: {m.hidden_size} is not divisible by model.num_heads {m.num_heads}")
    kv = m.kv_heads
    if m.num_heads % kv:
        problems.append(f"model.num_kv_heads: {kv} must divide model.num_heads {m.num_heads}")
    if m.position_embedding == "rope" and (m.hidden_size // m.num_heads) % 2:
        problems.append("model.hidden_size: rotary embeddings need an even head size (hidden_size / num_heads)")
    return problems


def _row_problems(m, tp: int) -> list[str]:
    """Weights of more rows than the seeded initialisation numbers (``models.init.MAX_ROWS``): found
    when the model was built, after the launch, and named by the weight, not the field."""
    problems = []
    padded = padded_vocab_size(m.vocab_size, VOCAB_MULTIPLE * tp)
    if padded >= MAX_ROWS:
        problems.append(f"model.vocab_size: {m.vocab_size} (padded to {padded} for parallel.tp {tp}) must be below "
                        f"{MAX_ROWS}, the rows the model's initialisation numbers")
    if m.position_embedding == "learned" and m.seq_length >= MAX_ROWS:
        problems.append(f"model.seq_length: {m.seq_length} learned positions must be fewer than {MAX_ROWS}, the rows "
                        "the model's initialisation numbers; use model.position_embedding rope")
    return problems


def _shape_problems(cfg: Config) -> list[str]:
    m, p = cfg.model, cfg.parallel
    problems = _model_problems(m) + _row_problems(m, p.tp)
    problems += tp_layout_problems(m, p.tp)
    if p.sequence_parallel and p.tp == 1:
        problems.append("parallel.sequence_parallel: needs parallel.tp > 1; set it false or raise tp")
    if p.tp_comm in ("serial", "peer_memory") and not p.sequence_parallel:
        problems.append(f"parallel.tp_comm: {p.tp_comm} is how sequence-parallel linears communicate; "
                        "set parallel.sequence_parallel true, or leave tp_comm at auto")
    elif p.tp_comm == "peer_memory" and cfg.train.device == "cpu":
        problems.append("parallel.tp_comm: peer_memory needs CUDA devices; set it to serial or overlap on CPU")
    elif p.tp_comm == "peer_memory" and p.allow_tp_across_nodes:
        problems.append("parallel.tp_comm: peer_memory maps the memory of GPUs in one node; with "
                        "parallel.allow_tp_across_nodes use serial or overlap")
    problems += _cuda_graph_problems(cfg)
    if p.sequence_parallel and m.seq_length % p.tp:
        problems.append(f"model.seq_length: {m.seq_length} is not divisible by parallel.tp {p.tp} (sequence parallel)")
    if p.virtual_stages > 1 and p.pp == 1:
        problems.append("parallel.virtual_stages: interleaving needs parallel.pp > 1; set it to 1")
    schedule = schedule_problem(p.pipeline_schedule, p.virtual_stages) if p.pipeline_schedule in TRAINING_SCHEDULES else None
    if schedule:
        problems.append(f"parallel.pipeline_schedule: {schedule}")
    split = split_problem(m.num_layers, p.pp, p.virtual_stages, p.pipeline_split)
    if split:
        problems.append(split)
    return problems


def _profile_problems(cfg: Config) -> list[str]:
    steps, ranks, last = cfg.logging.profile_steps, cfg.logging.profile_ranks, cfg.train.train_steps
    problems = []
    if steps is not None and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
        problems.append(f"logging.profile_steps: expected [first, last] with 1 <= first <= last, e.g. [10, 12]; "
                        f"got {steps!r}")
    elif steps is not None and last is not None and steps[0] > last:
        problems.append(f"logging.profile_steps: step {steps[0]} comes after the run's last step "
                        f"(train.train_steps {last}); profile earlier steps")
    if not ranks or min(ranks) < 0:
        problems.append(f"logging.profile_ranks: must name at least one rank, as a list such as [0]; got {ranks!r}")
    return problems


def _layout_problems(cfg: Config, world_size: Optional[int], local_world_size: Optional[int]) -> list[str]:
    p, t = cfg.parallel, cfg.train
    problems = []
    model_parallel = p.tp * p.pp
    dp = p.dp
    if world_size is not None:
        if dp is None:
            if world_size % model_parallel:
                return [f"parallel.tp*parallel.pp = {model_parallel} does not divide the world size {world_size}; "
                        f"launch a multiple of {model_parallel} ranks or change tp/pp"]
            dp = world_size // model_parallel
        elif p.tp * p.pp * dp != world_size:
            return [f"parallel.dp: tp*pp*dp = {p.tp}*{p.pp}*{dp} = {p.tp * p.pp * dp} but the world size is "
                    f"{world_size}; set parallel.dp to {world_size // model_parallel if world_size % model_parallel == 0 else 'null'}"
                    f" or launch {p.tp * p.pp * dp} ranks"]
    if dp is not None and t.global_batch_size % (t.micro_batch_size * dp):
        problems.append(f"train.global_batch_size: {t.global_batch_size} is not divisible by "
                        f"train.micro_batch_size*dp = {t.micro_batch_size}*{dp}; make it a multiple of "
                        f"{t.micro_batch_size * dp}")
    elif dp is not None:
        try:
            build_batch_schedule(cfg.schedule, cfg.train, dp)
        except ConfigError as exc:
            problems.append(str(exc))
    if local_world_size and p.tp > 1 and local_world_size % p.tp and not p.allow_tp_across_nodes:
        problems.append(f"parallel.tp: {p.tp} ranks per tensor group do not fit the {local_world_size} ranks per "
                        f"node; use a tp that divides {local_world_size} or set parallel.allow_tp_across_nodes")
    outside = [r for r in cfg.logging.profile_ranks if world_size is not None and r >= world_size]
    if cfg.logging.profile_steps is not None and outside:
        problems.append(f"logging.profile_ranks: {outside} are not ranks of this world of {world_size}; name ranks "
                        f"below {world_size}")
    return problems
