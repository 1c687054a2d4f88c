"""Issue 27, bad input: an Enroot/Pyxis image file that is missing or not a squashfs, and a
site whose srun does not load pyxis, each give one line at `ray up`/`validate` time; registry
references in enroot's form pass untouched."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.agent.container import NodeContainer
from ray_slurm_provider.provider import validation
from ray_slurm_provider.runtimes import images
from tests.unit.test_validation import BASE, info, seen

KEY = "available_node_types.a.node_config.container"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm-22.05"
#: `srun --help` recorded on the sandbox with pyxis 0.24.0 loaded and without.
SRUN_HELP = FIXTURES.joinpath("srun_help_pyxis.txt").read_text()
PLAIN_HELP = FIXTURES.joinpath("srun_help.txt").read_text()


def cfg(runtime: str, image: str, **provider: Any) -> dict[str, Any]:
    c = copy.deepcopy(BASE)
    c["provider"].update(provider)
    c["available_node_types"]["a"]["node_config"]["container"] = {"runtime": runtime,
                                                                   "image": image}
    return c


def sqsh(tmp_path: Path, data: bytes = b"hsqs" + bytes(60)) -> str:
    p = tmp_path / "ray.sqsh"
    p.write_bytes(data)
    return str(p)


def helped(text: str) -> Any:
    return lambda: text


def check(c: dict[str, Any]) -> list[validation.Finding]:
    """The pipeline as `ray up` runs it on a login node whose srun loads pyxis."""
    return validation.run(c, info=info(), env={}, pyxis_help=helped(SRUN_HELP))[1]


@pytest.mark.parametrize("runtime", ["enroot", "pyxis"])
def test_a_missing_sqsh_is_one_line(runtime: str, tmp_path: Path) -> None:
    found = check(cfg(runtime, str(tmp_path / "nope.sqsh")))
    assert seen(found) == [("error", f"{KEY}.image", "image")]
    assert "nope.sqsh does not exist" in found[0].message and "\n" not in str(found[0])
    assert "enroot import -o" in found[0].message


@pytest.mark.parametrize("runtime", ["enroot", "pyxis"])
def test_a_file_that_is_not_squashfs_is_one_line(runtime: str, tmp_path: Path) -> None:
    found = check(cfg(runtime, sqsh(tmp_path, b"PK\x03\x04 a zip file")))
    assert seen(found) == [("error", f"{KEY}.image", "image")]
    assert "is not a squashfs file" in found[0].message


@pytest.mark.parametrize("image", ["nvcr.io#nvidia/pytorch:25.01-py3",
                                   "docker://nvcr.io#nvidia/pytorch:25.01-py3",
                                   "docker://ubuntu:24.04", "dockerd://rsp-bind:latest",
                                   "ubuntu:24.04"])
def test_pyxis_leaves_registry_references_to_enroot(image: str) -> None:
    assert check(cfg("pyxis", image)) == []
    assert images.squashfs_path("pyxis", image) is None


def test_enroot_leaves_its_uris_alone_and_takes_the_rest_for_a_file(tmp_path: Path) -> None:
    assert check(cfg("enroot", "nvcr.io#nvidia/pytorch:25.01-py3")) == []
    assert check(cfg("enroot", "docker://ubuntu:24.04")) == []
    assert check(cfg("enroot", sqsh(tmp_path))) == []


def test_pyxis_would_pull_a_relative_sqsh_from_a_registry() -> None:
    found = check(cfg("pyxis", "images/ray.sqsh"))
    assert seen(found) == [("error", f"{KEY}.image", "image")]
    assert "./images/ray.sqsh" in found[0].message


def test_offline_the_files_are_not_asked_for(tmp_path: Path) -> None:
    """`validate --offline` (and the example configs' test) name files of other sites."""
    assert validation.validate(cfg("enroot", str(tmp_path / "nope.sqsh"))) == []


def test_a_good_sqsh_and_other_runtimes_pass(tmp_path: Path) -> None:
    assert check(cfg("pyxis", sqsh(tmp_path))) == []
    assert check(cfg("docker", "/not/there.sqsh")) == []


def test_over_rest_the_file_is_left_to_the_job(tmp_path: Path) -> None:
    c = cfg("enroot", str(tmp_path / "nope.sqsh"), slurm_api="rest",
            rest={"url": "http://slurm:6820", "jwt_file": str(tmp_path / "jwt")})
    assert [f for f in check(c) if f.rule == "image"] == []


def test_pyxis_not_loaded_is_one_line_when_slurm_is_asked(tmp_path: Path) -> None:
    c = cfg("pyxis", sqsh(tmp_path))
    _, found = validation.run(c, info=info(), env={}, pyxis_help=helped(PLAIN_HELP))
    assert seen(found) == [("error", f"{KEY}.runtime", "pyxis")]
    assert "lists no --container-image" in found[0].message and "plugstack.conf" in \
        found[0].message
    _, found = validation.run(c, info=info(), env={}, pyxis_help=helped(SRUN_HELP))
    assert found == []


def test_pyxis_is_not_asked_offline_over_rest_or_without_pyxis(tmp_path: Path) -> None:
    def boom() -> str:
        raise AssertionError("srun --help should not run")
    image = sqsh(tmp_path)
    assert validation.run(cfg("pyxis", image), env={}, pyxis_help=boom)[1] == []  # offline
    assert validation.run(cfg("enroot", image), info=info(), env={}, pyxis_help=boom)[1] == []
    rest = cfg("pyxis", image, slurm_api="rest",
               rest={"url": "http://slurm:6820", "jwt_file": str(tmp_path / "jwt")})
    assert [f for f in validation.run(rest, info=info(), env={}, pyxis_help=boom)[1]
            if f.rule == "pyxis"] == []


def test_srun_that_fails_is_a_warning_in_its_words(tmp_path: Path) -> None:
    """Measured: srun without a slurm.conf fails before it prints its help."""
    def fails() -> str:
        raise proc.CommandFailed(["srun", "--help"], "exit 1", 1, "",
                                 FIXTURES.joinpath("srun_help_no_conf.stderr.txt").read_text())
    _, found = validation.run(cfg("pyxis", sqsh(tmp_path)), info=info(), env={},
                              pyxis_help=fails)
    assert seen(found) == [("warning", f"{KEY}.runtime", "pyxis")]
    assert "srun: error: resolve_ctls_from_dns_srv" in found[0].message


def test_the_job_log_says_the_same_where_ray_up_could_not_check(tmp_path: Path) -> None:
    bad = sqsh(tmp_path, b"not squashfs")
    c = NodeContainer.from_spec({"runtime": "pyxis", "image": bad}, cluster_name="c1",
                                job_id="7", temp_dir=str(tmp_path / "t"),
                                cluster_dir=str(tmp_path), env={}, drain_timeout_s=5,
                                head=False, env_names=[], log=print)
    assert c is not None
    with pytest.raises(RuntimeError, match="is not a squashfs file"):
        c.prepare()
