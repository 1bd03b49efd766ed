"""AdamW over one bucket of the fp32 shard, writing the 16-bit parameters in the same pass.

torch's fused AdamW updates the fp32 master, and a second pass then rounds the master into the
16-bit parameters the model computes with: the master is read twice, and torch's multi-tensor
launcher reaches about two thirds of the card's bandwidth on a shard of hundreds of tensors
(1.3B GPT on an H100: 16.4 ms for the update and 2.9 ms for the rounding copy per step). Here one
kernel reads gradient, master and both moments once and writes master, moments and the rounded
parameter, from flat buffers, so each program streams one contiguous piece.

Work is cut into *tiles*: runs of at most ``BLOCK`` elements inside one parameter's segment of the
bucket, so each tile has one weight-decay setting (matrices decay, biases and norm weights do not).
The table of tiles depends only on the layout and is built once. Every tile starts on a multiple
of 64 elements and its last one is processed up to the next multiple of 64, into the padding the
flat layout leaves before the next parameter, so the kernel is told its loads never start or stop
inside a 16-byte group: with lengths it cannot see it would load element by element. The padding's
gradient is taken as zero (stages 2-3 leave stale sums there), so master, moments and parameters
keep their zero padding. The step's gradient multiplier (unscale x clip), skip flag and bias
corrections are device tensors, so a step never waits for the host.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Elements per tile (the fastest of 1024 to 8192 on an H200; ``benchmarks/optimizer_step_gpu.py --sweep``)."""
ALIGN = 64
"""The flat layout's alignment of every parameter's start (``FlatLayout``'s ``align``)."""


@triton.jit
def _adamw_tiles(tiles_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, skip_ptr,
                 corrections_ptr, lr, weight_decay, beta1, beta2, eps, BLOCK: tl.constexpr, ROUND_OUT: tl.constexpr):
    if tl.load(skip_ptr) != 0:
        return
    tile = tl.program_id(0)
    start = tl.multiple_of(tl.load(tiles_ptr + 3 * tile).to(tl.int64), 64)
    length = tl.load(tiles_ptr + 3 * tile + 1)
    decays = tl.load(tiles_ptr + 3 * tile + 2)
    idx = tl.arange(0, BLOCK)
    mask = idx < (length + 63) // 64 * 64
    offs = start + idx
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0) * tl.load(coef_ptr)
    g = tl.where(idx < length, g, 0.0)
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    p = p * (1.0 - lr * weight_decay * decays)
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    bias1 = tl.load(corrections_ptr)
    bias2_sqrt = tl.sqrt_rn(tl.load(corrections_ptr + 1))
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if ROUND_OUT:
        tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


def tile_table(segments: list[tuple[int, int, bool]], bucket_numel: int, device: torch.device) -> torch.Tensor:
    """The tiles of one bucket as an int32 (n, 3) table of (start, length, decays), from its segments'
    (start within the bucket, length, whether the parameter decays), in order. Refuses a layout whose
    segments do not start aligned or leave no room to round their ends up to ``ALIGN``."""
    assert BLOCK % ALIGN == 0, "tiles after the first of a segment must start aligned too"
    if bucket_numel >= 2**31:
        raise ValueError(f"a bucket slice of {bucket_numel} elements is too large for the AdamW kernel's "
                         "int32 offsets; lower zero.bucket_size_mb")
    parts = []
    ends = [lo for lo, _, _ in segments[1:]] + [bucket_numel]
    for (lo, n, decays), limit in zip(segments, ends):
        if lo % ALIGN or -(-(lo + n) // ALIGN) * ALIGN > limit:
            raise ValueError(f"AdamW tiles need every segment {ALIGN}-element aligned with padding after it; "
                             f"the segment at {lo} of length {n} is followed at {limit}")
        offsets = torch.arange(0, n, BLOCK, dtype=torch.int64)
        parts.append(torch.stack([lo + offsets, (n - offsets).clamp(max=BLOCK), torch.full_like(offsets, int(decays))], 1))
    rows = torch.cat(parts) if parts else torch.zeros(1, 3, dtype=torch.int64)
    return rows.to(device=device, dtype=torch.int32)


def adamw_bucket(tiles: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, out: Optional[torch.Tensor], coef: torch.Tensor, skip: torch.Tensor,
                 corrections: torch.Tensor, lr: float, weight_decay: float, betas: tuple[float, float],
                 eps: float) -> None:
    """One AdamW step on the tiles of one bucket (all tensors flat and of the bucket's length).
    ``coef`` (fp32) multiplies every gradient; a nonzero ``skip`` leaves everything as it was;
    ``corrections`` holds this step's 1 - beta1^t and 1 - beta2^t (fp32); ``out`` None: no 16-bit
    copy to round into (ZeRO-3 rounds from the master as it gathers)."""
    _adamw_tiles[(tiles.shape[0],)](
        tiles, grad, master, exp_avg, exp_avg_sq, master if out is None else out, coef, skip.view(torch.uint8),
        corrections, lr, weight_decay, betas[0], betas[1], eps, BLOCK=BLOCK, ROUND_OUT=out is not None,
        num_warps=4)
