"""Finding a Megatron-LM checkpoint's files: the iteration its tracker names, and the format it is
in. A wrong guess imports another iteration than the one Megatron-LM would load, or leaves the user
with no way forward."""

from __future__ import annotations

import shutil

import pytest

from tests.convert_sources import fails, llama_folder, megatron_checkpoint


@pytest.mark.parametrize("text,want", [("7", "names iter_0000007, which"), ("release", "names release, which"),
                                       ("junk", "holds 'junk', not an iteration number"),
                                       ("5²", "holds '5²', not an iteration number")])  # a digit int() refuses
def test_a_megatron_tracker_naming_no_iteration_here_is_refused(tmp_path, capsys, text, want):
    """Megatron-LM loads the iteration its tracker names or fails; another one was imported instead."""
    root = megatron_checkpoint(tmp_path / "meg")
    (root / "latest_checkpointed_iteration.txt").write_text(text)
    assert want in fails(capsys, tmp_path, root)


def test_a_megatron_torch_dist_checkpoint_is_named_with_the_fix(tmp_path, capsys):
    """Megatron-LM's default format: iter_* holds *.distcp files, no mp_rank_* directories."""
    (tmp_path / "meg" / "iter_0000005").mkdir(parents=True)
    (tmp_path / "meg" / "iter_0000005" / "__0_0.distcp").write_bytes(b"")
    (tmp_path / "meg" / "latest_checkpointed_iteration.txt").write_text("5")
    assert "--ckpt-convert-format torch" in fails(capsys, tmp_path, tmp_path / "meg")


def test_a_megatron_checkpoint_of_the_legacy_model_is_named_with_the_fix(tmp_path, capsys):
    """Megatron-LM's models before megatron-core nest their weights under ``language_model``."""
    import torch

    root = megatron_checkpoint(tmp_path / "meg")
    path = root / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    torch.save({"args": state["args"], "model": {"language_model": {"embedding": {}, "encoder": {}}}}, path)
    assert "pre-megatron-core model (language_model.*)" in fails(capsys, tmp_path, root)


@pytest.mark.parametrize("kind", ["megatron", "hf"])
def test_no_verify_on_a_source_without_checksums_is_refused(tmp_path, capsys, kind):
    """--no-verify skips a megazero source's checksums; given with a Megatron source or a Hugging Face
    folder, which record none, it was accepted and did nothing."""
    src = megatron_checkpoint(tmp_path / "meg") if kind == "megatron" else llama_folder(tmp_path / "hf")
    err = fails(capsys, tmp_path, src, "--no-verify")
    assert err.endswith(f"--no-verify: skips the checksums of a megazero source's files; this {kind} source "
                        "records none, so leave the flag out"), err


def test_a_megatron_root_without_its_tracker_imports_its_newest_iteration(tmp_path):
    from megazero.convert.megatron import iteration_dir

    root = megatron_checkpoint(tmp_path / "meg")
    (root / "latest_checkpointed_iteration.txt").unlink()
    shutil.copytree(root / "iter_0000005", root / "iter_0000010")
    shutil.copytree(root / "iter_0000005", root / "iter_0000002")
    assert iteration_dir(root).name == "iter_0000010"
