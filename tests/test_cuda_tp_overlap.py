"""The sequence-parallel linear ops against the composed layers, on two GPUs over NCCL.

``parallel.tensor_parallel.overlap`` reorders each linear's collectives around its matrix products
(asynchronous all-gather, reduce and reduce-scatter on NCCL's stream); the CPU suite checks it over
gloo against one process. Here the same inputs go through both forms on NCCL: the composed one
(``gather_sequence`` + ``F.linear``, ``F.linear`` + ``reduce_scatter_sequence``) and the overlapped
one in each of its communication modes (``serial``, ``overlap``, ``peer_memory``), in fp32 and bf16;
the outputs and the gradients of input, weight and bias must agree to the dtype's rounding (the
forms sum in different orders). Every rank is checked. The peer-memory case runs each layer three
times in a row, so one workspace serves successive operations as in a model.

A second world captures a column then a row linear, forward and backward, in each mode as one CUDA
graph (what ``train.cuda_graphs`` does to a block), replays it on three fresh sets of values written
into the captured inputs, and compares the output and every gradient with the same ops run eagerly:
a collective that escaped the capture, or a workspace or barrier that does not replay, shows up
as a mismatch (or a hang, stopped by the world's timeout).

(Skipped unless two CUDA devices are visible.)
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.tensor_parallel.collectives import gather_sequence, reduce_scatter_sequence
from parallel.tensor_parallel.overlap import MODES, column_linear, row_linear
from tests.distributed import run_world

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

DTYPES = {"fp32": (torch.float32, 1e-5), "bf16": (torch.bfloat16, 2e-2)}
BATCH, SEQ, HIDDEN, OUT = 4, 256, 512, 768


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def _compare(overlapped, composed, inputs: list[torch.Tensor]) -> dict:
    """Relative error of the output and of every input's gradient, overlapped against composed."""
    results = []
    for fn in (overlapped, composed):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        y = fn(*leaves)
        g = torch.Generator(device=y.device).manual_seed(11 + dist.get_rank())
        y.backward(torch.randn(y.shape, generator=g, device=y.device, dtype=y.dtype))
        results.append((y.detach(), [leaf.grad for leaf in leaves]))
    (y_a, grads_a), (y_b, grads_b) = results
    return {"out": _rel(y_a, y_b), "grads": [_rel(a, b) for a, b in zip(grads_a, grads_b)]}


def _layers(rank: int, world_size: int) -> dict:
    group, device = dist.group.WORLD, torch.device("cuda", rank)
    report = {}
    for (name, (dtype, _)), mode in itertools.product(DTYPES.items(), MODES):
        g = torch.Generator(device=device).manual_seed(5 + rank)  # every rank its own tokens and shards
        rand = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)  # noqa: E731
        x_local, x_full = rand(BATCH, SEQ // world_size, HIDDEN), rand(BATCH, SEQ, HIDDEN // world_size)
        w_col, b_col = rand(OUT // world_size, HIDDEN) * 0.05, rand(OUT // world_size)
        w_row = rand(OUT, HIDDEN // world_size) * 0.05
        for _ in range(3 if mode == "peer_memory" else 1):
            report.setdefault(("column", name, mode), []).append(_compare(
                lambda x, w, b: column_linear(x, w, b, group, mode),
                lambda x, w, b: F.linear(gather_sequence(x, group), w, b), [x_local, w_col, b_col]))
            report.setdefault(("row", name, mode), []).append(_compare(
                lambda x, w: row_linear(x, w, group, mode),
                lambda x, w: reduce_scatter_sequence(F.linear(x, w), group), [x_full, w_row]))
    return report


@pytest.fixture(scope="module")
def reports():
    return run_world(2, _layers, timeout=300, backend="nccl")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer", ["column", "row"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sequence_parallel_linear_equals_composed(reports, layer, dtype, mode):
    tolerance = DTYPES[dtype][1]
    for rank, report in enumerate(reports):
        for value in report[(layer, dtype, mode)]:
            assert value["out"] < tolerance, (rank, value)
            assert max(value["grads"]) < tolerance, (rank, value)


def _captured(rank: int, world_size: int) -> dict:
    group, device = dist.group.WORLD, torch.device("cuda", rank)
    dtype, report = torch.bfloat16, {}
    for mode in MODES:
        g = torch.Generator(device=device).manual_seed(7 + rank)
        shapes = [(BATCH, SEQ // world_size, HIDDEN), (OUT // world_size, HIDDEN), (OUT // world_size,),
                  (HIDDEN, OUT // world_size)]
        scales = [1.0, 0.05, 1.0, 0.05]
        fresh = lambda: [torch.randn(s, generator=g, device=device, dtype=dtype) * k  # noqa: E731
                         for s, k in zip(shapes, scales)]
        leaves = [t.requires_grad_(True) for t in fresh()]
        grad_out = torch.randn(BATCH, SEQ // world_size, HIDDEN, generator=g, device=device, dtype=dtype)

        def block(x, w_col, b_col, w_row):
            y = row_linear(column_linear(x, w_col, b_col, group, mode), w_row, group, mode)
            y.backward(grad_out)
            return y

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the default stream, as capture asks
            for _ in range(3):
                for t in leaves:
                    t.grad = None
                block(*leaves)
        torch.cuda.current_stream().wait_stream(side)
        for t in leaves:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_graph = block(*leaves)
        errors = []
        for _ in range(3):
            with torch.no_grad():
                for t, value in zip(leaves, fresh()):
                    t.copy_(value)
                grad_out.copy_(torch.randn(grad_out.shape, generator=g, device=device, dtype=dtype))
            graph.replay()
            eager = [t.detach().clone().requires_grad_(True) for t in leaves]
            y_eager = block(*eager)
            errors.append(max(_rel(y_graph, y_eager), *(_rel(a.grad, b.grad) for a, b in zip(leaves, eager))))
        report[mode] = errors
    return report


@pytest.fixture(scope="module")
def captured():
    return run_world(2, _captured, timeout=300, backend="nccl")


@pytest.mark.parametrize("mode", MODES)
def test_sequence_parallel_linears_replay_as_cuda_graphs(captured, mode):
    for rank, report in enumerate(captured):
        assert max(report[mode]) < DTYPES["bf16"][1], (rank, report[mode])


def _back_to_back(rank: int, world_size: int) -> dict:
    """Sixty peer-memory all-gathers and chunk sums queued without a host synchronisation, each on
    fresh values (a barrier that let a rank overwrite its slot before the peer had read it would
    show as a peer's chunk from a later operation)."""
    from parallel.tensor_parallel import peer_memory

    torch.cuda.set_device(rank)
    name, device, n, h = dist.group.WORLD.group_name, torch.device("cuda", rank), 4096, 256
    gathered, summed = [], []
    for i in range(30):
        rows = torch.full((n, h), float(100 * i + rank), device=device)
        full = rows.new_empty((world_size * n, h))
        gathered.append((full, peer_memory.all_gather(full, rows, name)))
        total = peer_memory.ChunkSum(torch.Size((n, h)), torch.float32, name, world_size)
        for step in range(1, world_size):
            owner = (rank + step) % world_size
            total.push(torch.full((n, h), float(i * (owner + 1) + rank), device=device), owner)
        summed.append(total.finish(torch.full((n, h), float(i * (rank + 1) + rank), device=device)))
    errors = []
    for i, ((full, work), (total, sum_work)) in enumerate(zip(gathered, summed)):
        work.wait()
        sum_work.wait()
        want = torch.arange(world_size, device=device, dtype=torch.float32).repeat_interleave(n) + 100 * i
        errors.append((full[:, 0] - want).abs().max().item() + (full - full[:, :1]).abs().max().item())
        errors.append((total - (i * (rank + 1) * world_size + sum(range(world_size)))).abs().max().item())
    return {"max_error": max(errors)}


def test_peer_memory_operations_queued_back_to_back_keep_their_values():
    for rank, report in enumerate(run_world(2, _back_to_back, timeout=300, backend="nccl")):
        assert report["max_error"] == 0.0, (rank, report)
