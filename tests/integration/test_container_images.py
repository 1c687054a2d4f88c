"""Image files on a shared filesystem, against the sandbox's real dockerd: a `.tar` is loaded
once per node and skipped when present; a missing or corrupt file fails with a clear error.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ray_slurm_provider.agent.container import NodeContainer
from ray_slurm_provider.config import ContainerConfig
from ray_slurm_provider.sandbox import image

pytestmark = [pytest.mark.integration]


def node_container(tmp_path: Path, img: str, tag: str, logs: list[str]) -> NodeContainer:
    cfg = ContainerConfig(runtime="docker", image=img, image_tag=tag)
    return NodeContainer(cfg, cluster_name="img", job_id="1", temp_dir=str(tmp_path / "t"),
                         cluster_dir=str(tmp_path), env={}, drain_timeout_s=5, head=False,
                         env_names=[], log=logs.append)


@pytest.fixture()
def docker_ok(sandbox: object) -> None:
    if not os.environ.get("DOCKER_HOST"):
        pytest.fail("the sandbox runs no dockerd: start it with `ray-slurm sandbox up --docker`")


def test_tar_loaded_once_then_skipped(docker_ok: None, tmp_path: Path) -> None:
    tag = "rsp-tar-test:1"
    image.build(tag)
    tar = tmp_path / "img.tar"
    subprocess.run(["docker", "save", "-o", str(tar), tag], check=True, timeout=120)
    subprocess.run(["docker", "rmi", tag], check=True, timeout=60, capture_output=True)
    logs: list[str] = []
    try:
        node_container(tmp_path, str(tar), tag, logs).prepare()
        assert any("docker load" in m for m in logs)
        assert subprocess.run(["docker", "image", "inspect", tag], capture_output=True,
                              timeout=60).returncode == 0
        logs.clear()
        node_container(tmp_path, str(tar), tag, logs).prepare()
        assert logs == [f"image {tag} already on this node; not loading"]
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=60)


def test_missing_and_corrupt_images_fail_clearly(docker_ok: None, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="does not exist"):
        node_container(tmp_path, str(tmp_path / "nope.tar"), "x:1", []).prepare()
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"this is not a tar")
    with pytest.raises(RuntimeError, match=r"docker load failed for .*bad\.tar\.gz"):
        node_container(tmp_path, str(bad), "rsp-bad:1", []).prepare()
