"""`megazero generate CHECKPOINT`: sample text from a trained checkpoint on one process."""

from __future__ import annotations

import argparse
import sys

from megazero.errors import UserError, utf8_text

SOURCE = "the CHECKPOINT argument"  # what the checkpoint errors tell the user to check


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="Sample text from a checkpoint (any training layout) on one process",
        description="Load a checkpoint directory (or a checkpoints root: its latest complete checkpoint), "
                    "reassemble the single-device model and sample a continuation of the prompt.")
    parser.add_argument("checkpoint", help="A step_* checkpoint directory or the directory holding them")
    parser.add_argument("--tokenizer", required=True, help="The SentencePiece .model or tokenizer.json used in training")
    parser.add_argument("--prompt", default="def ", help="Text to continue")
    parser.add_argument("--tokens", type=at_least(0), default=64, help="Tokens to generate (0 or more)")
    parser.add_argument("--temperature", type=temperature, default=0.8, help="0 for greedy, else a positive number")
    parser.add_argument("--top-k", type=at_least(1), default=40, help="Sample among the k likeliest tokens (1 or more)")
    parser.add_argument("--seed", type=at_least(0, below=2**63), default=0, help="Sampling seed, 0 to 2**63 - 1")
    parser.add_argument("--past-eod", action="store_true",
                        help="Keep sampling after the end-of-document token (default: stop there, as a document ends)")
    parser.add_argument("--prepend", action="append", default=[], metavar="TOKEN",
                        help="A token put before the prompt, named as the tokenizer spells it (e.g. '<s>'); repeat "
                             "for more. For a model trained with a token opening every text, as imported ones may be")
    parser.add_argument("--stop-at", action="append", default=[], metavar="TOKEN",
                        help="Stop also when this token is drawn, named as the tokenizer spells it (e.g. "
                             "'<|eot_id|>'); repeat for more")
    parser.add_argument("--device", default="auto", metavar="DEVICE",
                        help="Where the model runs: cpu, cuda or cuda:N (default: auto, the first GPU if there is "
                             "one, else the CPU); the draw among the top-k is made on the CPU")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="The weights' dtype: fp32, the checkpoint's master weights (default), or rounded to 16 "
                             "bits (half the memory; on a GPU about twice the tokens a second)")
    parser.set_defaults(func=run)


def at_least(low: int, below: int | None = None):
    """An argparse type: an integer no smaller than ``low`` and, if given, smaller than ``below``
    (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, got {value}")
        if below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"must be below {below}, got {value}")
        return value
    return parse


def temperature(text: str) -> float:
    """An argparse type: a finite number of 0 or more (a negative one would favour the least likely tokens)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number of 0 or more, got {text}")
    return value


def run(args) -> int:
    from data_pipeline.tokenizer import load_tokenizer
    from megazero.data import not_trained_with
    from megazero.generate import DTYPES, load_opened, open_checkpoint, sample, saved_config

    ckpt = open_checkpoint(args.checkpoint, source=SOURCE)  # before the tokenizer: the cheaper check
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    mismatch = not_trained_with(ckpt.meta, tokenizer, "--tokenizer")
    if mismatch:
        raise UserError(mismatch)
    pieces = tokenizer.pieces()  # every id's token: built once (a vocabulary may be 200,000 ids)
    prefix = token_ids(args.prepend, pieces, "--prepend", args.tokenizer)
    stops = set(token_ids(args.stop_at, pieces, "--stop-at", args.tokenizer))
    # before the model is read and verified; a prepended token is a start of its own to continue from
    prompt = prefix + tokenizer.encode(utf8_text(args.prompt, "--prompt"))
    if not prompt:
        raise UserError(f"--prompt {args.prompt!r} encodes to no tokens; give some text to continue "
                        "(or --prepend the token the model's texts open with)")
    vocab_size = saved_config(ckpt).model.vocab_size  # before the weights are read
    if tokenizer.vocab_size > vocab_size:
        raise UserError(f"--tokenizer {args.tokenizer}: has {tokenizer.vocab_size} tokens, but the checkpoint's model "
                        f"has {vocab_size}; use the tokenizer it was trained with")
    device = chosen_device(args.device)  # before the model is read
    model, _ = load_opened(ckpt, DTYPES[args.dtype])
    model.to(device)
    _note_a_cut_prompt(len(prefix), len(prompt) - len(prefix), model.cfg.seq_length, args.tokens)
    out = list(prompt)
    eod = set() if args.past_eod or tokenizer.eod_id is None else {tokenizer.eod_id}
    try:
        sample(model, out, args.tokens, args.temperature, args.top_k, args.seed, ids=decodable(pieces),
               stop=eod | stops, device=device)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (raised as one): what was sampled is printed, not lost
        print(tokenizer.decode(out[len(prefix):]), flush=True)
        print(f"note: stopped after {len(out) - len(prompt)} of {args.tokens} tokens", file=sys.stderr)
        raise
    print(tokenizer.decode(out[len(prefix):]))  # the prepended tokens are not the user's text
    drawn = len(out) - len(prompt)
    if drawn and drawn < args.tokens and out[-1] in stops:
        print(f"note: stopped at {pieces[out[-1]]} (--stop-at) after {drawn} of {args.tokens} tokens", file=sys.stderr)
    elif drawn and drawn < args.tokens and out[-1] in eod:
        print(f"note: the document ended after {drawn} of {args.tokens} tokens (--past-eod samples on)", file=sys.stderr)
    return 0


def chosen_device(name: str):
    """The torch device ``--device`` names, checked to exist here (a GPU asked for on a machine
    without one is said before the weights are read, not as CUDA's traceback after)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r}: not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r}: megazero samples on cpu or cuda only; use cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"--device {name}: this machine has no GPU torch can use; use --device cpu")
        if device.index is not None and device.index >= count:
            raise UserError(f"--device {name}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return device


def token_ids(names: list[str], pieces: list[str], option: str, tokenizer: str) -> list[int]:
    """The ids of the tokens ``names`` spells, as the tokenizer's vocabulary does; a name it lacks is an
    error naming ``option`` (an id given by number would be a guess at what the text means)."""
    where = {piece: i for i, piece in enumerate(pieces) if piece}
    missing = [name for name in names if name not in where]
    if missing:
        raise UserError(f"{option} {missing[0]!r}: no such token in --tokenizer {tokenizer}; name one of its "
                        "tokens exactly as its vocabulary spells it")
    return [where[name] for name in names]


def decodable(pieces: list[str]) -> list[int]:
    """The ids a tokenizer has a token for (``pieces``, in id order): a ``tokenizer.json`` may leave gaps
    below its largest id (added tokens placed far above the vocabulary), and an id drawn there decoded
    to nothing, silently shortening the text (and the note counting what was drawn)."""
    return [i for i, piece in enumerate(pieces) if piece]


def _note_a_cut_prompt(prefix_tokens: int, prompt_tokens: int, context: int, new_tokens: int) -> None:
    """The model sees at most ``context`` tokens, so a longer prompt is continued from its end alone,
    while the whole of it is printed as if continued; and where the prompt fits but the prompt and
    the tokens drawn do not, each draw reads the last ``context`` tokens, the prompt's start sliding
    out of view. The ``--prepend`` tokens go first (a BOS the model was trained to see): said by
    name. Say so on stderr (stdout is the text)."""
    if not new_tokens:
        return  # nothing is read
    total = prefix_tokens + prompt_tokens
    if total > context:
        cut = total - context
        if not prefix_tokens:
            print(f"note: --prompt is {prompt_tokens} tokens, more than the model's context of {context} "
                  f"(model.seq_length); only its last {context} tokens are read", file=sys.stderr)
        else:
            unread = ("the --prepend tokens" if cut >= prefix_tokens else "the first --prepend token" if cut == 1
                      else f"the first {cut} --prepend tokens")
            print(f"note: --prepend and --prompt are {total} tokens, more than the model's context of {context} "
                  f"(model.seq_length); only the last {context} are read, not {unread}", file=sys.stderr)
    elif total + new_tokens - 1 > context:  # the k-th draw (from 0) reads prompt + k tokens
        sliding = ("the --prepend tokens, then the prompt's start, slide" if prefix_tokens
                   else "the prompt's start slides")
        print(f"note: the model's context is {context} tokens (model.seq_length): from token "
              f"{context - total + 2} drawn on, it reads the last {context} alone and {sliding} out of view",
              file=sys.stderr)
