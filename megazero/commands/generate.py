"""`megazero generate CHECKPOINT`: sample text from a trained checkpoint on one process."""

from __future__ import annotations

from megazero.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="Sample text from a checkpoint (any training layout) on one process",
        description="Load a checkpoint directory (or a checkpoints root: its latest complete checkpoint), "
                    "reassemble the single-device model and sample a continuation of the prompt.")
    parser.add_argument("checkpoint", help="A step_* checkpoint directory or the directory holding them")
    parser.add_argument("--tokenizer", required=True, help="The SentencePiece .model or tokenizer.json used in training")
    parser.add_argument("--prompt", default="def ", help="Text to continue")
    parser.add_argument("--tokens", type=int, default=64, help="Tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args) -> int:
    from data_pipeline.tokenizer import load_tokenizer
    from megazero.checkpoint import latest_checkpoint
    from megazero.generate import load_model, sample

    path = latest_checkpoint(args.checkpoint) or args.checkpoint
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    model, _ = load_model(path)
    prompt = tokenizer.encode(args.prompt)
    out = sample(model, prompt, args.tokens, args.temperature, args.top_k, args.seed)
    print(tokenizer.decode(out))
    return 0
