"""A safetensors file streamed tensor by tensor holds exactly what its header declares: a file closed
short of any declared byte, or given more than a tensor owes, is an error, never a file whose
header promises bytes it does not hold."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megazero.convert.streaming import StreamedSafetensors


def _declared() -> dict[str, torch.Tensor]:
    return {"a": torch.empty(4, device="meta"), "b": torch.empty(2, 3, device="meta")}


def test_pieces_in_declared_order_read_back_whole(tmp_path):
    out = StreamedSafetensors(tmp_path / "x.safetensors", _declared(), {"format": "pt"})
    out.write(torch.arange(4.0))
    out.write(torch.tensor([1.0, 2.0]))
    out.write_zeros(3)
    out.write(torch.tensor([6.0]))
    out.close()
    back = load_file(tmp_path / "x.safetensors")
    assert torch.equal(back["a"], torch.arange(4.0))
    assert torch.equal(back["b"], torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 6.0]]))


@pytest.mark.parametrize("written", [4, 9], ids=["a tensor left out", "the last element left out"])
def test_a_file_closed_short_of_its_header_is_refused(tmp_path, written):
    out = StreamedSafetensors(tmp_path / "x.safetensors", _declared(), {"format": "pt"})
    out.write(torch.zeros(4))
    if written > 4:
        out.write(torch.zeros(written - 4))
    with pytest.raises(ValueError, match="closed with tensors unwritten"):
        out.close()


@pytest.mark.parametrize("dtype, message", [(torch.float32, "a gets 8 bytes where 4 remain"),
                                            (torch.uint8, "a gets 2 bytes where 1 remain")])
def test_a_piece_longer_than_its_tensor_owes_is_refused(tmp_path, dtype, message):
    """Two elements where one of ``a`` remains: they would spill into ``b``'s bytes."""
    declared = {"a": torch.empty(4, dtype=dtype, device="meta"), "b": torch.empty(2, dtype=dtype, device="meta")}
    out = StreamedSafetensors(tmp_path / "x.safetensors", declared, {"format": "pt"})
    out.write(torch.zeros(3, dtype=dtype))
    with pytest.raises(ValueError, match=message):
        out.write(torch.zeros(2, dtype=dtype))


def test_a_file_ending_in_zeros_holds_them(tmp_path):
    """Zeros are left as a hole; a file whose last tensor ends in one must still be as long as its
    header says (fresh optimizer moments are the last tensors of a converted rank file)."""
    out = StreamedSafetensors(tmp_path / "x.safetensors", _declared(), {"format": "pt"})
    out.write(torch.ones(4))
    out.write(torch.tensor([5.0]))
    out.write_zeros(5)
    entry = out.close()
    assert entry["bytes"] == (tmp_path / "x.safetensors").stat().st_size
    back = load_file(tmp_path / "x.safetensors")
    assert torch.equal(back["b"], torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
