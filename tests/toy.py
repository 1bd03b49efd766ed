"""The small model the ZeRO tests train, its data, and the single-process AdamW run they are compared with.

A stack of residual blocks between a tied embedding and head, small enough that every rank of a test
world also computes the reference itself. Its forward can leave a block, or one block's norm, out,
so that some parameters get no gradient in a step or a micro-batch.
"""

import copy

import torch
import torch.distributed as dist

STEPS, MICRO, BATCH, VOCAB, WIDTH = 3, 2, 4, 50, 24


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.fc = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x, skip_norm=False):
        return x + self.proj(torch.nn.functional.gelu(self.fc(x if skip_norm else self.norm(x))))


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, tokens, labels, skip=None, skip_norm=None):
        """``skip``: index of a block left out, so its parameters get no gradient that step;
        ``skip_norm``: index of a block whose norm alone is left out, so part of a bucket gets none."""
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = block(x, skip_norm=i == skip_norm)
        logits = self.norm(x) @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _data(step, index):
    g = torch.Generator().manual_seed(1000 * step + index)
    tokens = torch.randint(0, VOCAB, (BATCH, 8), generator=g)
    return tokens, torch.roll(tokens, -1, 1)


def _left_out(variant, step, index):
    """What the model leaves out of micro-batch ``index`` of ``step``, as its keyword arguments. The
    "unused" variant leaves block 1 out of step 1: stale gradients must not leak into it.
    "unused_micro" leaves block 1's norm out of step 1's second micro-batch only: that norm's
    gradient of the first micro-batch must not stand in for the second's, in a bucket that the
    rest of the block fills (stages 2-3 reduce each backward from fresh buffers). A variant ending
    in "+unused" leaves block 1 out as "unused" does."""
    if step == 1 and variant.split("+")[-1] == "unused":
        return {"skip": 1}
    if step == 1 and variant == "unused_micro" and index % MICRO == 1:
        return {"skip_norm": 1}
    return {}


def _lr(variant, step):
    """The "schedule" variant hands each step its learning rate (1e-2, 5e-3, 3.3e-3), as the trainer
    does; the others keep the optimizer's own 1e-2. Every parameter group must take it: biases and
    norms, which do not decay, as well as the matrices."""
    return 1e-2 / (step + 1) if variant == "schedule" else None


def _reference(model, steps, batches_per_step, clip, variant="plain"):
    model = copy.deepcopy(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    norms = []
    for step in range(steps):
        opt.zero_grad(set_to_none=False)  # an unused parameter steps with a zero gradient, as in ZeRO
        for group in opt.param_groups:
            group["lr"] = _lr(variant, step) or 1e-2
        for index in range(batches_per_step):
            (model(*_data(step, index), **_left_out(variant, step, index)) / batches_per_step).backward()
        if variant == "fp16grads":  # one micro-batch's gradients, as fp16 buffers hold them
            for p in model.parameters():
                p.grad = p.grad.half().float()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    moments = {name: opt.state[p]["exp_avg"].reshape(-1) for name, p in model.named_parameters()}
    return model, norms, moments


def _first_moments(opt, group):
    """Each parameter's AdamW first moment, assembled by name from every rank's shard. Unlike the
    parameters, it is not invariant to a constant factor on the gradients: an unscale or clipping
    coefficient left out shows here even where Adam's normalised update hides it."""
    numels = opt.layout.param_numel
    # each parameter's moment, then how many ranks hold each element (stage 0 keeps a whole copy on
    # every rank), all summed over the group in one reduction
    held = [torch.zeros(2, numel) for numel in numels]
    for seg in opt.layout.segments:
        here = slice(seg.param_offset, seg.param_offset + seg.numel)
        held[seg.param][0, here] = opt.exp_avg[seg.shard_offset:seg.shard_offset + seg.numel].cpu()
        held[seg.param][1, here] = 1
    summed = torch.cat(held, dim=1)
    dist.all_reduce(summed, group=group)
    return {info.name: value / owners for info, (value, owners) in zip(opt.dp.info, summed.split(numels, dim=1))}
