"""Pipeline activation memory: releasing a sent activation's storage keeps backward exact (one
process), and a real 2-stage pipeline holds, in bytes, the activations of exactly as many
micro-batches as its schedule keeps live (measured from what autograd saves, independently of the
executor's own op-list count). Planted bug this caught: an executor that keeps every micro-batch's
graph until the step's end (peak m x one micro-batch, not pp - rank)."""

import pytest
import torch
from torch import nn

from models import GPT
from models.config import ModelConfig
from parallel.pipeline import PipelineExecutor
from parallel.pipeline.p2p import StageLink, free_storage
from parallel.pipeline.plan import Message, Transfer
from parallel.pipeline.schedule import max_live_activations
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world


def test_backward_from_a_released_clone_matches_plain_backward():
    torch.manual_seed(0)
    plain, released = nn.Linear(8, 8), nn.Linear(8, 8)
    released.load_state_dict(plain.state_dict())
    x, grad = torch.randn(4, 8), torch.randn(4, 8)

    torch.relu(plain(x)).backward(grad)  # relu saves its output: the case a raw .data swap would break

    out = torch.relu(released(x)).clone()  # the executor's send buffer
    full_bytes = out.untyped_storage().nbytes()
    free_storage(out)
    assert out.shape == (4, 8) and out.untyped_storage().nbytes() == 4 < full_bytes
    torch.autograd.backward(out, grad)

    for a, b in zip(plain.parameters(), released.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


class SavedBytes:
    """Bytes of activation storage autograd holds, measured from the saved tensors themselves (not
    from the schedule): each saved tensor's storage counts once while any saved view of it lives;
    the parameters' storages (``shared``), which every micro-batch saves views of, are left out."""

    def __init__(self, shared: set[int]):
        self.shared = shared
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in self.shared:
            return tensor
        return _Held(self, tensor)

    @staticmethod
    def unpack(held):
        return held if isinstance(held, torch.Tensor) else held.tensor

    def acquire(self, key: int, nbytes: int) -> None:
        self.refs[key] = self.refs.get(key, 0) + 1
        if self.refs[key] == 1:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes


class _Held:
    def __init__(self, tracker: SavedBytes, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        self.tracker, self.tensor, self.key, self.nbytes = tracker, tensor, storage.data_ptr(), storage.nbytes()
        tracker.acquire(self.key, self.nbytes)

    def __del__(self):
        self.tracker.release(self.key, self.nbytes)


PP_CFG = dict(num_layers=4, hidden_size=32, num_heads=4, vocab_size=64, seq_length=16)
MICRO_BATCHES = 6


def _forward_step(module, x, microbatch, first: bool, last: bool):
    tokens, labels = microbatch
    out = module(tokens if first else x, labels if last else None)
    return out.mean() if last else out


def _peak_bytes(topo, schedule: str, m: int) -> tuple[int, int]:
    """Peak saved-activation bytes of one step on this rank, and the schedule's live micro-batch count."""
    cfg = ModelConfig(**PP_CFG, tie_embeddings=False)
    first, last = topo.is_first_stage, topo.is_last_stage
    stage = GPT(cfg, layers=range(2) if first else range(2, 4), has_embedding=first, has_head=last, seed=1)
    executor = PipelineExecutor([stage], topo, (2, cfg.seq_length, cfg.hidden_size), schedule=schedule,
                                forward_step=_forward_step, timeout_s=60)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))
            for _ in range(m)]
    tracker = SavedBytes({p.untyped_storage().data_ptr() for p in stage.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, SavedBytes.unpack):
        executor.step(data)
    assert tracker.live == 0, "activations outlived the step"
    return tracker.peak, max_live_activations(executor.stats.ops)


def _pipeline_world(rank, world_size):
    topo = Topology(RankGrid(tp=1, pp=2, dp=1))
    return {"one": _peak_bytes(topo, "1f1b", 1),
            "1f1b": _peak_bytes(topo, "1f1b", MICRO_BATCHES),
            "serial": _peak_bytes(topo, "gradient_accumulation", MICRO_BATCHES)}


@pytest.fixture(scope="module")
def pipeline_peaks():
    return run_world(2, _pipeline_world)


def test_activation_bytes_peak_at_the_schedules_live_count(pipeline_peaks):
    """1F1B holds pp - rank micro-batches' activations at its peak, however many micro-batches the
    step has; running each micro-batch through forward and backward first holds one. Measured in
    bytes from the tensors autograd saves, against one micro-batch's bytes."""
    for rank, peaks in enumerate(pipeline_peaks):
        one, _ = peaks["one"]
        peak, live = peaks["1f1b"]
        assert live == 2 - rank
        assert peak == live * one, (rank, peak, live, one)
        assert peaks["serial"] == (one, 1), rank


class _Batch:
    """One coalesced handle for a whole batch, as NCCL returns it, that the test completes by hand."""

    def __init__(self):
        self.done = False
        self.waits = 0

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        self.done = True
        return True


def _coalesced_sends(rank, world_size):
    """A batch that sends and receives, coalesced into one handle as on NCCL: the send's buffer is
    not released before the batch completes, although nothing waits for the batch when it is posted
    (its receive is taken later, by its op)."""
    import torch.distributed as dist

    from parallel.pipeline.p2p import StageLink
    from parallel.pipeline.plan import Message, Transfer

    group = dist.new_group([0])
    link = StageLink({"act": group, "grad": group}, lambda r: r, (2,), torch.float32, torch.device("cpu"))
    handle = _Batch()
    posted = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [handle]
    try:
        sent = torch.ones(2)
        # one channel's batch: an activation out, another in
        link.exchange([(Transfer(0, Message("act", 0, 0)), sent)], (Transfer(0, Message("act", 1, 1)),), "test")
        early = link.finish_sends(block=False)
        handle.done = True
        late = link.finish_sends(block=False)
        link.take(Message("act", 1, 1))
        # a receive taken before its batch has completed: the op must wait for the batch, whose
        # handle is also what orders the receive buffer's use after NCCL has written it
        pending = _Batch()
        dist.batch_isend_irecv = lambda ops: [pending]
        link.exchange([(Transfer(0, Message("grad", 2, 0)), torch.ones(2))], (Transfer(0, Message("grad", 3, 0)),),
                      "test")
        link.take(Message("grad", 3, 0))
    finally:
        dist.batch_isend_irecv = posted
    return len(early), len(late), link.untaken, pending.waits


def test_a_coalesced_batch_keeps_its_send_buffer_until_it_completes():
    """(Planted: the send recorded as complete when posted, as when the exchange still waited for its
    batch; its buffer was released while the batch could still be reading it. And: a receive of a
    coalesced batch handed to its op with nothing to wait on, which would compute on a buffer NCCL
    had not written yet.)"""
    early, late, untaken, waits = run_world(1, _coalesced_sends, timeout=60)[0]
    assert (early, late, untaken, waits) == (0, 1, [], 1)


def test_a_link_refuses_a_boundary_tensor_of_another_dtype_and_missing_channels(one_rank_group):
    """The receiver allocates its buffer in the pipeline's dtype, so a bf16 activation sent where fp32
    was set up would be read as the wrong bytes (or never match its receive): the link refuses it by
    name before posting anything. A V-shaped pipeline's link needs the return leg's groups too; one built
    with only the first leg's would never post those messages. (Planted: only the shape compared; the
    channel set unchecked.)"""
    def link(channels):
        return StageLink({c: one_rank_group for c in channels}, lambda r: r, (2,), torch.float32,
                         torch.device("cpu"))

    sent = link(("act", "grad"))
    with pytest.raises(ValueError, match=r"is \(2,\) torch.bfloat16, but the pipeline was set up for \(2,\) "
                                         r"torch.float32"):
        sent.exchange([(Transfer(0, Message("act", 0, 0)), torch.ones(2, dtype=torch.bfloat16))], (), "test")
    assert sent.finish_sends(block=True) == [] and sent.untaken == []
    for channels in (("act",), ("act", "grad", "act_back"), ("act", "grad", "pp")):
        with pytest.raises(ValueError, match="needs one group per channel"):
            link(channels)
