"""A GPU run with dropout, stopped and resumed, continues with the losses of the run never stopped.

Dropout on one GPU draws its masks from the CUDA generator, which the checkpoint must carry (the CPU
tests cannot see it: there the masks come from the CPU generator). One process trains the small GPT
of ``tests/test_trainer.py`` on the GPU for 6 steps with dropout 0.1; a second is told at its third
stop check that time is up, saves, and is started again to finish. Its last steps' losses must equal
the uninterrupted run's within 1e-5 relative (the same kernels on the same data, their sums in
another order at most); a run without dropout must differ from both by far more, or the check would
not be about dropout. (Planted: the CUDA generator left out of the checkpoint, so the resumed run
draws other masks.) Skipped without CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

from megazero.metrics import read_metrics
from tests.distributed import run_world
from tests.test_trainer import _overrides, _stop_at_third_check, _train, write_arithmetic_shard

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 6
DROPOUT = ("--train.device", "cuda", "--model.dropout", "0.1", "--model.attention_dropout", "0.1")


def _runs(rank, world, root):
    prefix = write_arithmetic_shard(f"{root}/arith_text_document", 400)
    whole = _train(_overrides(prefix, f"{root}/whole", steps=STEPS, extra=DROPOUT), 1)
    quiet = _train(_overrides(prefix, f"{root}/quiet", steps=STEPS, extra=("--train.device", "cuda")), 1)
    stopped = _overrides(prefix, f"{root}/stopped", steps=STEPS, extra=DROPOUT)
    first_steps, checkpoints = _stop_at_third_check(f"{root}/stopped", stopped)
    _train(stopped, 1)
    rows = read_metrics(os.path.join(root, "stopped", "metrics.jsonl"))
    resumed = {row["step"]: row["loss"] for row in rows if row["step"] > max(first_steps)}
    return whole, quiet, first_steps, checkpoints, resumed


def test_a_resumed_gpu_run_draws_the_same_dropout_masks(tmp_path):
    whole, quiet, first_steps, checkpoints, resumed = run_world(1, _runs, str(tmp_path), timeout=600)[0]
    assert checkpoints and max(first_steps) < STEPS, (first_steps, checkpoints)
    assert sorted(resumed) == list(range(max(first_steps) + 1, STEPS + 1)), resumed
    for step, loss in resumed.items():
        assert abs(loss - whole[step - 1]) <= 1e-5 * abs(whole[step - 1]), (step, loss, whole)
        assert abs(quiet[step - 1] - whole[step - 1]) > 1e-3 * abs(whole[step - 1]), "dropout made no difference"
