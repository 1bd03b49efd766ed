"""`megazero train CONFIG [--section.field VALUE ...]`: validate, check, lay out the ranks, train.

The config package (and through it the model and torch) is imported where a function needs it:
every ``megazero`` command registers this one's parser, and the data commands would otherwise pay
torch's import, about 2 s, on every call."""

from __future__ import annotations

import contextlib
import time

from megazero.errors import UserError, said_in_one_line

REPORTER_WAIT_S = 600.0  # the longest a rank whose checks failed waits for rank 0 to say so (and end it)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", usage="megazero train [CONFIG] [--section.field VALUE ...] [--check] [--help-config]",
        help="Train a GPT model from a YAML config with dotted overrides",
        description="Train a GPT model. CONFIG is a YAML file; any field can be overridden on the "
                    "command line as --section.field VALUE (for example --parallel.tp 2). "
                    "Run under torchrun (scripts/pretrain_gpt.sh) for more than one rank.")
    parser.add_argument("--help-config", action="store_true", help="List every config field with its default and meaning")
    parser.add_argument("--check", action="store_true",
                        help="Validate the config, data, tokenizer and directories for this launch and exit "
                             "(set WORLD_SIZE and LOCAL_WORLD_SIZE to check a multi-rank layout)")
    parser.set_defaults(func=run, accepts_overrides=True)


def run(args) -> int:
    started = time.monotonic()  # train.max_wall_seconds counts from here, through the checks and start-up
    if args.help_config:
        from megazero.config import field_docs

        for name, default, help_text in field_docs():
            print(f"{name:36s} {default!r:>14}  {help_text}")
        return 0
    from parallel.launch import LaunchError, rank_0_checks, read_launch_env, tell_checks

    with said_in_one_line(LaunchError):
        launch = read_launch_env()
    try:
        cfg, facts = checked_config(args, launch)
    except UserError as exc:
        if args.check:
            raise
        with contextlib.suppress(LaunchError):  # this error is the one to say
            tell_checks(launch.rank, passed=False)
        with said_in_one_line(LaunchError):
            if reports_errors(launch) or rank_0_checks(launch.rank):
                raise exc from None  # the last: rank 0 passed what this rank failed, and will not say it
        return _left_to_rank_0(exc)  # it finds the same, after checks this rank skips (the data scan)
    if not args.check:
        with said_in_one_line(LaunchError):
            tell_checks(launch.rank, passed=True)
            rank_0_passed = rank_0_checks(launch.rank)
        if rank_0_passed is False:  # rank 0 says why, for all
            return _left_to_rank_0(UserError("rank 0's start-up checks failed; its error says why"))
    if launch.rank == 0:
        from megazero.planner.fit import estimate_line

        print(estimate_line(cfg), flush=True)
    if args.check:
        from megazero.config.validate import config_notes

        for note in config_notes(cfg):  # what the run would say at its start
            print(f"megazero: note: {note}", flush=True)
        p = cfg.parallel
        largest = "" if facts.largest_token_id is None else f", largest token id {facts.largest_token_id}"
        tokenizer = "" if facts.tokenizer_vocab is None else f", tokenizer {facts.tokenizer_vocab} tokens"
        print(f"config ok for {launch.world_size} rank(s): tp{p.tp} pp{p.pp} dp{p.dp}; data: "
              f"{len(facts.prefixes)} dataset(s){largest}, model.vocab_size {cfg.model.vocab_size}{tokenizer}")
        return 0
    from megazero.startup import start_run

    try:
        return start_run(cfg, launch, started)
    except UserError as exc:
        if launch.rank == 0 or not exc.agreed:
            raise
        return _left_to_rank_0(exc)  # every rank raised it alike (``UserError.agreed``): rank 0 says it for all


def _left_to_rank_0(error: UserError) -> int:
    """The exit of a rank whose error rank 0 says for all (the same lines from every rank would only
    bury it). Under torchrun the rank waits for that: its exit made torchrun stop rank 0 a tenth of a
    second later, before rank 0 had said anything, and rank 0's own exit ends this wait. A rank still
    here after ``REPORTER_WAIT_S`` says the error itself."""
    from parallel.launch import started_by_torchrun

    if not started_by_torchrun():
        return 2
    time.sleep(REPORTER_WAIT_S)
    raise error


def checked_config(args, launch):
    """The resolved config and the facts the checks learned, or a ``UserError`` listing every problem
    with the config, device, data, tokenizer and directories, before any process group exists."""
    from megazero.config import load_config, resolve_config
    from megazero.preflight import check_run
    from megazero.run_lock import job_identity

    config_path, overrides = split_config_path(args.overrides)
    cfg = resolve_config(load_config(config_path, overrides), launch.world_size, launch.local_world_size)
    reports = args.check or reports_errors(launch)
    return cfg, check_run(cfg, scan_data=args.check or launch.rank == 0, checkpoint_files=reports, locks=reports,
                          own_job=None if args.check or launch.rank == 0 else job_identity(),
                          ranks_per_node=launch.local_world_size)


def reports_errors(launch) -> bool:
    """Rank 0 reports, and on a multi-node launch the first rank of each node too (a node may lack a
    file the others have)."""
    return launch.rank == 0 or (launch.num_nodes > 1 and launch.local_rank == 0)


def launch_facts(argv: list[str]) -> list[str]:
    """What ``scripts/pretrain_gpt.sh`` decides before it starts torchrun, one value a line: the GPUs
    visible, the device the config trains on, what the launch does (``train``, or ``check`` for
    ``--check``), where it saves checkpoints and the tokenizer it reads (the demo samples from those
    after training). ``argv`` is what the script hands to every rank's ``megazero train``, parsed
    here as train parses it: train's own flags taken for overrides failed the load, so a CPU config
    given ``--check`` was laid out on the GPUs. Read once, at the launch: the demo's sample once read
    the config again after training, so a file edited during the run sent it to another run's
    checkpoints. A config that does not load gives device auto and no paths (train itself says what
    is wrong with it)."""
    import argparse
    import os

    import torch

    from megazero.config import load_config

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())  # train's own parser, without importing the command line back
    args, extra = parser.parse_known_args(["train", *argv])
    action = "check" if args.check else "train"
    gpus = str(torch.cuda.device_count())
    try:
        cfg = load_config(*split_config_path(extra))
    except UserError:
        return [gpus, "auto", action, "", ""]
    checkpoints = cfg.checkpoint.save_dir or os.path.join(cfg.logging.run_dir, "checkpoints")
    return [gpus, cfg.train.device, action, checkpoints, cfg.data.tokenizer or ""]


def split_config_path(extra: list[str]) -> tuple[str | None, list[str]]:
    """The optional leading CONFIG path, then the dotted overrides."""
    if extra and not extra[0].startswith("--"):
        return extra[0], extra[1:]
    return None, extra
