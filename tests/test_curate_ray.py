"""The Ray executor writes the same bytes as the local pool (on a local Ray instance; skipped without Ray)."""

from __future__ import annotations

import json

import pytest

from data_pipeline.curate import pipeline
from data_pipeline.curate.config import build_config
from tests.test_curate_pipeline import config, every_stage, tree_digest, write_corpus


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray instance for the module (starting one takes seconds); the executor joins it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_and_local_pool_write_identical_files(tmp_path):
    corpus, stages = write_corpus(tmp_path), every_stage(tmp_path)
    for kind in ("local", "ray"):
        raw = config(tmp_path, [corpus], out=kind, executor={"kind": kind, "workers": 2}, **stages)
        pipeline.run_pipeline(build_config(raw), log=lambda s: None)
    assert tree_digest(str(tmp_path / "local")) == tree_digest(str(tmp_path / "ray"))


def test_a_stage_error_on_ray_is_the_same_one_line_error(tmp_path):
    task = tmp_path / "vanishing.jsonl"
    task.write_text(json.dumps({"text": " ".join(f"word{i}" for i in range(20))}) + "\n")
    raw = config(tmp_path, [write_corpus(tmp_path)], stages=["decontaminate"], executor={"kind": "ray", "workers": 2},
                 decontaminate={"tasks": [str(task)]})
    cfg = build_config(raw)
    task.unlink()  # after the config's checks, so that the stage's task is what fails
    with pytest.raises(OSError, match="vanishing.jsonl"):
        pipeline.run_pipeline(cfg, log=lambda s: None)
