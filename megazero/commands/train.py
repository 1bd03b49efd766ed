"""`megazero train CONFIG [--section.field VALUE ...]`: validate, lay out the ranks, train."""

from __future__ import annotations

from megazero.config import field_docs, load_config, resolve_config


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", usage="megazero train [CONFIG] [--section.field VALUE ...] [--check] [--help-config]",
        help="Train a GPT model from a YAML config with dotted overrides",
        description="Train a GPT model. CONFIG is a YAML file; any field can be overridden on the "
                    "command line as --section.field VALUE (for example --parallel.tp 2). "
                    "Run under torchrun (scripts/pretrain_gpt.sh) for more than one rank.")
    parser.add_argument("--help-config", action="store_true", help="List every config field with its default and meaning")
    parser.add_argument("--check", action="store_true", help="Validate the config for this launch and exit")
    parser.set_defaults(func=run, accepts_overrides=True)


def run(args) -> int:
    if args.help_config:
        for name, default, help_text in field_docs():
            print(f"{name:36s} {default!r:>14}  {help_text}")
        return 0
    from parallel.launch import read_launch_env

    config_path, overrides = split_config_path(args.overrides)
    launch = read_launch_env()
    cfg = resolve_config(load_config(config_path, overrides), launch.world_size, launch.local_world_size)
    if args.check:
        print(f"config ok for {launch.world_size} rank(s): tp{cfg.parallel.tp} pp{cfg.parallel.pp} dp{cfg.parallel.dp}")
        return 0
    from megazero.launch import start_run

    return start_run(cfg, launch)


def split_config_path(extra: list[str]) -> tuple[str | None, list[str]]:
    """The optional leading CONFIG path, then the dotted overrides."""
    if extra and not extra[0].startswith("--"):
        return extra[0], extra[1:]
    return None, extra
