"""The one-GPU peer: the GPT of ``common.py`` in plain PyTorch (bf16 autocast, fused AdamW), eager
and ``torch.compile``d, for each size asked. What a user would run instead of megazero on one GPU.

    python benchmarks/peers/single_gpu.py --sizes 125m,350m,1.3b --micro-batches 16,8,8
"""

from __future__ import annotations

import argparse

import torch

from common import GPT, SIZES, adamw, random_batch, report, time_steps


def measure(size_name: str, micro_batch: int, seq: int, compiled: bool, warmup: int, steps: int) -> str:
    torch.manual_seed(0)
    model = GPT(SIZES[size_name], seq).cuda()
    optimizer = adamw(model.parameters())
    forward = torch.compile(model) if compiled else model
    tokens, labels = random_batch(micro_batch, seq, "cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(tokens, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timing = time_steps(step, warmup, steps)
    return report("plain" + ("-compile" if compiled else ""), size_name, seq, micro_batch * seq, timing,
                  micro_batch=micro_batch, compile=compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="125m,350m,1.3b")
    parser.add_argument("--micro-batches", default="16,8,8", help="one per size")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for size_name, micro_batch in zip(args.sizes.split(","), map(int, args.micro_batches.split(","))):
        for compiled in (False,) if args.no_compile else (False, True):
            print(measure(size_name, micro_batch, args.seq, compiled, args.warmup, args.steps), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
