"""The `ray-slurm` command line (cli/main.py): options may sit between positionals."""

from __future__ import annotations

import pytest

from ray_slurm_provider.cli.main import parse


def test_an_option_between_the_positionals_is_taken_as_typed() -> None:
    """`ray-slurm logs CFG --run ID head` said "unrecognized arguments: head": argparse ends
    the positionals at the first option when the last one is optional."""
    for argv in (["logs", "c.yaml", "--run", "r1", "head"],
                 ["logs", "c.yaml", "head", "--run", "r1"],
                 ["logs", "--run", "r1", "c.yaml", "head"]):
        args = parse(argv)
        assert (args.command, args.config, args.job, args.run) == ("logs", "c.yaml", "head",
                                                                    "r1"), argv


def test_a_stray_argument_is_still_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse(["logs", "c.yaml", "head", "extra"])
    assert e.value.code == 2
    assert "unrecognized arguments: extra" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a command with subcommands of its own
        parse(["sandbox", "status", "extra"])
