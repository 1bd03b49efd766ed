"""`megazero curate run`: stages in order, byte-identical output for any worker count, resumable after a
kill at any task, and bad input reported with file and line (counted, or fatal with --strict)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from pathlib import Path

import pytest
import yaml

from data_pipeline.curate import pipeline
from data_pipeline.curate.config import build_config
from data_pipeline.curate.runner import LocalExecutor
from megazero.cli import main
from tests.curation import shown_demo_chain, train_quality_model

WORDS = ("river stone market garden lantern harbor pencil orchard violet thunder meadow copper "
         "whisper canyon ribbon saddle marble cobalt feather glacier").split()


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(80)) + "." for _ in range(n)]
    docs += docs[:5]  # exact copies
    docs += [d.replace("river", "creek", 1) + " The end." for d in docs[5:10]]  # near copies, Jaccard about 0.95
    docs += ["too short", "buy $$$ ### now @@@ !!! " * 30]  # junk
    return docs


def write_corpus(tmp_path: Path, n: int = 40, extra_lines: tuple = ()) -> str:
    path = tmp_path / "raw.jsonl"
    lines = [json.dumps({"text": d}) for d in _docs(n)] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def config(tmp_path: Path, inputs: list[str], out: str = "out", **sections) -> dict:
    raw = {"input": {"paths": inputs, "shard_docs": 7}, "output": {"dir": str(tmp_path / out)},
           "stages": ["clean", "exact_dedup", "fuzzy_dedup"], "clean": {"min_words": 20}}
    raw.update(sections)
    return raw


def every_stage(tmp_path: Path) -> dict:
    """Config sections that run all five stages, each with something to do: a quality model trained
    on part of the corpus's words against the rest plus junk (so the Pareto draw keeps some
    documents and drops others), and a task quoting every third document."""
    junk = "click buy now free win casino cheap pills lol omg subscribe".split()
    model = train_quality_model(tmp_path, list(WORDS[:12]), list(WORDS[12:]) + junk, docs=100, epoch=5, seed=1)
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"text": " ".join(doc.split()[10:30])}) + "\n" for doc in _docs(40)[:40:3]))
    return {"stages": ["clean", "exact_dedup", "quality", "fuzzy_dedup", "decontaminate"],
            "quality": {"model": model}, "decontaminate": {"tasks": [str(task)]}}


def tree_digest(directory: str) -> dict:
    """sha256 of every file a run leaves, except timings and completion markers (they hold timings)."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory)
            if name in ("stats.json", "report.md") or name.endswith(".png") or ".done" in rel:
                continue
            out[rel] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


def test_pipeline_removes_planted_defects_and_counts_them(tmp_path):
    result = pipeline.run_pipeline(build_config(config(tmp_path, [write_corpus(tmp_path)])), log=lambda s: None)
    by_stage = {s["stage"]: s for s in result["stages"]}
    assert by_stage["input"]["docs_out"] == 52
    assert by_stage["clean"]["dropped"] == {"too few words": 1, "symbol ratio": 1}
    assert by_stage["exact_dedup"]["dropped"] == {"exact duplicate": 5}
    assert by_stage["fuzzy_dedup"]["dropped"] == {"near duplicate": 5}
    removed = [json.loads(line) for line in open(tmp_path / "out/03-fuzzy_dedup/removed.jsonl")]
    assert [r["kept"] for r in removed] == [f"raw.jsonl:{i}" for i in range(6, 11)]
    assert [r["id"] for r in removed] == [f"raw.jsonl:{i}" for i in range(46, 51)]
    assert (tmp_path / "out/report.md").is_file() and (tmp_path / "out/report/kept.png").is_file()


def test_one_and_two_workers_write_identical_files(tmp_path):
    corpus, stages = write_corpus(tmp_path), every_stage(tmp_path)
    work = {}  # documents each stage dropped, plus task matches cut out
    for workers in (1, 2):
        raw = config(tmp_path, [corpus], out=f"w{workers}", executor={"workers": workers},
                     output={"dir": str(tmp_path / f"w{workers}"), "format": "jsonl.gz"}, **stages)
        result = pipeline.run_pipeline(build_config(raw), log=lambda s: None)
        work[workers] = {s["stage"]: sum(s["dropped"].values()) + sum(s.get("hits", {}).values())
                         for s in result["stages"][1:]}
    assert tree_digest(str(tmp_path / "w1")) == tree_digest(str(tmp_path / "w2"))
    assert work[1] == work[2] and all(work[1].values()), work
    report = (tmp_path / "w1/report.md").read_text()
    for plot in ("kept", "quality", "clusters", "decontamination"):  # one per stage that has a picture
        png = (tmp_path / f"w1/report/{plot}.png").read_bytes()
        assert f"report/{plot}.png" in report and png.startswith(b"\x89PNG\r\n\x1a\n"), plot


def _pid_after_a_nap() -> dict:
    time.sleep(0.2)
    return {"pid": os.getpid()}


def test_local_workers_serve_every_task_list_until_closed(tmp_path):
    """The sub-stages of a run share one pool (no start-up per sub-stage); close() stops it."""
    executor = LocalExecutor(2)
    pids = []
    for run in range(2):
        jobs = [(_pid_after_a_nap, (), str(tmp_path / f"{run}-{i}.json")) for i in range(6)]
        pids.append({stats["pid"] for stats in executor.run(jobs)})
    executor.close()
    assert len(pids[0]) == 2 and pids[1] <= pids[0] and os.getpid() not in pids[0]
    for pid in pids[0]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_input_globs_recurse_and_a_misspelt_id_field_is_named(tmp_path):
    """``**`` in input.paths reaches every depth (glob without recursive=True read one level of it);
    an input.id_field that no record of a file holds is a misspelling, not FILE:LINE ids."""
    for sub in ("", "x", "x/y"):
        (tmp_path / "rec" / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / "rec" / sub / f"part{len(sub)}.jsonl").write_text(
            "".join(json.dumps({"id": f"{sub}-{i}", "text": d}) + "\n" for i, d in enumerate(_docs(4, seed=len(sub)))))
    quiet = lambda s: None  # noqa: E731
    raw = config(tmp_path, [str(tmp_path / "rec" / "**" / "*.jsonl")], stages=[])
    result = pipeline.run_pipeline(build_config(raw), log=quiet)
    ids = [json.loads(line)["id"] for shard in result["shards"] for line in open(shard)]
    assert len(ids) == 3 * len(_docs(4)) and {i.split("-")[0] for i in ids} == {"", "x", "x/y"}
    raw = config(tmp_path, [str(tmp_path / "rec" / "part0.jsonl")], out="uid", stages=[])
    raw["input"]["id_field"] = "uid"
    with pytest.raises(ValueError, match=r"part0.jsonl: input.id_field 'uid' is in none of its records \(their keys: "
                                         r"\['id', 'text'\]\); fix input.id_field"):
        pipeline.run_pipeline(build_config(raw), log=quiet)
    # a record's own 'id' beside another input.id_field would be replaced by the document id: lost without
    # a word (planted: replaced); an 'id' equal to it loses nothing
    records = [{"uid": "u0", "id": "u0", "text": _docs(2)[0]}, {"uid": "u1", "id": 1000, "text": _docs(2)[1]}]
    (tmp_path / "both.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    raw = config(tmp_path, [str(tmp_path / "both.jsonl")], out="both", stages=[])
    raw["input"]["id_field"] = "uid"
    with pytest.raises(ValueError, match=r"both.jsonl: the record of uid 'u1' also has a field 'id' \(1000\), which "
                                         r"the output's 'id' \(the document id\) would replace"):
        pipeline.run_pipeline(build_config(raw), log=quiet)


def _sentencepiece(tmp_path: Path) -> str:
    from data_pipeline.tokenizer import train_sentencepiece

    return train_sentencepiece(iter(_docs(40) * 5), str(tmp_path / "sp"), 400, max_sentences=1000)


def _cli(tmp_path, raw: dict, *args: str) -> int:
    path = tmp_path / "curate.yaml"
    path.write_text(yaml.safe_dump(raw))
    return main(["curate", "run", str(path), "--no-progress", *args])


@pytest.mark.parametrize("change, message", [
    ({"stages": ["clean", "dedupe"]}, "stages: unknown stage 'dedupe'; known stages:"),
    ({"stages": ["quality"]}, "quality.model: no classifier given; train one with `megazero curate train-quality"),
    ({"quality": {"model": "missing.bin"}, "stages": ["quality"]}, "quality.model: .*missing.bin: no such file"),
    ({"clean": {"min_wrds": 3}}, "clean.min_wrds: unknown key; did you mean clean.min_words?"),
    ({"input": {"paths": ["nope/*.jsonl"]}}, "input.paths: nope/\\*.jsonl: no such file"),
    ({"fuzzy_dedup": {"bands": 30}}, "bands x rows \\(30 x 13\\) needs at most num_perm \\(260\\)"),
])
def test_config_errors_are_one_line(tmp_path, capsys, change, message):
    raw = config(tmp_path, [write_corpus(tmp_path)])
    raw.update(change)
    assert _cli(tmp_path, raw) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_empty_input_and_non_fasttext_model(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _cli(tmp_path, config(tmp_path, [str(empty)])) == 2
    err = capsys.readouterr().err
    assert "input.paths: no documents in" in err and "every input file is empty" in err
    assert not (tmp_path / "out").exists()  # the refused run left no empty output folder behind
    raw = config(tmp_path, [write_corpus(tmp_path)])
    raw["input"]["text_field"] = "txet"  # misspelt: no record has it
    (tmp_path / "out").mkdir()  # a folder the user made stays, emptied of what the run wrote
    assert _cli(tmp_path, raw) == 2
    assert "raw.jsonl: not one of its 52 records could be read (52 not text): no record holds 'txet' as a string; " \
           "set input.text_field" in capsys.readouterr().err
    assert list((tmp_path / "out").iterdir()) == []
    (tmp_path / "out").rmdir()
    fake = tmp_path / "model.bin"
    fake.write_bytes(b"not a model at all" * 10)
    raw = config(tmp_path, [write_corpus(tmp_path)], out="q", stages=["quality"], quality={"model": str(fake)})
    assert _cli(tmp_path, raw) == 2
    assert f"quality.model: {fake} is not a fastText model" in capsys.readouterr().err


def test_dotted_overrides_reach_the_stage(tmp_path, capsys):
    """The override empties the corpus, which stops the run at that stage (the later stages and the
    tokenizer would get nothing) and removes the stage, so the corrected run starts it afresh."""
    raw = config(tmp_path, [write_corpus(tmp_path)], preprocess={"tokenizer": _sentencepiece(tmp_path)})
    assert _cli(tmp_path, raw, "--clean.min_words", "200") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["megazero curate: error: clean: dropped all 52 documents (52 too few words); loosen the clean "
                   "settings (override one with --clean.FIELD VALUE) and run again"], err
    assert sorted(os.listdir(tmp_path / "out")) == ["00-input"]
    assert _cli(tmp_path, raw) == 0
    stats_path = tmp_path / "out/01-clean/stats.json"
    stats = json.loads(stats_path.read_text())
    assert stats["docs_out"] > 0
    # an empty stage left complete by a version that let it through is not carried on with either
    stats_path.write_text(json.dumps({**stats, "docs_out": 0}))
    assert _cli(tmp_path, raw) == 2
    assert "clean: dropped all 52 documents" in capsys.readouterr().err
    assert not (tmp_path / "out/01-clean").exists()


@pytest.mark.parametrize("fmt", ["parquet", "jsonl.zst"])
def test_parquet_and_zstd_shards_hold_the_same_documents(tmp_path, fmt):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_pipeline.curate.shards import read_shard

    docs = _docs(40)
    source = tmp_path / "raw.parquet"
    pq.write_table(pa.table({"text": docs}), source)
    raw = config(tmp_path, [str(source)], output={"dir": str(tmp_path / fmt), "format": fmt})
    shards = pipeline.run_pipeline(build_config(raw), log=lambda s: None)["shards"]
    raw = config(tmp_path, [write_corpus(tmp_path)], output={"dir": str(tmp_path / "jsonl")})
    reference = pipeline.run_pipeline(build_config(raw), log=lambda s: None)["shards"]
    assert all(s.endswith(f".{fmt}") for s in shards)
    texts = [r["text"] for s in shards for r in read_shard(s)]
    assert texts == [r["text"] for s in reference for r in read_shard(s)]
    assert [r["id"] for r in read_shard(shards[0])][:2] == ["raw.parquet:0", "raw.parquet:1"]


def test_a_field_of_two_types_in_a_parquet_shard_is_named(tmp_path):
    """One Parquet column holds one type; Arrow's error named no field, file or document."""
    docs = _docs(3)
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"text": d, "meta": m}) + "\n" for d, m in zip(docs, [1, 2.5, "x"])))
    raw = config(tmp_path, [str(path)], output={"dir": str(tmp_path / "out"), "format": "parquet"}, stages=[])
    with pytest.raises(ValueError, match=r"00-input/shard-00000-00000\.parquet: field 'meta' is number in an earlier "
                                         r"document and str in document mixed\.jsonl:3; give the field one type"):
        pipeline.run_pipeline(build_config(raw), log=lambda s: None)


def test_a_parquet_shard_keeps_fields_its_first_document_lacks(tmp_path):
    """Arrow took a shard's columns from its first record: a field only later documents had (a url
    on every second one) was dropped from the whole shard."""
    from data_pipeline.curate.shards import read_shard

    path = tmp_path / "meta.jsonl"
    path.write_text("".join(json.dumps({"text": d, **({"url": f"u{i}"} if i % 2 else {})}) + "\n"
                            for i, d in enumerate(_docs(4))))
    raw = config(tmp_path, [str(path)], output={"dir": str(tmp_path / "out"), "format": "parquet"}, stages=[])
    shards = pipeline.run_pipeline(build_config(raw), log=lambda s: None)["shards"]
    urls = [r["url"] for s in shards for r in read_shard(s)]
    assert urls == [f"u{i}" if i % 2 else None for i in range(len(_docs(4)))]


def test_demo_curates_then_trains(tmp_path, monkeypatch):
    """The chain README.md and docs/curation.md show, run as shown from a checkout (training cut to two
    steps): build the demo, curate it, train on the blend it writes, in a run directory of its own
    (curation.md's once trained in the demo config's, where a README reader's main job had saved
    another model, and was refused)."""
    from megazero.config import load_config

    root = Path(__file__).resolve().parent.parent
    demo, curate, train = shown_demo_chain(root / "docs" / "curation.md")
    assert [demo, curate, train] == shown_demo_chain(root / "README.md")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(root / "configs")
    assert main(demo) == 0
    assert main(curate) == 0
    stats = [json.loads(p.read_text()) for p in Path("data/curate_demo/out").glob("*/stats.json")]
    by_stage = {s["stage"]: s for s in stats}
    assert by_stage["fuzzy_dedup"]["dropped"]["near duplicate"] >= 60
    assert by_stage["exact_dedup"]["dropped"]["exact duplicate"] >= 30
    assert load_config(train[1], train[2:]).logging.run_dir != load_config(train[1]).logging.run_dir
    two_steps = ["--train.train_steps", "2", "--train.global_batch_size", "4", "--train.eval_interval", "0"]
    assert main(train + two_steps) == 0


def test_the_demo_elsewhere_names_a_config_for_its_own_folder(tmp_path, monkeypatch):
    """``curate demo other/dir`` printed the repository's config, which curates data/curate_demo."""
    from data_pipeline.curate.demo import demo_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "other").mkdir()
    path = demo_config("other")
    assert path == "other/curate.yaml"
    text = Path(path).read_text()
    assert "data/curate_demo" not in text and "other/corpus.jsonl" in text and "other/quality.bin" in text
    assert demo_config("data/curate_demo") == "configs/curate_demo.yaml"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_shard_a_stage_emptied_is_tokenized_as_no_documents(tmp_path, fmt):
    """The last shard (two junk documents) left clean empty: as parquet it had no columns, and the
    tokenizing step stopped the finished run on "no column ['text']"."""
    raw = config(tmp_path, [write_corpus(tmp_path)], output={"dir": str(tmp_path / "out"), "format": fmt},
                 stages=["clean"], preprocess={"tokenizer": _sentencepiece(tmp_path)})
    raw["input"]["shard_docs"] = 2
    pipeline.run_pipeline(build_config(raw), log=lambda s: None)
    from data_pipeline.indexed import IndexedDataset

    assert len(IndexedDataset(str(tmp_path / "out/tokenized/curated_text_document"))) == 50


@pytest.mark.parametrize("weight", [1e-05, 0.5, 3e16])
def test_the_blend_written_reads_back_with_its_weight(tmp_path, weight):
    """``1e-05`` formatted by hand is a string to a YAML reader: the blend a run wrote was refused."""
    from data_pipeline.blend import load_blend_preset

    raw = config(tmp_path, [write_corpus(tmp_path)], stages=["clean"],
                 preprocess={"tokenizer": _sentencepiece(tmp_path), "weight": weight})
    blend = pipeline.run_pipeline(build_config(raw), log=lambda s: None)["blend"]
    [[read, prefix]] = load_blend_preset(blend, str(tmp_path / "out"))
    assert read == weight and os.path.isfile(f"{prefix}.idx")


def test_outputs_curation_commands_refuse(tmp_path, capsys):
    """What was taken silently or failed with a bare errno: an output.dir under a file; the demo
    built over a folder's own files (it replaced a tokenizer shards recorded); a quality model
    trained over an existing one (a finished quality stage then refused as changed)."""
    corpus = write_corpus(tmp_path)
    (tmp_path / "afile").write_text("x")
    raw = config(tmp_path, [corpus], out=str(tmp_path / "afile" / "sub"), stages=["clean"])
    assert _cli(tmp_path, raw) == 2
    assert f"output.dir: {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is a file, not a folder" in \
        capsys.readouterr().err
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "tokenizer.model").write_bytes(b"ours")
    assert main(["curate", "demo", str(tmp_path / "demo")]) == 2
    assert "demo: already holds tokenizer.model; the demo does not replace files" in capsys.readouterr().err
    assert (tmp_path / "demo" / "tokenizer.model").read_bytes() == b"ours" and len(list((tmp_path / "demo").iterdir())) == 1
    assert main(["curate", "train-quality", "--hq", corpus, "--lq", corpus, "--output", str(tmp_path / "afile")]) == 2
    assert f"--output {tmp_path / 'afile'}: already exists" in capsys.readouterr().err
    assert main(["curate", "train-quality", "--hq", corpus, "--lq", corpus, "--output",
                 str(tmp_path / "afile" / "q.bin")]) == 2
    assert f"{tmp_path / 'afile'} is a file, not a folder" in capsys.readouterr().err
    raw = config(tmp_path, [corpus], stages=["clean"])
    raw["executor"] = None  # an empty section takes its defaults, as every other one
    assert _cli(tmp_path, raw) == 0


def test_ingest_shards_ids_and_sizes(tmp_path):
    """Shards of exactly shard_docs documents; integer ids kept (as strings); sizes in UTF-8 bytes;
    a record with an unpaired surrogate in a field other than the text (a JSON escape) is a bad
    record, where it failed the whole stage at the write, naming no record."""
    from data_pipeline.curate.shards import ingest_file, list_shards

    src = tmp_path / "raw.jsonl"
    lines = [json.dumps({"id": i, "text": "\u00e9" * 10}) for i in range(15)]
    src.write_text("\n".join(lines[:3] + ['{"id": 99, "text": "fine", "title": "bad \\ud800 title"}'] + lines[3:]) + "\n")
    (tmp_path / "o").mkdir()
    stats = ingest_file(str(src), 0, str(tmp_path / "o"), "jsonl", "text", "id", 7, False)
    shards = list_shards(str(tmp_path / "o"))
    assert [sum(1 for _ in open(s)) for s in shards] == [7, 7, 1]
    assert [json.loads(line)["id"] for s in shards for line in open(s)] == [str(i) for i in range(15)]
    assert stats["bytes_in"] == stats["bytes_out"] == 15 * 20
    assert stats["bad_records"] == {"not UTF-8": 1} and "raw.jsonl:4: field 'title'" in stats["bad_examples"][0]


def test_stats_merge_lists_elementwise_and_the_report_shows_documents_out(tmp_path):
    from data_pipeline.curate.report import write_report
    from data_pipeline.curate.runner import merge_stats

    assert merge_stats([{"h": [1, 2], "n": 1}, {"h": [3, 4], "n": 2}]) == {"h": [4, 6], "n": 3}
    write_report(str(tmp_path), [{"stage": "clean", "docs_in": 52, "docs_out": 50, "bytes_out": 1e6, "seconds": 1}])
    assert "| clean | 52 | 50 | 1.000 |" in (tmp_path / "report.md").read_text()


def test_the_hits_plot_names_the_configured_n_gram(tmp_path, monkeypatch):
    """The decontamination plot's axis said "13-gram hits" whatever ``decontaminate.ngram`` was (planted:
    the stage's stats without the n-gram, or the label written as 13)."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from data_pipeline.curate.report import write_report

    labels = []
    monkeypatch.setattr(Axes, "set_ylabel", lambda ax, label, *a, **k: labels.append(label))
    write_report(str(tmp_path), [{"stage": "decontaminate", "docs_in": 2, "docs_out": 2, "bytes_out": 10, "ngram": 8,
                                  "hits": {"qa": 3}}])
    assert labels[-1] == "8-gram hits" and "13-gram hits" not in labels, labels


def test_the_report_adds_up_with_documents_cut_into_pieces_and_leaves_matplotlib_as_it_was(tmp_path):
    """Decontamination's row said 324 in, 3 dropped, 322 out: the documents it cut into pieces were not
    said (planted: pieces left out). Drawing the plots switched the caller's matplotlib backend to Agg
    (a notebook's inline plots with it)."""
    matplotlib = pytest.importorskip("matplotlib")
    from data_pipeline.curate.pipeline import summary_line
    from data_pipeline.curate.report import write_report

    stats = {"stage": "decontaminate", "docs_in": 324, "docs_out": 322, "bytes_out": 1e6, "seconds": 1, "ngram": 13,
             "dropped": {"contaminated": 3}, "cut": 10, "pieces": 11, "hits": {"qa": 4}}
    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        write_report(str(tmp_path), [stats])
        assert matplotlib.get_backend() == "svg" and (tmp_path / "report/decontamination.png").is_file()
    finally:
        matplotlib.use(before)
    assert "| decontaminate | 324 | 322 | 1.000 | 1.0 | 3 contaminated, 10 cut into 11 pieces |" in \
        (tmp_path / "report.md").read_text()
    assert summary_line(stats).endswith("; 3 contaminated, 10 cut into 11 pieces")
