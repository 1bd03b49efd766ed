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


def _dies(i: int) -> dict:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a worker
    return {"i": i}


def test_a_ray_worker_that_dies_is_one_line(tmp_path):
    """Ray raises WorkerCrashedError (or its out-of-memory error) for a task whose worker died: it
    escaped the command's handler as a 50-line traceback (planted: RayTaskError alone caught)."""
    from data_pipeline.curate.runner import RayExecutor
    from data_pipeline.worker_pool import WorkerDied

    executor = RayExecutor(workers=2)
    with pytest.raises(WorkerDied, match=r"^a Ray worker ended \(\w+\) while running a task of this stage, which is "
                                         "lost; run again"):
        list(executor.run([(_dies, (0,), str(tmp_path / "task0.json"))]))
    executor.close()
