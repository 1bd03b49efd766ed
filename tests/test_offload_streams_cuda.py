"""On a GPU, an offloaded step uploads each unit's new weights on a copy stream of its own, lazily,
from the next forward's hooks. However late those uploads run, the forward must compute with the
new weights: here the copy stream is stalled by a long sleep right after the step, and the forward
that follows must equal one computed again after everything has finished. The gradients travel the
other way on the same stream: however late they arrive, the host update must read them, not what
the buffer held before. (Skipped without CUDA.)
"""

import time

import pytest
import torch

from tests.sharded import sharded_adamw
from tests.test_zero_toy import Toy, _data

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STALL_CYCLES = 1_000_000_000  # about half a second of GPU clock


def _offloaded(group, stage):
    """A bf16 toy model with its offloaded optimizer at ``stage``, and one batch, on the GPU."""
    torch.manual_seed(0)
    model = Toy().cuda()
    opt = sharded_adamw(model, group, model.blocks, stage=stage, bucket_numel=320, lr=1e-2, offload=True,
                        param_dtype=torch.bfloat16)
    tokens, labels = (t.cuda() for t in _data(0, 0))
    return model, opt, tokens, labels


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_forward_waits_for_its_units_upload(one_rank_group, stage):
    model, opt, tokens, labels = _offloaded(one_rank_group, stage)
    for _ in range(2):  # the second step finds its pinned buffers made: nothing in the way but the stall
        before = model(tokens, labels)
        before.backward()
        opt.step()
    torch.cuda.synchronize()
    with torch.cuda.stream(opt.dp.host_copies.stream):
        torch.cuda._sleep(STALL_CYCLES)  # every upload the next forward issues queues behind this
    with torch.no_grad():
        during = model(tokens, labels)
        forward_done = torch.cuda.Event()
        forward_done.record()
        time.sleep(0.05)  # far longer than this forward, far shorter than the stall
        held_back = not forward_done.query()
        torch.cuda.synchronize()
        after = model(tokens, labels)
    assert held_back, "the forward did not wait for the uploads of its units"
    assert torch.equal(during, after), "the forward read weights its upload had not written yet"
    assert not torch.equal(during, before.detach()), "the step did not change the weights"


def _stepped_twice(group, stage, stall):
    """A forward after two offloaded steps (whose host updates run lazily, from this forward's hooks
    and the second step's); with ``stall``, each step's gradient copies to the host queue behind a
    long sleep on the copy stream, and nothing on the host waits for the device in between."""
    model, opt, tokens, labels = _offloaded(group, stage)
    for _ in range(2):
        if stall:
            with torch.cuda.stream(opt.dp.host_copies.stream):
                torch.cuda._sleep(STALL_CYCLES)
        model(tokens, labels).backward()
        opt.step()
    with torch.no_grad():
        out = model(tokens, labels)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_the_host_update_waits_for_its_gradients_to_arrive(one_rank_group, stage):
    """The host AdamW reads the gradients the copy stream brings: however late the copies run, the
    step must equal one whose copies were not held back (planted: the step not waiting for them)."""
    assert torch.equal(_stepped_twice(one_rank_group, stage, stall=True),
                       _stepped_twice(one_rank_group, stage, stall=False))
