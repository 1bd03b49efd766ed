"""`megazero curate run` checks the whole config before any stage runs: an option outside its range,
an unknown key, a missing file or a task field the task files lack is one line naming the field and
what is allowed, and the output directory is never created."""

from __future__ import annotations

import gzip
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from data_pipeline.curate.config import build_config
from megazero.cli import main
from tests.test_curate_pipeline import write_corpus


@pytest.fixture
def base(tmp_path, monkeypatch) -> dict:
    """A valid config running every stage but quality (which needs a trained model), in ``tmp_path``
    so that the overrides below can name files relative to it."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path)
    task = "a task text long enough to hold one thirteen word n-gram for the decontamination stage"
    (tmp_path / "task.jsonl").write_text(json.dumps({"text": task, "label": 1}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "notes.txt").write_text("not a tokenizer\n")
    _tokenizer_without_eod(tmp_path / "noeod.json")
    (tmp_path / "plain.jsonl.gz").write_text((tmp_path / "raw.jsonl").read_text())  # named compressed, but plain
    (tmp_path / "packed.jsonl").write_bytes(gzip.compress((tmp_path / "raw.jsonl").read_bytes()))  # the reverse
    pq.write_table(pa.table({"body": ["a document in a column of another name"]}), tmp_path / "body.parquet")
    return {"input": {"paths": ["raw.jsonl"], "shard_docs": 7}, "output": {"dir": "out"},
            "stages": ["clean", "exact_dedup", "fuzzy_dedup", "decontaminate"],
            "clean": {"min_words": 20}, "decontaminate": {"tasks": ["task.jsonl"]}}


def _tokenizer_without_eod(path) -> None:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0, "word": 1}, unk_token="[UNK]")).save(str(path))


def refused(tmp_path, capsys, raw: dict, *overrides: str) -> str:
    """Run the CLI expecting a config error; returns its one line, after checking nothing was written."""
    (tmp_path / "curate.yaml").write_text(yaml.safe_dump(raw))
    assert main(["curate", "run", "curate.yaml", "--no-progress", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert not (tmp_path / "out").exists(), "the config error came after the run had started writing"
    return err[0]


@pytest.mark.parametrize("field, value, message", [
    ("fuzzy_dedup.threshold", "5", r"fuzzy_dedup\.threshold: 5\.0 is outside \[0, 1\]; it is the exact Jaccard"),
    ("fuzzy_dedup.threshold", "-1", r"fuzzy_dedup\.threshold: -1\.0 is outside \[0, 1\]"),
    ("fuzzy_dedup.bands", "0", r"fuzzy_dedup\.bands: 0 must be at least 1"),
    ("fuzzy_dedup.num_perm", "1000000000000", r"fuzzy_dedup\.num_perm: 1000000000000 is outside \[1, 8192\]; more "
     r"permutations refine the estimate little"),
    ("fuzzy_dedup.num_perm", "0", r"fuzzy_dedup\.num_perm: 0 is outside \[1, 8192\]"),
    ("fuzzy_dedup.bands", "30", r"fuzzy_dedup\.bands: bands x rows \(30 x 13\) needs at most num_perm \(260\)"),
    ("fuzzy_dedup.ngram", "0", r"fuzzy_dedup\.ngram: 0 is outside \[1, 64\]"),
    # a shingle as long as a document hashed each text that many times: minutes, printing nothing
    ("fuzzy_dedup.ngram", "100000", r"fuzzy_dedup\.ngram: 100000 is outside \[1, 64\]; characters a shingle holds"),
    # the default banding (turning at 0.79) would compare 18% of the pairs at 0.7: one that fits is named
    ("fuzzy_dedup.threshold", "0.7", r"fuzzy_dedup\.threshold: 0\.7 with bands 20 x rows 13 compares only 18% of "
     r"the pairs at that similarity .* set --fuzzy_dedup\.bands 28 --fuzzy_dedup\.rows 9 \(68%\)"),
    ("fuzzy_dedup.seed", "-1", r"fuzzy_dedup\.seed: -1 must be at least 0"),
    ("fuzzy_dedup.partitions", "-1", r"fuzzy_dedup\.partitions: -1 must be at least 0"),
    ("decontaminate.max_doc_freq", "0", r"decontaminate\.max_doc_freq: 0 must be at least 2; .*nothing would be removed"),
    ("decontaminate.max_doc_freq", "1", r"decontaminate\.max_doc_freq: 1 must be at least 2"),
    ("decontaminate.ngram", "0", r"decontaminate\.ngram: 0 is outside \[1, 1000\]"),
    ("decontaminate.ngram", "-2", r"decontaminate\.ngram: -2 is outside \[1, 1000\]"),
    # asked numpy for terabytes of multipliers while the config was checked: its traceback
    ("decontaminate.ngram", "1000000000000", r"decontaminate\.ngram: 1000000000000 is outside \[1, 1000\]; it is the "
     r"words in a compared n-gram"),
    # a task record's fields are names: a nested list was a TypeError's traceback
    ("decontaminate.task_fields", "[[text]]", r"decontaminate\.task_fields\[0\]: .*a string"),
    ("decontaminate.task_fields", "[text, [answer]]", r"decontaminate\.task_fields\[1\]: .*a string"),
    ("decontaminate.margin", "-1", r"decontaminate\.margin: -1 must be at least 0"),
    # below 0, every document with a match would be dropped whole, however few its splits
    ("decontaminate.max_splits", "-1", r"decontaminate\.max_splits: -1 must be at least 0"),
    ("decontaminate.min_piece_chars", "-5", r"decontaminate\.min_piece_chars: -5 must be at least 0"),
    ("decontaminate.task_fields", "[question]",
     r"decontaminate\.task_fields: question \(the first, which every record needs\) not in task\.jsonl \(its "
     r"records have label, text\)"),
    ("decontaminate.task_fields", "[text, answr]", r"decontaminate\.task_fields: answr in no task file \(they have "
     r"label, text\)"),
    ("decontaminate.task_fields", "[]", r"decontaminate\.task_fields: empty; list the fields"),
    ("decontaminate.tasks", "[missing.jsonl]", r"decontaminate\.tasks: missing\.jsonl: no such file"),
    ("decontaminate.tasks", "[empty.jsonl]", r"decontaminate\.tasks: empty\.jsonl holds no records"),
    ("decontaminate.tasks", "[]", r"decontaminate\.tasks: no task files"),
    # read as text, the one said to hold no records and the other to be corrupt
    ("decontaminate.tasks", "[packed.jsonl]", r"decontaminate\.tasks: .*packed\.jsonl: gzip data \(it starts with "
     r"b'\\x1f\\x8b.*\), though not named \.gz, so it would be read as text; rename it packed\.jsonl\.gz"),
    ("decontaminate.tasks", "[plain.jsonl.gz]", r"decontaminate\.tasks: .*plain\.jsonl\.gz: not gzip data"),
    # its hits were counted under the first entry, and the report gave the second's none
    ("decontaminate.tasks", "[task.jsonl, ./task.jsonl]", r"decontaminate\.tasks: \./task\.jsonl is listed twice "
     r"\(also as task\.jsonl\); list each task file once"),
    ("quality.alpha", "0", r"quality\.alpha: 0\.0 must be above 0; it is the Pareto shape"),
    ("quality.alpha", ".nan", r"quality\.alpha: nan is not a finite number"),
    ("quality.seed", "-1", r"quality\.seed: -1 must be at least 0"),
    ("clean.min_words", "-5", r"clean\.min_words: -5 must be at least 0"),
    ("clean.max_words", "10", r"clean\.max_words: 10 must be at least 20; .*every document would be dropped"),
    ("clean.max_symbol_ratio", "-1", r"clean\.max_symbol_ratio: -1\.0 is outside \[0, 1\]"),
    ("clean.max_repeated_line_ratio", "1.5", r"clean\.max_repeated_line_ratio: 1\.5 is outside \[0, 1\]"),
    ("exact_dedup.foo", "1", r"exact_dedup\.foo: unknown key; exact_dedup takes no fields"),
    ("preprocess.weight", "-1", r"preprocess\.weight: -1\.0 must be above 0; it is the curated dataset's weight"),
    ("preprocess.weight", ".inf", r"preprocess\.weight: inf is not a finite number"),
    ("preprocess.workers", "0", r"preprocess\.workers: 0 must be at least 1"),
    ("preprocess.tokenizer", "missing.model", r"preprocess\.tokenizer: missing\.model: tokenizer file not found"),
    # an unset variable in a generated config: the run would write into the current folder, or skip tokenizing
    ("output.dir", "''", r"output\.dir: an empty path names no folder \(it would be read as the current directory\)"),
    ("preprocess.tokenizer", "''",
     r"preprocess\.tokenizer: an empty path names no tokenizer; .*or leave the field out"),
    ("preprocess.tokenizer", "notes.txt", r"preprocess\.tokenizer: notes\.txt: not a tokenizer"),
    # it loads (--no-eod and training take it), but the curated shard ends each document with the token
    ("preprocess.tokenizer", "noeod.json", r"preprocess\.tokenizer: noeod\.json: no end-of-document token among "
     r"\[.*\] to end each curated document with"),
    ("executor.workers", "0", r"executor\.workers: 0 must be at least 1"),
    ("executor.kind", "spark", r"executor\.kind: 'spark' is not one of local, ray"),
    ("input.shard_docs", "0", r"input\.shard_docs: 0 must be at least 1"),
    ("input.paths", "[raw.jsonl, notes.txt]", r"input\.paths: .*notes\.txt: unknown input type; use \.jsonl"),
    # read, the whole file would be one bad record; found before the inputs ahead of it are ingested
    ("input.paths", "[raw.jsonl, plain.jsonl.gz]", r"input\.paths: .*plain\.jsonl\.gz: not gzip data \(it starts with "
     r"b'\{\"te'\), though named \.gz; rename it"),
    ("input.paths", "[raw.jsonl, packed.jsonl]", r"input\.paths: .*packed\.jsonl: gzip data \(it starts with "
     r"b'\\x1f\\x8b.*\), though not named \.gz, so it would be read as text; rename it packed\.jsonl\.gz"),
    ("input.paths", "[raw.jsonl, body.parquet]", r"input\.paths: .*body\.parquet: no column 'text' \(columns: "
     r"\['body'\]\); set input\.text_field"),
    # every file a glob matches, not only its first (empty.jsonl)
    ("input.paths", "['[ent]*']", r"input\.paths: .*notes\.txt: unknown input type; .* or narrow the glob"),
])
def test_bad_option_is_one_line_before_any_stage(tmp_path, capsys, base, field, value, message):
    line = refused(tmp_path, capsys, base, f"--{field}", value)
    assert re.search(message, line), line


@pytest.mark.parametrize("quality, message", [
    ({}, r"quality\.model: no classifier given"),
    ({"model": "missing.bin"}, r"quality\.model: missing\.bin: no such file"),
    ({"model": "notes.txt"}, r"quality\.model: notes\.txt is not a fastText model"),
])
def test_quality_model_is_checked_before_the_stages_ahead_of_it(tmp_path, capsys, base, quality, message):
    raw = {**base, "stages": ["clean", "exact_dedup", "quality"], "quality": quality}
    assert re.search(message, refused(tmp_path, capsys, raw)), message


@pytest.mark.parametrize("paths, out, message", [
    (["*/**/*.jsonl"], "out", r"input\.paths: \*/\*\*/\*\.jsonl would also match the shards this run writes under "
     r"output\.dir out \(a rerun would ingest them\)"),
    (["raw.jsonl", "*/*/*.jsonl.zst"], "out", r"input\.paths: \*/\*/\*\.jsonl\.zst would also match"),
    (["old/raw.jsonl"], "old", r"input\.paths: old/raw\.jsonl is inside output\.dir old; move the input"),
])
def test_inputs_that_reach_into_the_output_are_refused(tmp_path, capsys, base, paths, out, message):
    """The first run would pass, and the next would take its own shards for new documents."""
    (tmp_path / "old" / "z").mkdir(parents=True)
    (tmp_path / "old" / "raw.jsonl").write_text((tmp_path / "raw.jsonl").read_text())
    (tmp_path / "old" / "z" / "part.jsonl.zst").write_bytes(b"")
    line = refused(tmp_path, capsys, {**base, "input": {"paths": paths}, "output": {"dir": out}})
    assert re.search(message, line), line
    for harmless in (["*/*.jsonl"], ["old/*.jsonl"], ["**/task.jsonl"]):  # cannot reach out/STAGE/shard-*
        build_config({**base, "input": {"paths": harmless}})


def test_every_problem_is_reported_on_its_own_line(tmp_path, capsys, base):
    (tmp_path / "curate.yaml").write_text(yaml.safe_dump(base))
    assert main(["curate", "run", "curate.yaml", "--fuzzy_dedup.threshold", "2", "--quality.alpha", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(": ")[2] for line in err] == ["quality.alpha", "fuzzy_dedup.threshold"], err
    assert not (tmp_path / "out").exists()


def test_valid_options_and_defaults_are_accepted(tmp_path, base):
    question = "why does the river run past the old mill before it turns east toward the sea at dawn"
    (tmp_path / "qa.jsonl").write_text(json.dumps({"question": question, "answer": "because"}) + "\n")
    edges = {"fuzzy_dedup": {"threshold": 1.0}, "clean": {"min_words": 0, "max_words": 1, "max_symbol_ratio": 0},
             "decontaminate": {"tasks": ["qa.jsonl"], "task_fields": ["question", "answer"], "max_doc_freq": 2},
             "exact_dedup": None, "preprocess": {"weight": 0.5}}
    for raw in (base, {**base, **edges}):
        cfg = build_config(raw)
        assert cfg.stages == base["stages"] and not (tmp_path / "out").exists()
    assert build_config({"input": {"paths": ["raw.jsonl"]}}).fuzzy_dedup.threshold == 0.8


def _jsonl(path, *records) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


@pytest.mark.parametrize("records, fields, message", [
    ([{"text": "a"}, {"text": "b"}, {"question": "c"}], "[text]",
     r"decontaminate\.tasks: qa\.jsonl: 1 of 3 records hold no usable task text \(first: qa\.jsonl:3: no key 'text'"),
    ([{"text": "a"}, "{not json", {"text": "b"}], "[text]", r"1 of 3 records .*qa\.jsonl:2: malformed JSON"),
    ([{"text": "a", "choices": ["x", "y"]}, {"text": "b", "choices": 4}], "[text, choices]",
     r"1 of 2 records .*qa\.jsonl:2: field 'choices' is a number, not a string.*a string, or a list of strings"),
    ([{"text": "a", "label": 1}], "[text, label]", r"qa\.jsonl: 1 of 1 records .*field 'label' is a number"),
    ([{"text": "a"}, {"text": "b", "choices": ["x", 2]}], "[text, choices]", r"1 of 2 records .*qa\.jsonl:2: field"),
])
def test_every_task_record_is_checked_before_any_stage(tmp_path, capsys, base, records, fields, message):
    """A record past the first that holds no text where the config says its task text is would have
    left its n-grams out of the decontamination without a word."""
    _jsonl(tmp_path / "qa.jsonl", *records)
    line = refused(tmp_path, capsys, base, "--decontaminate.tasks", "[qa.jsonl]", "--decontaminate.task_fields", fields)
    assert re.search(message, line), line


def test_task_fields_of_later_records_and_lists_of_texts_count(tmp_path, base):
    """A further field only later records have is no misspelling; a list of strings (multiple-choice
    options) is task text, each string its own; a null field is absent."""
    from data_pipeline.curate.decontaminate import build_task_ngrams

    _jsonl(tmp_path / "qa.jsonl", {"text": "one two three"}, {"text": "four five six", "choices": None},
           {"text": "seven eight nine", "choices": ["ten eleven twelve", "thirteen fourteen fifteen"]})
    cfg = build_config({**base, "decontaminate": {"tasks": ["qa.jsonl"], "task_fields": ["text", "choices"],
                                                  "ngram": 3}})
    stats = build_task_ngrams(cfg.decontaminate, str(tmp_path / "tasks.npz"))
    assert stats["task_ngrams"] == 5
    _jsonl(tmp_path / "qa.jsonl", {"text": "one two three"}, {"choices": "x"})  # changed after the check
    with pytest.raises(ValueError, match=r"qa\.jsonl: 1 of 2 records hold no usable task text"):
        build_task_ngrams(cfg.decontaminate, str(tmp_path / "tasks.npz"))


def test_a_stage_listed_twice_is_refused_and_a_sibling_folder_is_not_inside_the_output(tmp_path):
    (tmp_path / "out2").mkdir()
    (tmp_path / "out2" / "raw.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    build_config({"input": {"paths": [str(tmp_path / "out2" / "raw.jsonl")]}, "output": {"dir": str(tmp_path / "out")}})
    with pytest.raises(ValueError, match="listed twice"):
        build_config({"input": {"paths": [str(tmp_path / "out2" / "raw.jsonl")]}, "output": {"dir": str(tmp_path / "o")},
                      "stages": ["clean", "clean"]})


def test_an_input_that_cannot_be_read_is_one_line(tmp_path, capsys, base, monkeypatch):
    """An input whose first bytes cannot be read (no permission, an I/O error) is named in the config's
    one line, not a traceback from the input check. (Planted: only ValueError caught there.)"""
    import errno

    import data_pipeline.sources as sources

    def unreadable(path, *args, **kwargs):
        if str(path).endswith("more.jsonl.gz"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return open(path, *args, **kwargs)

    (tmp_path / "more.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00")
    monkeypatch.setattr(sources, "open", unreadable, raising=False)
    line = refused(tmp_path, capsys, base, "--input.paths", "[more.jsonl.gz]")
    assert re.search(r"input\.paths: .*more\.jsonl\.gz: cannot be read \(Permission denied\)", line), line


def test_the_documented_defaults_are_the_configs():
    """Every default in docs/curation.md's option table is the one a config gets (planted: a default
    changed in code, such as fuzzy_dedup.max_bucket_pairs or decontaminate.margin, and the docs left
    saying the old one). A row lists options and defaults in the same order, split at ", " and " / ";
    an option without a section is in the one before it."""
    from pathlib import Path

    from data_pipeline.curate.config import CurateConfig

    doc = (Path(__file__).parent.parent / "docs" / "curation.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (`[a-z_]+\.[^|]*) \| ([^|]*) \|", doc, flags=re.M)
    defaults, checked = CurateConfig(), 0
    for options, values in rows:
        names, values = re.split(r", | / ", options), re.split(r", | / ", values)
        assert len(names) == len(values), (options, values)
        for name, value in zip(names, values):
            name = name.strip("`")
            if "." in name:
                section, name = name.split(".")
            assert getattr(getattr(defaults, section), name) == yaml.safe_load(value.strip("`")), (section, name)
            checked += 1
    assert checked == 25


def test_the_workers_flag_is_executor_workers(tmp_path, capsys, base):
    """``--workers`` sets executor.workers and is checked as it is (planted: the flag dropped, so the
    run went on with the config's workers and said nothing)."""
    line = refused(tmp_path, capsys, base, "--workers", "0")
    assert re.search(r"executor\.workers: 0 must be at least 1", line), line


def test_two_inputs_of_one_file_name_are_refused(tmp_path, capsys, base):
    """A record without an id is named FILE:LINE, so a/raw.jsonl and b/raw.jsonl would give two
    documents one id: one Pareto draw for both, and audits that cannot tell them apart."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "raw.jsonl").write_text((tmp_path / "raw.jsonl").read_text())
    line = refused(tmp_path, capsys, {**base, "input": {"paths": ["a/raw.jsonl", "b/raw.jsonl"]}})
    assert "input.paths: two inputs are named raw.jsonl; a document without an id is named FILE:LINE" in line, line
    # one file found by two patterns is listed twice, not two files of one name; a folder is no file
    line = refused(tmp_path, capsys, {**base, "input": {"paths": ["a/r*.jsonl", "a/raw.jsonl"]}})
    assert re.search(r"input\.paths: \S*a/raw\.jsonl is listed twice \(two patterns find it, or it is a link to "
                     r"another input\)", line), line
    os.link(tmp_path / "a" / "raw.jsonl", tmp_path / "a" / "hard.jsonl")  # a hard link: the same file (planted: paths)
    line = refused(tmp_path, capsys, {**base, "input": {"paths": ["a/raw.jsonl", "a/hard.jsonl"]}})
    assert re.search(r"input\.paths: \S*a/hard\.jsonl is listed twice", line), line
    (tmp_path / "c.jsonl").mkdir()
    line = refused(tmp_path, capsys, {**base, "input": {"paths": ["*.jsonl"]}})
    assert re.search(r"input\.paths: \S*c\.jsonl: is a folder; give the files in it", line), line


def test_a_home_folder_in_any_path_is_expanded(tmp_path, monkeypatch):
    """Inputs took ``~`` as the home folder; the model, task files, tokenizer and output folder looked
    for a folder named ``~`` (``quality.model: ~/q.bin: no such file`` for a file that was there)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    corpus = write_corpus(tmp_path)
    (tmp_path / "task.jsonl").write_text(json.dumps({"text": " ".join(f"w{i}" for i in range(20))}) + "\n")
    cfg = build_config({"input": {"paths": [corpus]}, "output": {"dir": "~/curated"}, "stages": ["decontaminate"],
                        "decontaminate": {"tasks": ["~/task.jsonl"]}, "quality": {"model": "~/q.bin"}})
    assert cfg.output.dir == str(tmp_path / "curated") and cfg.decontaminate.tasks == [str(tmp_path / "task.jsonl")]
    assert cfg.quality.model == str(tmp_path / "q.bin")
