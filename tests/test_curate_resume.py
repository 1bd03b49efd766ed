"""Curation runs that stop and run again: a run killed between tasks (in this process, and by a real
kill -9) resumes to the files a whole run writes, a damaged completion marker reruns its task, a
stage made with other settings or rules, or under a changed stage before it, is refused or
discarded, and a tokenizing step killed outright is redone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from data_pipeline.curate import pipeline
from data_pipeline.curate.config import build_config
from data_pipeline.curate.runner import LocalExecutor, _run_packed
from tests.test_curate_pipeline import _docs, _sentencepiece, config, tree_digest, write_corpus


class _Killed(Exception):
    pass


class DyingExecutor(LocalExecutor):
    """Runs ``budget`` tasks, then dies as a killed process would: the next task's output shard is
    written but its marker is not, and a temporary file is left behind."""

    budget = 0

    def run(self, jobs):
        for fn, args, marker in jobs:
            if DyingExecutor.budget == 0:
                out = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
                if out.endswith(".jsonl"):
                    fn(*args)  # the output is complete, its marker missing
                    Path(f"{out}.tmp-999").write_text("half a shard")
                Path(f"{marker}.tmp-999").write_text("{")  # and its marker's, in .done
                raise _Killed
            DyingExecutor.budget -= 1
            yield _run_packed((fn, args, marker))


@pytest.mark.parametrize("budget", [2, 11, 19, 27])
def test_killed_run_resumes_to_identical_output(tmp_path, monkeypatch, budget):
    corpus = write_corpus(tmp_path)
    pipeline.run_pipeline(build_config(config(tmp_path, [corpus], out="whole")), log=lambda s: None)
    monkeypatch.setattr(pipeline, "make_executor", lambda *a: DyingExecutor(1))
    DyingExecutor.budget = budget
    with pytest.raises(_Killed):
        pipeline.run_pipeline(build_config(config(tmp_path, [corpus], out="killed")), log=lambda s: None)
    monkeypatch.undo()
    pipeline.run_pipeline(build_config(config(tmp_path, [corpus], out="killed")), log=lambda s: None)
    assert tree_digest(str(tmp_path / "killed")) == tree_digest(str(tmp_path / "whole"))
    assert not [f for _, _, files in os.walk(tmp_path / "killed") for f in files if ".tmp-" in f]  # .done's too


def test_rerun_with_other_options_is_refused(tmp_path):
    """Another stage option, or --strict (which decides whether a bad record stops the input stage;
    planted: strict left out of its fingerprint, passed)."""
    corpus = write_corpus(tmp_path)
    pipeline.run_pipeline(build_config(config(tmp_path, [corpus])), log=lambda s: None)
    raw = config(tmp_path, [corpus])
    raw["clean"]["min_words"] = 5
    with pytest.raises(ValueError, match=r"01-clean was made with other settings \(options differ\); delete it"):
        pipeline.run_pipeline(build_config(raw), log=lambda s: None)
    with pytest.raises(ValueError, match=r"00-input was made with other settings \(strict differ\); delete it"):
        pipeline.run_pipeline(build_config({**config(tmp_path, [corpus]), "strict": True}), log=lambda s: None)


def test_stages_made_by_earlier_rules_are_refused(tmp_path):
    """A finished run's stages made by code whose stages compute otherwise (``pipeline.RULES`` raised
    with a fix) are refused naming the rules, not kept beside stages the new code makes. (Planted:
    no rules in the fingerprint.)"""
    corpus = write_corpus(tmp_path)
    pipeline.run_pipeline(build_config(config(tmp_path, [corpus])), log=lambda s: None)
    stage = next((tmp_path / "out").glob("00-input")) / "stage.json"
    recorded = json.loads(stage.read_text())
    stage.write_text(json.dumps({**recorded, "rules": pipeline.RULES - 1}))
    with pytest.raises(ValueError, match=r"00-input was made with other settings \(rules differ\)"):
        pipeline.run_pipeline(build_config(config(tmp_path, [corpus])), log=lambda s: None)


def test_a_change_upstream_or_in_a_file_read_reaches_every_later_stage(tmp_path):
    """A stage is stale when anything before it changed, not only its own options: another earlier
    stage (planted: fingerprints without the upstream digest, which served the old exact_dedup
    output after a new fuzzy_dedup), an input file edited in place, or the tokenizer of the
    tokenized shards (the blend of shards no longer the last stage's), a task file. An unfinished
    stage made otherwise is discarded and run again."""
    corpus = write_corpus(tmp_path)
    quiet = lambda s: None  # noqa: E731
    pipeline.run_pipeline(build_config(config(tmp_path, [corpus], stages=["clean", "exact_dedup"])), log=quiet)
    with pytest.raises(ValueError, match=r"02-exact_dedup was made with other settings \(upstream differ\)"):
        pipeline.run_pipeline(build_config(config(tmp_path, [corpus], stages=["fuzzy_dedup", "exact_dedup"])),
                              log=quiet)
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "one more document " * 10}) + "\n")
    with pytest.raises(ValueError, match=r"00-input was made with other settings \(inputs differ\)"):
        pipeline.run_pipeline(build_config(config(tmp_path, [corpus], stages=["clean", "exact_dedup"])), log=quiet)

    (tmp_path / "b").mkdir()
    fresh = write_corpus(tmp_path / "b")
    raw = config(tmp_path, [fresh], out="tok", stages=["clean"], preprocess={"tokenizer": _sentencepiece(tmp_path)})
    pipeline.run_pipeline(build_config(raw), log=quiet)
    with pytest.raises(ValueError, match=r"tokenized was made with other settings \(upstream differ\)"):
        pipeline.run_pipeline(build_config({**raw, "stages": ["clean", "exact_dedup"]}), log=quiet)  # not deduplicated
    os.utime(raw["preprocess"]["tokenizer"], ns=(1, 1))  # the tokenizer file replaced
    with pytest.raises(ValueError, match=r"tokenized was made with other settings \(tokenizer differ\)"):
        pipeline.run_pipeline(build_config(raw), log=quiet)

    task = tmp_path / "qa.jsonl"
    task.write_text(json.dumps({"text": " ".join(_docs(1)[0].split()[:20])}) + "\n")
    raw = config(tmp_path, [fresh], out="decon", stages=["decontaminate"], decontaminate={"tasks": [str(task)]})
    pipeline.run_pipeline(build_config(raw), log=quiet)
    task.write_text(json.dumps({"text": " ".join(_docs(1)[0].split()[:30])}) + "\n")  # the task file edited
    with pytest.raises(ValueError, match=r"01-decontaminate was made with other settings \(files differ\)"):
        pipeline.run_pipeline(build_config(raw), log=quiet)

    other = config(tmp_path, [fresh], out="partial", stages=["clean"])
    stage = tmp_path / "partial" / "01-clean"
    stage.mkdir(parents=True)
    (stage / "stage.json").write_text(json.dumps({"stage": "clean", "options": {"min_words": 1}}))
    (stage / "left-over.jsonl").write_text("{}\n")
    lines = []
    pipeline.run_pipeline(build_config(other), log=lines.append)
    assert any("01-clean: discarding its unfinished output" in line for line in lines), lines
    assert not (stage / "left-over.jsonl").exists() and (stage / "stats.json").exists()


def test_a_damaged_completion_marker_reruns_its_task(tmp_path):
    """A marker cut to nothing (a disk that lost its last write) stopped the stage with "Expecting value"
    and no file named; the task now runs again and the stage ends as an undamaged run does."""
    corpus = write_corpus(tmp_path)
    raw = config(tmp_path, [corpus], stages=["clean"])
    pipeline.run_pipeline(build_config(raw), log=lambda s: None)
    whole = tree_digest(str(tmp_path / "out"))
    marker = sorted((tmp_path / "out" / "01-clean" / ".done").iterdir())[0]
    marker.write_text("")
    (tmp_path / "out" / "01-clean" / "stats.json").unlink()
    pipeline.run_pipeline(build_config(raw), log=lambda s: None)
    assert tree_digest(str(tmp_path / "out")) == whole and json.loads(marker.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("markers", [3, 30, 90])
def test_sigkill_mid_run_then_rerun_gives_identical_output(tmp_path, markers):
    """A real kill -9 of `megazero curate run` once some tasks have finished, then a rerun."""
    import signal
    import subprocess
    import sys
    import time

    corpus = write_corpus(tmp_path, n=400)
    raw = config(tmp_path, [corpus], out="killed", executor={"workers": 2})
    raw["input"]["shard_docs"] = 5
    path = tmp_path / "curate.yaml"
    path.write_text(yaml.safe_dump(raw))
    command = [sys.executable, "-m", "megazero.cli", "curate", "run", str(path), "--no-progress"]
    proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    done = lambda: sum(len(files) for root, _, files in os.walk(tmp_path / "killed") if root.endswith(".done"))  # noqa: E731
    while proc.poll() is None and done() < markers:
        time.sleep(0.001)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before the kill: nothing was tested"
    assert subprocess.run(command, stdout=subprocess.DEVNULL).returncode == 0
    whole = config(tmp_path, [corpus], out="whole")
    whole["input"]["shard_docs"] = 5
    pipeline.run_pipeline(build_config(whole), log=lambda s: None)
    assert tree_digest(str(tmp_path / "killed")) == tree_digest(str(tmp_path / "whole"))


def test_a_tokenizing_step_killed_outright_is_redone_to_the_same_files(tmp_path):
    """kill -9 between putting the .bin and the .idx in place left the .bin and a temporary .idx:
    every rerun tokenized the corpus again, then stopped on the .bin as another run's."""
    raw = config(tmp_path, [write_corpus(tmp_path)], stages=["clean"],
                 preprocess={"tokenizer": _sentencepiece(tmp_path)})
    pipeline.run_pipeline(build_config(raw), log=lambda s: None)
    whole, dataset = tree_digest(str(tmp_path / "out")), tmp_path / "out/tokenized/curated_text_document"
    os.remove(f"{dataset}.tokenizer.json")
    os.replace(f"{dataset}.idx", f"{dataset}.idx.tmp-999-0123abcd")
    pipeline.run_pipeline(build_config(raw), log=lambda s: None)
    assert tree_digest(str(tmp_path / "out")) == whole


def test_a_run_killed_while_discarding_a_stage_does_not_reuse_it(tmp_path, monkeypatch):
    """A stage left unfinished, then run with other settings, is discarded; killed part-way through
    that removal (stage.json gone first, its completion markers not yet), the next run took the
    folder for a new stage whose tasks were done and kept their old-settings shards. The folder is
    now renamed aside before it is deleted, and what is left of it goes at the next start."""
    corpus = write_corpus(tmp_path)
    loose = config(tmp_path, [corpus], stages=["clean"])
    loose["clean"]["min_words"] = 5
    pipeline.run_pipeline(build_config(loose), log=lambda s: None)
    (tmp_path / "out" / "01-clean" / "stats.json").unlink()  # unfinished: some tasks have their markers
    strict = config(tmp_path, [corpus], stages=["clean"])
    strict["clean"]["min_words"] = 81  # every document of the corpus but its near copies has 80 words
    remove = pipeline.shutil.rmtree

    def killed(path, *args, **kwargs):  # the kill lands after the first file, stage.json, is deleted
        os.remove(os.path.join(path, "stage.json"))
        raise _Killed

    monkeypatch.setattr(pipeline.shutil, "rmtree", killed)
    with pytest.raises(_Killed):
        pipeline.run_pipeline(build_config(strict), log=lambda s: None)
    monkeypatch.setattr(pipeline.shutil, "rmtree", remove)
    pipeline.run_pipeline(build_config(strict), log=lambda s: None)
    pipeline.run_pipeline(build_config(config(tmp_path, [corpus], out="whole", stages=["clean"], clean={"min_words": 81})),
                          log=lambda s: None)
    assert tree_digest(str(tmp_path / "out")) == tree_digest(str(tmp_path / "whole"))
    assert sorted(os.listdir(tmp_path / "out")) == ["00-input", "01-clean", "report", "report.md"]
    # a leftover that is a file goes too, and a folder of the user's that only ends alike stays
    (tmp_path / "out" / "02-clean.discarded").write_text("")
    (tmp_path / "out" / "notes.discarded").mkdir()
    pipeline.run_pipeline(build_config(strict), log=lambda s: None)
    assert sorted(os.listdir(tmp_path / "out")) == ["00-input", "01-clean", "notes.discarded", "report", "report.md"]
