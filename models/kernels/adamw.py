"""AdamW over one bucket of the fp32 shard, writing the 16-bit parameters in the same pass.

torch's fused AdamW updates the fp32 master, and a second pass then rounds the master into the
16-bit parameters the model computes with: the master is read twice, and torch's multi-tensor
launcher reaches about two thirds of the card's bandwidth on a shard of hundreds of tensors
(1.3B GPT on an H100: 16.4 ms for the update and 2.9 ms for the rounding copy per step). Here one
kernel reads gradient, master and both moments once and writes master, moments and the rounded
parameter, from flat buffers, so each program streams one contiguous piece.

Work is cut into *tiles*: runs of at most ``BLOCK`` elements inside one parameter's segment of the
bucket, so each tile has one weight-decay setting (matrices decay, biases and norm weights do not).
The table of tiles depends only on the layout and is built once. Tiles start and end on multiples
of 64 elements (a segment's last tile runs on into the zero padding the flat layout puts after each
parameter, which the update leaves zero), and the kernel is told so: with lengths it cannot see, it
would mask and load element by element instead of 16 bytes at a time. The step count, the gradient
multiplier (unscale x clip) and the skip flag are device tensors, so a step never waits for the host.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Elements per tile."""
ALIGN = 64
"""The flat layout's alignment of every parameter's start (``FlatLayout``'s ``align``)."""


@triton.jit
def _adamw_tiles(tiles_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr,
                 coef_ptr, skip_ptr, step_ptr, lr, weight_decay, beta1, beta2, log2_beta1, log2_beta2, eps,
                 BLOCK: tl.constexpr):
    if tl.load(skip_ptr) != 0:
        return
    tile = tl.program_id(0)
    start = tl.multiple_of(tl.load(tiles_ptr + 3 * tile).to(tl.int64), 64)
    count = tl.multiple_of(tl.load(tiles_ptr + 3 * tile + 1), 64)
    decays = tl.load(tiles_ptr + 3 * tile + 2)
    idx = tl.arange(0, BLOCK)
    mask = idx < count
    offs = start + idx
    step = tl.load(step_ptr)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0) * tl.load(coef_ptr)
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    p = p * (1.0 - lr * weight_decay * decays)
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


def tile_table(segments: list[tuple[int, int, bool]], bucket_numel: int, device: torch.device) -> torch.Tensor:
    """The tiles of one bucket as an int32 (n, 3) table of (start, count, decays), from its
    segments' (start within the bucket, length, whether the parameter decays); lengths are rounded up
    to ``ALIGN``, into the padding before the next segment or the bucket's end."""
    parts = []
    for lo, n, decays in segments:
        n = min(-(-n // ALIGN) * ALIGN, bucket_numel - lo)
        offsets = torch.arange(0, n, BLOCK, dtype=torch.int64)
        parts.append(torch.stack([lo + offsets, (n - offsets).clamp(max=BLOCK), torch.full_like(offsets, int(decays))], 1))
    rows = torch.cat(parts) if parts else torch.zeros(1, 3, dtype=torch.int64)
    if bool((rows[:, :2] % ALIGN).any()):
        raise ValueError(f"AdamW tiles must be {ALIGN}-element aligned: the flat layout aligns every parameter")
    return rows.to(device=device, dtype=torch.int32)


def adamw_bucket(tiles: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, out: torch.Tensor, coef: torch.Tensor, skip: torch.Tensor,
                 step: torch.Tensor, lr: float, weight_decay: float, betas: tuple[float, float], eps: float) -> None:
    """One AdamW step on the tiles of one bucket (all tensors flat and of the bucket's length; ``step``
    already counts this step). ``coef`` multiplies every gradient; a nonzero ``skip`` leaves
    everything as it was."""
    beta1, beta2 = betas
    _adamw_tiles[(tiles.shape[0],)](
        tiles, grad, master, exp_avg, exp_avg_sq, out, coef, skip.view(torch.uint8), step,
        lr, weight_decay, beta1, beta2, math.log2(beta1), math.log2(beta2), eps, BLOCK=BLOCK, num_warps=4)

