"""A Hugging Face ``config.json`` is read as ``transformers`` reads it: a key it leaves out takes the
value ``transformers`` gives it, a rotary base kept in ``rope_parameters`` (where ``transformers``
5 saves it) is the model's, and a head width other than hidden_size / heads is refused by name. An
export's config.json imports back to the model section it was written from, and an imported model
exports back with the dtype and GeLU name of its folder."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from megazero.cli import main
from megazero.convert.hf import HFSource
from megazero.convert.hf_models import GPT2
from megazero.errors import UserError
from models.config import ModelConfig
from tests.convert_sources import fails, llama_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A GPT-2 of transformers' default context (1024 positions, so its n_positions can be left out)
    and a Llama, each saved by transformers."""
    root = tmp_path_factory.mktemp("hf_config")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=61)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "gpt2")
    return {"gpt2": root / "gpt2", "llama": llama_folder(root / "llama")}


def _saved(folder: Path, tmp_path: Path, drop: str) -> Path:
    """A copy of ``folder`` whose config.json lacks ``drop``."""
    copy = Path(shutil.copytree(folder, tmp_path / folder.name))
    config = json.loads((copy / "config.json").read_text())
    del config[drop]
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("family, key, field", [
    ("gpt2", "n_positions", "seq_length"),
    ("gpt2", "layer_norm_epsilon", "norm_eps"),
    ("gpt2", "resid_pdrop", "dropout"),
    ("gpt2", "attn_pdrop", "attention_dropout"),
    ("llama", "rms_norm_eps", "norm_eps"),
    ("llama", "max_position_embeddings", "seq_length"),
    ("llama", "attention_dropout", "attention_dropout"),
    ("gpt2", "initializer_range", "init_std"),
    ("llama", "initializer_range", "init_std"),
])
def test_a_key_left_out_takes_the_value_transformers_gives_it(folders, tmp_path, family, key, field):
    """The model imported is the one ``from_pretrained`` builds from the same file: Llama's RMSNorm
    epsilon is 1e-6 there when the file has none, not GPT-2's 1e-5, and GPT-2's dropout rates are 0.1
    (they were read as 0: a fine-tuning run from the import trained without dropout), the initial
    standard deviation 0.02 (it was read as the width's own, which a re-export then wrote out)."""
    folder = _saved(folders[family], tmp_path, key)
    assert getattr(HFSource(folder).cfg, field) == getattr(transformers.AutoConfig.from_pretrained(folder), key)


def test_a_rotary_base_in_rope_parameters_is_the_models(tmp_path):
    """transformers 5 keeps rope_theta only inside rope_parameters: a Llama 3 base of 500,000 read as
    the default 10,000 would put every position at other angles."""
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      vocab_size=61, max_position_embeddings=16, rope_theta=500000.0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    saved = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == 500000.0
    assert HFSource(tmp_path / "llama").cfg.rope_theta == 500000.0

    # both places, agreeing, is the same model; disagreeing, transformers 4 reads one and 5 the other
    saved["rope_theta"] = 500000
    (tmp_path / "llama" / "config.json").write_text(json.dumps(saved))
    assert HFSource(tmp_path / "llama").cfg.rope_theta == 500000.0
    saved["rope_theta"] = 10000.0
    (tmp_path / "llama" / "config.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match=r"rope_theta: 10000.0 differs from the rotary base in "
                                        r"rope_parameters.rope_theta \(500000.0\).*keep one of the two"):
        HFSource(tmp_path / "llama")

    # the two rope settings, disagreeing (transformers 5 computed with the other base)
    del saved["rope_theta"]
    saved["rope_scaling"] = {"rope_type": "default", "rope_theta": 10000.0}
    (tmp_path / "llama" / "config.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match=r"rope_parameters.rope_theta: 500000.0 differs from the rotary base in "
                                        r"rope_scaling.rope_theta \(10000.0\)"):
        HFSource(tmp_path / "llama")
    saved["rope_scaling"]["rope_theta"] = 500000  # agreeing
    (tmp_path / "llama" / "config.json").write_text(json.dumps(saved))
    assert HFSource(tmp_path / "llama").cfg.rope_theta == 500000.0
    # three places, the last the odd one: the message names a pair that differs
    saved.update(rope_theta=500000, rope_scaling={"rope_type": "default", "rope_theta": 10000})
    (tmp_path / "llama" / "config.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match=r"rope_theta: 500000.0 differs from the rotary base in "
                                        r"rope_scaling.rope_theta \(10000.0\)"):
        HFSource(tmp_path / "llama")


def test_gpt2_sizes_under_transformers_other_names(tmp_path):
    """GPT2Config reads num_attention_heads, num_hidden_layers, hidden_size and max_position_embeddings
    as its n_* sizes, and the alias wins where both are given: a file with an alias alone was refused
    as incomplete, and one with both, disagreeing, imported another model (the alias's is the one
    transformers builds)."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=16)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    path = tmp_path / "gpt2" / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "num_attention_heads": 2}))
    with pytest.raises(UserError, match=r"num_attention_heads: 2 differs from n_head = 4, and transformers reads "
                                        r"num_attention_heads, another tool n_head; keep one of the two"):
        HFSource(tmp_path / "gpt2")
    renamed = {k: v for k, v in saved.items() if k not in ("n_head", "n_layer")}
    path.write_text(json.dumps({**renamed, "num_attention_heads": 2, "num_hidden_layers": 1, "n_embd": 32}))
    built = transformers.AutoConfig.from_pretrained(tmp_path / "gpt2")
    read = GPT2.model_config(json.loads(path.read_text()), str(path))  # the config alone: the weights have 2 layers
    assert (read.num_heads, read.num_layers, read.hidden_size) == (built.n_head, built.n_layer, built.n_embd)
    assert (read.num_heads, read.num_layers) == (2, 1)
    path.write_text(json.dumps({**renamed, "num_attention_heads": 3, "num_hidden_layers": 1, "n_embd": 32}))
    with pytest.raises(UserError, match=r"num_attention_heads \(model\.num_heads\)") as refused:  # the file's key
        GPT2.model_config(json.loads(path.read_text()), str(path))
    assert not re.search(r"\bn_head\b", str(refused.value)), refused.value


def test_a_head_width_other_than_the_models_is_refused_by_name(tmp_path, capsys):
    """A Llama whose head_dim (16) is not hidden_size / num_attention_heads (32 / 4 = 8) cannot be
    built by megazero, which derives the width; the refusal names head_dim, not a tensor shape."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      head_dim=16, vocab_size=61, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    err = fails(capsys, tmp_path, tmp_path / "llama")
    assert err.endswith("head_dim: 16 differs from hidden_size / num_attention_heads = 8; megazero derives the "
                        "head width from those two"), err


def test_an_embedding_dropout_other_than_the_residuals_is_refused_by_name(folders, tmp_path, capsys):
    """megazero's one ``model.dropout`` covers the embeddings and both residual branches: a GPT-2 whose
    embd_pdrop differs would train with the residual rate on its embeddings, so it is refused."""
    copy = Path(shutil.copytree(folders["gpt2"], tmp_path / "gpt2"))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "embd_pdrop": 0.2, "resid_pdrop": 0.1}))
    err = fails(capsys, tmp_path, copy)
    assert err.endswith("embd_pdrop: 0.2 differs from resid_pdrop = 0.1, and megazero has one dropout rate for the "
                        "embeddings and the residual branches; give both one rate"), err
    del config["embd_pdrop"], config["resid_pdrop"]  # both left out: transformers' 0.1 each
    (copy / "config.json").write_text(json.dumps(config))
    assert HFSource(copy).cfg.dropout == 0.1


MODEL_SECTIONS = {
    "gpt2": {"norm_eps": 1e-3, "seq_length": 12, "dropout": 0.25, "attention_dropout": 0.125, "init_std": 0.05,
             "tie_embeddings": False},
    "llama": {"position_embedding": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False,
              "num_kv_heads": 2, "rope_theta": 500.0, "norm_eps": 1e-3, "seq_length": 12, "attention_dropout": 0.125,
              "init_std": 0.05, "tie_embeddings": True},
}


@pytest.mark.parametrize("family", MODEL_SECTIONS)
def test_an_hf_export_imports_back_to_the_model_section_it_was_written_from(tmp_path, family):
    """Every field config.json carries, away from both defaults, comes back as written: an epsilon or
    a rotary base written as the family's default would export another model, silently, with the
    right weights (planted: layer_norm_epsilon, rms_norm_eps and rope_theta written as defaults)."""
    from megazero.convert.hf import write_hf
    from tests.convert_sources import RandomSource

    source = RandomSource(num_layers=2, **MODEL_SECTIONS[family])
    (tmp_path / "hf").mkdir()
    write_hf(source, tmp_path / "hf")
    back = HFSource(tmp_path / "hf").cfg
    for field in ("num_layers", "hidden_size", "num_heads", "kv_heads", "ffn_size", "vocab_size",
                  *MODEL_SECTIONS[family]):
        assert getattr(back, field) == getattr(source.cfg, field), field


def test_a_llama_config_without_a_rotary_base_takes_transformers_default(folders, tmp_path):
    """A Llama config.json with no rope_theta at all (nor in rope_parameters) is built by transformers
    with its default base, 10,000: imported with another, every position would turn at other angles
    (planted: the default 1,000)."""
    copy = _saved(folders["llama"], tmp_path, "rope_parameters")
    assert "rope_theta" not in json.loads((copy / "config.json").read_text())
    want = transformers.AutoConfig.from_pretrained(copy).rope_parameters["rope_theta"]
    assert HFSource(copy).cfg.rope_theta == want == 10000.0


def _round_trip(folder: Path, tmp_path: Path) -> Path:
    """``folder`` imported to a megazero checkpoint (``tmp_path / "mz"``) and exported back without --dtype."""
    assert main(["convert", str(folder), str(tmp_path / "mz")]) == 0
    assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "back")]) == 0
    return tmp_path / "back"


@pytest.mark.parametrize("key", ["dtype", "torch_dtype", None], ids=["dtype", "older-torch_dtype", "weights-alone"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_an_imported_half_precision_model_exports_back_in_its_own_dtype(tmp_path, capsys, dtype, key):
    """A bf16 or fp16 model imported and exported back without --dtype is the folder it came from: the
    same tensors in the same dtype, and its dtype in config.json (planted: written as fp32, twice the
    size, and loaded by ``from_pretrained`` as another precision), from the config's ``dtype``, an
    older ``torch_dtype`` or, with neither, the weights' own; the export's note says why."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=61, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    saved = json.loads(path.read_text())
    name = saved.pop("dtype")
    path.write_text(json.dumps({**saved, key: name} if key else saved))
    capsys.readouterr()
    back = _round_trip(tmp_path / "hf", tmp_path)
    ours = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    assert f"note: weights written in {ours}, the dtype of the Hugging Face model" in capsys.readouterr().out
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(back / "model.safetensors")
    assert before.keys() == after.keys()
    for tensor in before:
        assert after[tensor].dtype == dtype and torch.equal(before[tensor], after[tensor]), tensor
    assert json.loads((back / "config.json").read_text())["torch_dtype"] == name
    assert transformers.AutoModelForCausalLM.from_pretrained(back, dtype="auto").dtype == dtype
    # a reshard keeps the record (the same weights); --dtype still chooses
    assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "resharded"), "--to", "megazero", "--tp", "2"]) == 0
    assert main(["convert", str(tmp_path / "resharded"), str(tmp_path / "again")]) == 0
    assert load_file(tmp_path / "again" / "model.safetensors")["lm_head.weight"].dtype == dtype
    assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "fp32"), "--dtype", "fp32"]) == 0
    assert load_file(tmp_path / "fp32" / "model.safetensors")["lm_head.weight"].dtype == torch.float32


def test_a_checkpoint_without_an_import_record_exports_fp32_without_a_note(tmp_path, capsys):
    """A checkpoint of weights a run trained records no Hugging Face dtype: fp32, as before, unannounced."""
    from safetensors.torch import load_file

    from megazero.convert.targets import write_megazero
    from tests.convert_sources import RandomSource

    write_megazero(RandomSource(num_layers=1), tmp_path / "mz")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "hf")]) == 0
    assert "note:" not in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float32"
    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.float32}


@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "gelu_new"])
def test_a_gpt2_tanh_gelu_exports_back_under_its_own_name(tmp_path, name):
    """``transformers`` computes gelu_pytorch_tanh and gelu_new, both megazero's ``gelu``, with other code,
    a few ulp apart: the round trip writes the name it read, so its logits are the folder's bit for bit
    (planted: gelu_pytorch_tanh written back as gelu_new)."""
    torch.manual_seed(1)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=16,
                                     activation_function=name)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # wide pre-activations, where the two GeLUs' code rounds differently
        for p in model.parameters():
            p.normal_(0.0, 1.0)
    model.save_pretrained(tmp_path / "hf")
    back = _round_trip(tmp_path / "hf", tmp_path)
    assert json.loads((back / "config.json").read_text())["activation_function"] == name
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = (transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(tokens).logits
                     for folder in (tmp_path / "hf", back))
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("activation, kept, written", [
    ("gelu", {"activation_function": "relu"}, "gelu_new"),  # not a tanh GeLU: not the model's
    ("gelu", {"activation_function": "gelu"}, "gelu_new"),  # the exact one is another function
    ("gelu_exact", {"activation_function": "gelu_pytorch_tanh"}, "gelu"),
    ("gelu", {}, "gelu_new"),
])
def test_a_kept_activation_name_is_written_only_where_it_computes_ours(activation, kept, written):
    """The record names the activation the export writes only where that name computes the model's
    GeLU: a record of another (edited, or of a model since changed) never makes an export of another
    function."""
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_heads=4, vocab_size=40, seq_length=8, activation=activation)
    assert GPT2.hf_config(cfg, kept)["activation_function"] == written
