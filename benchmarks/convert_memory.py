"""Peak host memory of converting a Llama-shaped model: megazero checkpoint -> Hugging Face.

Random weights are made one tensor at a time (the model itself is only ever built on the meta
device) and written as a consolidated megazero checkpoint (fp32 master, fresh moments) by the same
streaming writer ``megazero convert`` uses; then ``megazero convert CKPT HF --dtype bf16`` runs in a
fresh process whose peak resident memory (``ru_maxrss``) is reported, beside the size of the largest
tensor and of the whole model. Each step runs in its own process, so one's memory is not counted
in the other's.

    python benchmarks/convert_memory.py --layers 32 --hidden 4096 --ffn 11008 --vocab 32000 --out /big/disk

A 7B shape needs about 81 GiB for the checkpoint (fp32 master and two moments) and 13 GiB for the
bf16 Hugging Face copy; ``--layers`` shrinks the model without changing the largest tensor.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_checkpoint(args) -> None:
    import torch

    from megazero.convert.sources import logical_shapes
    from megazero.convert.targets import write_megazero
    from models.config import ModelConfig

    cfg = ModelConfig(preset="llama", num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                      ffn_hidden_size=args.ffn, vocab_size=args.vocab, seq_length=4096, position_embedding="rope",
                      norm="rmsnorm", activation="swiglu", tie_embeddings=False, bias=False)

    class RandomSource:
        kind = "random"

        def __init__(self):
            self.cfg, self.shapes = cfg, logical_shapes(cfg)
            self.names = list(self.shapes)

        def read(self, name):
            shape = self.shapes[name]
            rows = cfg.vocab_size if name in ("embedding.tokens.weight", "lm_head.weight") else shape[0]
            return torch.randn((rows, *shape[1:])).mul_(0.02)

    write_megazero(RandomSource(), Path(args.dir) / "mz")


def measured(argv: list[str]) -> tuple[float, float]:
    """Run this script with ``argv`` in a fresh process: (seconds, its peak resident memory in MiB)."""
    start = time.time()
    out = subprocess.run([sys.executable, __file__, *argv], check=True, capture_output=True, text=True)
    peak = [line for line in out.stdout.splitlines() if line.startswith("PEAK_RSS_KIB ")]
    return time.time() - start, int(peak[-1].split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", default=None, help="Directory for the files (default: a temporary one)")
    parser.add_argument("--step", choices=("make", "convert"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        if args.step == "make":
            make_checkpoint(args)
        else:
            from megazero.cli import main as cli

            assert cli(["convert", f"{args.dir}/mz", f"{args.dir}/hf", "--dtype", "bf16"]) == 0
        print("PEAK_RSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
        return
    work = Path(tempfile.mkdtemp(dir=args.out))
    shape = [f"--layers={args.layers}", f"--hidden={args.hidden}", f"--heads={args.heads}", f"--ffn={args.ffn}",
             f"--vocab={args.vocab}"]
    try:
        write_s, write_rss = measured(["--step=make", f"--dir={work}", *shape])
        convert_s, convert_rss = measured(["--step=convert", f"--dir={work}", *shape])
        params = args.layers * (4 * args.hidden ** 2 + 3 * args.hidden * args.ffn + 2 * args.hidden) + \
            2 * args.vocab * args.hidden + args.hidden
        largest = max(args.vocab * args.hidden, 2 * args.ffn * args.hidden) * 4 / 2**20
        print(json.dumps({"params": params, "fp32_model_mib": round(params * 4 / 2**20),
                          "largest_fp32_tensor_mib": round(largest),
                          "checkpoint_gib": round(sum(f.stat().st_size for f in (work / "mz").rglob("*")) / 2**30, 2),
                          "write_s": round(write_s, 1), "write_peak_rss_mib": round(write_rss),
                          "convert_s": round(convert_s, 1), "convert_peak_rss_mib": round(convert_rss)}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
