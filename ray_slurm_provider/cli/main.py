"""The ``ray-slurm`` command.

Each command group lives in its own module with a ``register(subparsers)`` function that adds
its subcommands and sets ``func`` (``args -> exit code``) on each; add a module to
`COMMAND_MODULES` to add a group.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ray_slurm_provider import __version__

#: Modules whose ``register(subparsers)`` adds commands, in help order.
COMMAND_MODULES: tuple[str, ...] = (
    "ray_slurm_provider.cli.run",
    "ray_slurm_provider.cli.sbatch",
    "ray_slurm_provider.cli.env",
    "ray_slurm_provider.cli.validate",
    "ray_slurm_provider.cli.status",
    "ray_slurm_provider.cli.logs",
    "ray_slurm_provider.cli.report",
    "ray_slurm_provider.cli.doctor",
    "ray_slurm_provider.cli.docs",
    "ray_slurm_provider.cli.schema",
    "ray_slurm_provider.sandbox.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray-slurm",
        description="Ray clusters as Slurm jobs: helper commands beside `ray up`/`ray down`.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line. Options may sit between a command's positionals
    (`logs CFG --run ID head`): argparse alone ends the positionals at the first option when
    the last one is optional, so such a command is parsed again, intermixed."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parser.parse_known_args(argv)
    command = getattr(args, "command", None)
    if not extra or command not in argv:
        return parser.parse_args(argv)  # prints the usual error for what is left over
    sub = _subparser(parser, command)
    if sub is None or any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
        return parser.parse_args(argv)  # intermixed parsing cannot have subcommands
    at = argv.index(command)
    again = sub.parse_intermixed_args(argv[at + 1:])
    return argparse.Namespace(**{**vars(args), **vars(again)})


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser | None = action.choices.get(command)
            return found
    return None


def main(argv: list[str] | None = None) -> int:
    from ray_slurm_provider.cli import remote

    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    func = getattr(args, "func", None)
    if func is None:
        build_parser().print_help()
        return 2
    try:
        forwarded = remote.forward(argv, args)  # a laptop's: run on the login node
        if forwarded is not None:
            return forwarded
        return int(func(args))
    except BrokenPipeError:  # `ray-slurm ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
