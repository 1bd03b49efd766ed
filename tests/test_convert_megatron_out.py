"""`megazero convert --to megatron`: Megatron-LM legacy checkpoints that megatron-core's own
``GPTModel`` (local layer spec) loads strictly at tp2 x pp2 and computes megazero's logits from, and
that import back bit for bit.

The sources are small Hugging Face models (a Llama with grouped key/value heads, RMSNorm, SwiGLU and
an untied head; a GPT-2 with learned positions, LayerNorm, biases and a tied head). Four gloo ranks
on CPU build megatron-core's model from the args the conversion recorded, load each rank's file with
``strict=True`` (every key present, none left over, every shape right) and run the pipeline's forward
by hand, as ``test_convert_megatron.py`` does for the import (its docstring says what is patched for
a machine without a GPU).
"""

from __future__ import annotations

import contextlib
import errno
import warnings

import pytest
import torch

from megazero.cli import main
from megazero.convert.megatron import safe_load
from tests.convert_sources import exact_gelu, fails, gpt2_folder, layernorm_without_biases, llama_folder
from tests.distributed import run_world

VOCAB, SEQ = 61, 8
MAKERS = {"llama": llama_folder, "gpt2": gpt2_folder, "layernorm-no-bias": layernorm_without_biases,
          "exact-gelu": exact_gelu}
TO_LOCAL = ("--to", "megatron", "--transformer-impl", "local")


def convert(*args) -> int:
    return main(["convert", *map(str, args)])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {name: make(root / name) for name, make in MAKERS.items()}


def _state_dict(path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.parametrize("lost, key", [("mp_rank_01_*", "tensor_model_parallel_size"),
                                       ("mp_rank_*_001", "pipeline_model_parallel_size")])
def test_a_megatron_checkpoint_short_of_the_ranks_its_args_record_is_named(sources, tmp_path, capsys, lost, key):
    """A tp2 x pp2 save whose second tp rank or stage was lost: refused for the rank grid its args
    record, not for a tensor's shape or the layer count, as if the weights did not match their args.
    (Planted: no comparison with the args.)"""
    import shutil

    out = tmp_path / "megatron"
    assert convert(sources["llama"], out, *TO_LOCAL, "--tp", 2, "--pp", 2) == 0
    for folder in (out / "release").glob(lost):
        shutil.rmtree(folder)
    found = "tp 1 x pp 2" if key.startswith("tensor") else "tp 2 x pp 1"
    assert fails(capsys, tmp_path, out).endswith(
        f"{out / 'release'}: holds the rank directories of {found}, but its args record args.{key} 2; restore the "
        "missing mp_rank_* directories, or remove those another save left")


@pytest.mark.parametrize("lost", ["folder", "file"])
def test_a_megatron_rank_lost_inside_its_grid_is_named(sources, tmp_path, capsys, lost):
    """tp rank 1 of stage 0 lost from a tp2 x pp2 save whose other ranks still span the grid: named as
    that rank's missing file, not a KeyError or a load error where its weights are first read.
    (Planted: no check that every rank of the grid has its file.)"""
    import shutil

    out = tmp_path / "megatron"
    assert convert(sources["llama"], out, *TO_LOCAL, "--tp", 2, "--pp", 2) == 0
    rank = out / "release" / "mp_rank_01_000"
    if lost == "folder":
        shutil.rmtree(rank)
    else:
        (rank / "model_optim_rng.pt").unlink()
    assert fails(capsys, tmp_path, out).endswith(
        f"{rank / 'model_optim_rng.pt'}: missing (tp rank 1, pipeline rank 0 of 2 x 2); restore it")


@pytest.mark.parametrize("name", MAKERS)
@pytest.mark.parametrize("tp, pp", [(2, 2), (1, 1), (2, 1)])
def test_a_megatron_checkpoint_imports_back_bit_for_bit(sources, tmp_path, name, tp, pp):
    """Hugging Face -> Megatron at tp x pp -> one fp32 state dict equals Hugging Face -> the same
    state dict: every tensor sliced, padded, renamed and put back exactly. A tied head is the last
    stage's copy of the embedding only where there are several stages (megatron-core's own
    layout). (Planted: the SwiGLU halves swapped per rank; the tied copy left out at pp 2; checkpoint_version
    2.0.)"""
    out = tmp_path / "megatron"
    assert convert(sources[name], out, *TO_LOCAL, "--tp", tp, "--pp", pp) == 0
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert convert(out, tmp_path / "back.safetensors", "--to", "torch") == 0
    assert convert(sources[name], tmp_path / "direct.safetensors", "--to", "torch") == 0
    back, direct = _state_dict(tmp_path / "back.safetensors"), _state_dict(tmp_path / "direct.safetensors")
    assert back.keys() == direct.keys()
    for key in direct:
        assert torch.equal(back[key], direct[key]), key
    last = out / "release" / (f"mp_rank_00_{pp - 1:03d}" if pp > 1 else "mp_rank_00") / "model_optim_rng.pt"
    state = safe_load(last)
    tied = name in ("gpt2", "exact-gelu")
    assert ("output_layer.weight" in state["model"]) == (not tied or pp > 1)
    assert (state["checkpoint_version"], state["iteration"]) == (3.0, 0)  # below 2.0 Megatron-LM reorders the qkv rows
    args = state["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
    assert args.padded_vocab_size == 128 * tp and args.vocab_size == VOCAB


def test_a_megatron_checkpoint_is_resharded_to_another_tp_and_pp(sources, tmp_path):
    """Megatron in and Megatron out: tp2 x pp2 rewritten as tp1 x pp2 and back to one state dict, the
    same tensors (Megatron-LM's legacy checkpoints reshard only through its own conversion tools)."""
    assert convert(sources["gpt2"], tmp_path / "a", *TO_LOCAL, "--tp", 2, "--pp", 2) == 0
    assert convert(tmp_path / "a", tmp_path / "b", *TO_LOCAL, "--pp", 2) == 0
    assert safe_load(tmp_path / "b" / "release" / "mp_rank_00_001" / "model_optim_rng.pt")["args"].padded_vocab_size == 128
    assert convert(tmp_path / "b", tmp_path / "back.safetensors", "--to", "torch") == 0
    assert convert(sources["gpt2"], tmp_path / "direct.safetensors", "--to", "torch") == 0
    back, direct = _state_dict(tmp_path / "back.safetensors"), _state_dict(tmp_path / "direct.safetensors")
    assert back.keys() == direct.keys() and all(torch.equal(back[k], direct[k]) for k in direct)


def test_bf16_weights_are_the_rounded_master(sources, tmp_path):
    out = tmp_path / "megatron"
    assert convert(sources["llama"], out, *TO_LOCAL, "--dtype", "bf16", "--tp", 2) == 0
    state = safe_load(out / "release" / "mp_rank_01" / "model_optim_rng.pt")
    assert {t.dtype for t in state["model"].values()} == {torch.bfloat16}
    assert state["args"].bf16 and state["args"].params_dtype == torch.bfloat16
    assert convert(out, tmp_path / "back.safetensors", "--to", "torch") == 0
    assert convert(sources["llama"], tmp_path / "direct.safetensors", "--to", "torch") == 0
    back, direct = _state_dict(tmp_path / "back.safetensors"), _state_dict(tmp_path / "direct.safetensors")
    for key in direct:
        assert torch.equal(back[key], direct[key].bfloat16().float()), key


@pytest.mark.parametrize("flags, message", [
    (["--tp", "3"], "--tp 3: the model's 4 attention heads do not split evenly over 3 tensor ranks; give a --tp "
                    "that divides 4"),
    (["--tp", "4"], "--tp 4: the model's 2 key/value heads do not split evenly over 4 tensor ranks"),
    (["--pp", "3"], "--pp 3: the model's 2 layers do not split evenly over 3 stages (Megatron-LM's split)"),
    (["--dp", "2"], "--dp: apply to --to megazero only (a Megatron checkpoint's layout is --tp and --pp)"),
    (["--zero-stage", "1", "--tp", "2"], "--zero-stage: apply to --to megazero only"),
    (["--tokenizer", "t.model"], "--tokenizer: applies to --to hf only (this conversion writes megatron)"),
])
def test_a_layout_megatron_cannot_take_is_one_line_before_anything_is_written(sources, tmp_path, capsys, flags,
                                                                              message):
    err = fails(capsys, tmp_path, sources["llama"], *TO_LOCAL, *flags)
    assert message in err, err


def test_dtype_applies_to_hf_and_megatron_only(sources, tmp_path, capsys):
    err = fails(capsys, tmp_path, sources["llama"], "--to", "megazero", "--dtype", "bf16")
    assert "--dtype: applies to --to hf and --to megatron only (this conversion writes megazero" in err, err
    err = fails(capsys, tmp_path, sources["llama"], "--to", "hf", "--tp", "2")
    assert "--tp: apply to --to megazero only (and --tp, --pp to --to megatron)" in err, err


def test_the_layer_implementation_is_never_guessed(sources, tmp_path, capsys):
    """Megatron-LM loads a file named for the other implementation without strictness, the norms left
    at their initial values: the flag is required, and applies to --to megatron alone."""
    err = fails(capsys, tmp_path, sources["llama"], "--to", "megatron")
    assert "--transformer-impl: give it with --to megatron, as the Megatron-LM run that loads DST has it" in err, err
    err = fails(capsys, tmp_path, sources["llama"], "--to", "hf", "--transformer-impl", "local")
    assert "--transformer-impl: applies to --to megatron only (this conversion writes hf)" in err, err


@pytest.mark.parametrize("name", MAKERS)
def test_transformer_engine_names_fuse_the_norms_and_import_back(sources, tmp_path, name):
    """Under Transformer Engine's layer spec a layer's norms are the ``layer_norm_*`` of the linear
    after them (the final norm keeps its own module); the rest is as in the local spec, and the
    files import back to the same tensors. (Planted: the local names written for both.)"""
    out = tmp_path / "te"
    assert convert(sources[name], out, "--to", "megatron", "--transformer-impl", "transformer_engine",
                   "--tp", 2, "--pp", 2) == 0
    assert convert(sources[name], tmp_path / "local", *TO_LOCAL, "--tp", 2, "--pp", 2) == 0
    for rank in ("mp_rank_00_000", "mp_rank_01_001"):
        te = safe_load(out / "release" / rank / "model_optim_rng.pt")
        local = safe_load(tmp_path / "local" / "release" / rank / "model_optim_rng.pt")
        assert te["args"].transformer_impl == "transformer_engine"
        renamed = {}
        for key, value in local["model"].items():
            for norm, linear in (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                                 ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")):
                key = key.replace(norm, linear)
            renamed[key] = value
        assert te["model"].keys() == renamed.keys()
        assert all(torch.equal(te["model"][k], renamed[k]) for k in renamed)
    assert convert(out, tmp_path / "back.safetensors", "--to", "torch") == 0
    assert convert(sources[name], tmp_path / "direct.safetensors", "--to", "torch") == 0
    back, direct = _state_dict(tmp_path / "back.safetensors"), _state_dict(tmp_path / "direct.safetensors")
    assert back.keys() == direct.keys() and all(torch.equal(back[k], direct[k]) for k in direct)


def test_args_megatron_lm_compares_and_its_gelu(sources, tmp_path, capsys):
    """add_position_embedding is Megatron-LM's default (True) under rotary too, or a run with its
    default flags fails ``check_checkpoint_args``; a GeLU model with biases runs megatron-core's
    fused bias-GeLU, the tanh one (``bias_gelu_fusion``), and one without biases runs the exact GeLU:
    megazero's tanh GeLU without biases is refused (it was written, with a note), its exact one is
    written. (Planted: add_position_embedding from the position type; the refusal dropped.)"""
    from megazero.convert.megatron_out import write_megatron
    from megazero.errors import UserError
    from tests.convert_sources import RandomSource

    assert convert(sources["llama"], tmp_path / "l", *TO_LOCAL) == 0
    assert convert(sources["gpt2"], tmp_path / "g", *TO_LOCAL) == 0
    llama = safe_load(tmp_path / "l" / "release" / "mp_rank_00" / "model_optim_rng.pt")["args"]
    gpt2 = safe_load(tmp_path / "g" / "release" / "mp_rank_00" / "model_optim_rng.pt")["args"]
    assert llama.add_position_embedding and llama.position_embedding_type == "rope" and not llama.bias_gelu_fusion
    assert gpt2.add_position_embedding and gpt2.bias_gelu_fusion and not gpt2.openai_gelu
    assert "computes the GeLU" not in capsys.readouterr().out
    with pytest.raises(UserError, match=r"^model\.activation: 'gelu' \(the tanh approximation\) without linear "
                                        r"biases .* exactly \(erf, megazero's gelu_exact\); export it to Hugging Face"):
        write_megatron(RandomSource(bias=False), tmp_path / "nobias", 1, 1, "local")
    assert not (tmp_path / "nobias").exists()
    write_megatron(RandomSource(bias=False, activation="gelu_exact"), tmp_path / "exact", 1, 1, "local")
    assert not safe_load(tmp_path / "exact" / "release" / "mp_rank_00" / "model_optim_rng.pt")["args"].bias_gelu_fusion


def test_fp16_refuses_weights_beyond_its_range(sources, tmp_path, capsys):
    """A weight past 65,504 would be written as inf (and refused by megazero's own import); the
    conversion stops naming it, as --to hf does. (Planted: a plain cast.)"""
    from megazero.convert.megatron_out import write_megatron
    from megazero.errors import UserError
    from tests.convert_sources import RandomSource

    source = RandomSource()
    real = source.read
    source.read = lambda name: real(name) * (1e6 if name.endswith("qkv.weight") else 1)
    with pytest.raises(UserError, match=r"^layers\.0\.attention\.qkv\.weight: holds values up to .* beyond what "
                                        r"float16 can hold"):
        write_megatron(source, tmp_path / "fp16", 1, 1, "local", "fp16")


def test_a_full_disk_is_one_line(sources, tmp_path, capsys, monkeypatch):
    """The rank files are written through a file object, so a full disk is an OSError that names DST,
    not torch's RuntimeError from inside its zip writer. (Planted: ``torch.save`` to the path.)"""
    real = open

    def full_disk(path, mode="r", *args, **kwargs):
        f = real(path, mode, *args, **kwargs)
        if str(path).endswith("model_optim_rng.pt"):
            def write(_):
                raise OSError(errno.ENOSPC, "No space left on device")
            f.write = write
        return f
    monkeypatch.setattr("builtins.open", full_disk)
    err = fails(capsys, tmp_path, sources["gpt2"], *TO_LOCAL)
    assert err.endswith(f"{tmp_path / 'out'}: cannot be written (No space left on device); free space beside it or "
                        "give a DST on another disk"), err


def _world(rank, world_size, root):
    warnings.simplefilter("ignore")
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.cuda.current_device = lambda: "cpu"  # as in test_convert_megatron.py
    torch.Tensor.cuda = lambda self, *_, **__: self
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    get_cuda_rng_tracker().fork = lambda *_, **__: contextlib.nullcontext()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    out = {}
    for name in MAKERS:
        state = safe_load(f"{root}/{name}/release/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt")
        a = state["args"]
        exact = not (a.add_bias_linear and a.bias_gelu_fusion)  # megatron-core's fused bias-GeLU is the tanh one
        config = TransformerConfig(
            num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
            num_query_groups=a.num_query_groups, kv_channels=a.kv_channels, ffn_hidden_size=a.ffn_hidden_size,
            use_cpu_initialization=True, pipeline_dtype=torch.float32, tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2, normalization=a.normalization, layernorm_epsilon=a.norm_epsilon,
            gated_linear_unit=a.swiglu, add_bias_linear=a.add_bias_linear, add_qkv_bias=a.add_qkv_bias,
            activation_func=F.silu if a.swiglu else (lambda x: F.gelu(x, approximate="none" if exact else "tanh")),
            hidden_dropout=0.0, attention_dropout=0.0)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=a.normalization),
                         vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
                         pre_process=first, post_process=last, position_embedding_type=a.position_embedding_type,
                         rotary_base=a.rotary_base, parallel_output=False,
                         share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights).eval()
        model.load_state_dict(state["model"], strict=True)
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(SEQ).expand(2, SEQ)
        mask = torch.ones(1, 1, SEQ, SEQ).triu(1).bool()
        with torch.no_grad():
            if first:
                dist.send(model(ids, positions, mask).contiguous(), rank + 2)  # ranks: tp fastest, then pp
            else:
                hidden = torch.empty(SEQ, 2, a.hidden_size)
                dist.recv(hidden, rank - 2)
                model.set_input_tensor(hidden)
                out[name] = (ids.numpy(), model(ids, positions, mask).numpy())
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def exported(sources, tmp_path_factory):
    with warnings.catch_warnings():  # megatron-core warns at import about missing GPU extras
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core.models.gpt", reason="megatron-core is not installed")
    root = tmp_path_factory.mktemp("exported")
    for name, folder in sources.items():
        assert convert(folder, root / name, *TO_LOCAL, "--tp", 2, "--pp", 2) == 0
    return run_world(4, _world, str(root))[2]


@pytest.mark.parametrize("name", MAKERS)
def test_megatron_core_loads_the_files_strictly_and_computes_our_logits(sources, exported, tmp_path, name):
    """(Planted: the position embedding left out, a strict-load failure; fc1's gate and up halves
    swapped on each rank, other logits.)"""
    from megazero.generate import load_model

    assert convert(sources[name], tmp_path / "mz", "--to", "megazero") == 0
    ours, _ = load_model(tmp_path / "mz")
    ids, want = (torch.from_numpy(a) for a in exported[name])
    with torch.no_grad():
        got = ours(ids)[..., :VOCAB]
    want = want[..., :VOCAB]
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def test_each_rank_file_holds_its_share_alone(tmp_path):
    """torch.save keeps a view's whole storage: a tp slice saved as a view of the full tensor carries
    every rank's share into each rank's file, tp times the model on disk (planted: the slices not
    copied out, passed)."""
    from megazero.convert.megatron_out import write_megatron
    from tests.convert_sources import RandomSource

    write_megatron(RandomSource(num_layers=2), tmp_path / "meg", 2, 1, "local")
    for rank in range(2):
        model = safe_load(tmp_path / "meg" / "release" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt")["model"]
        for key, t in model.items():
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
