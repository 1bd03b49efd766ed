"""What `megazero curate run` prints while it runs: a bar per stage and sub-stage on a terminal's stderr
(none when stderr is not a terminal or with --no-progress), counting shards and starting at the tasks
a resumed run already finished, and one summary line per stage on stdout."""

from __future__ import annotations

import json
import re
import sys

import yaml

from data_pipeline.curate.runner import LocalExecutor, Task, run_tasks
from megazero.cli import main
from tests.test_curate_pipeline import config, write_corpus

SUB_STAGES = ["input", "clean", "exact: hashes", "exact: duplicates", "exact: filter", "fuzzy: signatures",
              "fuzzy: buckets", "fuzzy: edges", "fuzzy: components", "fuzzy: filter"]


def _final_counts(err: str) -> dict:
    """{bar description: (done, total)} as each bar last showed it."""
    return {desc: (int(done), int(total))
            for desc, done, total in re.findall(r"([a-z:_ ]+): +\d+%\|[^|]*\| *(\d+)/(\d+)", err)}


def _run(tmp_path, monkeypatch, capsys, *args: str, tty: bool = True) -> tuple[str, str]:
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "curate.yaml"
    corpus = tmp_path / "raw.jsonl"  # written once: a rewritten input makes the finished run stale
    path.write_text(yaml.safe_dump(config(tmp_path, [str(corpus) if corpus.exists() else write_corpus(tmp_path)])))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    assert main(["curate", "run", str(path), *args]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_a_terminal_gets_a_bar_per_sub_stage_and_a_line_per_stage(tmp_path, monkeypatch, capsys):
    out, err = _run(tmp_path, monkeypatch, capsys)
    bars = _final_counts(err)
    shards = len(list((tmp_path / "out" / "00-input").glob("shard-*.jsonl")))
    assert list(bars) == SUB_STAGES
    assert all(done == total for done, total in bars.values()), bars
    assert bars["input"] == (1, 1) and bars["clean"] == (shards, shards) and bars["fuzzy: components"] == (1, 1)
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == ["input", "clean", "exact_dedup", "fuzzy_dedup"]
    for line, stage in zip(lines[1:4], ("01-clean", "02-exact_dedup", "03-fuzzy_dedup")):
        stats = json.loads((tmp_path / "out" / stage / "stats.json").read_text())
        assert f"{stats['docs_in']} -> {stats['docs_out']} documents" in line
    assert lines[-1].startswith("curated ") and "report.md" in lines[-1]
    out, err = _run(tmp_path, monkeypatch, capsys)  # a finished run: nothing to do, no bars
    assert err == "" and all(": already complete (" in line for line in out.splitlines()[:4])


def test_no_bars_off_a_terminal_or_with_no_progress(tmp_path, monkeypatch, capsys):
    out, err = _run(tmp_path, monkeypatch, capsys, tty=False)
    assert err == "" and "clean: " in out
    out, err = _run(tmp_path / "again", monkeypatch, capsys, "--no-progress", tty=True)
    assert err == "" and "clean: " in out


def _touch(path: str) -> dict:
    with open(path, "w") as f:
        f.write("x")
    return {}


def test_a_resumed_stage_starts_its_bar_at_the_finished_tasks(tmp_path, capsys):
    tasks = [Task(f"t{i}", _touch, (str(tmp_path / f"f{i}"),)) for i in range(4)]
    run_tasks(LocalExecutor(1), str(tmp_path), tasks[:1], "demo")  # as if killed after the first task
    run_tasks(LocalExecutor(1), str(tmp_path), tasks, "demo", progress=True)
    shown = [(int(a), int(b)) for a, b in re.findall(r"demo: +\d+%\|[^|]*\| *(\d+)/(\d+)", capsys.readouterr().err)]
    assert shown[0] == (1, 4) and shown[-1] == (4, 4)
