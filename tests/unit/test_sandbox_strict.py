"""`sandbox up --strict` (issue 29): the slurm.conf of a strict controller, refused on a
release without rate limiting, kept in sandbox.json, and shown by `status`."""

from __future__ import annotations

import pytest

from ray_slurm_provider.sandbox import strict
from ray_slurm_provider.sandbox.config import SandboxSpec, render_slurm_conf
from ray_slurm_provider.sandbox.layout import Layout

ROOT = "/tmp/rsp-unit"


def conf(spec: SandboxSpec) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in render_slurm_conf(Layout(ROOT), spec).splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_strict_sets_a_small_rate_limit_bucket_short_job_age_and_private_jobs() -> None:
    c = conf(SandboxSpec(slurm="25.11", users=1, strict=True))
    assert c["SlurmctldParameters"] == [
        "rl_enable,rl_bucket_size=10,rl_refill_rate=1,rl_refill_period=1"]
    assert c["MinJobAge"] == ["30"]
    assert c["PrivateData"] == ["jobs"]
    # Slurm's default bucket is 30 tokens and 2 per second: ours must be smaller, or tests
    # never see throttling.
    assert strict.BUCKET_SIZE < 30


def test_plain_sandbox_has_none_of_it() -> None:
    c = conf(SandboxSpec(slurm="25.11"))
    assert "SlurmctldParameters" not in c
    assert "PrivateData" not in c
    assert c["MinJobAge"] == ["600"]


@pytest.mark.parametrize("release", ["22.05", "24.11"])
def test_strict_needs_a_release_with_rate_limiting(release: str) -> None:
    with pytest.raises(ValueError, match=r"--strict needs a Slurm with RPC rate limiting.*"
                       r"--slurm 25\.11 or 26\.05"):
        SandboxSpec(slurm=release, strict=True)
    assert SandboxSpec(slurm="26.05", strict=True).strict


def test_strict_round_trips_and_old_specs_are_not_strict() -> None:
    spec = SandboxSpec(slurm="25.11", users=1, strict=True)
    assert SandboxSpec.from_json(spec.to_json()) == spec
    assert not SandboxSpec.from_json(SandboxSpec().to_json().replace('"strict": false,', ""))\
        .strict


def test_status_picks_the_strict_settings_out_of_show_config() -> None:
    # Recorded from `scontrol show config` on the 25.11 strict sandbox.
    shown = ("MinJobAge               = 30 sec\n"
             "MaxJobCount             = 10000\n"
             "PrivateData             = jobs\n"
             "SlurmctldParameters     = rl_enable,rl_bucket_size=10,rl_refill_rate=1,"
             "rl_refill_period=1\n")
    assert strict.config_lines(shown) == [
        "MinJobAge = 30 sec", "PrivateData = jobs",
        "SlurmctldParameters = rl_enable,rl_bucket_size=10,rl_refill_rate=1,rl_refill_period=1"]


def test_cgroups_confine_cores_and_ram_on_the_hosts_release_only() -> None:
    from ray_slurm_provider.sandbox.config import render_cgroup_conf

    assert conf(SandboxSpec(cgroups=True))["TaskPlugin"] == ["task/cgroup,task/affinity"]
    assert conf(SandboxSpec())["TaskPlugin"] == ["task/none"]
    text = render_cgroup_conf(True)
    assert "CgroupPlugin=cgroup/v1" in text and "ConstrainCores=yes" in text
    assert "ConstrainRAMSpace=yes" in text
    assert "CgroupPlugin=disabled" in render_cgroup_conf()
    with pytest.raises(ValueError, match=r"--cgroups runs only with the host's Slurm 22\.05"):
        SandboxSpec(slurm="25.11", cgroups=True)
    spec = SandboxSpec(cgroups=True)
    assert SandboxSpec.from_json(spec.to_json()) == spec
