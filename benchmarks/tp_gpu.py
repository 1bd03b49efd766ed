"""Tensor-parallel throughput on GPUs: a 1B-class GPT in bf16, forward + backward at tp=1 and tp=2.

Run on one node with two GPUs (NCCL)::

    torchrun --nproc_per_node 2 benchmarks/tp_gpu.py [--micro-batch-size 4] [--steps 10]

Each configuration prints one JSON line (rank 0): tokens/s of one model replica (its tp ranks
together) and per GPU, the step time, peak memory and the loss of the first step. Every
configuration builds the same model (same seed: initialisation does not depend on tp) and runs the
same batch, so the first-step losses must agree up to bf16 rounding; a final line reports their
largest relative difference from tp=1. At tp=1 on two GPUs each GPU runs its own replica
(data parallel without gradient sync), which is what "per GPU" means there. Only forward and
backward are timed (no optimizer step), so the numbers isolate the layer math and the tp
collectives. ``--device cpu`` runs the same code on gloo with a tiny model, as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from models import GPT
from models.config import ModelConfig
from models.ops import IGNORE_INDEX
from models.parallelize import tensor_parallelize_gpt
from parallel.tensor_parallel.partial_grads import sum_partial_grads
from models.presets import MODEL_PRESETS
from parallel.topology import RankGrid, Topology

SEED = 1234


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2", choices=sorted(MODEL_PRESETS))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps per config (after 2 warm-up steps)")
    p.add_argument("--configs", nargs="+", default=["tp1", "tp2", "tp2-sp", "tp2-sp-selective"],
                   help="tpN[-sp][-selective|-full]")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return p.parse_args()


def parse_config(name: str) -> tuple[int, bool, str]:
    parts = name.split("-")
    recompute = next((p for p in parts if p in ("full", "selective")), "none")
    return int(parts[0][2:]), "sp" in parts, recompute


def run_config(args, cfg: ModelConfig, name: str, device, dtype, batch) -> dict:
    tp, sp, recompute = parse_config(name)
    world = dist.get_world_size()
    topo = Topology(RankGrid(tp=tp, pp=1, dp=world // tp))
    model = GPT(cfg, vocab_multiple=128 * tp, device="meta")
    tensor_parallelize_gpt(model, topo.tp_group, seed=SEED, device=device, sequence_parallel=sp, recompute=recompute)
    model.to_empty(device=device)
    model.init_weights(SEED)  # each rank draws only its shards
    model.to(dtype)
    ids, labels = batch

    def step():
        model.zero_grad(set_to_none=True)
        mean = model(ids, labels, reduction="sum") / (labels != IGNORE_INDEX).sum()
        mean.backward()
        sum_partial_grads(model, topo.tp_group)
        return mean.detach()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    first_loss = step().item()
    step()
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    elapsed = time.perf_counter() - start
    tokens = args.steps * ids.numel()
    result = {"config": name, "tp": tp, "sequence_parallel": sp, "recompute": recompute, "preset": args.preset,
              "layers": cfg.num_layers, "hidden": cfg.hidden_size, "seq": cfg.seq_length,
              "micro_batch_size": ids.shape[0], "dtype": str(dtype).replace("torch.", ""),
              "params_b": round(sum(p.numel() for p in model.parameters()) * tp / 1e9, 3),
              "tokens_per_s": round(tokens / elapsed, 1), "tokens_per_s_per_gpu": round(tokens / elapsed / tp, 1),
              "step_s": round(elapsed / args.steps, 4), "loss": first_loss}
    if device.type == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result["gpu"] = torch.cuda.get_device_name()
        del model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
        dist.init_process_group("nccl", device_id=device)
    else:
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo")
    cfg = ModelConfig(**MODEL_PRESETS[args.preset], num_layers=args.layers, hidden_size=args.hidden,
                      num_heads=args.heads, vocab_size=args.vocab, seq_length=args.seq)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, cfg.seq_length + 1), generator=g)
    batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))
    losses = {}
    for name in args.configs:
        if parse_config(name)[0] > dist.get_world_size():
            continue
        torch.manual_seed(SEED)
        result = run_config(args, cfg, name, device, dtype, batch)
        losses[name] = result["loss"]
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    if dist.get_rank() == 0 and "tp1" in losses:
        diffs = {n: abs(v - losses["tp1"]) / abs(losses["tp1"]) for n, v in losses.items() if n != "tp1"}
        print(json.dumps({"loss_rel_diff_vs_tp1": diffs}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
