"""Property tests: no string that reaches a job or a command can run code or add a directive.

test_script_injection.py proves it for the renderer alone. Here every string a cluster YAML
(or Ray) hands the provider goes the whole way: config -> `build_job` -> `render` -> the
script sbatch reads (with the sbatch-faithful parser) and bash runs (with a stub Python that
reports its argv and environment). Also the job comment (an sbatch argv, read back through
squeue), the environment exports of `ray exec` commands, and container image names in the
runtime's argv. The prologue and the YAML's setup commands are trusted shell code (the
user's own), so they stay fixed here.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from ray_slurm_provider.cluster import NodeCommands, NodeType, parse_cluster
from ray_slurm_provider.config import ConfigError, ContainerConfig, parse_node_config
from ray_slurm_provider.jobs import build_job, decode_tags, encode_tags
from ray_slurm_provider.nodespec import NodeSpec
from ray_slurm_provider.provider.validation import check_static
from ray_slurm_provider.runtimes.base import RunContext
from ray_slurm_provider.runtimes.docker import Docker
from ray_slurm_provider.shellcmd import env_exports
from ray_slurm_provider.slurm.parse import DELIM, SQUEUE_FIELDS, parse_squeue
from ray_slurm_provider.slurm.script import JobSpec, ScriptError, render
from tests.unit.test_script_injection import (
    EXTRA_SLOTS,
    HARNESS_SENSITIVE,
    KEY,
    parse_sbatch,
    tricky,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,10}", fullmatch=True)
TYPED = {"partition": "cpu", "account": "proj", "qos": "normal", "time": "1:00:00",
         "constraint": "ib", "reservation": "maint", "nodelist": "n[1-2]", "exclude": "n3",
         "mem": "4G", "gpu_type": "a100"}
STUB = "import json, os, sys; print(json.dumps([sys.argv[1:], dict(os.environ)]))\n"


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    """Inputs of one job: valid values with a few hostile ones mixed in."""
    hostile = draw(st.sets(st.sampled_from([*TYPED, "cluster", "state_dir", *EXTRA_SLOTS]),
                           max_size=2))
    nc: dict[str, Any] = {k: draw(tricky) if k in hostile else draw(st.none() | st.just(v))
                          for k, v in TYPED.items()}
    for slot in EXTRA_SLOTS:
        nc[slot] = draw(EXTRA_SLOTS[slot]) if slot in hostile else {} if "opt" in slot else []
    nc["gpus"] = draw(st.none() | st.integers(1, 2))
    nc["environment"] = draw(st.dictionaries(KEY, tricky, max_size=3))
    nc["container"] = {"runtime": "docker", "image": draw(tricky),
                       "mounts": draw(st.lists(tricky, max_size=2))}
    return {
        "cluster": draw(tricky) if "cluster" in hostile else draw(NAME),
        "node_type": draw(tricky),  # Ray's key: reaches the NodeSpec and the tags only
        "state_dir": "/tmp/rsp-state/" + (draw(tricky) if "state_dir" in hostile else "s"),
        "temp_dir_root": draw(tricky), "iface": draw(st.none() | tricky),
        "env": draw(st.dictionaries(KEY, tricky, max_size=3)),
        "start": draw(st.lists(tricky, max_size=2)),
        "labels": draw(st.dictionaries(tricky, tricky, max_size=2)),
        "custom": draw(st.dictionaries(tricky, st.integers(0, 4), max_size=2)),
        "node_config": nc,
    }


def build(c: dict[str, Any], python: str) -> JobSpec:
    from ray_slurm_provider.config import ProviderConfig

    pcfg = ProviderConfig(state_dir=c["state_dir"], temp_dir_root=c["temp_dir_root"],
                          node_ip_interface=c["iface"], environment=c["env"])
    nt = NodeType(c["node_type"], parse_node_config(c["node_config"], "t"),
                  resources={"CPU": 1, **c["custom"]}, labels=c["labels"],
                  commands=NodeCommands(["# init $(touch init-ran)"], [], c["start"]))
    return build_job(pcfg, c["cluster"], nt, kind="worker", python=python)


def expected_directives(c: dict[str, Any]) -> list[bytes]:
    """What the job must ask sbatch for, from the inputs alone."""
    nc = c["node_config"]
    state = Path(os.path.expanduser(c["state_dir"]))
    out = [f"--job-name=ray-{c['cluster']}", "--nodes=1", "--ntasks=1", "--cpus-per-task=1",
           f"--output={state / c['cluster'] / 'logs' / '%j.out'}", "--open-mode=append",
           "--no-requeue", "--signal=B:TERM@60"]
    out += [f"--{k}={nc[k]}" for k in ("partition", "account", "qos", "time", "constraint",
                                       "reservation", "nodelist", "exclude", "mem") if nc[k]]
    if nc["gpus"]:
        out.append(f"--gres=gpu:{nc['gpu_type']}:{nc['gpus']}" if nc["gpu_type"]
                   else f"--gres=gpu:{nc['gpus']}")
    out += [f"--{k}" if v is None else f"--{k}={v}" for k, v in nc["sbatch_options"].items()]
    out += [d.removeprefix("#SBATCH").lstrip(" ") for d in nc["extra_directives"]]
    return [a.encode() for a in out]


@pytest.fixture(scope="module")
def stub_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="rsp-inj-") as tmp:
        yield Path(tmp)


def stub_python(root: Path, name: str) -> str:
    """A stand-in for the agent's Python at a path with a hostile directory name."""
    d = Path(tempfile.mkdtemp(dir=root)) / name
    d.mkdir()
    py = d / "python"
    py.write_text(f"#!{sys.executable}\n{STUB}")
    py.chmod(0o700)
    return str(py)


@SETTINGS
@given(c=configs(), dirname=tricky.map(lambda s: "d" + s.replace("/", "|").replace("\0", "")))
def test_job_script_runs_exactly_the_agent(c: dict[str, Any], dirname: str,
                                           stub_dir: Path) -> None:
    try:
        python = stub_python(stub_dir, dirname)
    except (OSError, UnicodeEncodeError):
        assume(False)
    try:
        spec = build(c, python)
        script = render(spec)
    except (ScriptError, ConfigError, ValueError):
        event("refused")
        return
    event("rendered")
    data = script.encode()
    args = parse_sbatch(data)
    assert Counter(args) == Counter(expected_directives(c)), script
    assert all(a.startswith(b"--") for a in args)
    env = {**c["env"], **c["node_config"]["environment"]}
    assume(not any(HARNESS_SENSITIVE.fullmatch(k) for k in env))
    work = Path(tempfile.mkdtemp(dir=stub_dir))
    job = work.parent / f"{work.name}.sbatch"
    job.write_bytes(data)
    job.chmod(0o700)
    res = subprocess.run([str(job)], cwd=work, capture_output=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(work), "LC_ALL": "C.UTF-8"})
    assert res.returncode == 0, (res.stderr, script)
    argv, seen = json.loads(res.stdout)
    assert os.listdir(work) == [], script  # nothing ran: no canary file appeared
    assert argv[:3] == ["-m", "ray_slurm_provider.agent", "--spec"] and len(argv) == 4
    got = NodeSpec.from_json(argv[3])
    assert (got.cluster_name, got.node_type, got.state_dir, got.temp_dir_root,
            got.node_ip_interface, got.start_commands, got.labels) == (
        c["cluster"], c["node_type"], c["state_dir"], c["temp_dir_root"], c["iface"],
        c["start"], c["labels"])
    assert got.container["image"] == c["node_config"]["container"]["image"]
    assert {k: seen.get(k) for k in env} == env
    shutil.rmtree(work)


@SETTINGS
@given(tags=st.dictionaries(tricky, tricky, max_size=4))
def test_job_comment_is_one_argv_word_and_reads_back(tags: dict[str, str]) -> None:
    comment = encode_tags(tags)
    assert "\n" not in comment and "\r" not in comment and DELIM not in comment
    assert comment.isascii() and comment.isprintable()
    assert decode_tags(comment) == tags
    fields = ["UNLIMITED", "12", "ray-c", "RUNNING", "None", "n1", "n1", "UNLIMITED",
              "2026-01-01T00:00:00", "2026-01-01T00:00:01", "cpu", "12", comment]
    assert len(fields) == len(SQUEUE_FIELDS)
    line = DELIM.join(fields)
    (job,) = parse_squeue(line)
    assert decode_tags(job.comment) == tags


@SETTINGS
@given(env=st.dictionaries(KEY, tricky, max_size=4))
def test_exec_environment_reaches_the_command_verbatim(env: dict[str, str],
                                                       stub_dir: Path) -> None:
    assume(not any(HARNESS_SENSITIVE.fullmatch(k) for k in env))
    assume(not any("\0" in v for v in env.values()))
    keys = sorted(env)
    prog = f"import json,os; print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"
    cmd = env_exports(env) + f"{sys.executable} -c {shlex.quote(prog)}"
    work = Path(tempfile.mkdtemp(dir=stub_dir))
    res = subprocess.run(["bash", "-c", cmd], cwd=work, capture_output=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(work)})
    bash_owned = {"_", "SHLVL", "PWD", "OLDPWD", "BASH_ENV", "ENV"}
    assume(not (set(env) & bash_owned))
    if res.returncode != 0:  # a readonly bash variable (UID, ...): refused, nothing ran
        event("refused")
    else:
        assert json.loads(res.stdout) == env
    assert os.listdir(work) == []


def docker_image_position(argv: list[str]) -> str:
    """The word `docker run` takes as the image: the first that is not an option or the value
    of one (docker's own flag parsing)."""
    takes_value = {"--name", "--label", "--stop-timeout", "--shm-size", "--ulimit", "--device",
                   "--user",
                   "--gpus", "-v", "-e"}
    i = argv.index("run") + 1
    while argv[i].startswith("-"):
        i += 2 if argv[i] in takes_value else 1
    return argv[i]


@SETTINGS
@given(image=st.one_of(tricky, st.tuples(st.sampled_from(
    ["nvcr.io/nvidia/pytorch:24.05-py3", "rayproject/ray", "/shared/ray.sif", "-", "--"]),
    tricky).map("".join)), privileged=st.booleans())
def test_container_image_cannot_become_an_option(image: str, privileged: bool) -> None:
    cfg = {"cluster_name": "c", "provider": {"type": "external"}, "head_node_type": "h",
           "available_node_types": {"w": {"resources": {"CPU": 1}, "node_config": {
               "container": {"runtime": "docker", "image": image, "privileged": privileged}}}}}
    try:
        check_static(parse_cluster(cfg))
    except ConfigError as e:
        event("refused")
        assert "container.image" in str(e)
        return
    ctx = RunContext("c", "1", ContainerConfig(runtime="docker", image=image,
                                               privileged=privileged), "/tmp/t", "/tmp/c")
    argv = Docker().run(ctx, ["ray", "start", "--block"], {"RAY_AUTH_MODE": "token"})
    assert docker_image_position(argv) == image
    assert ("--privileged" in argv) == privileged  # opt-in only
    assert not any(a.startswith("--device") for a in argv)
