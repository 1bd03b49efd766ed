"""`megazero convert` from a Megatron-LM checkpoint written by hand: what it takes, and each bad input
as one line naming the file, key or argument, exit status 2, nothing at DST."""

from __future__ import annotations

import pytest
import torch

from megazero.cli import main
from tests.convert_sources import fails, megatron_checkpoint


def test_a_handwritten_megatron_checkpoint_imports(tmp_path):
    """The fixture of the Megatron cases below is a checkpoint the importer takes as it is, also with
    the values Megatron records for switches that change nothing."""
    assert main(["convert", str(megatron_checkpoint(tmp_path / "meg")), str(tmp_path / "out")]) == 0
    root = megatron_checkpoint(tmp_path / "meg2", kv_channels=4, rotary_seq_len_interpolation_factor=1, apply_layernorm_1p=False)
    assert main(["convert", str(root), str(tmp_path / "out2")]) == 0
    # rotary settings recorded beside learned positions change nothing there
    root = megatron_checkpoint(tmp_path / "meg3", rotary_percent=0.5, use_rope_scaling=True, rotary_seq_len_interpolation_factor=4)
    assert main(["convert", str(root), str(tmp_path / "out3")]) == 0


def test_megatron_rope_args_with_the_values_megatron_records_for_no_change_are_taken():
    """A rope model's args hold the rotary switches at the values that change nothing (an interpolation
    factor of 1 included, which Megatron-LM records for "none"): such a model must import, not be
    refused as unsupported by the checks that guard the values megazero cannot compute."""
    import argparse

    from megazero.convert.megatron import model_config

    args = argparse.Namespace(num_layers=2, hidden_size=16, ffn_hidden_size=64, num_attention_heads=4,
                              padded_vocab_size=128, max_position_embeddings=8, seq_length=8, openai_gelu=True,
                              position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
                              rotary_interleaved=False, use_rope_scaling=False, no_rope_freq=None,
                              rotary_seq_len_interpolation_factor=1, kv_channels=4)
    assert model_config(args, "args").position_embedding == "rope"


@pytest.mark.parametrize("drop,changes,want", [
    ((), {"padded_vocab_size": 0}, "args.padded_vocab_size: 0 is not a positive whole number"),  # no vocabulary
    # a value of the wrong type failed in arithmetic or a lookup with a traceback
    ((), {"padded_vocab_size": "16"}, "args.padded_vocab_size: '16' is not a positive whole number"),
    ((), {"padded_vocab_size": []}, "args.padded_vocab_size: [] is not a positive whole number"),
    ((), {"tensor_model_parallel_size": "16"}, "args.tensor_model_parallel_size: '16' is not a positive whole"),
    ((), {"make_vocab_size_divisible_by": "16"}, "args.make_vocab_size_divisible_by: '16' is not a positive whole"),
    ((), {"position_embedding_type": []}, "args.position_embedding_type: [] is not supported"),
    ((), {"normalization": {}}, "args.normalization: {} is not supported"),
    # padding rows the args do not record: imported, the extra rows were cut without a word
    ((), {"padded_vocab_size": 100},
     "embedding.word_embeddings.weight has shape [128, 16] where its args imply [100, 16]"),
    ((), {"padded_vocab_size": 120, "vocab_size": 121},
     "records args.vocab_size 121, more than args.padded_vocab_size"),
    ((), {"num_attention_heads": 3}, "args.num_attention_heads (model.num_heads)"),  # blamed on the weights
    ((), {"num_attention_heads": 0}, "args.num_attention_heads (model.num_heads)"),  # ZeroDivisionError
    (("hidden_size",), {}, "its args lack args.hidden_size"),  # TypeError in torch.empty
    (("padded_vocab_size",), {}, "args record neither args.vocab_size nor args.padded_vocab_size"),
    ((), {"hidden_size": "16"}, "args.hidden_size: expected an integer, got '16'"),
    ((), {"rotary_base": None, "position_embedding_type": "rope"}, "args.rotary_base: expected a number, got None"),
    # settings megazero does not build: imported without them, the logits would be another model's
    ((), {"position_embedding_type": "rope", "rotary_percent": 0.5}, "args.rotary_percent"),
    ((), {"position_embedding_type": "rope", "rotary_interleaved": True}, "args.rotary_interleaved"),
    ((), {"apply_layernorm_1p": True}, "args.apply_layernorm_1p"),  # norm weights stored as gamma - 1
    ((), {"apply_residual_connection_post_layernorm": True}, "args.apply_residual_connection_post_layernorm"),
    ((), {"squared_relu": True}, "args.squared_relu"),
    ((), {"multi_latent_attention": True}, "args.multi_latent_attention"),
    ((), {"num_experts": 8}, "args.num_experts"),
    ((), {"qk_layernorm": True}, "args.qk_layernorm"),
    ((), {"qk_l2_norm": True}, "args.qk_l2_norm"),
    ((), {"window_size": (4, 0)}, "args.window_size: (4, 0) is not supported"),  # sliding-window attention
    ((), {"softmax_type": "off-by-one"}, "args.softmax_type: 'off-by-one'"),
    ((), {"softmax_scale": 0.5}, "args.softmax_scale"),
    ((), {"swiglu": True, "glu_linear_offset": 1.0}, "args.glu_linear_offset: 1.0"),
    ((), {"swiglu": True, "activation_func_clamp_value": 7.0}, "args.activation_func_clamp_value"),
    ((), {"quick_geglu": True}, "args.quick_geglu"),
    ((), {"attention_output_gate": True}, "args.attention_output_gate"),
    ((), {"experimental_attention_variant": "dsa"}, "args.experimental_attention_variant"),
    ((), {"mtp_num_layers": 1}, "args.mtp_num_layers"),  # multi-token prediction layers
    ((), {"is_hybrid_model": True}, "args.is_hybrid_model"),
    ((), {"hybrid_override_pattern": "M*-"}, "args.hybrid_override_pattern"),
    ((), {"heterogeneous_layers_config_path": "layers.json"}, "args.heterogeneous_layers_config_path"),
    ((), {"position_embedding_type": "rope", "use_rope_scaling": True}, "args.use_rope_scaling"),
    ((), {"position_embedding_type": "rope", "rotary_seq_len_interpolation_factor": 4},
     "args.rotary_seq_len_interpolation_factor"),
    ((), {"position_embedding_type": "rope", "no_rope_freq": [3]}, "args.no_rope_freq"),  # layers without rotary
    ((), {"kv_channels": 8}, "args.kv_channels: 8 differs from args.hidden_size / args.num_attention_heads = 4"),
    # biases on every linear but the qkv one (megazero's model.bias covers all): the qkv bias is not Megatron's
    ((), {"add_qkv_bias": False}, "args.add_qkv_bias: False differs from args.add_bias_linear"),
    ((), {"add_bias_linear": False, "add_qkv_bias": True}, "args.add_qkv_bias: True differs from args.add_bias_linear"),
    # switches are bools in Megatron's argparse: read with bool(), a "False" would build the other model
    ((), {"add_bias_linear": "False"}, "args.add_bias_linear: 'False' is not true or false"),
    ((), {"swiglu": "False"}, "args.swiglu: 'False' is not true or false"),
    ((), {"untie_embeddings_and_output_weights": 1}, "args.untie_embeddings_and_output_weights: 1 is not true"),
    ((), {"group_query_attention": None}, "args.group_query_attention: None is not true or false"),
    ((), {"bias_gelu_fusion": "no"}, "args.bias_gelu_fusion: 'no' is not true or false"),
])
def test_megatron_args_are_checked_as_a_model_config(tmp_path, capsys, drop, changes, want):
    err = fails(capsys, tmp_path, megatron_checkpoint(tmp_path / "meg", drop, **changes))
    assert want in err and "model_optim_rng.pt" in err, err


def test_a_vocabulary_size_other_than_the_args_record_is_refused(tmp_path, capsys):
    """--vocab-size names the tokenizer's rows where args record only the padded size; where args
    record the real size too, another --vocab-size would cut real token rows without a word."""
    root = megatron_checkpoint(tmp_path / "meg", vocab_size=100)
    err = fails(capsys, tmp_path, root, "--vocab-size", "90")
    assert "--vocab-size: 90, but" in err and "records args.vocab_size 100" in err, err


def test_a_null_tokenizers_end_of_document_row_is_imported(tmp_path, capsys):
    """Megatron's NullTokenizer takes args.vocab_size ids and gives end-of-document the id after them:
    its vocabulary is one token more. The import left that row out without a word, and refused the
    --vocab-size that would have kept it."""
    from megazero.convert.megatron import MegatronSource

    root = megatron_checkpoint(tmp_path / "meg", vocab_size=100, tokenizer_type="NullTokenizer")
    assert MegatronSource(root).cfg.vocab_size == MegatronSource(root, vocab_size=101).cfg.vocab_size == 101
    err = fails(capsys, tmp_path, root, "--vocab-size", "100")
    assert "records a NullTokenizer of args.vocab_size 100 and its end-of-document, 101 tokens" in err, err
    assert MegatronSource(megatron_checkpoint(tmp_path / "bpe", vocab_size=100)).cfg.vocab_size == 100


def test_a_megatron_rank_file_without_weights_is_named(tmp_path, capsys):
    root = megatron_checkpoint(tmp_path / "meg", ranks=2)
    second = root / "iter_0000005" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(second, weights_only=False)
    torch.save({"args": state["args"], "model0": state["model"]}, second)
    err = fails(capsys, tmp_path, root)
    assert err.endswith(f"{second}: holds model0 (a virtual-pipeline checkpoint's model chunks); only one model chunk "
                        "per rank can be imported"), err
    torch.save({"args": state["args"]}, second)
    assert f"{second}: holds no 'model' weights (tp rank 1, pipeline rank 0)" in fails(capsys, tmp_path, root)


@pytest.mark.parametrize("key,value,want", [
    ("decoder.final_layernorm.weight", None, "maps 'decoder.final_layernorm.weight' to a NoneType"),
    ("decoder.final_layernorm.weight", [1.0] * 16, "maps 'decoder.final_layernorm.weight' to a list"),
    (3, torch.ones(2), "maps 3 to a Tensor"),
])
def test_a_megatron_model_entry_that_is_not_a_named_tensor_is_named(tmp_path, capsys, key, value, want):
    """A weight saved as something other than a tensor, or under a key that is not a name, was a
    traceback (``'NoneType' object has no attribute 'shape'``) where its shape was first read.
    ``_extra_state`` entries, which hold no weights, may be anything."""
    root = megatron_checkpoint(tmp_path / "meg", ranks=2)
    second = root / "iter_0000005" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(second, weights_only=False)
    state["model"]["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None
    state["model"][key] = value
    torch.save(state, second)
    err = fails(capsys, tmp_path, root)
    assert err.endswith(f"{second}: its 'model' {want}, where megatron-core saves weight names and tensors (tp rank "
                        "1, pipeline rank 0); the checkpoint is damaged or not Megatron-LM's: restore that file"), err


def test_layernorm_biases_beside_no_linear_biases_import_only_when_zero(tmp_path, capsys):
    """Megatron-LM's --disable-bias-linear leaves its LayerNorms their biases; megazero's model.bias
    false has none. Zero (as initialised) they change nothing and import; trained, they are refused
    in one line naming the tensor, not as a checkpoint that does not match its args."""
    root = megatron_checkpoint(tmp_path / "meg", add_bias_linear=False)
    path = root / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"] = {k: v for k, v in state["model"].items() if "linear" not in k or not k.endswith(".bias")}
    torch.save(state, path)
    assert main(["convert", str(root), str(tmp_path / "zero")]) == 0
    state["model"]["decoder.layers.1.pre_mlp_layernorm.bias"] = torch.full((16,), 0.5)
    torch.save(state, path)
    err = fails(capsys, tmp_path, root)
    assert err.endswith(f"{path}: holds decoder.layers.1.pre_mlp_layernorm.bias, a LayerNorm bias that is not zero, "
                        "beside args.add_bias_linear False; megazero's model.bias false has no norm biases, so such a "
                        "model cannot be imported"), err
