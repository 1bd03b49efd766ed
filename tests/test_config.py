"""Config: YAML round trip, dotted overrides, and every validation error naming its field (how YAML
reads the values a file gives: ``test_config_yaml.py``)."""

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
import yaml

from megazero.config import Config, field_docs, load_config, resolve_config, save_config, validate_config
from megazero.config.loader import read_yaml
from megazero.errors import ConfigError


def _cfg(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def test_round_trip_through_yaml(tmp_path):
    cfg = _cfg("--parallel.tp", "2", "--model.preset", "llama", "--optimizer.lr=1e-4",
               "--data.blend", "[[0.3, a], [0.7, b]]", "--parallel.pipeline_split", "[1, 1]")
    path = tmp_path / "config.yaml"
    save_config(cfg, str(path))
    again = load_config(str(path))
    assert again == cfg
    assert again.optimizer.lr == 1e-4 and again.data.blend == [[0.3, "a"], [0.7, "b"]]
    assert not list(tmp_path.glob("*.tmp*")), "atomic write leaves no temporary file"


def test_preset_fills_architecture_but_explicit_fields_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  preset: llama\n  bias: true\n")
    cfg = load_config(str(path))
    assert (cfg.model.norm, cfg.model.activation, cfg.model.position_embedding) == ("rmsnorm", "swiglu", "rope")
    assert cfg.model.tie_embeddings is False and cfg.model.bias is True


def test_every_field_is_documented():
    rows = field_docs()
    assert len(rows) > 60
    undocumented = [name for name, _, text in rows if not text.strip()]
    assert not undocumented
    assert {name.split(".")[0] for name, _, _ in rows} == {f.name for f in dataclasses.fields(Config)}


def test_every_documented_default_is_the_fields_default():
    """``megazero train --help-config`` prints ``field_docs``' defaults: each must be what a config
    that leaves the field out gets, a list made by a factory included."""
    from megazero.config.validate import get

    rows = field_docs()
    assert ("logging.profile_ranks", [0]) in [(name, default) for name, default, _ in rows]
    assert [(name, default) for name, default, _ in rows] == [(name, get(Config(), name)) for name, _, _ in rows]


DOC_DEFAULT = re.compile(r"`([a-z_]+\.[a-z_]+)`\s+\(default\s+`([^`]+)`\)")
DOC_WORDS_FOR_NULL = {"checkpoint.save_dir": "RUN_DIR/checkpoints"}  # a null default the page explains


def test_every_default_the_docs_state_is_the_fields_default():
    """A default stated in docs/*.md as "`section.field` (default `VALUE`)" is what a config leaving
    the field out gets (planted: checkpoint.keep_last or zero.overlap_comm changed in the schema and
    the page left saying the old one). Those two were stated nowhere: they must be among the checked."""
    from megazero.config.validate import get

    checked = {}
    for page in sorted((Path(__file__).resolve().parent.parent / "docs").glob("*.md")):
        for name, text in DOC_DEFAULT.findall(page.read_text(encoding="utf-8")):
            value = None if DOC_WORDS_FOR_NULL.get(name) == text else yaml.safe_load(text)
            assert get(Config(), name) == value, (page.name, name, text)
            checked[name] = value
    assert checked["checkpoint.keep_last"] == 3 and checked["zero.overlap_comm"] is True, checked


def test_a_note_is_said_only_where_a_setting_changes_less_than_it_seems():
    """The start-up notes of ``config_notes``: none for the defaults, nor for a warm-up that ends on the
    last step (which reaches the peak rate); each where a setting does less than its name says."""
    from megazero.config.validate import config_notes

    assert config_notes(_cfg()) == []
    assert config_notes(_cfg("--schedule.warmup_steps", "100")) == []  # train_steps 100: it ends at the peak
    assert config_notes(_cfg("--data.blend_root", "shared", "--data.blend_preset", "mtnlg530b")) == []
    notes = config_notes(_cfg("--parallel.recompute", "selective", "--parallel.recompute_every", "2"))
    assert [n.split(";")[0] for n in notes] == ["parallel.recompute_every 2 applies to parallel.recompute full only"]
    notes = config_notes(_cfg("--checkpoint.save_on_exit", "false", "--train.max_wall_seconds", "60"))
    assert len(notes) == 1 and notes[0].endswith("only if it is preempted or reaches train.max_wall_seconds"), notes
    # saving at an interval is saving (planted: said for any run without save_on_exit, passed)
    assert config_notes(_cfg("--checkpoint.save_on_exit", "false", "--checkpoint.save_interval", "10")) == []


def test_an_interleaved_pipeline_that_runs_every_forward_first_is_noted():
    """Interleaved schedules at micro-batches a pipeline that are not a multiple of pp, or are pp, hold
    all of them in flight: noted at the full batch, and where only a ramp-up's steps do; not at 8."""
    from megazero.config.validate import config_notes

    def notes(*overrides):
        return config_notes(resolve_config(_cfg("--model.num_layers", "4", "--parallel.pp", "2", "--parallel.virtual_stages",
                                                "2", "--train.micro_batch_size", "1", *overrides), 2, 2))

    assert notes("--train.global_batch_size", "8") == []
    for batch in ("3", "2"):
        (line,) = notes("--train.global_batch_size", batch)
        assert line.startswith(f"interleaved_1f1b runs every forward of a step first at {batch} micro-batches"), line
    (line,) = notes("--train.global_batch_size", "8", "--schedule.rampup_start_batch", "3",
                    "--schedule.rampup_increment", "2", "--schedule.rampup_samples", "100")
    assert "ramp-up's steps" in line and "(between 3 and 7)" in line, line
    assert notes("--train.global_batch_size", "8", "--schedule.rampup_start_batch", "4",  # 4, 6 and 8 only
                 "--schedule.rampup_increment", "2", "--schedule.rampup_samples", "100") == []


def _error(*overrides, world=None, local=None) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(_cfg(*overrides), world, local)
    return str(info.value)


@pytest.mark.parametrize("overrides, world, field, fix", [
    (("--parallel.tp", "4", "--model.num_heads", "4"), 6, "parallel.tp", "does not divide the world size"),
    (("--parallel.dp", "4"), 2, "parallel.dp", "set parallel.dp to 2"),
    (("--parallel.tp", "2", "--model.num_heads", "3", "--model.hidden_size", "66"), None, "model.num_heads", None),
    (("--parallel.tp", "4", "--model.num_heads", "6", "--model.hidden_size", "96"), None, "model.num_heads", "parallel.tp"),
    (("--parallel.tp", "4", "--model.num_heads", "8", "--model.num_kv_heads", "2"), None, "model.num_kv_heads", "parallel.tp"),
    (("--parallel.tp", "4", "--model.ffn_hidden_size", "258"), None, "model.ffn_hidden_size", "parallel.tp"),
    (("--parallel.pp", "2", "--parallel.virtual_stages", "2", "--model.num_layers", "3"), None, "model.num_layers",
     "lower pp or virtual_stages"),
    (("--train.global_batch_size", "10", "--train.micro_batch_size", "4"), 1, "train.global_batch_size", "multiple of 4"),
    (("--train.global_batch_size", "12", "--train.micro_batch_size", "2"), 8, "train.global_batch_size", "multiple of 16"),
    (("--parallel.sequence_parallel", "true"), None, "parallel.sequence_parallel", "tp > 1"),
    (("--parallel.tp", "2", "--parallel.tp_comm", "serial"), None, "parallel.tp_comm", "sequence_parallel true"),
    (("--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--parallel.tp_comm", "peer_memory",
      "--train.device", "cpu"), None, "parallel.tp_comm", "serial or overlap on CPU"),
    (("--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--parallel.tp_comm", "peer_memory",
      "--parallel.allow_tp_across_nodes", "true"), None, "parallel.tp_comm", "one node"),
    (("--parallel.tp_comm", "nccl"), None, "parallel.tp_comm", "serial, overlap, peer_memory"),
    (("--train.cuda_graphs", "true", "--train.device", "cpu"), None, "train.cuda_graphs", "train.device cpu"),
    (("--train.cuda_graphs", "true", "--train.compile", "false"), None, "train.cuda_graphs", "train.compile false"),
    (("--train.cuda_graphs", "true", "--parallel.pp", "2", "--model.num_layers", "4"), None, "train.cuda_graphs",
     "parallel.pp 2"),
    (("--train.cuda_graphs", "true", "--zero.stage", "3"), None, "train.cuda_graphs", "zero.stage 3"),
    (("--train.cuda_graphs", "true", "--parallel.pipeline_schedule", "zb-h1"), None, "train.cuda_graphs",
     "parallel.pipeline_schedule zb-h1"),
    (("--train.cuda_graphs", "true", "--model.dropout", "0.1"), None, "train.cuda_graphs", "model.dropout"),
    (("--train.cuda_graphs", "true", "--parallel.recompute", "full"), None, "train.cuda_graphs",
     "parallel.recompute full"),
    (("--logging.run_dir", ""), None, "logging.run_dir", "is empty"),
    (("--model.num_layers", "-2"), None, "model.num_layers", "positive"),
    (("--train.micro_batch_size", "0"), None, "train.micro_batch_size", "positive"),
    (("--zero.stage", "4"), None, "zero.stage", "0, 1, 2, 3"),
    (("--parallel.tp", "8"), 16, "parallel.tp", None),
    (("--train.seed", "99999999999999999999"), None, "train.seed", "outside 0 to 2**32 - 1"),
    (("--precision.dtype", "fp16", "--precision.min_loss_scale", "1e9"), None, "precision.min_loss_scale",
     "exceeds precision.initial_loss_scale 65536.0"),
    # torch's deadlines: 1e300 s raised OverflowError at the process group, 1e-9 s (0 ms) failed every rendezvous
    (("--train.collective_timeout_s", "1e300"), None, "train.collective_timeout_s", "give seconds such as 600"),
    (("--train.collective_timeout_s", "1e-9"), None, "train.collective_timeout_s", "outside 0.001 to 1e+09 s"),
    # the scale seeds the backward as an fp32 tensor: beyond float32 it was a traceback at the first backward
    (("--precision.dtype", "fp16", "--precision.initial_loss_scale", "1e39"), None, "precision.initial_loss_scale",
     "above float32's largest value"),
    (("--optimizer.weight_decay", "-0.1"), None, "optimizer.weight_decay", "must be zero or more"),
    (("--model.attention_dropout", "1.0"), None, "model.attention_dropout", "must be below 1"),
    (("--optimizer.beta2", "1.0"), None, "optimizer.beta2", "must be in [0, 1)"),
    (("--data.seed", str(2**32)), None, "data.seed", "outside 0 to 2**32 - 1"),
    (("--train.seed", str(2**32)), None, "train.seed", "outside 0 to 2**32 - 1"),
    (("--logging.profile_steps", "[0, 2]"), None, "logging.profile_steps", "1 <= first <= last"),
    (("--logging.profile_ranks", "[-1]"), None, "logging.profile_ranks", "at least one rank"),
    (("--logging.profile_steps", "[1, 1]", "--logging.profile_ranks", "[1]"), 1, "logging.profile_ranks", "below 1"),
    (("--parallel.tp", "2", "--parallel.tp_comm", "peer_memory"), None, "parallel.tp_comm", "sequence_parallel true"),
    (("--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--model.seq_length", "127"), None,
     "model.seq_length", "not divisible by parallel.tp 2"),
    (("--model.num_heads", "8", "--model.num_kv_heads", "3"), None, "model.num_kv_heads",
     "must divide model.num_heads 8"),
    (("--model.position_embedding", "rope", "--model.hidden_size", "36"), None, "model.hidden_size", "even head size"),
    (("--logging.run_dir", "  "), None, "logging.run_dir", "is empty"),
    # checked before any process group exists, not when the trainer builds its schedules (planted: passed)
    (("--train.train_steps", "null", "--train.train_tokens", "1000"), None, "schedule.decay_steps",
     "must be set when train.train_steps is null"),
    (("--logging.profile_steps", "[3, 3]", "--train.train_steps", "2"), None, "logging.profile_steps",
     "step 3 comes after the run's last step"),
    (("--schedule.rampup_start_batch", "8"), 1, "schedule.rampup_samples", "ramps nothing up"),
    (("--schedule.rampup_start_batch", "32", "--schedule.rampup_samples", "64"), 1, "schedule.rampup_start_batch",
     "exceeds train.global_batch_size"),
    # read as unset: the checkpoints went to the run directory, the index cache beside the data (planted: passed)
    (("--checkpoint.save_dir", ""), None, "checkpoint.save_dir", "is empty, which names no folder"),
    (("--data.cache_dir", " "), None, "data.cache_dir", "is empty, which names no folder"),
    # '~' is expanded by neither YAML nor a shell after '=': a folder named '~' was made (planted: passed)
    (("--logging.run_dir", "~/runs/x"), None, "logging.run_dir", "would make a folder named '~' in the current one"),
    (("--checkpoint.save_dir", "~/ckpt"), None, "checkpoint.save_dir", "with the home folder spelled out, e.g. /"),
])
def test_validation_names_field(overrides, world, field, fix):
    local = 4 if overrides == ("--parallel.tp", "8") else None
    if local:
        overrides = overrides + ("--model.num_heads", "8", "--model.hidden_size", "64")
    message = _error(*overrides, world=world, local=local)
    assert message.startswith(field) or f"\n{field}" in message or field in message.split(":")[0], message
    if fix:
        assert fix in message, message


@pytest.mark.parametrize("overrides", [
    ("--optimizer.lr", "0.001", "--optimizer.min_lr", "0.001"),  # a constant rate after warm-up
    ("--optimizer.beta1", "0"),
    ("--train.steps_ahead", "8"),
    ("--train.collective_timeout_s", "0.001"),
    ("--train.collective_timeout_s", "1e9"),
    ("--precision.dtype", "fp16", "--precision.min_loss_scale", "65536"),
    ("--data.seed", str(2**32 - 1), "--train.seed", str(2**32 - 1)),
    ("--optimizer.weight_decay", "0", "--model.dropout", "0", "--optimizer.clip_grad", "0"),
    ("--logging.profile_steps", "[1, 1]", "--logging.profile_ranks", "[0]"),
    ("--logging.profile_steps", "[2, 2]", "--train.train_steps", "2"),  # the last step (planted: one past it passed)
])
def test_values_at_the_edges_of_their_ranges_are_accepted(overrides):
    """Each range's closed end is a setting a user may mean (a min_lr equal to lr, beta1 0, the last
    seed numpy takes, eight steps ahead): validation must pass it, as the refusals above show where
    the range ends."""
    validate_config(_cfg(*overrides), 1, 1)


def test_a_plan_refuses_a_model_that_no_layout_can_build():
    """``megazero plan`` checks the model's own shape before it searches: a head count that does not
    divide the width is named once, not left for every layout tried to fail."""
    from megazero.config.validate import validate_without_layout

    for overrides, message in [
            (("--model.hidden_size", "66"), "model.hidden_size: 66 is not divisible by model.num_heads 4"),
            (("--model.num_kv_heads", "3"), "model.num_kv_heads: 3 must divide model.num_heads 4")]:
        with pytest.raises(ConfigError, match=message):
            validate_without_layout(_cfg(*overrides))
    validate_without_layout(_cfg("--parallel.virtual_stages", "2"))  # a layout's problem is the search's


def test_tp_across_nodes_can_be_forced():
    cfg = _cfg("--parallel.tp", "8", "--model.num_heads", "8", "--parallel.allow_tp_across_nodes", "true")
    validate_config(cfg, 16, 4)


@pytest.mark.parametrize("overrides, message", [
    (("--parallel.tpp", "2"), "parallel.tpp: unknown key; did you mean parallel.tp?"),
    (("--modle.num_layers", "2"), "modle: unknown key; did you mean model?"),
    (("--train.seed", "two"), "train.seed: expected an integer, got 'two'"),
    (("--model.bias", "1"), "model.bias: expected true or false"),
    # YAML's booleans are ints to Python: true was a seed of 1 and a learning rate of 1.0 (planted: passed)
    (("--train.seed", "true"), "train.seed: expected an integer, got True"),
    (("--optimizer.lr", "true"), "optimizer.lr: expected a number, got True"),
    (("--optimizer.lr", "fast"), "optimizer.lr: expected a number"),
    # a number in quotes is text: float() took "1", " 1 " and "1_0" (10.0); YAML 1.1's 3e-4 stays a number,
    # and text that only begins as one is text
    *[(("--optimizer.lr", text), f"optimizer.lr: expected a number, got {value!r}")
      for text, value in (('"1"', "1"), ('" 1 "', " 1 "), ('"1_0"', "1_0"), ("3e-4x", "3e-4x"))],
    (("--model.preset", "gpt5"), "model.preset: unknown preset"),
    (("--logging.profile_steps", "[2, x]"), r"logging.profile_steps\[1\]: expected an integer, got 'x'"),
    (("--logging.profile_ranks", "[0.5]"), r"logging.profile_ranks\[0\]: expected an integer, got 0.5"),
])
def test_bad_keys_and_types(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace("(", r"\(")):
        _cfg(*overrides)


def test_vocab_auto_with_a_missing_tokenizer_names_the_field(tmp_path):
    """A tokenizer path that does not exist is one ConfigError naming ``data.tokenizer`` (load_tokenizer
    raises FileNotFoundError for it, not the ValueError of a file that is no tokenizer)."""
    with pytest.raises(ConfigError, match=r"^data.tokenizer: .*absent.json: tokenizer file not found"):
        _cfg("--model.vocab_size", "auto", "--data.tokenizer", str(tmp_path / "absent.json"))


def test_a_folder_given_as_the_config_suggests_only_a_config_it_holds(tmp_path):
    """A run directory holds its resolved config.yaml, which the message offers; an empty folder
    holds none, and the message must not send the user to a file that is not there."""
    with pytest.raises(ConfigError) as refused:
        read_yaml(str(tmp_path))
    assert str(refused.value) == f"{tmp_path}: is a folder, not a config file; give a YAML file"
    (tmp_path / "config.yaml").write_text("train: {seed: 1}\n")
    with pytest.raises(ConfigError) as refused:
        read_yaml(str(tmp_path))
    assert str(refused.value).endswith(f"give a YAML file, such as {tmp_path / 'config.yaml'}")


def test_resolve_fills_dp():
    cfg = resolve_config(_cfg("--parallel.tp", "2", "--parallel.pp", "2", "--model.num_layers", "4",
                              "--train.global_batch_size", "8", "--train.micro_batch_size", "2"), 16)
    assert cfg.parallel.dp == 4


@pytest.mark.parametrize("yaml_text, expected", [
    ("model:\n  num_layres: 2\n", "model.num_layres: unknown key; did you mean model.num_layers?"),
    ("model:\n  num_layers: -4\n", "model.num_layers: must be positive, got -4"),
    ("train:\n  micro_batch_size: four\n", "train.micro_batch_size: expected an integer, got 'four'"),
    (None, "config file not found"),
    ("model: [1, 2\n", "not valid YAML"),
])
def test_cli_bad_input_is_one_clear_line(tmp_path, yaml_text, expected):
    path = tmp_path / "run.yaml"
    if yaml_text is not None:
        path.write_text(yaml_text)
    proc = subprocess.run([sys.executable, "-m", "megazero.cli", "train", str(path), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_run_without_data_names_the_field_and_writes_nothing(tmp_path):
    """A launch that fails its checks leaves the run directory as it was: no config.yaml."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megazero.cli", "train", "--logging.run_dir", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("megazero train: error: data.blend: no training data")
    assert not run_dir.exists()


def test_each_choice_list_is_the_one_its_module_dispatches_on():
    """Validation checks a choice against the acting module's own tuple, not a copy of it, so a norm,
    activation, stage or order added there is accepted here with nothing else to edit. (Planted: a
    copied tuple in validate.py, as before the rules moved; this test failed on it.)"""
    from megazero import metrics, training_schedules
    from megazero.config.validate import CHOICES
    from models import embedding, mlp, norms, parallelize
    from parallel import data_parallel, launch, topology
    owners = {"model.position_embedding": embedding.POSITION_EMBEDDINGS, "model.norm": norms.NORM_KINDS,
              "model.activation": mlp.ACTIVATIONS, "parallel.order": topology.ORDERS,
              "parallel.recompute": parallelize.RECOMPUTE_MODES, "zero.stage": data_parallel.STAGES,
              "schedule.decay_style": training_schedules.DECAY_STYLES, "train.device": launch.DEVICES,
              "logging.wandb_mode": metrics.WANDB_MODES}
    for field, owned in owners.items():
        assert CHOICES[field] is owned, field


def test_layout_rules_are_the_ones_the_model_and_the_pipeline_enforce():
    """The tensor-parallel and pipeline-split rules are written once, where the model and the
    pipeline enforce them: validation reports the very sentence they would raise. (Planted: validate.py
    rewording the tensor-parallel rule as its own copy did; this test failed on it.)"""
    from models.parallelize import tp_layout_problems
    from parallel.pipeline.partition import resolve_split, split_problem
    cfg = _cfg("--parallel.tp", "4", "--model.num_heads", "8", "--model.num_kv_heads", "2")
    assert tp_layout_problems(cfg.model, 4)[0] in _error("--parallel.tp", "4", "--model.num_heads", "8",
                                                         "--model.num_kv_heads", "2")
    bad = ("--parallel.pp", "2", "--parallel.pipeline_split", "[1, 2]")
    with pytest.raises(ValueError) as raised:
        resolve_split(2, 2, 1, [1, 2])
    assert str(raised.value) == split_problem(2, 2, 1, [1, 2]) and str(raised.value) in _error(*bad)


@pytest.mark.parametrize("path", sorted(str(p) for p in Path(__file__).resolve().parent.parent.glob("configs/*.yaml")
                                        if p.name != "curate_demo.yaml"))
def test_every_shipped_training_config_validates(path):
    """A shipped config must pass validation for the smallest world its layout needs (tp x pp, or 8
    ranks per node when that is more): the MT-NLG config once did not (no decay span for a
    token-limited run), and a user would only have learned it at launch."""
    cfg = load_config(path)
    p = cfg.parallel
    world = p.tp * p.pp * (p.dp or 1)
    resolve_config(cfg, world, min(world, 8))


def test_architecture_page_names_the_module_of_every_config_field():
    """docs/architecture.md's table sends a newcomer from any config field to the module acting on it;
    a field added without a row there fails here. A cell's bare names (`train_tokens`) belong to the
    section of the dotted name before them; `*` is a wildcard."""
    import fnmatch
    import re

    page = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    patterns = []
    for line in page.splitlines():
        if not line.startswith("| `"):
            continue
        section = None
        for token in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if "." in token:
                section = token.split(".")[0]
                patterns.append(token)
            elif section:
                patterns.append(f"{section}.{token}")
    missing = [name for name, _, _ in field_docs() if not any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    assert not missing, f"config fields without a row in docs/architecture.md: {missing}"


def _parallelism(cfg):
    from megazero.config.auto import resolve_auto
    from megazero.engine import build_chunks, parallelism
    cfg = resolve_auto(cfg, on_cuda=False, peer_memory=False)  # as the engine does on this machine
    return parallelism(cfg, torch.device("cpu"), build_chunks(cfg, 0))


def test_cuda_graphs_without_a_gpu_is_refused_before_building():
    # train.device auto passes validation; the engine finds no GPU to replay on
    with pytest.raises(ConfigError, match="train.cuda_graphs"):
        _parallelism(_cfg("--train.cuda_graphs", "true"))


def test_recompute_with_dropout_under_compile_and_tp_is_refused_before_building():
    # the checkpoint would replay the tensor-parallel random stream, which torch.compile cannot trace
    def build(*overrides):
        return _parallelism(_cfg("--train.compile", "true", *overrides))

    for recompute, dropout in (("full", "--model.dropout"), ("full", "--model.attention_dropout"),
                               ("selective", "--model.attention_dropout")):
        with pytest.raises(ConfigError, match="parallel.recompute"):
            build("--parallel.tp", "2", "--parallel.recompute", recompute, dropout, "0.1")
    build("--parallel.tp", "2", "--parallel.recompute", "selective", "--model.dropout", "0.1")  # the core draws nothing
    build("--parallel.tp", "2", "--parallel.recompute", "full")  # no dropout
    build("--parallel.recompute", "full", "--model.dropout", "0.1")  # tp 1: torch replays the default generator
    _parallelism(_cfg("--parallel.tp", "2", "--parallel.recompute", "full", "--model.dropout", "0.1",
                      "--train.compile", "false"))


CHECKED_ELSEWHERE = {"train.memory_budget_gib"}  # by the start-up memory check (megazero/planner/fit.py)


def _number_fields() -> list[str]:
    """Every config field that holds an int or a float (or null), from the schema."""
    found = []
    for section, values in typing.get_type_hints(Config).items():
        for name, hint in typing.get_type_hints(values).items():
            if typing.get_origin(hint) in (None, typing.Union) and {int, float} & {hint, *typing.get_args(hint)}:
                found.append(f"{section}.{name}")
    return found


def test_every_number_field_refuses_a_negative_value_naming_itself():
    """No count, size, rate, seed or time of a run is negative: -1 in any number field is refused
    with a line naming it. The fields are taken from the schema, so one added there is covered.
    (Planted: zero.persistence_threshold or train.eval_interval left out of the range lists, each
    passed.)"""
    from megazero.config.validate import get

    numbers = _number_fields()
    assert len(numbers) > 40 and {"zero.persistence_threshold", "train.max_wall_seconds"} <= set(numbers)
    for name in sorted(set(numbers) - CHECKED_ELSEWHERE):
        cfg = _cfg(f"--{name}", "-1")
        assert get(cfg, name) == -1
        with pytest.raises(ConfigError, match=rf"(^|\n){re.escape(name)}: "):
            validate_config(cfg)
