"""Config files as YAML reads them: numbers YAML 1.1 leaves as text are the numbers they spell, a
number it would read as another is refused, text fields keep what was written (through merge keys,
booleans and the command line), null where a field cannot take it, empty sections, and merge keys
that are no repeated keys.
"""

import pytest
import yaml

from megazero.config import Config, load_config
from megazero.config.loader import read_yaml
from megazero.errors import ConfigError


def _cfg(*overrides: str) -> Config:
    return load_config(None, list(overrides))


@pytest.mark.parametrize("text", ["1e3", "1E+3", ".5e3", "-2e-3", "+1.5e2", "nan", "-inf", "+Infinity"])
def test_a_float_yaml_1_1_reads_as_text_is_the_number_it_spells(text):
    """YAML 1.1 reads an exponent's float without a dot or without its exponent's sign as text, and
    nan and inf unless written .nan and .inf: a float field takes each as its number, nan and inf
    left for the field's own check to refuse by name (planted: the pattern matching without a sign, a
    leading dot or a signed exponent; nan and inf refused as no number)."""
    from data_pipeline.typed_config import coerce

    assert yaml.safe_load(text) == text  # what a config's reader hands on
    assert repr(coerce(text, float, "optimizer.lr")) == repr(float(text))


@pytest.mark.parametrize("text, value", [
    ("3e11", 300_000_000_000), ("15E2", 1500), ("2e0", 2), ("12345678901234567e3", 12345678901234567000),
    ("1.5e0", None), ("3e-1", None), ("1e10000000", None)])
def test_an_integer_yaml_1_1_reads_as_text_is_the_integer_it_spells(text, value):
    """A token budget written 3e11 reached an integer field as text, and was refused as no integer
    while a float field took it (planted: integers as written only); spelled exactly, not through a
    float (planted: 17 digits rounded by float); a fraction is still refused, and so is an exponent
    no count reaches (planted: unbounded, 1e10000000 took minutes to spell out)."""
    from data_pipeline.typed_config import coerce

    assert yaml.safe_load(text) == text
    if value is None:
        with pytest.raises(ValueError, match=f"train.train_tokens: expected an integer, got '{text}'"):
            coerce(text, int, "train.train_tokens")
    else:
        assert coerce(text, int, "train.train_tokens") == value


@pytest.mark.parametrize("yaml_text, message", [
    ("train: {max_wall_seconds: fast}", "train.max_wall_seconds: expected a number or null, got 'fast'"),
    ("data: {blend_preset: [mtnlg]}", "data.blend_preset: expected a string or null, got ['mtnlg']"),
    ("parallel: {pipeline_split: 5}", "parallel.pipeline_split: expected a list or null, got 5"),
    ("logging: {profile_steps: 5}", "logging.profile_steps: expected a list or null, got 5"),  # a list[int]
])
def test_a_field_that_may_be_null_says_so_when_refused(tmp_path, yaml_text, message):
    """Null is most such fields' default, and often the fix, so the message offers it, for each type
    (true, false or null and an integer's are in test_bad_inputs and test_convert_bad_inputs)."""
    (tmp_path / "run.yaml").write_text(yaml_text + "\n")
    with pytest.raises(ConfigError) as refused:
        load_config(str(tmp_path / "run.yaml"), [])
    assert str(refused.value) == message


def test_an_empty_yaml_section_takes_overrides(tmp_path):
    """``data:`` with its fields commented out is an empty section to the loader, so an override of one
    of its fields applies (it was refused as "expected a mapping, got NoneType")."""
    (tmp_path / "empty.yaml").write_text("data:\ntrain:\n  train_steps: 2\n")
    cfg = load_config(str(tmp_path / "empty.yaml"), ["--data.split", "1"])
    assert (cfg.data.split, cfg.train.train_steps) == ("1", 2)
    # and without one it takes the section's defaults (planted: refused as no mapping, passed)
    assert load_config(str(tmp_path / "empty.yaml")).data == Config().data


def test_text_fields_take_the_command_line_as_typed(tmp_path):
    """YAML would read ``2024_01`` as 202401, ``98:1:1`` as a base-60 number (all data to training) and
    cut ``exp #3`` at its comment; a text field takes the value as typed, ``null`` aside where the field
    may be None, while other fields keep YAML's types."""
    cfg = _cfg("--logging.run_dir", "2024_01", "--data.split", "98:1:1", "--checkpoint.load", "runs/exp #3",
               "--data.tokenizer", "null", "--train.seed", "7")
    assert (cfg.logging.run_dir, cfg.data.split, cfg.checkpoint.load) == ("2024_01", "98:1:1", "runs/exp #3")
    assert cfg.data.tokenizer is None and cfg.train.seed == 7
    assert _cfg("--logging.run_dir", '"2024_01"', "--model.norm", "'rmsnorm'").logging.run_dir == "2024_01"
    from data_pipeline.curate.config import CurateConfig
    from megazero.config.loader import parse_overrides

    assert parse_overrides(["--output.dir", "007", "--executor.ray-address", "null"], CurateConfig) == [
        ("output.dir", "007"), ("executor.ray-address", None)]
    # a field named with hyphens is the same text field (planted: looked up as typed, YAML read 2024_01)
    assert parse_overrides(["--executor.ray-address", "2024_01"], CurateConfig) == [("executor.ray-address", "2024_01")]
    with pytest.raises(ConfigError, match=r"model.preset: unknown preset '\[gpt2\]'"):
        _cfg("--model.preset", "[gpt2]")
    (tmp_path / "list.yaml").write_text("model: {preset: [gpt2]}\n")
    with pytest.raises(ConfigError, match=r"model.preset: unknown preset \['gpt2'\]"):
        load_config(str(tmp_path / "list.yaml"))
    (tmp_path / "tok.yaml").write_text("model: {vocab_size: auto}\ndata: {tokenizer: [tok.json]}\n")
    with pytest.raises(ConfigError, match=r"data.tokenizer: expected a path, got \['tok.json'\]"):
        load_config(str(tmp_path / "tok.yaml"))


def test_a_config_file_gives_its_text_fields_as_written(tmp_path):
    """In a YAML file, too, an unquoted text field is taken as written: YAML 1.1 read ``98:1:1`` as a
    base-60 number, a split of one share that sent every document to training, and ``2024_01`` as
    202401; number fields keep YAML's reading, and null stays null. (It kept the digits, silently.)"""
    (tmp_path / "run.yaml").write_text("data: {split: 98:1:1, cache_dir: null, seed: 1_000}\n"
                                       "logging: {run_dir: 2024_01, wandb_project: '7'}\n")
    cfg = load_config(str(tmp_path / "run.yaml"))
    assert (cfg.data.split, cfg.data.cache_dir, cfg.data.seed) == ("98:1:1", None, 1000)
    assert (cfg.logging.run_dir, cfg.logging.wandb_project) == ("2024_01", "7")
    typed = load_config(None, ["--data.split", "98:1:1", "--logging.run_dir", "2024_01"])
    assert (typed.data.split, typed.logging.run_dir) == (cfg.data.split, cfg.logging.run_dir)
    from data_pipeline.curate.config import CurateConfig  # the curation config is read the same way

    (tmp_path / "curate.yaml").write_text("output: {dir: 007}\n")
    assert read_yaml(str(tmp_path / "curate.yaml"), CurateConfig) == {"output": {"dir": "007"}}


def test_a_number_yaml_reads_as_another_is_refused(tmp_path):
    """YAML 1.1 reads ``0042`` as octal 34 and ``1:30`` as 90: a seed or a step count changed without a
    word. Such a number of a number field is refused, in a file (naming its line) and on the command
    line, and so is ``08``, which YAML left as text and the integer check called no integer; quoted
    they are text, and a text field takes them as written. (Planted: YAML's reading kept.)"""
    (tmp_path / "run.yaml").write_text("train:\n  seed: 0042\n")
    with pytest.raises(ConfigError) as refused:
        load_config(str(tmp_path / "run.yaml"))
    assert str(refused.value) == (f"{tmp_path / 'run.yaml'} (line 2, column 9): 0042 has a leading zero, which YAML "
                                  "1.1 reads as octal (or as text); write the number without it")
    (tmp_path / "run.yaml").write_text("optimizer: {lr: 1:30}\n")
    with pytest.raises(ConfigError, match=r"run.yaml \(line 1, column 17\): 1:30 is a base-60 number to YAML 1.1"):
        load_config(str(tmp_path / "run.yaml"))
    for typed, shown in (("010", "--train.train_steps: 010"), ("08", "train.train_steps: 08"), ("-07", "--train.train_steps: -07")):
        with pytest.raises(ConfigError) as refused:
            _cfg("--train.train_steps", typed)
        assert str(refused.value) == f"{shown} has a leading zero, which YAML 1.1 reads as octal (or as text); " \
                                     "write the number without it"
    with pytest.raises(ConfigError, match="--train.max_wall_seconds: 1:30 is a base-60 number"):
        _cfg("--train.max_wall_seconds", "1:30")
    assert _cfg("--train.seed", "0", "--optimizer.lr", "0.5", "--logging.run_dir", "007").logging.run_dir == "007"
    (tmp_path / "run.yaml").write_text("train: {seed: 0}\noptimizer: {lr: 0.001}\nlogging: {run_dir: 0042}\n")
    assert load_config(str(tmp_path / "run.yaml")).logging.run_dir == "0042"


def test_text_fields_as_written_reach_through_merge_keys_and_booleans(tmp_path):
    """A text field brought in by a merge key kept YAML 1.1's number (planted: a section's own keys
    alone), and ``no`` for a text field was false where the command line takes it as typed (planted:
    numbers alone); a key that is no plain scalar is refused in one line, not a TypeError (planted:
    every key looked up); a mapping merged into itself is read, not recursed into for ever."""
    (tmp_path / "run.yaml").write_text("data: {<<: {split: 98:1:1}, seed: 3}\nlogging: {wandb_project: no}\n")
    cfg = load_config(str(tmp_path / "run.yaml"))
    assert (cfg.data.split, cfg.data.seed, cfg.logging.wandb_project) == ("98:1:1", 3, "no")
    (tmp_path / "run.yaml").write_text("data: &a {split: 98:1:1, <<: *a}\n")  # merged into itself
    assert load_config(str(tmp_path / "run.yaml")).data.split == "98:1:1"
    (tmp_path / "run.yaml").write_text("data: {[a, b]: 1}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(str(tmp_path / "run.yaml"))
    assert "\n" not in str(refused.value), refused.value


def test_null_is_text_for_a_text_field_that_cannot_be_null():
    """``null`` (or YAML's ``~``) empties an optional text field; a required one, such as the run
    directory, takes it as the name typed, not as a missing value to refuse."""
    cfg = _cfg("--logging.run_dir", "null", "--data.tokenizer", "~", "--checkpoint.load", "null")
    assert (cfg.logging.run_dir, cfg.data.tokenizer, cfg.checkpoint.load) == ("null", None, None)


def test_yaml_merge_keys_are_not_repeated_keys(tmp_path):
    """``<<: *anchor`` merges defaults that the mapping's own keys override; only a key written twice
    is refused."""
    from megazero.errors import ConfigError

    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {lr: 1.0e-4, min_lr: 1.0e-5}\noptimizer:\n  <<: *b\n  lr: 3.0e-4\n")
    raw = read_yaml(str(path))
    assert raw["optimizer"] == {"lr": 3.0e-4, "min_lr": 1.0e-5}
    path.write_text("optimizer:\n  lr: 1.0e-4\n  lr: 3.0e-4\n")
    with pytest.raises(ConfigError, match="line 3.*'lr' appears twice"):
        read_yaml(str(path))


def test_a_merged_mapping_that_overrides_its_own_merge_is_no_repeat(tmp_path):
    path = tmp_path / "nested.yaml"
    path.write_text("a: &a {x: 1}\ndefaults:\n  inner: &b\n    <<: *a\n    x: 3\nc:\n  <<: *b\n  y: 5\n")
    assert read_yaml(str(path)) == yaml.safe_load(path.read_text())
