"""The hand-off files: one typed reader and writer each, and JSON that stays as it was (agents of
jobs queued with an older release, and the other side of each hand-off, read it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_slurm_provider.state import (
    AgentInfo,
    ClusterDir,
    HeadInfo,
    RayUp,
    StartRequest,
    StartResult,
    read_json,
    write_json,
)


def cdir(tmp_path: Path) -> ClusterDir:
    c = ClusterDir(str(tmp_path), "c1")
    c.create()
    return c


def test_node_files_keep_their_json(tmp_path: Path) -> None:
    n = cdir(tmp_path).node("12_3")
    assert n.path == tmp_path / "c1" / "nodes" / "12_3"
    n.write_agent(AgentInfo(host="n1", pid=42, kind="worker", job_id="15"))
    n.write_ray_up(RayUp(ip="10.0.0.1", job_id="15"))
    n.write_start(StartRequest(id="r1", ray_start=["ray", "start", "--head"],
                               exports={"A": "$B"}, env={"C": "1"}, before=["echo hi"]))
    assert read_json(n.path / "agent.json") == {"host": "n1", "pid": 42, "kind": "worker",
                                                "job_id": "15", "container_mounts": [],
                                                "container_gpus": [], "container_path": "",
                                                "temp_dir": ""}
    assert read_json(n.path / "ray.json") == {"ip": "10.0.0.1", "job_id": "15"}
    # Keys are only ever added (an older agent ignores the ones it does not know).
    assert read_json(n.path / "start.json") == {
        "id": "r1", "ray_start": ["ray", "start", "--head"], "exports": {"A": "$B"},
        "env": {"C": "1"}, "before": ["echo hi"], "prefix": "", "entrypoint": [],
        "runtime_env": {}}
    assert (n.path / "start.json").stat().st_mode & 0o777 == 0o600  # it carries the env
    n.write_result(StartResult("r1", ok=True))
    assert read_json(n.path / "result.json") == {"id": "r1", "ok": True}
    n.write_result(StartResult("r2", ok=False, error="boom"))
    assert read_json(n.path / "result.json") == {"id": "r2", "ok": False, "error": "boom"}
    assert n.read_result() == StartResult("r2", ok=False, error="boom")
    assert n.read_agent() == AgentInfo(host="n1", pid=42, kind="worker", job_id="15")
    assert n.read_ray_up() == RayUp(ip="10.0.0.1", job_id="15")
    assert n.read_start() == StartRequest(id="r1", ray_start=["ray", "start", "--head"],
                                          exports={"A": "$B"}, env={"C": "1"},
                                          before=["echo hi"])
    # A start.json an older `ray up` wrote (no one-shot keys) reads as no one-shot.
    write_json(n.path / "start.json", {"id": "r0", "ray_start": ["ray", "start"]})
    old = n.read_start()
    assert old is not None and old.entrypoint == [] and old.runtime_env == {}


def test_missing_files_read_as_none_and_markers(tmp_path: Path) -> None:
    n = cdir(tmp_path).node("7")
    assert (n.read_agent(), n.read_ray_up(), n.read_start(), n.read_result()) == (None,) * 4
    assert not n.agent_up() and not n.ray_up() and not n.ray_stop_requested()
    with pytest.raises(OSError):
        n.request_ray_stop()  # a node without a directory is gone: nothing to stop
    n.write_ray_up(RayUp(ip="x", job_id="7"))
    assert n.ray_up() and cdir(tmp_path).ray_up("7")
    n.request_ray_stop()
    assert n.ray_stop_requested() and (n.path / "ray-stop").exists()
    n.clear_ray_stop()
    n.clear_ray_up()
    assert not n.ray_stop_requested() and not n.ray_up() and not cdir(tmp_path).ray_up("7")


def test_the_address_a_nodes_ray_bound_reads_from_its_ray_json(tmp_path: Path) -> None:
    """Issue 26.7: ClusterDir.ray_ip (the provider's per-tick read, and status's) is
    NodeDir.read_ray_up's address: None before ray.json, "" where it does not say."""
    c = cdir(tmp_path)
    assert c.ray_ip("7") is None
    c.node("7").write_ray_up(RayUp(ip="10.1.2.3", job_id="7"))
    assert c.ray_ip("7") == "10.1.2.3" == c.node("7").read_ray_up().ip  # type: ignore[union-attr]
    (c.node("7").path / "ray.json").write_text('{"job_id": "7"}')  # no address: malformed
    assert c.ray_ip("7") == ""
    c.node("7").clear_ray_up()
    assert c.ray_ip("7") is None


@pytest.mark.parametrize("text", ["{", "[]", "null", '"10.1.2.3"', '{"ip": 7, "job_id": "7"}'])
def test_a_ray_json_that_says_no_address_is_up_without_one(tmp_path: Path, text: str) -> None:
    """ray.json is there (the listing's ray_up), so the node's Ray is up; whatever it holds
    that is no address reads as "" (Slurm's NodeAddr then), never as not up (None)."""
    c = cdir(tmp_path)
    c.node("7").path.mkdir(parents=True)
    (c.node("7").path / "ray.json").write_text(text)
    assert c.ray_up("7") and c.ray_ip("7") == ""


MARKERS = [("request_ray_stop", "ray_stop_requested", "ray-stop"),
           ("release", "released", "released"),
           ("mark_orphan", "orphaned", "orphan")]


@pytest.mark.parametrize(("write", "read", "name"), MARKERS)
def test_each_marker_means_one_thing_and_writes_the_legacy_stop(
        tmp_path: Path, write: str, read: str, name: str) -> None:
    """Issue 25: one file per meaning; each writer also writes the legacy `stop`, which is
    all an agent of the previous release reads (remove after the next release)."""
    n = cdir(tmp_path).node("7")
    n.path.mkdir(parents=True)
    getattr(n, write)()
    assert (n.path / name).exists() and (n.path / "stop").exists()
    assert [getattr(n, r)() for _, r, _ in MARKERS] == [r == read for _, r, _ in MARKERS]


@pytest.mark.parametrize(("write", "read", "name"), MARKERS)
def test_a_legacy_stop_alone_counts_as_every_marker(tmp_path: Path, write: str, read: str,
                                                    name: str) -> None:
    """A `stop` the previous release wrote (no new marker beside it) stops the node in every
    reader, as it did then."""
    n = cdir(tmp_path).node("7")
    n.path.mkdir(parents=True)
    (n.path / "stop").touch()
    assert getattr(n, read)()


def test_clearing_a_ray_stop_clears_the_legacy_stop(tmp_path: Path) -> None:
    n = cdir(tmp_path).node("7")
    n.path.mkdir(parents=True)
    (n.path / "stop").touch()  # the previous release's `ray stop`
    n.clear_ray_stop()
    assert not n.ray_stop_requested() and not (n.path / "stop").exists()


def test_older_and_malformed_files(tmp_path: Path) -> None:
    n = cdir(tmp_path).node("7")
    # Agents older than job arrays wrote no job_id: the runner falls back to the node id.
    write_json(n.path / "agent.json", {"host": "n1", "pid": 1, "kind": "head"})
    assert n.read_agent() == AgentInfo(host="n1", pid=1, kind="head", job_id="")
    # A newer writer's extra keys do not break an older reader.
    write_json(n.path / "start.json", {"id": "r5", "ray_start": ["ray", "start"], "new": 1})
    assert n.read_start() == StartRequest(id="r5", ray_start=["ray", "start"])
    write_json(n.path / "result.json", {"ok": True})
    with pytest.raises(ValueError, match=r"result\.json: malformed"):
        n.read_result()


def test_head_file(tmp_path: Path) -> None:
    c = cdir(tmp_path)
    assert c.read_head() is None
    head = HeadInfo(job_id="5", ip="10.0.0.2", gcs_port=24000, dashboard_port=24001,
                    client_port=24002)
    c.write_head(head)
    assert read_json(tmp_path / "c1" / "head.json") == {
        "job_id": "5", "ip": "10.0.0.2", "gcs_port": 24000, "dashboard_port": 24001,
        "client_port": 24002}
    assert c.read_head() == head and c.head_file == tmp_path / "c1" / "head.json"
    c.clear_head("4")  # a head that is no longer the current one leaves the file alone
    assert c.read_head() == head
    c.clear_head("5")
    assert c.read_head() is None
    c.write_head(head)
    c.clear_head()  # `ray down`: whoever wrote it
    assert not c.head_file.exists()
    c.head_file.write_text("{not json")
    with pytest.raises(ValueError):
        c.read_head()


def test_teardown_marker(tmp_path: Path) -> None:
    c = cdir(tmp_path)
    assert not c.teardown_marked()
    c.mark_teardown()
    assert c.teardown_marked() and (tmp_path / "c1" / "teardown").exists()
    c.clear_teardown()
    assert not c.teardown_marked()
    ClusterDir(str(tmp_path / "missing"), "c1").mark_teardown()  # best effort, no error
