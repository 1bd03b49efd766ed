"""The FlashAttention 4 path of the attention seam, without a GPU.

The kernels themselves are checked on a GPU (``tests/test_kernels.py``: against SDPA, forward and
backward, deterministic, compiled). What a CPU can check is everything around them: that the package
is found without importing it, which shapes the seam sends to it, that ``models.ops.attention`` routes
there and nowhere else, and that the custom ops' shape-only bodies (what torch.compile traces) give
the shapes, dtypes and gradients' plumbing of the real ones, on the meta device, also compiled into
one graph.
"""

from __future__ import annotations

import importlib
import pathlib
import re
import types

import pytest
import torch

from models import kernels, ops
from models.kernels import flash_attention
from models.kernels import liger as kernels_liger

H200 = types.SimpleNamespace(major=9, multi_processor_count=132)


def _package(root, *files: str) -> None:
    for name in files:
        path = root.joinpath(*name.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("raise ImportError('must not be imported to be found')\n")


def _record(root, version: str) -> None:
    """The package record pip writes beside an installed wheel."""
    folder = root / f"flash_attn_4-{version}.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flash-attn-4\nVersion: {version}\n")


@pytest.mark.parametrize("files,record,version", [
    (("flash_attn/cute/interface.py",), "4.0.0b36", "4.0.0b36"),  # flash-attn-4's wheel: a namespace package
    (("flash_attn/__init__.py", "flash_attn/cute/interface.py"), "4.0.0b36", "4.0.0b36"),  # beside FA 2
    (("flash_attn/cute/interface.py",), "4.0.1", "4.0.1"),
    (("flash_attn/__init__.py", "flash_attn/cute/interface.py"), None, ""),  # a source tree
    (("flash_attn/__init__.py", "flash_attn/flash_attn_interface.py"), None, None),  # FlashAttention 2 alone
    (("flash_attn/__init__.py", "flash_attn/flash_attn_interface.py"), "4.0.0b36", None),  # a record, no files
    ((), None, None),
])
def test_flash_attention_4_is_found_without_importing_it(tmp_path, monkeypatch, files, record, version):
    _package(tmp_path, *files)
    if record:
        _record(tmp_path, record)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert kernels._flash_attention_4_version() == version


@pytest.mark.parametrize("version,runs", [("4.0.0b36", True), ("4.0.1", False)])
def test_the_package_runs_at_the_tested_release_only(tmp_path, monkeypatch, version, runs):
    """``HAS_FLASH`` and the line naming an unused release, as the package computes them on import."""
    _package(tmp_path, "flash_attn/cute/interface.py")
    _record(tmp_path, version)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        importlib.reload(kernels)
        assert (kernels.FLASH_VERSION, kernels.HAS_FLASH) == (version, runs)
        assert (kernels._flash_attention_unused(kernels.FLASH_VERSION) is None) is runs
    finally:
        monkeypatch.undo()
        importlib.invalidate_caches()
        importlib.reload(kernels)
    assert kernels.FLASH_VERSION is None or kernels.FLASH_VERSION != version


def test_only_the_tested_release_runs_and_another_is_named():
    """The seam calls flash-attn-4 below its public API: another release (or a source tree, with no
    version) is left unused, and the line the trainer prints names it, what runs instead and the fix."""
    setup = (pathlib.Path(__file__).parents[1] / "setup.cfg").read_text()
    assert re.findall(r"flash-attn-4==(\S+)", setup) == list(kernels.FLASH_VERSIONS)  # the ``flash`` extra's pin
    assert kernels._flash_attention_unused(None) is None and kernels._flash_attention_unused("4.0.0b36") is None
    line = kernels._flash_attention_unused("4.0.1")
    assert "flash-attn-4 4.0.1 is installed" in line and "runs only 4.0.0b36" in line and "SDPA" in line
    assert "pip install -e '.[flash]'" in line and "\n" not in line
    assert "source tree" in kernels._flash_attention_unused("")


@pytest.mark.parametrize("version, said", [("4.0.1", "flash-attn-4 4.0.1 is installed, but megazero runs only"),
                                           (None, None)], ids=["another release", "none"])
def test_the_unused_release_is_named_on_hopper_only(monkeypatch, version, said):
    """A release the seam does not run is named, on Hopper only, and neither it nor an absent
    flash-attn-4 is imported (planted: imported all the same, and every Hopper run without the package
    told it 'is installed but does not import'; where liger-kernel is installed, planted too: the kernel
    settling reading a copy of whether liger-kernel runs that the test's NEEDS["liger"] did not turn off)."""
    tried = _imports_that(monkeypatch)
    monkeypatch.setattr(kernels, "FLASH_VERSION", version)
    monkeypatch.setattr(kernels, "HAS_FLASH", False)
    monkeypatch.setitem(kernels.NEEDS, "liger", False)
    assert kernels.settle_kernels(torch.device("cpu")) == []
    for major, hopper in ((9, True), (8, False), (10, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, major=major: (major, 0))
        lines = kernels.settle_kernels(torch.device("cuda", 0))
        assert [line[:len(said)] for line in lines] == ([said] if said and hopper else []), lines
    assert tried == []


def _imports_that(monkeypatch, flash=None, liger=None) -> list:
    """Both optional packages installed, their imports replaced by ``flash`` and ``liger`` (an exception
    to raise, or None to succeed); returns the names of the imports tried."""
    tried = []

    def load(name, outcome):
        def attempt():
            tried.append(name)
            if outcome is not None:
                raise outcome
        return attempt

    monkeypatch.setattr(flash_attention, "load_interface", load("flash", flash))
    monkeypatch.setattr(kernels_liger, "load_rms_norm", load("liger", liger))
    monkeypatch.setattr(kernels, "FLASH_VERSION", "4.0.0b36")
    monkeypatch.setattr(kernels, "HAS_FLASH", True)
    monkeypatch.setitem(kernels.NEEDS, "liger", True)
    return tried


@pytest.mark.parametrize("major", [9, 8])
def test_the_packages_that_run_are_imported_before_the_first_step(monkeypatch, major):
    """On a GPU the run imports the optional packages the seam would run there (flash-attn-4 on Hopper
    only) at its start, and keeps them on; on the CPU it imports nothing. Whether liger-kernel runs is
    one record, ``NEEDS``, which settling and the choice both read (planted: a copy of it that settling
    read, which a machine without liger-kernel kept off here, so its import was never tried)."""
    tried = _imports_that(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (major, 0))
    assert kernels.settle_kernels(torch.device("cpu")) == [] and tried == []
    assert kernels.settle_kernels(torch.device("cuda", 0)) == []
    assert tried == (["flash", "liger"] if major == 9 else ["liger"])
    assert kernels.HAS_FLASH and kernels.NEEDS["liger"]


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'cutlass'"), ImportError(),
                                   OSError("libcuda.so.1: cannot open shared object file\nmore lines")])
def test_a_package_that_does_not_import_is_turned_off_and_named(monkeypatch, error):
    """An installed package whose import fails (a dependency missing or off the path) would fail the
    first step with a traceback: it is turned off, its op runs the torch body, and one line says why
    and the fix, also for an error without a message (planted: an IndexError in its place). The other
    package is untouched."""
    _imports_that(monkeypatch, flash=error)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    [line] = kernels.settle_kernels(torch.device("cuda", 0))
    assert not kernels.HAS_FLASH and kernels.NEEDS["liger"]
    assert line.startswith("flash-attn-4 4.0.0b36 is installed but does not import (")
    reason = ": ".join([type(error).__name__, *filter(None, [str(error).partition(chr(10))[0]])])
    assert f"({reason})" in line and "\n" not in line
    assert "runs SDPA" in line and "pip install -e '.[flash]'" in line
    q = types.SimpleNamespace(is_cuda=True, shape=torch.Size((8, 16, 2048, 128)), dtype=torch.bfloat16,
                              device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H200)
    assert not kernels.use_flash_attention(q, 0.0)

    _imports_that(monkeypatch, liger=error)
    [line] = kernels.settle_kernels(torch.device("cuda", 0))
    assert kernels.HAS_FLASH and not kernels.NEEDS["liger"]
    assert line.startswith(f"liger-kernel is installed but does not import ({reason})")
    assert "rms_norm runs its torch body" in line and "pip install -e '.[gpu]'" in line
    x = types.SimpleNamespace(is_cuda=True)
    assert not kernels.use_fused(x, needs="liger")
    assert kernels.use_fused(x, needs="triton") == kernels.NEEDS["triton"]


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_settles_the_kernels_and_rank_0_says_why_not(monkeypatch, capsys, rank):
    from megazero.trainer import Trainer

    settled = []
    monkeypatch.setattr(kernels, "settle_kernels", lambda device: settled.append(device) or ["a ...", "b ..."])
    Trainer._settle_kernels(types.SimpleNamespace(rank=rank, device=torch.device("cuda", 0)))
    assert settled == [torch.device("cuda", 0)]
    assert capsys.readouterr().out == ("megazero: a ...\nmegazero: b ...\n" if rank == 0 else "")


@pytest.mark.parametrize("shape,dtype,dropout,gpu,fits", [
    ((8, 16, 2048, 128), torch.bfloat16, 0.0, H200, True),  # GPT 1.3B at micro-batch 8
    ((8, 16, 2048, 64), torch.float16, 0.0, H200, True),
    ((16, 12, 2048, 64), torch.bfloat16, 0.0, H200, True),  # 125M at 16
    ((8, 16, 2048, 128), torch.float32, 0.0, H200, False),  # the kernels have no fp32
    ((8, 16, 2048, 128), torch.bfloat16, 0.1, H200, False),  # nor dropout
    ((8, 16, 2048, 128), torch.bfloat16, 0.0, types.SimpleNamespace(major=8, multi_processor_count=108), False),
    ((8, 16, 2048, 128), torch.bfloat16, 0.0, types.SimpleNamespace(major=10, multi_processor_count=148), False),
    ((8, 16, 2048, 260), torch.bfloat16, 0.0, H200, False),
    ((8, 16, 2048, 100), torch.bfloat16, 0.0, H200, False),
    ((8, 16, 2048, 256), torch.bfloat16, 0.0, H200, True),  # the kernels' largest head
    ((8, 16, 2048, 264), torch.bfloat16, 0.0, H200, False),
    ((8, 16, 2048, 72), torch.bfloat16, 0.0, H200, True),  # a multiple of 8, not of 16
    ((2, 16, 2048, 128), torch.bfloat16, 0.0, H200, False),  # 32 pairs: measured slower than SDPA
    ((2, 32, 2048, 128), torch.bfloat16, 0.0, H200, False),  # 64
    ((1, 66, 2048, 128), torch.bfloat16, 0.0, H200, True),  # half a pair per multiprocessor
    ((1, 65, 2048, 128), torch.bfloat16, 0.0, H200, False),
])
def test_flash_attention_fits_the_measured_cases(shape, dtype, dropout, gpu, fits):
    assert kernels.flash_attention_fits(torch.Size(shape), dtype, dropout, gpu) is fits


def test_flash_attention_runs_only_on_cuda_tensors_with_the_kernels_on(monkeypatch):
    """With the package present and a shape that fits, a CUDA tensor takes FlashAttention 4; a CPU
    tensor, or any tensor under ``MEGAZERO_KERNELS=0``, keeps SDPA. (The CUDA tensor is a stand-in
    holding what the choice reads, and the GPU's properties an H200's.)"""
    def q(is_cuda):
        return types.SimpleNamespace(is_cuda=is_cuda, shape=torch.Size((8, 16, 2048, 128)), dtype=torch.bfloat16,
                                     device=torch.device("cuda" if is_cuda else "cpu"))

    monkeypatch.setattr(kernels, "HAS_FLASH", True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H200)
    assert kernels.use_flash_attention(q(True), 0.0)
    assert not kernels.use_flash_attention(q(False), 0.0)
    monkeypatch.setattr(kernels, "ENABLED", False)
    assert not kernels.use_flash_attention(q(True), 0.0)


def test_the_seam_routes_to_flash_attention_only_when_it_fits(monkeypatch):
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    assert not kernels.use_flash_attention(q, 0.0)  # a CPU tensor
    calls = []
    monkeypatch.setattr(kernels, "flash_attention", types.SimpleNamespace(
        attention=lambda *args: calls.append(args) or torch.zeros(())), raising=False)
    monkeypatch.setattr(kernels, "use_flash_attention", lambda q, p: p == 0.0)
    assert ops.attention(q, k, v, 0.0).shape == () and len(calls) == 1 and calls[0][0] is q
    torch.manual_seed(0)
    got = ops.attention(q, k, v, 0.5)
    torch.manual_seed(0)
    assert torch.equal(got, ops.sdpa_attention(q, k, v, 0.5)) and len(calls) == 1
    assert ops.attention.reference is ops.sdpa_attention


def _qkv_views(batch=2, seq=64, groups=2, r=3, dim=16):
    qkv = torch.empty(batch, seq, groups, r + 2, dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
    q = qkv[..., :r, :].flatten(2, 3).transpose(1, 2)
    return qkv, q, qkv[..., r, :].transpose(1, 2), qkv[..., r + 1, :].transpose(1, 2)


def test_the_custom_ops_shape_bodies_match_the_kernels_outputs():
    """The kernels return out [batch, seq, heads, dim] and the fp32 log-sum-exp [batch, heads, seq],
    both contiguous; the backward returns gradients shaped as its inputs (fewer kv heads: GQA)."""
    qkv, q, k, v = _qkv_views()
    out, lse = torch.ops.megazero.flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2),
                                                          v.transpose(1, 2), 0.25)
    assert out.shape == (2, 64, 6, 16) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (2, 6, 64) and lse.dtype == torch.float32 and lse.is_contiguous()
    grads = torch.ops.megazero.flash_attention_backward(out, q.transpose(1, 2), k.transpose(1, 2),
                                                        v.transpose(1, 2), out, lse, 0.25)
    assert [g.shape for g in grads] == [(2, 64, 6, 16), (2, 64, 2, 16), (2, 64, 2, 16)]
    assert all(g.is_contiguous() and g.dtype == torch.bfloat16 for g in grads)


@pytest.mark.parametrize("compiled", [False, True])
def test_gradients_reach_the_projection_through_the_ops(compiled):
    """The seam's layout in and out, and autograd from the output back to the fused qkv projection,
    eagerly and compiled into one graph (no break: the ops are traced as nodes)."""
    qkv, q, k, v = _qkv_views()
    attend = torch.compile(flash_attention.attention, fullgraph=True, backend="aot_eager") if compiled \
        else flash_attention.attention
    out = attend(q, k, v)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()
    out.sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape
