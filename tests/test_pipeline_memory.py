"""Releasing a sent activation's storage keeps backward exact (one process, no communication)."""

import torch
from torch import nn

from parallel.pipeline.p2p import free_storage


def test_backward_from_a_released_clone_matches_plain_backward():
    torch.manual_seed(0)
    plain, released = nn.Linear(8, 8), nn.Linear(8, 8)
    released.load_state_dict(plain.state_dict())
    x, grad = torch.randn(4, 8), torch.randn(4, 8)

    torch.relu(plain(x)).backward(grad)  # relu saves its output: the case a raw .data swap would break

    out = torch.relu(released(x)).clone()  # the executor's send buffer
    full_bytes = out.untyped_storage().nbytes()
    free_storage(out)
    assert out.shape == (4, 8) and out.untyped_storage().nbytes() == 4 < full_bytes
    torch.autograd.backward(out, grad)

    for a, b in zip(plain.parameters(), released.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
