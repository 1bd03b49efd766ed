"""Decoding speed of `megazero generate`'s sampler against transformers' ``generate`` on the same weights.

    python benchmarks/generate_speed.py --preset llama --layers 12 --hidden 768 --prompt 256 --tokens 64

One process, one device (``--device``, default cpu). The model is a random-initialised megazero
GPT; its weights go through the Hugging Face export mapping into transformers' class, so both
decode the same model: the greedy texts are checked equal (the cross-check). Each is timed,
the two alternating, best of ``--repeats``, as wall and as CPU time of the process (the machine may
be shared: CPU time does not count the waits). Also timed: the sampler as it was before its KV cache (every draw a whole
forward over the context), over ``--uncached-tokens`` draws only, as it is slow.
"""

from __future__ import annotations

import argparse
import time

import torch

from megazero.convert.hf_models import family_for
from megazero.generate import round_weights, sample
from models import GPT
from models.config import ModelConfig
from models.presets import MODEL_PRESETS


def hf_twin(model: GPT):
    """transformers' model holding ``model``'s weights, through the export mapping."""
    import transformers

    cfg = model.cfg
    family = family_for(cfg)
    config = getattr(transformers, family.hf_class.replace("ForCausalLM", "Config").replace("LMHeadModel", "Config"))(
        vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, **family.hf_config(cfg))
    twin = getattr(transformers, family.hf_class)(config).eval()
    state = {}
    for name, t in model.named_parameters():
        rows = t[:cfg.vocab_size] if name in ("embedding.tokens.weight", "lm_head.weight") else t
        state.update(family.to_hf(name, rows.detach(), cfg))
    missing, unexpected = twin.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and (not missing or cfg.tie_embeddings), \
        (missing, unexpected)
    return twin


def uncached(model: GPT, tokens: list[int], new_tokens: int, device) -> list[int]:
    """Greedy draws the way the sampler made them before its cache: a whole forward per token."""
    for _ in range(new_tokens):
        logits = model(torch.tensor([tokens[-model.cfg.seq_length:]], device=device))[0, -1, :model.vocab_size]
        tokens = [*tokens, int(logits.argmax())]
    return tokens


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, result)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="llama")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=256, help="Prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="Tokens drawn")
    parser.add_argument("--uncached-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="Both models' weights (bf16: the greedy texts may part where rounding moves an argmax)")
    parser.add_argument("--hf-static", action="store_true",
                        help="Also time transformers' generate with its static cache (which it compiles on a GPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = ModelConfig(**dict(MODEL_PRESETS[args.preset], num_layers=args.layers, hidden_size=args.hidden,
                             num_heads=args.heads, vocab_size=args.vocab, seq_length=args.seq_length))
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = GPT(cfg, seed=0).eval().to(device)
    twin = hf_twin(model).to(device, dtype)
    round_weights(model, dtype)  # as `megazero generate --dtype` does
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.preset} {args.layers} x {args.hidden}, vocab {args.vocab}, {params / 1e6:.0f}M parameters, "
          f"{args.dtype} on {device}, {torch.get_num_threads()} threads; prompt {args.prompt} tokens, "
          f"{args.tokens} drawn")

    ids = torch.tensor([prompt], device=device)
    runs = {"megazero (KV cache)": (args.tokens, lambda: sample(model, list(prompt), args.tokens, temperature=0,
                                                               device=device)),
            "transformers generate": (args.tokens, lambda: twin.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.tokens,
                min_new_tokens=args.tokens, pad_token_id=0)[0].tolist())}
    if args.hf_static:
        runs["transformers static cache"] = (args.tokens, lambda: twin.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.tokens,
            min_new_tokens=args.tokens, pad_token_id=0, cache_implementation="static")[0].tolist())
    best: dict[str, tuple[float, float]] = {}
    texts = {}
    with torch.no_grad():
        for _ in range(args.repeats):  # the two alternate, so a busy spell of the machine falls on both
            for name, (_, run) in runs.items():
                wall, cpu, texts[name] = timed(run)
                best[name] = tuple(min(pair) for pair in zip(best.get(name, (wall, cpu)), (wall, cpu)))
        wall, cpu, _ = timed(lambda: uncached(model, list(prompt), args.uncached_tokens, device))
    best["megazero before the cache"] = (wall, cpu)
    drawn = {name: count for name, (count, _) in runs.items()} | {"megazero before the cache": args.uncached_tokens}
    same = all(text == texts["megazero (KV cache)"] for text in texts.values())
    print(f"greedy texts equal: {same}")  # every run's
    for name, (wall, cpu) in best.items():
        print(f"{name:28s} {drawn[name]:4d} tokens: {wall:7.2f} s wall ({drawn[name] / wall:7.1f} tokens/s), "
              f"{cpu:7.2f} s CPU ({drawn[name] / cpu:7.1f} tokens per CPU-second)")
    if not same and args.dtype == "fp32":
        raise SystemExit("the greedy texts differ: the two models do not compute the same thing")


if __name__ == "__main__":
    main()
