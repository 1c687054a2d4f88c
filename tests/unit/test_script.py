"""Golden files and validation errors for the batch-script renderer.

Regenerate the golden files with `UPDATE_GOLDEN=1 pytest tests/unit/test_script.py`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider.slurm.script import JobSpec, ScriptError, render, user_options, validate

GOLDEN = Path(__file__).resolve().parent.parent / "golden"

MINIMAL_CPU = JobSpec(job_name="ray-worker", command=["ray", "start", "--block"])

FULL_GPU = JobSpec(
    job_name="ray-head.cluster-a",
    command=["ray", "start", "--head", "--block", "--num-gpus=8", "--port=6379"],
    partition="gpu,gpu-long",
    account="proj_ml",
    qos="high",
    time="2-12:30:00",
    nodes=2,
    ntasks=2,
    cpus_per_task=32,
    mem="0",
    gres="gpu:a100:8",
    gpus_per_node="a100:8",
    constraint="[rack1|rack2]&ib",
    exclusive=True,
    reservation="ml-week",
    nodelist="gpu[01-02]",
    exclude="gpu[07,09]",
    signal="B:TERM@120",
    output="/scratch/ray/logs/%x-%j.out",
    error="/scratch/ray/logs/%x-%j.err",
    open_mode="append",
    requeue=False,
    sbatch_options={"mail-user": "ops@example.org", "mail-type": "END,FAIL", "no-kill": None},
    extra_directives=["#SBATCH --comment=ray-cluster:a", "--wckey=ml"],
    environment={"RAY_DEDUP_LOGS": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
    setup=["module load cuda/12.2", "source /opt/venvs/ray/bin/activate"],
    shebang="#!/bin/bash -l",
)

ENV_METACHARS = JobSpec(
    job_name="env-metachars",
    command=["python3", "-c", "import os; print(os.environ['A'])", "$HOME", "a b", "it's"],
    environment={
        "A": "$(touch pwned) `touch pwned` ; touch pwned | x && y || z > f < g & bg",
        "B": 'it\'s "quoted" \\ back\\slash $HOME ${X:-y} ~ * ? [a] {a,b} !! #not-comment',
        "C": "line1\nline2\r\n\ttab \x01\x7f end",
        "D": "",
        "E": "#SBATCH --partition=evil",
        "F": "ünïcødé ✓",
    },
)

CASES = {"minimal_cpu": MINIMAL_CPU, "full_gpu": FULL_GPU, "env_metachars": ENV_METACHARS}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    path = GOLDEN / f"{name}.sbatch"
    text = render(CASES[name])
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="\n")
    assert path.read_text(encoding="utf-8") == text


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_is_valid_bash(name: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=render(CASES[name]).encode(), capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_render_is_deterministic() -> None:
    reordered = JobSpec(
        **{
            **FULL_GPU.__dict__,
            "sbatch_options": dict(reversed(list(FULL_GPU.sbatch_options.items()))),
            "environment": dict(reversed(list(FULL_GPU.environment.items()))),
        }
    )
    assert render(reordered) == render(FULL_GPU) == render(FULL_GPU)


def test_layout() -> None:
    lines = render(FULL_GPU).splitlines()
    assert lines[0] == "#!/bin/bash -l"
    first_plain = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    assert all(line.startswith("#SBATCH --") for line in lines[1:first_plain])
    assert lines[first_plain] == "set -eo pipefail"
    assert lines[-1].startswith("exec ray start --head")
    assert "#SBATCH --no-requeue" in lines and "#SBATCH --exclusive" in lines
    assert "#SBATCH --no-kill" in lines and "#SBATCH --comment=ray-cluster:a" in lines


def test_flags_and_defaults() -> None:
    assert "--requeue\n" in render(JobSpec("j", ["x"], requeue=True))
    text = render(JobSpec("j", ["x"]))
    assert "requeue" not in text and "exclusive" not in text and "cpus-per-task" not in text
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n" in text


@pytest.mark.parametrize(
    "value", ["5", "30:00", "1:00:00", "2-0", "2-12:30", "2-12:30:00", "UNLIMITED", "infinite"]
)
def test_time_formats(value: str) -> None:
    assert f"#SBATCH --time={value}\n" in render(JobSpec("j", ["x"], time=value))


@pytest.mark.parametrize("value", ["4000", "4G", "0", "512m", "2T"])
def test_mem_formats(value: str) -> None:
    validate(JobSpec("j", ["x"], mem=value))


@pytest.mark.parametrize(
    "shebang", ["#!/bin/bash", "#!/bin/bash -l", "#!/usr/bin/env bash", "#!/usr/local/bin/bash -x"]
)
def test_shebangs(shebang: str) -> None:
    assert render(JobSpec("j", ["x"], shebang=shebang)).startswith(shebang + "\n")


def test_extra_directive_forms() -> None:
    text = render(JobSpec("j", ["x"], extra_directives=["#SBATCH   --wckey=a", "--contiguous"]))
    assert "#SBATCH --wckey=a\n#SBATCH --contiguous\n" in text


def test_user_options_are_what_sbatch_reads_from_their_lines() -> None:
    """The (option, value) pairs back ends without sbatch translate: sbatch's getopt_long
    splits each `--key=value` argument at its first '='; a flag has no value."""
    spec = JobSpec("j", ["x"], sbatch_options={"no-kill": None, "mail-type": "END"},
                   extra_directives=["#SBATCH   --wckey=a=b", "--contiguous"])
    pairs = [("mail-type", "END"), ("no-kill", None), ("wckey", "a=b"), ("contiguous", None)]
    assert user_options(spec) == pairs
    directives = [ln for ln in render(spec).splitlines() if ln.startswith("#SBATCH")]
    assert directives[-4:] == ["#SBATCH --mail-type=END", "#SBATCH --no-kill",
                               "#SBATCH --wckey=a=b", "#SBATCH --contiguous"]
    with pytest.raises(ScriptError, match=r"extra_directives\[0\]"):
        user_options(JobSpec("j", ["x"], extra_directives=["--partition=x"]))


def test_exact_option_that_prefixes_a_reserved_one_is_allowed() -> None:
    # --gpus is a real option and an exact match wins over the prefix of --gpus-per-node.
    assert "#SBATCH --gpus=2\n" in render(JobSpec("j", ["x"], sbatch_options={"gpus": "2"}))


def _spec(**changes: Any) -> JobSpec:
    base: dict[str, Any] = {"job_name": "j", "command": ["x"]}
    base.update(changes)
    return JobSpec(**base)


BAD_FIELDS: list[tuple[str, Any]] = [
    ("job_name", "a b"),
    ("job_name", ""),
    ("job_name", None),
    ("job_name", "x\ny"),
    ("job_name", "ray-hetjob"),
    ("job_name", "x#y"),
    ("job_name", "naïve"),
    ("partition", "p q"),
    ("partition", "a,,b"),
    ("partition", "p'"),
    ("account", "acct;rm"),
    ("qos", 'q"'),
    ("time", "1h"),
    ("time", "1:2:3:4"),
    ("time", "1-"),
    ("time", "10\n"),
    ("time", "١٢"),  # non-ASCII digits
    ("nodes", 0),
    ("nodes", True),
    ("nodes", "2"),
    ("ntasks", -1),
    ("cpus_per_task", 0),
    ("cpus_per_task", 1.5),
    ("mem", "4GB"),
    ("mem", "-1"),
    ("gres", "gpu 2"),
    ("gpus_per_node", "8#x"),
    ("constraint", "a b"),
    ("exclusive", None),
    ("exclusive", "yes"),
    ("reservation", "r\tx"),
    ("nodelist", "n1 n2"),
    ("exclude", "n1;n2"),
    ("signal", "TERM@"),
    ("signal", "X:TERM"),
    ("output", "/tmp/a b.out"),
    ("output", "/tmp/#x"),
    ("output", "/tmp/a\\b"),
    ("output", "/tmp/packjob.out"),
    ("error", "'x'"),
    ("error", ""),
    ("open_mode", "write"),
    ("requeue", "no"),
    ("shebang", "#!/bin/sh"),
    ("shebang", "#!/bin/bash\n#SBATCH --qos=x"),
    ("shebang", "/bin/bash"),
    ("shebang", "#!bash"),
    ("shebang", "#!/usr/bin/env python3"),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_bad_field_is_named(field: str, value: Any) -> None:
    with pytest.raises(ScriptError) as info:
        render(_spec(**{field: value}))
    message = str(info.value)
    assert message.startswith(f"JobSpec.{field}:"), message
    assert repr(value) in message
    assert "allowed:" in message
    with pytest.raises(ValueError):  # ScriptError is a ValueError
        validate(_spec(**{field: value}))


BAD_COLLECTIONS: list[tuple[dict[str, Any], str]] = [
    ({"command": []}, "JobSpec.command:"),
    ({"command": "ray start"}, "JobSpec.command:"),
    ({"command": ["-x"]}, "JobSpec.command:"),
    ({"command": [""]}, "JobSpec.command:"),
    ({"command": ["x", "a\x00b"]}, "JobSpec.command[1]:"),
    ({"command": ["x", 3]}, "JobSpec.command[1]:"),
    ({"command": ["x", "\ud800"]}, "JobSpec.command[1]:"),
    ({"environment": {"1A": "x"}}, "JobSpec.environment:"),
    ({"environment": {"A-B": "x"}}, "JobSpec.environment:"),
    ({"environment": {"A=B": "x"}}, "JobSpec.environment:"),
    ({"environment": {"UID": "x"}}, "JobSpec.environment:"),
    ({"environment": {"SHLVL": "x"}}, "JobSpec.environment:"),
    ({"environment": {"_": "x"}}, "JobSpec.environment:"),
    ({"environment": {"A": "x\x00"}}, "JobSpec.environment['A']:"),
    ({"environment": {"A": 1}}, "JobSpec.environment['A']:"),
    ({"environment": ["A=1"]}, "JobSpec.environment:"),
    ({"setup": "module load x"}, "JobSpec.setup:"),
    ({"setup": ["ok", "dos\r"]}, "JobSpec.setup[1]:"),
    ({"sbatch_options": {"Mail-Type": "END"}}, "JobSpec.sbatch_options:"),
    ({"sbatch_options": {"--mail-type": "END"}}, "JobSpec.sbatch_options:"),
    ({"sbatch_options": {"mail type": "END"}}, "JobSpec.sbatch_options:"),
    ({"sbatch_options": {"mail-type": "END FAIL"}}, "JobSpec.sbatch_options['mail-type']:"),
    ({"sbatch_options": {"comment": "a\nb"}}, "JobSpec.sbatch_options['comment']:"),
    ({"sbatch_options": {"comment": "hetjob"}}, "JobSpec.sbatch_options['comment']:"),
    ({"sbatch_options": {"comment": ""}}, "JobSpec.sbatch_options['comment']:"),
    ({"sbatch_options": {"hetjob": None}}, "JobSpec.sbatch_options:"),
    ({"sbatch_options": ["x"]}, "JobSpec.sbatch_options:"),
    ({"extra_directives": ["--comment=a b"]}, "JobSpec.extra_directives[0]:"),
    ({"extra_directives": ["--comment=x", "--x\n#SBATCH --y"]}, "JobSpec.extra_directives[1]:"),
    ({"extra_directives": ["#SBATCH-x"]}, "JobSpec.extra_directives[0]:"),
    ({"extra_directives": ["#SBATCH\t--wckey=x"]}, "JobSpec.extra_directives[0]:"),
    ({"extra_directives": ["-p gpu"]}, "JobSpec.extra_directives[0]:"),
    ({"extra_directives": ["echo hi"]}, "JobSpec.extra_directives[0]:"),
    ({"extra_directives": "--wckey=x"}, "JobSpec.extra_directives:"),
]


@pytest.mark.parametrize(("changes", "prefix"), BAD_COLLECTIONS)
def test_bad_collection_is_named(changes: dict[str, Any], prefix: str) -> None:
    with pytest.raises(ScriptError) as info:
        validate(_spec(**changes))
    assert str(info.value).startswith(prefix), str(info.value)


@pytest.mark.parametrize(
    ("key", "owner"),
    [
        ("partition", "partition"),
        ("part", "partition"),  # getopt_long would take the abbreviation
        ("j", "job_name"),
        ("time", "time"),
        ("mem", "mem"),
        ("gres", "gres"),
        ("gpus-per", "gpus_per_node"),
        ("cpus-per-task", "cpus_per_task"),
        ("no-requeue", "requeue"),
        ("requeue", "requeue"),
        ("exclusive", "exclusive"),
        ("output", "output"),
        ("open-mode", "open_mode"),
        ("signal", "signal"),
        ("nodelist", "nodelist"),
    ],
)
def test_reserved_options_name_the_typed_field(key: str, owner: str) -> None:
    for changes in ({"sbatch_options": {key: "1"}}, {"extra_directives": [f"--{key}=1"]}):
        with pytest.raises(ScriptError, match=rf"set JobSpec\.{owner} instead"):
            validate(_spec(**changes))


@pytest.mark.parametrize("option", ["array", "wait", "export", "wrap", "parsable", "test-only",
                                    "arr", "expo"])
def test_options_the_provider_owns_are_refused(option: str) -> None:
    """Issue 14.11: `array` would nest inside the provider's own arrays, `wait` would block
    the autoscaler's submit, `export` changes what environment the agent starts with."""
    for spec in (_spec(sbatch_options={option: "1"}), _spec(extra_directives=[f"--{option}=1"])):
        with pytest.raises(ScriptError, match="the provider"):
            render(spec)
