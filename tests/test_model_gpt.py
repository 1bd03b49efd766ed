"""The single-device decoder: stage interface, layout-independent initialisation, ops seam.

Tolerances: fp32 on CPU; chained stages run the very same ops as the whole model, so their outputs
and gradients must agree to 1e-6 relative; initial values must match bitwise.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megazero.engine import gpt_forward_step
from models import GPT, ops
from models.config import ModelConfig
from models.init import seeded_normal
from models.parallelize import check_tp_layout, recompute_replays_tp_stream, tensor_parallelize_gpt
from models.presets import MODEL_PRESETS
from parallel.tensor_parallel.sharding import Shard

RTOL = 1e-6


def config(preset: str, **overrides) -> ModelConfig:
    fields = dict(MODEL_PRESETS[preset], num_layers=4, hidden_size=64, num_heads=4, vocab_size=300, seq_length=16)
    if preset == "llama":
        fields["num_kv_heads"] = 2
    fields.update(overrides)
    return ModelConfig(**fields)


def batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels[0, :3] = ops.IGNORE_INDEX
    return ids, labels


def close(a, b, rtol=RTOL):
    return (a - b).abs().max().item() <= rtol * b.abs().max().item() + 1e-12


ATTENTION, MLP = ("attention",), ("mlp",)
WHOLE_BLOCKS = [(range(0, 1), {}), (range(1, 3), {}), (range(3, 4), {})]
HALF_BLOCKS = [(range(0, 2), {1: ATTENTION}), (range(1, 4), {1: MLP, 3: ATTENTION}), (range(3, 4), {3: MLP})]


@pytest.mark.parametrize("cuts", [WHOLE_BLOCKS, HALF_BLOCKS], ids=["whole blocks", "half blocks"])
@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_stages_chained_equal_the_whole_model(preset, cuts):
    cfg = config(preset, tie_embeddings=False)
    whole = GPT(cfg, seed=3)
    stages = [GPT(cfg, layers=layers, parts=parts, has_embedding=i == 0, has_head=i == len(cuts) - 1, seed=3)
              for i, (layers, parts) in enumerate(cuts)]
    whole_params = dict(whole.named_parameters())
    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(names) == sorted(whole_params)  # every parameter on exactly one stage
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, whole_params[name]), name
    ids, labels = batch(cfg)
    x = ids
    for stage in stages[:-1]:
        x = stage(x)
        assert x.shape == (2, cfg.seq_length, cfg.hidden_size)
    loss = stages[-1](x, labels)
    ref = whole(ids, labels)
    assert loss.shape == labels.shape and close(loss, ref)
    assert (loss[0, :3] == 0).all()
    total = stages[-1](x, labels, reduction="sum")  # as training asks: the stages' gradients come from it
    assert total.shape == () and close(total, ref.sum())
    total.backward()
    ref.sum().backward()
    for stage in stages:
        for name, p in stage.named_parameters():
            assert close(p.grad, whole_params[name].grad), name


def test_tied_head_on_a_later_stage_starts_equal_to_the_embedding():
    cfg = config("gpt2")
    first, last = GPT(cfg, layers=[0], has_head=False), GPT(cfg, layers=[3], has_embedding=False)
    assert torch.equal(first.embedding.tokens.weight, last.lm_head.weight)
    whole = GPT(cfg)
    assert whole.lm_head.weight is whole.embedding.tokens.weight
    # only a stage without the embedding holds a copy: the shared weight itself enters the gradient norm
    assert whole.tied_head_copy is None and first.tied_head_copy is None
    assert last.tied_head_copy is last.lm_head.weight


def test_logits_are_padded_to_the_vocab_multiple_and_padding_is_zero():
    cfg = config("llama")
    model = GPT(cfg, vocab_multiple=256)
    ids, _ = batch(cfg)
    assert model(ids).shape == (2, cfg.seq_length, 512)
    assert model.embedding.tokens.weight[cfg.vocab_size:].abs().sum() == 0
    assert model.lm_head.weight[cfg.vocab_size:].abs().sum() == 0


@pytest.mark.parametrize("parts", [("attention", "mlp"), ("attention",), ("mlp",)])
def test_dropout_covers_every_residual_branch_and_the_embedding(parts):
    """With dropout 1 in training every branch a block adds to the residual stream is dropped whole, so
    a block (or either half of one) returns its input unchanged and the embedding returns zeros. A
    branch added without its dropout would be regularised by nothing, which no loss comparison run
    at dropout 0 can show."""
    from models.gpt import Block

    cfg = config("gpt2", dropout=1.0)
    model = GPT(cfg, seed=3)
    block = Block(cfg, parts=parts)
    block.load_state_dict(model.layers["0"].state_dict(), strict=False)
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(block(x), x)
    assert torch.equal(model.embedding(batch(cfg)[0]), torch.zeros(2, cfg.seq_length, cfg.hidden_size))
    block.eval()
    assert not torch.equal(block(x), x)  # the branches themselves are not zero


def test_meta_build_then_init_equals_eager_build():
    cfg = config("llama")
    eager = GPT(cfg, seed=5)
    meta = GPT(cfg, seed=5, device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights(5)
    for (name, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), name
    buffers = dict(meta.named_buffers())
    assert buffers and all(torch.equal(b, buffers[name]) for name, b in eager.named_buffers())  # rotary tables
    ids, _ = batch(cfg)
    assert torch.equal(eager(ids), meta(ids))


def test_rotary_tables_are_computed_once_and_match_fresh_ones():
    cfg = config("llama")
    model = GPT(cfg)
    attention = model.layers["0"].attention
    assert not any("rotary" in name for name in model.state_dict())  # follow from the config: not saved
    assert all(block.attention.rotary_cos is attention.rotary_cos for block in model.layers.values())  # shared
    for seq, dtype in ((cfg.seq_length, torch.bfloat16), (cfg.seq_length // 2, torch.float32),
                       (cfg.seq_length + 3, torch.float32)):  # longer than the tables: computed
        fresh = ops.rotary_tables(seq, cfg.head_dim, cfg.rope_theta, "cpu", dtype)
        kept = attention.rotary(seq, dtype)
        assert all(torch.equal(a, b) and a.dtype == dtype for a, b in zip(kept, fresh))


def test_initialisation_scales():
    cfg = config("gpt2", num_layers=8, hidden_size=256, num_heads=8)
    model = GPT(cfg, seed=0)
    std = 1 / math.sqrt(3 * 256)
    assert abs(model.layers["0"].attention.qkv.weight.std().item() / std - 1) < 0.02
    for projection in (model.layers["0"].mlp.fc_out, model.layers["0"].attention.out):  # both residual outputs
        assert abs(projection.weight.std().item() / (std / math.sqrt(16)) - 1) < 0.02
    for norm in (model.layers["0"].attn_norm, model.layers["0"].mlp_norm, model.final_norm):  # an identity at start
        assert torch.equal(norm.weight, torch.ones(256)) and torch.equal(norm.bias, torch.zeros(256))
    assert model.layers["0"].attention.qkv.bias.abs().sum() == 0
    other = GPT(cfg, seed=1)
    assert not torch.equal(model.layers["0"].attention.qkv.weight, other.layers["0"].attention.qkv.weight)


@pytest.mark.parametrize("shard", [Shard(0, 1, 4), Shard(1, 2, 4)])
def test_seeded_shards_are_slices_of_the_full_draw(shard):
    full = seeded_normal((16, 8), 0.02, seed=7, key="w", zero_rows_from=14)
    part = seeded_normal((16, 8), 0.02, seed=7, key="w", shard=shard, zero_rows_from=14)
    assert torch.equal(part, shard.take(full))
    assert full[14:].abs().sum() == 0 and full[:14].abs().min() > 0


def test_ops_match_their_textbook_definitions():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 8, generator=g), torch.randn(8, generator=g)
    assert close(ops.rms_norm(x, w, 1e-5), x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    assert close(ops.attention(q, k, v, 0.0), scores.softmax(-1) @ v)
    k2, v2 = k[:, :2], v[:, :2]  # grouped-query: heads 0,1 read kv 0; heads 2,3 read kv 1
    expect = ops.attention(q, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), 0.0)
    assert close(ops.attention(q, k2, v2, 0.0), expect)
    cos, sin = ops.rotary_tables(6, 8, 10000.0, "cpu", torch.float32)
    r = ops.apply_rotary(q.transpose(1, 2), cos, sin)
    assert close(r.norm(dim=-1), q.transpose(1, 2).norm(dim=-1))  # a rotation keeps lengths
    logits, labels = torch.randn(4, 10, generator=g), torch.tensor([1, ops.IGNORE_INDEX, 3, 9])
    expect = F.cross_entropy(logits, labels, reduction="none", ignore_index=ops.IGNORE_INDEX)
    assert close(ops.cross_entropy(logits, labels), expect)


def test_unknown_loss_reduction_is_refused():
    cfg = config("gpt2")
    with pytest.raises(ValueError, match="reduction"):
        GPT(cfg)(*batch(cfg), reduction="mean")


def test_layers_outside_the_model_are_refused():
    with pytest.raises(ValueError, match="num_layers"):
        GPT(config("gpt2"), layers=range(2, 6))
    with pytest.raises(ValueError, match="num_layers"):  # the first index past the last block
        GPT(config("gpt2"), layers=[4])
    with pytest.raises(ValueError, match="outside layers"):
        GPT(config("gpt2"), layers=range(0, 2), parts={2: MLP})
    with pytest.raises(ValueError, match="non-empty subset"):
        GPT(config("gpt2"), layers=range(0, 2), parts={1: ("norm",)})


@pytest.mark.parametrize("preset,overrides,field", [
    ("llama", dict(num_heads=4, num_kv_heads=2), "model.num_kv_heads"),
    ("gpt2", dict(num_heads=2, hidden_size=64), "model.num_heads"),
    ("gpt2", dict(ffn_hidden_size=130), "model.ffn_hidden_size"),
])
def test_layouts_that_do_not_split_are_refused_naming_the_field(preset, overrides, field):
    tp = 4
    model = GPT(config(preset, **overrides), vocab_multiple=128 * tp, device="meta")
    with pytest.raises(ValueError, match=field):
        check_tp_layout(model, tp)
    check_tp_layout(model, 1)


def test_a_vocabulary_padded_for_another_tp_is_refused():
    """A vocabulary padded to a multiple that tp does not divide cannot be split into equal row blocks."""
    model = GPT(config("gpt2", num_heads=8), vocab_multiple=2, device="meta")  # 300 rows: heads and MLP split by 8
    with pytest.raises(ValueError, match="padded vocabulary 300 is not divisible by tp 8"):
        check_tp_layout(model, 8)
    check_tp_layout(model, 4)


def test_a_one_rank_group_refuses_sequence_parallelism_and_unknown_recompute(one_rank_group):
    """Both would otherwise build a model other than the one asked for (sequence parallelism over one
    rank is the plain model, silently) or fail on a lookup that names neither field."""
    model = GPT(config("gpt2"), seed=3)
    with pytest.raises(ValueError, match="sequence parallelism needs a tensor-parallel group of more than one"):
        tensor_parallelize_gpt(model, one_rank_group, seed=3, sequence_parallel=True)
    with pytest.raises(ValueError, match="recompute 'ful'"):
        tensor_parallelize_gpt(model, one_rank_group, seed=3, recompute="ful")


def test_no_recompute_replays_no_tp_stream():
    """The engine asks this of every compiled tensor-parallel run, recompute off included."""
    model = GPT(config("gpt2", attention_dropout=0.1), device="meta")
    assert recompute_replays_tp_stream(model, "none") == []
    assert recompute_replays_tp_stream(model, "selective") == [f"layers.{i}.attention.core" for i in range(4)]


def _rotate_half_by_hand(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face Llama / GPT-NeoX rotary, element by element: at position m, element i of the
    first half pairs with element i of the second half, rotated by m * theta^(-2i/d)."""
    seq, d = x.shape[1], x.shape[-1]
    out = torch.empty_like(x, dtype=torch.float64)
    for m in range(seq):
        for i in range(d // 2):
            angle = m * theta ** (-2 * i / d)
            a, b = x[:, m, :, i].double(), x[:, m, :, i + d // 2].double()
            out[:, m, :, i] = a * math.cos(angle) - b * math.sin(angle)
            out[:, m, :, i + d // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


def test_rotary_is_the_rotate_half_convention_of_hugging_face_checkpoints():
    """A checkpoint converted from Hugging Face only works with the same pairing of dimensions: an
    interleaved (GPT-J) rotation keeps lengths and relative positions too, so only an element-wise
    reference tells them apart. Planted bug this caught: that interleaved pairing, which the
    length check alone passed."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 3, 8, generator=g)
    cos, sin = ops.rotary_tables(7, 8, 500.0, "cpu", torch.float32)
    assert close(ops.apply_rotary(x, cos, sin).double(), _rotate_half_by_hand(x, 500.0))


def test_rotary_scores_depend_only_on_the_relative_position():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 1, 8, generator=g).double(), torch.randn(1, 1, 1, 8, generator=g).double()
    cos, sin = ops.rotary_tables(12, 8, 10000.0, "cpu", torch.float64)

    def score(m: int, n: int) -> float:
        rq = ops.apply_rotary(q.expand(1, 12, 1, 8), cos, sin)[0, m, 0]
        rk = ops.apply_rotary(k.expand(1, 12, 1, 8), cos, sin)[0, n, 0]
        return float(rq @ rk)
    assert score(5, 2) == pytest.approx(score(9, 6), rel=1e-6) == pytest.approx(score(3, 0), rel=1e-6)  # fp32 angles
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


def _forward_runs(module, runs: list, key) -> None:
    """Count each run of ``module``'s own forward in ``runs`` under ``key``: a recompute wraps the
    forward in place, so the count includes the re-run in backward."""
    forward = module.forward

    def counted(*args, **kwargs):
        runs.append(key)
        return forward(*args, **kwargs)
    module.forward = counted


@pytest.mark.parametrize("recompute,layers,recomputed", [("selective", range(0, 4), [0, 1, 2, 3]),
                                                          ("full", range(1, 4), [1, 3])])
def test_recompute_every_picks_whole_blocks_from_the_stages_first(one_rank_group, recompute, layers, recomputed):
    """``recompute_every 2`` recomputes every other whole block, counted from a stage's own first block
    (the planner and the FLOPs count assume that), and never thins selective recompute: every attention
    core is re-run. (Planted: the count started at the second match; the every-th core alone recomputed
    under selective.)"""
    cfg = config("gpt2")
    model = GPT(cfg, layers=layers, has_embedding=layers[0] == 0, has_head=True, seed=3)
    runs = []
    for i, block in model.layers.items():
        _forward_runs(block.attention.core if recompute == "selective" else block, runs, int(i))
    tensor_parallelize_gpt(model, one_rank_group, seed=3, recompute=recompute, recompute_every=2)
    ids, labels = batch(cfg)
    x = ids if layers[0] == 0 else torch.randn(2, cfg.seq_length, cfg.hidden_size, requires_grad=True)
    model(x, labels, reduction="sum").backward()
    assert sorted(i for i in set(runs) if runs.count(i) == 2) == recomputed
    assert sorted(set(runs)) == list(layers)


def test_the_engines_last_stage_loss_is_the_mean_over_real_labels():
    """The pipeline's last stage returns a micro-batch's mean token loss, ignored labels left out of
    the count as well as the sum (a micro-batch of ignored labels alone gives 0, not NaN). (Planted:
    the sum divided by every label, ignored ones included.)"""
    cfg = config("gpt2")
    model = GPT(cfg, seed=3)
    ids, labels = batch(cfg)
    per_token = model(ids, labels)
    loss = gpt_forward_step(model, None, {"tokens": ids, "labels": labels}, True, True)
    assert close(loss, per_token.sum() / (labels != ops.IGNORE_INDEX).sum())
    ignored = torch.full_like(labels, ops.IGNORE_INDEX)
    assert gpt_forward_step(model, None, {"tokens": ids, "labels": ignored}, True, True).item() == 0.0
