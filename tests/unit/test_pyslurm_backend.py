"""The pyslurm back end against a fake of pyslurm's API (no pyslurm builds here)."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest

from ray_slurm_provider.config import parse_provider
from ray_slurm_provider.slurm.client import (
    PermanentSlurmError,
    SlurmClient,
    TransientSlurmError,
)
from ray_slurm_provider.slurm.factory import make_client
from ray_slurm_provider.slurm.pyslurm import PyslurmSlurmClient, major_minor
from tests.pyslurm_fake import FakeJob, make_module


@pytest.fixture
def mod(monkeypatch: pytest.MonkeyPatch) -> Any:
    m = make_module()
    monkeypatch.setenv("USER", "root")
    return m


def test_factory_builds_it_without_importing_pyslurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "pyslurm", raising=False)
    client = make_client(parse_provider({"slurm_api": "pyslurm"}))
    assert isinstance(client, PyslurmSlurmClient) and isinstance(client, SlurmClient)
    assert "pyslurm" not in sys.modules


def test_missing_pyslurm_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def fake_import(name: str, *a: Any) -> Any:
        if name == "pyslurm":
            raise ModuleNotFoundError("No module named 'pyslurm'")
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(PermanentSlurmError, match=r"not installed.*works only with Slurm X\.Y"):
        PyslurmSlurmClient().list_jobs("x")


def test_pyslurm_built_for_another_libslurm(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_import(name: str, *a: Any) -> Any:
        raise ImportError("libslurmfull.so: cannot open shared object file")

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(PermanentSlurmError, match="cannot load against this machine's libslurm"):
        PyslurmSlurmClient().cluster_info()


def test_release_mismatch_is_refused() -> None:
    client = PyslurmSlurmClient(module=make_module("25.11.2"))
    with pytest.raises(PermanentSlurmError,
                       match=r"pyslurm 25\.11\.2 is for Slurm 25\.11, but this cluster runs "
                             r"Slurm 22\.05"):
        client.node_addresses()


def test_major_minor() -> None:
    assert major_minor("24.5.1") == "24.05" == major_minor("24.05.3")
    assert major_minor("slurm") == ""


def test_submit_list_cancel(mod: Any) -> None:
    client = PyslurmSlurmClient(module=mod)
    job_id = client.submit("#!/bin/bash\n#SBATCH --partition=gpu\ntrue\n", job_name="ray-c",
                           comment="ray-slurm:{}")
    ((script, kw, opts),) = mod.state["submitted"]
    assert kw == {"environment": "ALL", "name": "ray-c", "comment": "ray-slurm:{}"}
    assert opts == {"partition": "gpu"} and script.startswith("#!/bin/bash")
    mod.state["jobs"][999] = FakeJob(999, "ray-c", user_name="bob", state="RUNNING")
    mod.state["jobs"][998] = FakeJob(998, "ray-c", state="COMPLETED")
    mod.state["jobs"][997] = FakeJob(997, "ray-c", state="RUNNING", batch_host="n2",
                                     allocated_nodes="n2", time_limit=10,
                                     run_time_remaining=300, start_time=1796000905)
    jobs = {j.job_id: j for j in client.list_jobs("ray-c")}
    assert set(jobs) == {job_id, "997"}
    pending, running = jobs[job_id], jobs["997"]
    assert (pending.state, pending.reason, pending.partition, pending.comment) == (
        "PENDING", "", "gpu", "ray-slurm:{}")
    assert pending.time_limit_s is None and pending.node_addr == ""
    assert (running.node_addr, running.time_limit_s, running.time_left_s) == (
        "127.0.0.3", 600, 300)
    client.cancel([job_id, "12345"])  # one unknown: fine
    client.cancel([job_id])  # already cancelled: fine
    assert mod.state["cancelled"] == [int(job_id)]


def test_errors_are_typed_by_slurms_words(mod: Any) -> None:
    client = PyslurmSlurmClient(module=mod)
    with pytest.raises(PermanentSlurmError, match="Invalid partition name specified"):
        client.submit("#!/bin/bash\n#SBATCH --partition=nope\ntrue\n")
    mod.state["fail"]["jobs"] = "Unable to contact slurm controller (connect failure)"
    with pytest.raises(TransientSlurmError):
        client.list_jobs("x")
    mod.state["fail"]["cancel"] = "Access/permission denied"
    mod.state["jobs"][5] = FakeJob(5, "x")
    with pytest.raises(PermanentSlurmError, match="permission denied"):
        client.cancel(["5"])


def test_cluster_info_matches_the_sandbox(mod: Any) -> None:
    info = PyslurmSlurmClient(module=mod).cluster_info()
    assert info.version == "22.05.8"
    cpu, gpu = info.partition("cpu"), info.partition("gpu")
    assert cpu is not None and gpu is not None and info.partition(None) == cpu
    assert gpu.gpus_per_node == 2 and cpu.max_time_s is None
    assert {n.addr for n in cpu.nodes} == {"127.0.0.2", "127.0.0.3", "127.0.0.4"}
    mod.state["parts"][0].max_time_limit = 120
    assert PyslurmSlurmClient(module=mod).cluster_info().partitions[0].max_time_s == 7200
