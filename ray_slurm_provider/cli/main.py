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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args))
    except BrokenPipeError:  # `ray-slurm ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
