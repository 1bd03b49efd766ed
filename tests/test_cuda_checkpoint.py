"""An asynchronous save of GPU tensors on a GPU: the file holds the values the tensors had when
``save`` was called, though their device-to-host copies are queued behind kernels still running and
training changes the tensors as soon as ``save`` returns.

The snapshot copies each tensor into pinned host memory without blocking, so the writer thread must
not read (hash, write) those buffers before the copies have landed. Here the copies wait behind
about a second of matrix products, so a writer that started at once would hash and write the
pinned buffers before the copies (planted: the wait removed; the file then held what the reused
pinned buffers held from the first save, and its checksum matched those bytes, so loading alone
would not notice).
(Skipped without CUDA.)
"""

import pytest
import torch

from megazero.checkpoint import CheckpointWriter, load_file

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_async_save_holds_the_values_of_tensors_still_being_computed(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", generator=g)
    rotation = torch.linalg.qr(torch.randn(4096, 4096, device="cuda", generator=g))[0]  # keeps the scale
    step = torch.tensor(7, device="cuda")
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=lambda: None, async_save=True)
    # A first save: its pinned buffers go back to torch's host cache, so the second save's snapshot
    # takes them without allocating pinned memory (an allocation would wait for the device itself).
    writer.save(1, {"model.pt": {"w": x, "step": step}})
    writer.wait()
    torch.cuda.synchronize()
    for _ in range(400):  # about a second of products queued ahead of the snapshot's copies
        x = x @ rotation
    writer.save(2, {"model.pt": {"w": x, "step": step}})
    expected = x.cpu()  # waits for the products; the saved file must hold exactly this
    x.mul_(-1.0)  # the next step changes the tensor while the file is written
    assert writer.wait() == tmp_path / "step_0000002"
    saved = load_file(tmp_path / "step_0000002", "model.pt")
    assert torch.equal(saved["w"], expected) and int(saved["step"]) == 7
