"""Which body ``models.kernels.use_fused`` picks for an op, without a GPU: a fused body only for a
CUDA tensor, with the kernels on and the package the body needs installed, and inside a compiled
region only where the op asks for it. The tensors are stand-ins holding what the choice reads."""

from __future__ import annotations

import types

import pytest
import torch

from models import kernels

CUDA, CPU = types.SimpleNamespace(is_cuda=True), types.SimpleNamespace(is_cuda=False)


@pytest.fixture
def triton_only(monkeypatch):
    """A machine with Triton and without liger-kernel, whatever this one has."""
    monkeypatch.setitem(kernels.NEEDS, "triton", True)
    monkeypatch.setitem(kernels.NEEDS, "liger", False)
    monkeypatch.setattr(kernels, "ENABLED", True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)


def test_a_fused_body_runs_on_cuda_tensors_only(triton_only, monkeypatch):
    assert kernels.use_fused(CUDA)
    assert not kernels.use_fused(CPU)
    monkeypatch.setattr(kernels, "ENABLED", False)  # MEGAZERO_KERNELS=0
    assert not kernels.use_fused(CUDA)


def test_a_body_needs_its_own_package(triton_only):
    """liger-kernel's RMSNorm is not chosen where only Triton is installed."""
    assert kernels.use_fused(CUDA, needs="triton")
    assert not kernels.use_fused(CUDA, needs="liger")


def test_inside_a_compiled_region_only_the_bodies_that_ask_run(triton_only, monkeypatch):
    """While dynamo traces, an elementwise op's reference is traced for inductor to fuse with its
    neighbours; a body wanted in the graph (the chunked cross-entropy) still runs."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not kernels.use_fused(CUDA)
    assert kernels.use_fused(CUDA, in_graph=True)
