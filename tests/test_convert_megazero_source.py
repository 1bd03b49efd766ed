"""A megazero checkpoint as the source of `megazero convert`: its files must hold the model its
recorded config describes. ``COMPLETE`` is sealed by its own sha256, so a config that disagrees with
the files is a record resealed by hand or written by a faulty tool; either way the conversion must
refuse it in one line naming the parameter, not drop a head, cut or zero-fill vocabulary rows, or
fail with a traceback deep inside the target."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from megazero.checkpoint import latest_checkpoint
from megazero.checkpoint.format import CHECKSUM, complete_text
from megazero.convert.targets import write_megazero
from tests.convert_sources import RandomSource, fails

LLAMA = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 129,
         "position_embedding": "rope", "norm": "rmsnorm", "activation": "swiglu", "tie_embeddings": False}


def _reseal(root, **model) -> None:
    """Change the recorded model config and seal ``COMPLETE`` again, as a hand edit would."""
    path = latest_checkpoint(root) / "COMPLETE"
    record = json.loads(path.read_text())
    record.pop(CHECKSUM)
    record["meta"]["config"]["model"].update(model)
    path.write_text(complete_text(record))


@pytest.mark.parametrize("to", ["hf", "torch", "megazero"])
@pytest.mark.parametrize("changes,want", [
    ({"ffn_hidden_size": 64}, "parameter 'layers.0.mlp.fc_in.weight' has shape [256, 32] where its config "
                              "implies [128, 32]"),
    ({"num_kv_heads": 4}, "parameter 'layers.0.attention.qkv.weight' has shape [64, 32]"),
    ({"vocab_size": 100}, "parameter 'embedding.tokens.weight' has shape [256, 32] where its config implies "
                          "[128, 32]"),  # rows 100.. would be cut
    ({"vocab_size": 300}, "parameter 'embedding.tokens.weight' has shape [256, 32] where its config implies "
                          "[384, 32]"),  # rows 256.. would be zero-filled
    ({"tie_embeddings": True}, "holds parameter 'lm_head.weight', which the model its config describes does "
                               "not have"),  # the head would be dropped
], ids=["ffn", "kv-heads", "fewer-tokens", "more-tokens", "tied"])
def test_a_config_the_files_do_not_match_is_refused(tmp_path, capsys, to, changes, want):
    write_megazero(RandomSource(**LLAMA), tmp_path / "mz")
    _reseal(tmp_path / "mz", **changes)
    dst = tmp_path / ("out.safetensors" if to == "torch" else "out")
    assert want in fails(capsys, tmp_path, tmp_path / "mz", "--to", to, dst=dst)


def test_a_parameter_the_config_describes_but_the_files_lack_is_refused(tmp_path, capsys):
    """A tied checkpoint whose config was edited to untie the head describes an ``lm_head.weight`` the
    files do not hold: the conversion must name it in one line, not end in a KeyError traceback when
    it compares shapes."""
    write_megazero(RandomSource(**{**LLAMA, "tie_embeddings": True}), tmp_path / "mz")
    _reseal(tmp_path / "mz", tie_embeddings=False)
    assert "holds no parameter 'lm_head.weight' of the model its config describes" in \
        fails(capsys, tmp_path, tmp_path / "mz", "--to", "hf")


def test_a_checkpoint_laid_out_at_tp2_has_the_rows_of_its_padding(tmp_path):
    """The vocabulary is padded to 128·tp of the layout the files were written at (256 rows at tp 2
    for 61 tokens): that is the config's shape, not a mismatch."""
    from megazero.cli import main

    write_megazero(RandomSource(**{**LLAMA, "vocab_size": 61}), tmp_path / "mz")
    assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "tp2"), "--to", "megazero", "--tp", "2",
                 "--pp", "2", "--dp", "1"]) == 0
    assert main(["convert", str(tmp_path / "tp2"), str(tmp_path / "hf")]) == 0
