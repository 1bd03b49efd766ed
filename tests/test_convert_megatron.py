"""Megatron-LM legacy checkpoints written by megatron-core's own code at tp2 x pp2 import with equal
logits, for a Llama-style model (grouped-query attention with two query groups per tp rank, rotary
with base 500, RMSNorm, SwiGLU, untied head) and a GPT-2-style one (learned positions, LayerNorm,
tanh GeLU, biases, tied head).

Four gloo ranks on CPU build megatron-core's GPTModel with the local (non-Transformer-Engine) layer
spec, save each rank's ``state_dict_for_save_checkpoint`` as Megatron-LM's legacy checkpointing
lays files out (``iter_0000005/mp_rank_TT_PPP/model_optim_rng.pt`` holding ``args`` and
``model``), and run the pipeline's forward by hand: the first stage sends its hidden state to the
second, which returns the gathered logits. megatron-core moves the rotary frequencies to
``torch.cuda.current_device()`` (patched to the CPU here), moves a tied head's weight to a GPU to
sync it between stages (``Tensor.cuda`` is the identity here), builds its default causal mask on a GPU
(passed explicitly here) and forks its CUDA RNG around attention dropout (a no-op here: dropout
is 0); nothing else of it needs one.

Parameters that every tp rank holds whole (norms, row-parallel biases, position embeddings) are
given the same values on both tp ranks, as Megatron's training keeps them: with a copy per rank
drawn from that rank's seed, each rank computes with its own copy, no single copy reproduces the
logits, and the importer (which takes tp rank 0's) says so in a note, tested below.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import warnings

import pytest
import torch

from megazero.cli import main
from megazero.convert.megatron import model_config
from megazero.errors import UserError
from tests.distributed import run_world

with warnings.catch_warnings():  # megatron-core warns at import about missing GPU extras
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core.models.gpt", reason="megatron-core is not installed (pip install megatron-core)")

VOCAB, SEQ, LAYERS = 128, 8, 4
HIDDEN = 32
MODELS = {
    "llama": {"args": {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
                       "add_bias_linear": False, "untie_embeddings_and_output_weights": True, "rotary_base": 500,
                       "num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 4},
              "share": False},
    "gpt2": {"args": {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "swiglu": False,
                      "add_bias_linear": True, "bias_gelu_fusion": True, "untie_embeddings_and_output_weights": False,
                      "num_attention_heads": 4},
             "share": True},
    # --disable-bias-linear with GeLU: megatron-core computes it exactly (erf), megazero's gelu_exact
    "gelu-without-biases": {"args": {"position_embedding_type": "learned_absolute", "normalization": "RMSNorm",
                                     "swiglu": False, "add_bias_linear": False, "bias_gelu_fusion": False,
                                     "untie_embeddings_and_output_weights": False, "num_attention_heads": 4},
                            "share": True},
}


def _world(rank, world_size, root):
    warnings.simplefilter("ignore")
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.cuda.current_device = lambda: "cpu"  # megatron-core's rotary embedding asks for a GPU
    torch.Tensor.cuda = lambda self, *_, **__: self  # and its tied head is synced on one (these are worker processes)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    get_cuda_rng_tracker().fork = lambda *_, **__: contextlib.nullcontext()  # no dropout here: no CUDA RNG needed
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    out = {}
    for name, spec in MODELS.items():
        a = spec["args"]
        swiglu = a["swiglu"]
        exact = not (a["add_bias_linear"] and a.get("bias_gelu_fusion"))  # as Megatron-LM builds its config
        config = TransformerConfig(
            num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=a["num_attention_heads"],
            num_query_groups=a.get("num_query_groups"),
            ffn_hidden_size=64, use_cpu_initialization=True, pipeline_dtype=torch.float32, tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2, normalization=a["normalization"], gated_linear_unit=swiglu,
            activation_func=F.silu if swiglu else (lambda x: F.gelu(x, approximate="none" if exact else "tanh")),
            add_bias_linear=a["add_bias_linear"], hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)
        torch.manual_seed(1 + rank)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=a["normalization"]), vocab_size=VOCAB,
                         max_sequence_length=SEQ, pre_process=first, post_process=last,
                         position_embedding_type=a["position_embedding_type"], rotary_base=a.get("rotary_base", 10000),
                         share_embeddings_and_output_weights=spec["share"], parallel_output=False).eval()
        torch.manual_seed(10 + pp)  # replicated over tp: the same values on both tp ranks (module docstring)
        with torch.no_grad():  # norms away from 1 and biases away from 0, so a misplaced one shows
            for key, p in model.named_parameters():
                if not getattr(p, "tensor_model_parallel", False):
                    p.normal_(1.0 if "norm" in key else 0.0, 0.2)
        args = argparse.Namespace(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=64,
                                  padded_vocab_size=VOCAB, max_position_embeddings=SEQ, seq_length=SEQ,
                                  tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                  params_dtype=torch.float32, **a)
        folder = f"{root}/{name}/iter_0000005/mp_rank_{tp:02d}_{pp:03d}"
        os.makedirs(folder, exist_ok=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 5,
                    "model": model.state_dict_for_save_checkpoint()}, f"{folder}/model_optim_rng.pt")
        if rank == 0:
            with open(f"{root}/{name}/latest_checkpointed_iteration.txt", "w") as f:
                f.write("5")
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(SEQ).expand(2, SEQ)
        mask = torch.ones(1, 1, SEQ, SEQ).triu(1).bool()  # True: masked (its default mask is built on a GPU)
        with torch.no_grad():
            if first:
                dist.send(model(ids, positions, mask).contiguous(), rank + 2)  # ranks: tp fastest, then pp
            else:
                hidden = torch.empty(SEQ, 2, HIDDEN)
                dist.recv(hidden, rank - 2)
                model.set_input_tensor(hidden)
                out[name] = (ids.numpy(), model(ids, positions, mask).numpy())  # by value, not shared memory
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    return root, run_world(4, _world, str(root))[2]


@pytest.mark.parametrize("name", MODELS)
def test_megatron_tp2_pp2_imports_with_equal_logits(megatron, name, tmp_path):
    from megazero.generate import load_model

    root, report = megatron
    assert main(["convert", str(root / name), str(tmp_path / "mz")]) == 0
    ours, _ = load_model(tmp_path / "mz")
    ids, want = (torch.from_numpy(a) for a in report[name])
    with torch.no_grad():
        got = ours(ids)[..., :VOCAB]
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def test_tp_copies_that_differ_are_named(megatron, tmp_path, capsys):
    """A replicated tensor whose tp copies differ cannot be imported faithfully: the conversion
    names it (and still writes tp rank 0's copy)."""
    root, _ = megatron
    src = shutil.copytree(root / "gpt2", tmp_path / "gpt2")
    path = src / "iter_0000005" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.final_layernorm.bias"] += 0.5
    torch.save(state, path)
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "mz")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "different copies" in line]
    assert len(notes) == 1 and "decoder.final_layernorm.bias (largest difference 0.5)" in notes[0], notes


@pytest.mark.parametrize("name, file, key, change, message", [
    ("gpt2", "mp_rank_01_000", "decoder.layers.0.self_attention.linear_qkv.weight", lambda t: t[:-1],
     r"mp_rank_01_000/model_optim_rng\.pt: decoder\.layers\.0\.self_attention\.linear_qkv\.weight has shape "
     r"\[47, 32\] where its args imply \[48, 32\] \(tp rank 1 of 2\)"),
    ("llama", "mp_rank_00_001", "decoder.layers.1.mlp.linear_fc2.weight", lambda t: t[:, :-2],
     r"linear_fc2\.weight has shape \[32, \d+\] where its args imply \[32, \d+\] \(tp rank 0 of 2\)"),
    ("gpt2", "mp_rank_01_001", "decoder.final_layernorm.weight", lambda t: torch.cat([t, t]),
     r"decoder\.final_layernorm\.weight has shape \[64\] where its args imply \[32\];"),
    ("gpt2", "mp_rank_00_000", "decoder.layers.0.self_attention.linear_proj.bias", lambda t: t.long(),
     r"linear_proj\.bias holds torch\.int64, not floating-point weights"),
])
def test_a_tensor_of_another_shape_stops_before_anything_is_written(megatron, tmp_path, capsys, name, file, key,
                                                                    change, message):
    """Every tensor on every rank is checked against the args before the writer starts: a wrong one
    stopped it half-way with a traceback."""
    root, _ = megatron
    src = shutil.copytree(root / name, tmp_path / name)
    path = src / "iter_0000005" / file / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"][key] = change(state["model"][key])
    torch.save(state, path)
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "mz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not (tmp_path / "mz").exists()


def test_a_vocabulary_short_of_rows_is_refused(megatron, tmp_path, capsys):
    """Rows missing from the embedding were filled with zeros, a model that silently never predicts
    the last tokens."""
    root, _ = megatron
    src = shutil.copytree(root / "llama", tmp_path / "llama")
    for t in range(2):
        path = src / "iter_0000005" / f"mp_rank_0{t}_000" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        rows = state["model"]["embedding.word_embeddings.weight"]
        state["model"]["embedding.word_embeddings.weight"] = rows[:VOCAB // 2 - 8]
        torch.save(state, path)
    assert main(["convert", str(src), str(tmp_path / "mz")]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(r"mp_rank_00_000/model_optim_rng\.pt: embedding\.word_embeddings\.weight has shape \[56, 32\] "
                     r"where its args imply \[64, 32\] \(tp rank 0 of 2\)", err), err


@pytest.mark.parametrize("name, file, change, message", [
    ("llama", "mp_rank_00_001", lambda m: m.update({"decoder.layers.0.mlp.extra_w": torch.zeros(2)}),
     r"mp_rank_00_001/model_optim_rng\.pt: holds 'decoder\.layers\.0\.mlp\.extra_w', which its args do not account "
     r"for; it would be dropped"),
    ("gpt2", "mp_rank_01_001", lambda m: m["output_layer.weight"].add_(0.25),
     r"mp_rank_01_001/model_optim_rng\.pt: output_layer\.weight differs from the embedding of .*mp_rank_01_000.*but "
     r"args tie them"),
])
def test_a_tensor_the_args_do_not_account_for_is_refused(megatron, tmp_path, capsys, name, file, change, message):
    """A weight the args leave unread was dropped without a word; above all a head beside args that tie
    it to the embedding, which was imported in its place."""
    root, _ = megatron
    src = shutil.copytree(root / name, tmp_path / name)
    path = src / "iter_0000005" / file / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    change(state["model"])
    torch.save(state, path)
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "mz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_padded_rows_are_named_and_left_out_with_vocab_size(megatron, tmp_path, capsys):
    """Args with only padded_vocab_size (Megatron's usual record) cannot tell padding from tokens: the
    conversion says so, and --vocab-size keeps the tokenizer's rows alone, the same values."""
    from megazero.generate import load_model

    root, _ = megatron
    capsys.readouterr()
    assert main(["convert", str(root / "llama"), str(tmp_path / "all")]) == 0
    assert "padded_vocab_size" not in capsys.readouterr().out  # 128 rows at tp 2 were padded to 256 if at all
    from megazero.convert.megatron import _vocab_size

    gpt2 = argparse.Namespace(padded_vocab_size=50304, tensor_model_parallel_size=1)
    assert _vocab_size(gpt2, "ckpt", None) == 50304 and _vocab_size(gpt2, "ckpt", 50257) == 50257
    assert ("ckpt: args record only padded_vocab_size (50304, a multiple of 128): every row is imported as a "
            "token; if the tokenizer has fewer (50,257 for GPT-2), give --vocab-size") in capsys.readouterr().out
    assert main(["convert", str(root / "llama"), str(tmp_path / "cut"), "--vocab-size", "100"]) == 0
    whole, _ = load_model(tmp_path / "all")
    cut, cfg = load_model(tmp_path / "cut")
    assert cfg.model.vocab_size == 100
    assert torch.equal(cut.embedding.tokens.weight[:100], whole.embedding.tokens.weight[:100])
    assert torch.equal(cut.lm_head.weight[:100], whole.lm_head.weight[:100])
    assert main(["convert", str(root / "llama"), str(tmp_path / "x"), "--vocab-size", "129"]) == 2
    assert "--vocab-size: 129 is more than the 128 rows" in capsys.readouterr().err
    assert main(["convert", str(root / "llama"), str(tmp_path / "y"), "--vocab-size", "100", "--dtype", "bf16"]) == 2
    assert "--dtype: applies to --to hf and --to megatron only (this conversion writes megazero" in capsys.readouterr().err


def _pretrain_args(**changes) -> argparse.Namespace:
    """Args as Megatron-LM's pretrain_gpt.py records them for a small GPT-2-style run."""
    base = dict(num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=1,
                group_query_attention=False, padded_vocab_size=128, max_position_embeddings=16, seq_length=16,
                position_embedding_type="learned_absolute", normalization="LayerNorm", norm_epsilon=1e-5,
                swiglu=False, add_bias_linear=True, bias_gelu_fusion=True, untie_embeddings_and_output_weights=False,
                tensor_model_parallel_size=1)
    return argparse.Namespace(**{**base, **changes})


def test_args_norm_epsilon_is_the_model_norm_eps():
    assert model_config(_pretrain_args(norm_epsilon=1e-6), "ckpt").norm_eps == 1e-6
    assert model_config(_pretrain_args(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                              norm_epsilon=3e-6), "ckpt").norm_eps == 3e-6


@pytest.mark.parametrize("recorded", [dict(layernorm_epsilon=2e-6), dict(norm_epsilon=2e-6, layernorm_epsilon=2e-6)])
def test_args_layernorm_epsilon_is_the_model_norm_eps_too(recorded):
    args = _pretrain_args(**recorded)
    if "norm_epsilon" not in recorded:
        del args.norm_epsilon
    assert model_config(args, "ckpt").norm_eps == 2e-6


def test_args_with_two_epsilons_that_disagree_are_refused():
    with pytest.raises(UserError, match=r"^ckpt: args.norm_epsilon: 1e-06 differs from args.layernorm_epsilon "
                                        r"1e-05, .*set both to the value its run trained with$"):
        model_config(_pretrain_args(norm_epsilon=1e-6, layernorm_epsilon=1e-5), "ckpt")


def test_learned_positions_cover_max_position_embeddings_rotary_the_sequence():
    """Megatron's learned position table has max_position_embeddings rows, which may exceed the
    training seq_length: the model must be that long, or the table is refused as the wrong shape."""
    assert model_config(_pretrain_args(max_position_embeddings=16, seq_length=8), "ckpt").seq_length == 16
    rope = _pretrain_args(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                          max_position_embeddings=16, seq_length=8)
    assert model_config(rope, "ckpt").seq_length == 8


@pytest.mark.parametrize("changes, erf", [
    ({}, False),  # biases and Megatron-LM's default bias_gelu_fusion: its fused bias-GeLU, the tanh one
    ({"bias_gelu_fusion": False}, True),  # --no-bias-gelu-fusion: F.gelu, exact
    ({"add_bias_linear": False, "bias_gelu_fusion": False}, True),
    ({"add_bias_linear": False}, True),  # the fused bias-GeLU needs a bias: without one, F.gelu
    ({"bias_gelu_fusion": False, "openai_gelu": True}, True),  # megatron-core's config does not read openai_gelu
])
def test_megatron_cores_gelu_is_tanh_only_in_its_fused_bias_gelu(changes, erf):
    """Imported as the GeLU Megatron computed: an exact one was taken for the tanh approximation,
    with a note, and the model's outputs differed by about 1e-3. (Planted: openai_gelu taken for
    the tanh GeLU; every GeLU imported as the tanh one.)"""
    assert model_config(_pretrain_args(**changes), "ckpt").activation == ("gelu_exact" if erf else "gelu")


def test_num_query_groups_counts_only_with_group_query_attention():
    """--num-query-groups defaults to 1 in Megatron-LM: without --group-query-attention it is not one
    key/value head."""
    cfg = model_config(_pretrain_args(), "ckpt")
    assert cfg.kv_heads == cfg.num_heads == 4
    assert model_config(_pretrain_args(group_query_attention=True, num_query_groups=2), "ckpt").kv_heads == 2


def test_as_many_query_groups_as_heads_is_multi_head_attention(megatron, tmp_path):
    """--group-query-attention with --num-query-groups equal to the heads is plain multi-head
    attention (megatron-core lays its fused qkv out alike): the import records num_kv_heads unset
    (= num_heads), as a Hugging Face import of such a model does, so the checkpoint records the same
    model, with the same values, as without group-query attention (planted: num_kv_heads recorded as
    the head count)."""
    from megazero.checkpoint import latest_checkpoint
    from megazero.checkpoint.reader import CheckpointReader

    cfg = model_config(_pretrain_args(group_query_attention=True, num_query_groups=4), "ckpt")
    assert cfg.num_kv_heads is None and cfg.kv_heads == cfg.num_heads == 4
    root, _ = megatron
    src = shutil.copytree(root / "gpt2", tmp_path / "gpt2")  # 4 heads, written without group-query attention
    for path in src.glob("iter_0000005/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        state["args"].group_query_attention, state["args"].num_query_groups = True, 4
        torch.save(state, path)
    assert main(["convert", str(src), str(tmp_path / "gqa")]) == 0
    assert main(["convert", str(root / "gpt2"), str(tmp_path / "mha")]) == 0
    gqa, mha = (CheckpointReader(latest_checkpoint(tmp_path / name)) for name in ("gqa", "mha"))
    assert gqa.meta["config"]["model"]["num_kv_heads"] is None
    assert gqa.meta["config"]["model"] == mha.meta["config"]["model"]
    assert set(gqa.shapes) == set(mha.shapes)
    for name in mha.shapes:
        assert torch.equal(gqa.read(name)["master"], mha.read(name)["master"]), name


def test_tp_copies_that_differ_import_tp_rank_0s(megatron, tmp_path, capsys):
    """The docs promise tp rank 0's copy of a replicated tensor when copies differ (and a note)."""
    from megazero.generate import load_model

    root, _ = megatron
    src = shutil.copytree(root / "gpt2", tmp_path / "gpt2")
    rank0 = torch.load(src / "iter_0000005" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    path = src / "iter_0000005" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.final_layernorm.bias"] += 0.5
    torch.save(state, path)
    assert main(["convert", str(src), str(tmp_path / "mz")]) == 0
    ours, _ = load_model(tmp_path / "mz")
    assert torch.equal(ours.final_norm.bias.detach(), rank0["model"]["decoder.final_layernorm.bias"].float())
