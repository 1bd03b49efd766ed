"""Tensor-parallel ops on 4 gloo ranks: the autograd collectives, vocab-parallel cross-entropy, the tp
random stream, dropout under checkpointing, the form the collectives take in compiled blocks, and what
the sequence-parallel linears and a plan's application refuse.

Tolerances: collectives only move and sum data, compared at 1e-6 relative; the cross-entropy (per
token, and summed: the gradient is the sum's) is compared with torch.nn.functional.cross_entropy at
1e-5 relative (fp32); so is its fused form (the GPU's: the head's projection inside the loss,
per-chunk statistics combined over the group), run here with the row kernel written in torch. That
case caught a combine that did not rescale each rank's sum of exponentials to the common maximum,
and a hidden state entering the loss without the gradient sum over the group. Dropout runs are
compared bitwise: same seed gives identical loss and gradients, and recomputation (full or
selective) replays the very same masks, so its gradients are identical too.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from models import GPT
from models.config import ModelConfig
from models.parallelize import tensor_parallelize_gpt
from models.presets import MODEL_PRESETS
from parallel.data_parallel import DataParallel, DataParallelSettings, ParamInfo
from parallel.tensor_parallel import collectives as C
from parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel.tensor_parallel.random import TensorParallelRNG
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world

RTOL = 1e-5
# (tp, vocab): at tp=4, vocab 100 leaves three shards all padding; at tp=2, vocab 255 leaves the last shard one
# padding column, which a bound off by one would leave in the sum of exponentials
CE_CASES = [(2, 300), (4, 300), (4, 100), (2, 255)]
FUSED_CE_CASES = [(2, 300, False), (2, 300, True), (4, 300, True), (4, 100, False)]  # (tp, vocab, sequence parallel)
DROPOUT_CASES = [("gpt2", 2, False), ("llama", 2, True), ("gpt2", 4, True), ("llama", 4, False)]
COMPILED_CASES = [("gpt2", False, "none"), ("gpt2", True, "none"), ("llama", False, "none"),
                  ("gpt2", False, "full"), ("llama", True, "selective")]  # (preset, sequence parallel, recompute) at tp 2
RECOMPUTE = ("none", "full", "selective")


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _cross_entropy(topo: Topology, tp: int, vocab: int) -> dict:
    padded = -(-vocab // (128 * tp)) * 128 * tp
    g = torch.Generator().manual_seed(tp * 1000 + vocab)
    full = torch.randn(3, 7, padded, generator=g) * 4
    full[..., vocab:] = 50.0  # padding logits, large enough to dominate if not excluded
    labels = torch.randint(0, vocab, (3, 7), generator=g)
    labels[0, :4] = -100
    labels[2, 6] = vocab - 1
    # the last id of a rank's slice and the first of the next, where a label is on the wrong side of
    # an off-by-one bound would be picked by two ranks (planted: ``<=`` for ``<``, it passed)
    slice_ = padded // tp
    edges = [i for start in range(slice_, vocab, slice_) for i in (start - 1, start)]
    labels[1, :len(edges)] = torch.tensor(edges, dtype=labels.dtype)
    local = full.chunk(tp, dim=-1)[topo.tp_rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, labels, vocab, topo.tp_group)
    total = vocab_parallel_cross_entropy(local, labels, vocab, topo.tp_group, reduction="sum")
    total.backward()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.grad, group=topo.tp_group)
    grad = torch.cat(parts, dim=-1)
    ref_logits = full[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    ref.sum().backward()
    # 16-bit logits (the head's output under mixed precision) are reduced in fp32 all the same
    half = vocab_parallel_cross_entropy(local.detach().bfloat16(), labels, vocab, topo.tp_group)
    half_ref = F.cross_entropy(full[..., :vocab].bfloat16().float().flatten(0, 1), labels.flatten(),
                               ignore_index=-100, reduction="none")
    return {"loss": rel(loss, ref.view(3, 7)), "sum": rel(total, ref.sum()),
            "half": (half.dtype, rel(half, half_ref.view(3, 7))),
            "grad": rel(grad[..., :vocab], ref_logits.grad), "padding_grad": grad[..., vocab:].abs().max().item(),
            "ignored": loss[0, :4].abs().max().item()}


def _torch_rows(logits, labels, scale, loss, vocab_start, n_valid, combine, grad):
    """The fused cross-entropy's row kernel in torch, to its contract (the Triton body needs a GPU):
    this rank's per-row (max, sum of exp, label logit) go through ``combine``, the chunk's loss is
    filled and, with ``grad``, the logits become the scaled gradient in place (0 in the padding)."""
    x = logits.float().masked_fill(torch.arange(logits.shape[1]) >= n_valid, float("-inf"))
    local = labels - vocab_start
    mine = (local >= 0) & (local < n_valid)
    picked = torch.where(mine, x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None])[:, 0], 0.0)
    peak = x.max(1).values
    sum_exp = (x - torch.where(peak.isfinite(), peak, 0.0)[:, None]).exp().sum(1)  # 0 for an all-padding slice
    lse, label_logit = combine(peak, sum_exp, picked)
    loss.copy_(lse - label_logit)
    if grad:
        g = (x - lse[:, None]).exp()
        rows = mine.nonzero()[:, 0]
        g[rows, local[rows]] -= 1.0
        logits.copy_(g * scale[:, None])


def _fused_cross_entropy(topo: Topology, tp: int, vocab: int, sp: bool) -> dict:
    """The vocabulary-parallel loss through the fused path (the head's projection inside the loss,
    chunks of 4 rows, each chunk's statistics combined over the group), as on GPU, against
    torch.nn.functional.cross_entropy on the full logits: the summed loss and its gradients, then a
    per-token loss weighted at random. Each rank's vocabulary slice is scaled differently, so the
    ranks' row maxima differ and the combined sum of exponentials must rescale each rank's."""
    from types import SimpleNamespace
    from models.kernels import cross_entropy as fused
    from parallel.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    padded, hidden_size, rank = -(-vocab // (128 * tp)) * 128 * tp, 16, topo.tp_rank
    g = torch.Generator().manual_seed(tp * 1000 + vocab + sp)
    hidden = torch.randn(2, 8, hidden_size, generator=g)
    weight = torch.randn(padded, hidden_size, generator=g) * torch.arange(1, tp + 1).repeat_interleave(padded // tp)[:, None]
    labels = torch.randint(0, vocab, (2, 8), generator=g)
    labels[0, :3] = -100
    weights = torch.rand(2, 8, generator=g)
    ref_hidden, ref_weight = hidden.clone().requires_grad_(True), weight[:vocab].clone().requires_grad_(True)
    ref = F.cross_entropy((ref_hidden @ ref_weight.t()).flatten(0, 1), labels.flatten(), reduction="none").view(2, 8)
    mine = slice(rank * padded // tp, (rank + 1) * padded // tp)
    # sequence parallel: a rank holds a contiguous chunk of the flattened tokens (split_sequence)
    chunk = (lambda t: t.reshape(-1, hidden_size).chunk(tp)[rank].view(2, 8 // tp, hidden_size)) if sp else (lambda t: t)
    loss_fn = VocabParallelCrossEntropy(vocab, topo.tp_group, kernel_for=lambda _: fused.linear_cross_entropy)
    saved = fused._row_kernel, fused.CHUNK_ELEMENTS
    fused._row_kernel, fused.CHUNK_ELEMENTS = (lambda: _torch_rows), 4 * padded // tp
    out = {}
    try:
        for reduction in ("sum", "none"):
            x = chunk(hidden).clone().requires_grad_(True)
            head = SimpleNamespace(weight=weight[mine].clone().requires_grad_(True), sequence_parallel=sp)
            loss = loss_fn(x, head, labels, reduction)
            (loss if reduction == "sum" else loss * weights).sum().backward()
            expected = ref.sum() if reduction == "sum" else ref
            ref_hidden.grad = ref_weight.grad = None
            (ref.sum() if reduction == "sum" else (ref * weights).sum()).backward(retain_graph=True)
            full_weight_grad = torch.cat([ref_weight.grad, torch.zeros(padded - vocab, hidden_size)])
            out[reduction] = {"loss": rel(loss.detach(), expected.detach()),
                              "hidden_grad": rel(x.grad, chunk(ref_hidden.grad)),
                              # against the whole gradient's scale: a slice of padding alone has none
                              "weight_grad": ((head.weight.grad - full_weight_grad[mine]).abs().max()
                                              / full_weight_grad.abs().max()).item()}
    finally:
        fused._row_kernel, fused.CHUNK_ELEMENTS = saved
    return out


COLLECTIVES = ("copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "split_sequence",
               "gather_sequence", "reduce_scatter_sequence")


def token_chunk(x: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s sequence-parallel part of [batch, seq, ...]: its chunk of the tokens in memory order."""
    return x.reshape(-1).chunk(tp)[rank].view(x.shape[0], x.shape[1] // tp, *x.shape[2:])


def join_tokens(parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of ``token_chunk`` over all ranks."""
    first = parts[0]
    return torch.cat([p.reshape(-1) for p in parts]).view(first.shape[0], first.shape[1] * len(parts), *first.shape[2:])


def _collective(name: str, topo: Topology) -> dict:
    """Forward output and input gradient of one collective against the same math on gathered data.

    Inputs differ per rank (except where the op expects a replicated input) and so do the output
    gradients (except after gather_from_tp, whose backward assumes a replicated consumer).
    """
    tp, me, group = topo.tp_size, topo.tp_rank, topo.tp_group
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 8, 12, generator=g) for _ in range(tp)]  # xs[r]: rank r's input
    replicated_in = name in ("copy_to_tp", "scatter_to_tp", "split_sequence")
    xs = [xs[0]] * tp if replicated_in else xs
    fn = getattr(C, name)
    x = xs[me].clone().requires_grad_(True)
    y = fn(x, group)
    ws = [torch.randn(y.shape, generator=g) for _ in range(tp)]
    ws = [ws[0]] * tp if name == "gather_from_tp" else ws
    (y * ws[me]).sum().backward()
    total_w = sum(ws)
    expected = {
        "copy_to_tp": lambda: (xs[me], total_w),
        "reduce_from_tp": lambda: (sum(xs), ws[me]),
        "scatter_to_tp": lambda: (xs[me].chunk(tp, -1)[me], torch.cat(ws, -1)),
        "gather_from_tp": lambda: (torch.cat(xs, -1), ws[me].chunk(tp, -1)[me]),
        "split_sequence": lambda: (token_chunk(xs[me], tp, me), join_tokens(ws)),
        "gather_sequence": lambda: (join_tokens(xs), sum(token_chunk(w, tp, me) for w in ws)),
        "reduce_scatter_sequence": lambda: (token_chunk(sum(xs), tp, me), join_tokens(ws)),
    }
    expect_y, expect_grad = expected[name]()
    return {"y": rel(y.detach(), expect_y), "grad": rel(x.grad, expect_grad)}


def _streams(topo: Topology) -> dict:
    rng = TensorParallelRNG(seed=5, tp_rank=topo.tp_rank)
    torch.manual_seed(9)
    with rng.fork():
        sharded = torch.rand(4)
    replicated = torch.rand(4)
    snapshot_ctx, replay_ctx = rng.checkpoint_contexts()
    with rng.fork():
        first = torch.rand(4)
    with rng.fork():  # a later block's draws, made before the first block is recomputed
        second = torch.rand(4)
    with replay_ctx, rng.fork():
        replayed = torch.rand(4)
    with rng.fork():
        after = torch.rand(4)
    unreplayed = TensorParallelRNG(seed=5, tp_rank=topo.tp_rank)
    with unreplayed.fork():
        expected_after = [torch.rand(4) for _ in range(4)][-1]  # sharded, first, second, after
    both = [torch.empty(8) for _ in range(topo.tp_size)]
    dist.all_gather(both, torch.cat([sharded, replicated]), group=topo.tp_group)
    return {"sharded_differ": not torch.equal(both[0][:4], both[1][:4]),
            "replicated_agree": torch.equal(both[0][4:], both[1][4:]),
            "replayed": torch.equal(first, replayed), "advanced": not torch.equal(first, after),
            "resumed": torch.equal(after, expected_after) and not torch.equal(after, second)}


def _small_tp_model(preset: str, topo: Topology, sp: bool, recompute: str = "none", dropout: float = 0.0):
    fields = dict(MODEL_PRESETS[preset], num_layers=2, hidden_size=64, num_heads=4, vocab_size=200,
                  seq_length=16, dropout=dropout, attention_dropout=dropout)
    model = GPT(ModelConfig(**fields), vocab_multiple=128 * topo.tp_size, seed=3)
    tensor_parallelize_gpt(model, topo.tp_group, seed=3, sequence_parallel=sp, recompute=recompute)
    ids = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_length), generator=torch.Generator().manual_seed(0))
    return model, ids


def _dropout_run(preset: str, topo: Topology, sp: bool, recompute: str, dropout: float):
    model, ids = _small_tp_model(preset, topo, sp, recompute, dropout)
    torch.manual_seed(1)  # the default stream: identical on every tp rank
    loss = model(ids, ids).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compiled_collectives(preset: str, topo: Topology, sp: bool, recompute: str) -> dict:
    """The communication operators in each compiled block's forward and backward graphs, as AOT
    autograd hands them to the compiler. Traced ``torch.distributed`` calls (``_c10d_functional``
    ops) compiled to wrong gradients on CUDA (``parallel.tensor_parallel.collectives``), which no CPU
    run shows, so every collective in a block must be one of megazero's opaque operators."""
    model, ids = _small_tp_model(preset, topo, sp, recompute)
    found = {"forward": set(), "backward": set()}

    def record(kind):
        def compiler(gm, example_inputs):
            found[kind].update(str(node.target) for node in gm.graph.nodes if node.op == "call_function"
                               and ("c10d" in str(node.target) or str(node.target).startswith("megazero.")))
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"))
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, backend=backend)
    model(ids, ids).mean().backward()
    torch._dynamo.reset()
    return found


def _masks_per_rank(topo: Topology) -> dict:
    """Whether the dropouts that act on each rank's own part (the residual-branch dropout on its token
    chunk under sequence parallelism, attention dropout on its heads) draw masks that differ across
    tp ranks when every rank feeds them the same values from the same default seed: they must use
    the tp stream. Also whether a module with nothing random skips the stream's fork."""
    fields = dict(MODEL_PRESETS["gpt2"], num_layers=1, hidden_size=32, num_heads=4, vocab_size=200,
                  seq_length=16, dropout=0.5, attention_dropout=0.5)
    model = GPT(ModelConfig(**fields), vocab_multiple=128 * topo.tp_size, seed=3)
    tensor_parallelize_gpt(model, topo.tp_group, seed=3, sequence_parallel=True)
    block = model.layers["0"]
    torch.manual_seed(4)
    q = torch.rand(1, 2, 16, 8)
    outs = {"residual": block.dropout(torch.ones(1, 8, 32)), "attention": block.attention.core(q, q, q)}
    report = {"norm_unforked": "forward" not in vars(block.mlp_norm)}
    for name, out in outs.items():
        both = [torch.empty_like(out) for _ in range(topo.tp_size)]
        dist.all_gather(both, out.contiguous(), group=topo.tp_group)
        report[name] = not torch.equal(both[0], both[1])
    return report


class _Discard:
    """A weight-gradient taker that drops what it is handed: only the backward's own outputs are checked."""

    def hand_over(self, weight, bias, x, grad_out) -> None:
        pass


def _fake_shapes(topo: Topology) -> list[str]:
    """torch.library.opcheck's comparison of each sequence-parallel linear's shape function (what a
    compiled graph plans its buffers by) with what the operator returns, forward and backward, the
    backward also with its weight gradient handed to a taker (a split-backward schedule's, compiled);
    the failures. The eager runs here never read those functions, and a compiled run on GPUs would."""
    from parallel.tensor_parallel import overlap
    from parallel.weight_grad_takers import IN_BACKWARD, register_weight_grad_taker

    name, tp = topo.tp_group.group_name, topo.tp_size
    g = torch.Generator().manual_seed(5)
    chunk, whole = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4 * tp, 6, generator=g)  # [batch, tokens, 8 or 6]
    weight, bias = torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    full = torch.randn(2 * 4 * tp, 8, generator=g)
    cases = [(overlap._column, (chunk, weight, bias, name, "overlap", IN_BACKWARD)),
             (overlap._column_backward, (whole, full, weight, bias, name, "overlap", IN_BACKWARD)),
             (overlap._row, (whole, weight.t().contiguous(), name, "overlap", IN_BACKWARD)),
             (overlap._row_backward, (chunk, whole, weight.t().contiguous(), name, "overlap", IN_BACKWARD))]
    taker = _Discard()
    deferred = register_weight_grad_taker(taker)
    cases += [(overlap._column_backward, (whole, full, weight, bias, name, "overlap", deferred)),
              (overlap._row_backward, (chunk, whole, weight.t().contiguous(), name, "overlap", deferred))]
    failures = []
    for op, args in cases:
        try:
            torch.library.opcheck(op, args, test_utils="test_faketensor")
        except Exception as exc:  # noqa: BLE001 - reported by name
            failures.append(f"{op}: {exc}")
    return failures


def _linear_refusals(topo: Topology) -> dict:
    """What the sequence-parallel linears raise for a communication mode they do not know (otherwise
    run as another mode, silently) and for tokens that do not split into tp equal chunks (the
    overlapped row linear would leave the remainder out of every chunk; splitting the sequence would
    fail reshaping the chunk, with a traceback that names no size); empty where nothing is raised.
    Every rank makes the same calls, so a linear that does not refuse runs its collectives everywhere."""
    from parallel.tensor_parallel import overlap

    g = torch.Generator().manual_seed(6)
    weight = torch.randn(6, 8, generator=g)
    even, odd = torch.randn(1, 4, 8, generator=g), torch.randn(1, 3, 8, generator=g)  # tokens: 4 split in 2, 3 do not
    calls = {"column_mode": lambda: overlap.column_linear(even, weight, None, topo.tp_group, "overlapped"),
             "row_mode": lambda: overlap.row_linear(even, weight, topo.tp_group, "overlapped"),
             "row_tokens": lambda: overlap.row_linear(odd, weight, topo.tp_group, "overlap"),
             "split_tokens": lambda: C.split_sequence(odd, topo.tp_group)}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = ""
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _partial_without_group() -> str:
    """The data-parallel wrapper refuses partial gradients it has no tensor group to sum over."""
    layer = torch.nn.LayerNorm(4)
    info = {id(p): ParamInfo(name, None, counts_for_norm=True, tp_partial=True) for name, p in layer.named_parameters()}
    try:
        DataParallel([layer], DataParallelSettings(), dist.group.WORLD, units=[], info=lambda p: info[id(p)])
    except ValueError as exc:
        return str(exc)
    return ""


def _checks(rank, world_size):
    topologies = {tp: Topology(RankGrid(tp=tp, pp=1, dp=world_size // tp)) for tp in (2, 4)}
    out = {"ce": {case: _cross_entropy(topologies[case[0]], *case) for case in CE_CASES},
           "fused_ce": {case: _fused_cross_entropy(topologies[case[0]], *case) for case in FUSED_CE_CASES},
           "collectives": {(n, tp): _collective(n, topologies[tp]) for n in COLLECTIVES for tp in (2, 4)},
           "streams": _streams(topologies[2]), "dropout": {}, "masks": _masks_per_rank(topologies[2]),
           "partial_without_group": _partial_without_group(), "fake_shapes": _fake_shapes(topologies[2]),
           "linear_refusals": _linear_refusals(topologies[2])}
    for preset, tp, sp in DROPOUT_CASES:
        topo = topologies[tp]
        base_loss, base_grads = _dropout_run(preset, topo, sp, "none", 0.1)
        quiet_loss, _ = _dropout_run(preset, topo, sp, "none", 0.0)
        report = {"active": not torch.equal(base_loss, quiet_loss)}
        for recompute in RECOMPUTE:
            loss, grads = _dropout_run(preset, topo, sp, recompute, 0.1)
            report[recompute] = torch.equal(loss, base_loss) and all(torch.equal(grads[n], g)
                                                                      for n, g in base_grads.items())
        out["dropout"][(preset, tp, sp)] = report
    out["compiled"] = {case: _compiled_collectives(case[0], topologies[2], *case[1:]) for case in COMPILED_CASES}
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(4, _checks)


@pytest.mark.parametrize("tp", (2, 4))
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_and_its_backward_mirror(results, name, tp):
    for result in results:
        assert result["collectives"][(name, tp)]["y"] <= 1e-6
        assert result["collectives"][(name, tp)]["grad"] <= 1e-6


@pytest.mark.parametrize("case", CE_CASES, ids=lambda c: f"tp{c[0]}-vocab{c[1]}")
def test_vocab_parallel_cross_entropy_equals_torch_on_full_logits(results, case):
    for result in results:
        ce = result["ce"][case]
        assert ce["loss"] <= RTOL and ce["sum"] <= RTOL and ce["grad"] <= RTOL
        assert ce["padding_grad"] == 0.0 and ce["ignored"] == 0.0


@pytest.mark.parametrize("case", CE_CASES, ids=lambda c: f"tp{c[0]}-vocab{c[1]}")
def test_vocab_parallel_cross_entropy_of_16_bit_logits_is_computed_in_fp32(results, case):
    """bf16 logits summed in bf16 lose about two digits of the loss; the loss is fp32 whatever comes in."""
    for result in results:
        dtype, error = result["ce"][case]["half"]
        assert dtype == torch.float32 and error <= RTOL, (dtype, error)


@pytest.mark.parametrize("case", FUSED_CE_CASES, ids=lambda c: f"tp{c[0]}-vocab{c[1]}{'-sp' if c[2] else ''}")
def test_fused_vocab_parallel_cross_entropy_equals_torch(results, case):
    """The GPU's path of the loss (projection inside, statistics combined over the group) on CPU."""
    for rank, result in enumerate(results):
        for reduction, errors in result["fused_ce"][case].items():
            assert max(errors.values()) <= RTOL, (rank, reduction, errors)


def test_tp_stream_differs_across_ranks_and_default_stream_agrees(results):
    for result in results:
        assert result["streams"]["sharded_differ"] and result["streams"]["replicated_agree"]


def test_checkpoint_context_replays_the_tp_stream(results):
    """A recompute replays the stream from the block's snapshot, then puts back where the forward left
    it: left at the replayed point, the next step's first block would redraw the masks a later block
    drew this step."""
    for result in results:
        assert result["streams"]["replayed"] and result["streams"]["advanced"]
        assert result["streams"]["resumed"]


def test_a_tied_parameter_split_two_ways_is_refused():
    """A weight shared by two modules is split once and both get that one shard; a second style that
    splits it along another dimension would otherwise be handed the first style's shard silently."""
    from parallel.tensor_parallel.layers import _shard_param
    from parallel.tensor_parallel.sharding import Shard

    tied, memo = torch.nn.Parameter(torch.randn(8, 4)), {}
    first = _shard_param(tied, Shard(0, 1, 2), memo)
    assert torch.equal(first, tied[4:]) and _shard_param(tied, Shard(0, 1, 2), memo) is first
    with pytest.raises(ValueError, match="split two ways"):
        _shard_param(tied, Shard(1, 1, 2), memo)


def test_sequence_parallel_linears_shape_functions_match_their_outputs(results):
    for result in results:
        assert not result["fake_shapes"], result["fake_shapes"]


def test_sequence_parallel_linears_refuse_unknown_modes_and_uneven_tokens(results):
    for result in results:
        refusals = result["linear_refusals"]
        assert "use one of" in refusals["column_mode"] and "use one of" in refusals["row_mode"], refusals
        assert "do not split into 2 equal" in refusals["row_tokens"], refusals
        assert "sequence length 3 is not divisible by the tensor-parallel size 2" in refusals["split_tokens"], refusals


def test_tp_stream_is_not_the_default_stream_of_the_same_seed():
    """The engine seeds the default generator and the tp stream from the one run seed (the tp stream
    with an offset): were the two equal on tp rank 0, its attention-dropout masks would repeat the
    replicated dropouts' masks drawn from the same state."""
    rng = TensorParallelRNG(seed=5, tp_rank=0)
    torch.manual_seed(5)
    replicated = torch.rand(16)
    with rng.fork():
        sharded = torch.rand(16)
    assert not torch.equal(replicated, sharded)


def test_a_plan_with_an_unknown_style_or_a_style_on_the_wrong_module_is_refused():
    """A misspelt style, or a split style on a module it cannot split, is named rather than failing
    inside a layer's constructor; a checkpoint interval below 1 too. Nothing here reaches the group."""
    from parallel.tensor_parallel.apply import apply_activation_checkpointing, apply_tensor_parallel

    model = GPT(ModelConfig(num_layers=1, vocab_size=200, seq_length=16), device="meta")
    rng = TensorParallelRNG(seed=0, tp_rank=0)
    with pytest.raises(ValueError, match=r"unknown tensor-parallel styles \['colwize'\]"):
        apply_tensor_parallel(model, {"layers.*.mlp.fc_in": "colwize"}, None, rng=rng)
    with pytest.raises(ValueError, match="layers.0.mlp: style 'colwise' needs a Linear, got MLP"):
        apply_tensor_parallel(model, {"layers.*.mlp": "colwise"}, None, rng=rng)
    with pytest.raises(ValueError, match="must be at least 1"):
        apply_activation_checkpointing(model, "layers.*", every=0)


def test_partial_gradients_without_a_tensor_group_are_refused(results):
    for result in results:
        assert "pass tp_group" in result["partial_without_group"]


def test_dropout_on_a_ranks_own_part_draws_from_the_tp_stream(results):
    for result in results:
        assert result["masks"] == {"residual": True, "attention": True, "norm_unforked": True}, result["masks"]


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: f"{c[0]}-tp{c[1]}{'-sp' if c[2] else ''}")
def test_dropout_is_reproducible_and_recompute_replays_its_masks(results, case):
    for result in results:
        report = result["dropout"][case]
        assert report["active"], "dropout changed nothing: the test would prove nothing"
        assert report["none"], "two runs with the same seed differ"
        assert report["full"], "full recompute changed the loss or gradients"
        assert report["selective"], "selective recompute changed the loss or gradients"


@pytest.mark.parametrize("case", COMPILED_CASES, ids=lambda c: f"{c[0]}{'-sp' if c[1] else ''}-recompute-{c[2]}")
def test_compiled_blocks_communicate_only_through_megazero_operators(results, case):
    for result in results:
        for kind, targets in result["compiled"][case].items():
            assert targets, f"no collective in the compiled {kind} graph: the test would prove nothing"
            traced = sorted(t for t in targets if not t.startswith("megazero."))
            assert not traced, f"{kind} graph traces {traced}"
