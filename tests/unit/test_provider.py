"""SlurmNodeProvider against the in-process FakeSlurm: the contract Ray's autoscalers rely on."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import click
import pytest
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    TAG_RAY_LAUNCH_CONFIG,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.provider.nodes import Phase
from ray_slurm_provider.provider.provider import SlurmNodeProvider
from ray_slurm_provider.slurm.client import TransientSlurmError
from ray_slurm_provider.slurm.script import JobSpec, render
from ray_slurm_provider.state import RayUp
from tests.fakes import FakeSlurm

HEAD_TAGS = {
    TAG_RAY_NODE_KIND: NODE_KIND_HEAD,
    TAG_RAY_USER_NODE_TYPE: "head",
    TAG_RAY_NODE_NAME: "ray-c1-head",
    TAG_RAY_LAUNCH_CONFIG: "abc",
    TAG_RAY_NODE_STATUS: "uninitialized",
}
WORKER_TAGS = {
    TAG_RAY_NODE_KIND: NODE_KIND_WORKER,
    TAG_RAY_USER_NODE_TYPE: "cpu_worker",
    TAG_RAY_NODE_STATUS: "uninitialized",
    "ray-launch-request": "req1",
}


def make(
    tmp_path: Path, fake: FakeSlurm | None = None, **extra: Any
) -> tuple[SlurmNodeProvider, FakeSlurm]:
    cfg = {
        "type": "external",
        "module": "ray_slurm_provider.provider.SlurmNodeProvider",
        "state_dir": str(tmp_path / "state"),
        "python": "/opt/venv/bin/python",
        **extra,
    }
    p = SlurmNodeProvider(cfg, "c1")
    f = fake or FakeSlurm()
    p._client = f
    return p, f


def test_constructor_never_raises_and_errors_surface_on_use(tmp_path: Path) -> None:
    p = SlurmNodeProvider({"type": "external", "bogus_key": 1}, "c1")
    with pytest.raises(ConfigError, match=r"provider\.bogus_key: unknown key; valid keys"):
        p.non_terminated_nodes({})


def test_created_node_listed_at_once_with_tags(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    created = p.create_node({"partition": "cpu", "cpus": 1}, HEAD_TAGS, 1)
    (head,) = created
    assert p.non_terminated_nodes(HEAD_TAGS) == [head]
    assert p.node_tags(head) == HEAD_TAGS
    assert not p.is_running(head) and not p.is_terminated(head)
    assert p.internal_ip(head) is None
    f.start(head, "n2")
    p.non_terminated_nodes({})
    assert p.is_running(head)
    assert p.internal_ip(head) == "127.0.0.3"


def test_one_scheduler_query_per_listing(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    ids = list(p.create_node_with_resources_and_labels({}, WORKER_TAGS, 3, {"CPU": 1}, {}))
    f.calls.clear()
    for _ in range(4):
        p.non_terminated_nodes({})
        for i in ids:
            p.node_tags(i), p.is_running(i), p.internal_ip(i), p.is_terminated(i)
    assert f.calls == {"list_jobs": 4}


def test_failed_listing_raises_never_returns_empty(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    p.create_node({}, WORKER_TAGS, 1)
    f.set_outage(True)
    with pytest.raises(TransientSlurmError, match="Unable to contact slurm controller"):
        p.non_terminated_nodes({})
    f.set_outage(False)
    assert len(p.non_terminated_nodes({})) == 1


def test_terminate_is_batched_and_idempotent(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    ids = list(p.create_node({}, WORKER_TAGS, 3))
    f.calls.clear()
    p.terminate_nodes(ids)
    assert f.calls["cancel"] == 1 and f.cancelled[-1] == ids
    assert p.non_terminated_nodes({}) == []
    assert all(p.is_terminated(i) for i in ids)
    p.terminate_nodes(ids)  # jobs already gone: no error
    p.terminate_node(ids[0])


def test_other_clusters_and_foreign_jobs_are_invisible(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    other = SlurmNodeProvider({"state_dir": str(tmp_path / "state")}, "c2")
    other._client = f
    other.create_node({}, WORKER_TAGS, 2)
    f.submit(JobSpec("ray-c1", ["true"]), comment="hand-made")
    assert p.non_terminated_nodes({}) == []
    assert len(other.non_terminated_nodes({})) == 2


def test_tags_survive_process_exit(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    p.set_node_tags(head, {TAG_RAY_NODE_STATUS: "up-to-date", "ray-runtime-config": "h1"})
    # A fresh provider, as in `ray exec` or the head's autoscaler, sees the same tags.
    q, _ = make(tmp_path, f)
    q.non_terminated_nodes({})
    assert q.node_tags(head)[TAG_RAY_NODE_STATUS] == "up-to-date"
    assert q.node_tags(head)["ray-runtime-config"] == "h1"


def test_worker_status_reports_ray_only_once_up(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    (w,) = p.create_node({}, WORKER_TAGS, 1)
    p.non_terminated_nodes({})
    assert p.node_tags(w)[TAG_RAY_NODE_STATUS] == "uninitialized"
    f.start(w)
    p.non_terminated_nodes({})
    assert p.node_tags(w)[TAG_RAY_NODE_STATUS] == "setting-up"
    p.cluster_dir.node(w).write_ray_up(RayUp(ip="127.0.0.2", job_id=w))
    p.non_terminated_nodes({})
    assert p.node_tags(w)[TAG_RAY_NODE_STATUS] == "up-to-date"


# --- issue 26 item 7: a node's address is the one its Ray bound --------------------------------

def test_a_nodes_address_is_the_one_its_ray_bound(tmp_path: Path) -> None:
    """Autoscaler v1 matches a worker to its raylet's heartbeats by internal_ip
    (test_rayapi.py, V1): with `node_ip_interface` the agent binds that interface's address
    and writes it to ray.json, so that is the node's address from then on; Slurm's NodeAddr
    only until then."""
    p, f = make(tmp_path, node_ip_interface="ib0")
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    (w,) = p.create_node({}, WORKER_TAGS, 1)
    f.start(head, "n2")
    f.start(w, "n1")
    p.non_terminated_nodes({})
    assert (p.internal_ip(head), p.internal_ip(w)) == ("127.0.0.3", "127.0.0.2")  # NodeAddr
    p.cluster_dir.node(head).write_ray_up(RayUp(ip="10.1.2.1", job_id=head))
    p.cluster_dir.node(w).write_ray_up(RayUp(ip="10.1.2.3", job_id=w))
    p.non_terminated_nodes({})
    assert p.node_tags(w)[TAG_RAY_NODE_STATUS] == "up-to-date"
    assert (p.internal_ip(w), p.external_ip(w)) == ("10.1.2.3", "10.1.2.3")
    assert (p.internal_ip(head), p.external_ip(head)) == ("10.1.2.1", "10.1.2.1")
    # A fresh provider (the head's autoscaler after `ray up`'s) finds the same.
    q, _ = make(tmp_path, f, node_ip_interface="ib0")
    q.non_terminated_nodes({})
    assert (q.internal_ip(head), q.internal_ip(w)) == ("10.1.2.1", "10.1.2.3")


def test_ray_json_is_read_once_per_node_when_its_ray_comes_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """internal_ip is asked per node several times a tick: it is answered from the record,
    and ray.json is read once, by the first internal_ip call after a listing saw the node's
    Ray up (the listing itself only looks whether ray.json is there)."""
    p, f = make(tmp_path)
    (w,) = p.create_node({}, WORKER_TAGS, 1)
    f.start(w, "n1")
    p.non_terminated_nodes({})
    p.cluster_dir.node(w).write_ray_up(RayUp(ip="10.1.2.3", job_id=w))
    reads: list[str] = []
    ray_ip = p.cluster_dir.ray_ip
    monkeypatch.setattr(p.cluster_dir, "ray_ip", lambda i: reads.append(i) or ray_ip(i))
    for _ in range(3):
        p.non_terminated_nodes({})
        assert [p.internal_ip(w) for _ in range(5)] == ["10.1.2.3"] * 5
    assert reads == [w]


def test_an_unreadable_ray_json_is_read_again_until_it_says_the_address(
        tmp_path: Path) -> None:
    """A ray.json that cannot be read (garbled, a filesystem error) gives Slurm's NodeAddr for
    that call only: it is read again, and the address kept once it says one."""
    p, f = make(tmp_path)
    (w,) = p.create_node({}, WORKER_TAGS, 1)
    f.start(w, "n1")
    ndir = p.cluster_dir.node(w)
    ndir.path.mkdir(parents=True)
    (ndir.path / "ray.json").write_text("{")
    p.non_terminated_nodes({})
    assert p.internal_ip(w) == "127.0.0.2"
    ndir.write_ray_up(RayUp(ip="10.1.2.3", job_id=w))
    assert p.internal_ip(w) == "10.1.2.3"


def test_a_ray_json_not_there_is_looked_for_again(tmp_path: Path) -> None:
    """`ray stop` on a head removes its ray.json (handoff.stop_ray) while its job, RAY_UP,
    runs on: Slurm's NodeAddr meanwhile, the address its Ray binds once `ray up` starts it
    again."""
    p, f = make(tmp_path)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    f.start(head, "n2")
    ndir = p.cluster_dir.node(head)
    ndir.write_ray_up(RayUp(ip="10.1.2.1", job_id=head))
    p.non_terminated_nodes({})
    ndir.clear_ray_up()  # before any internal_ip call
    p.non_terminated_nodes({})
    assert p.internal_ip(head) == "127.0.0.3"
    ndir.write_ray_up(RayUp(ip="10.1.2.1", job_id=head))
    assert p.internal_ip(head) == "10.1.2.1"


def test_the_address_read_is_kept_by_a_listing_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """internal_ip keeps the address on the node's record under the provider's lock, as
    records change (nodes.py): a listing in another thread meanwhile, one that rebuilds every
    record (a tags file changed), waits for it and keeps the address: ray.json is read
    once."""
    p, f = make(tmp_path)
    (w,) = p.create_node({}, WORKER_TAGS, 1)
    f.start(w, "n1")
    p.cluster_dir.node(w).write_ray_up(RayUp(ip="10.1.2.3", job_id=w))
    p.non_terminated_nodes({})
    p.cluster_dir.set_tags(w, {"x": "y"})  # the next listing rebuilds every record
    listing = threading.Thread(target=p.non_terminated_nodes, args=({},))
    reads: list[str] = []
    ray_ip = p.cluster_dir.ray_ip

    def read(node_id: str) -> str | None:
        reads.append(node_id)
        if len(reads) == 1:
            listing.start()
            listing.join(1.0)  # it runs now unless the read holds the lock
        return ray_ip(node_id)

    monkeypatch.setattr(p.cluster_dir, "ray_ip", read)
    assert p.internal_ip(w) == "10.1.2.3"
    listing.join()
    assert p.internal_ip(w) == "10.1.2.3"
    assert reads == [w]


def test_a_new_run_drops_what_ended_jobs_left_under_ids_slurm_gives_again(
        tmp_path: Path) -> None:
    """Job ids restart after a controller's state is reset, and jobs killed outright (SIGKILL,
    a lost node) leave their node dirs, ray.json too: a new job of the same id was RAY_UP
    before its Ray started, with the old job's address, and the old orphan marker stood. A
    new run (a new head) removes the dirs of the jobs Slurm no longer lists."""
    p, _ = make(tmp_path)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    (w,) = p.create_node({}, WORKER_TAGS, 1)
    for node_id, ip in ((head, "10.1.2.1"), (w, "10.1.2.3")):
        p.cluster_dir.node(node_id).write_ray_up(RayUp(ip=ip, job_id=node_id))
    p.cluster_dir.node(w).mark_orphan()
    reset = FakeSlurm()  # the controller's state reset: its ids start again
    q, _ = make(tmp_path, reset)
    assert list(q.create_node({}, HEAD_TAGS, 1)) == [head]
    assert list(q.create_node({}, WORKER_TAGS, 1)) == [w]
    reset.start(head, "n2")
    reset.start(w, "n1")
    q.non_terminated_nodes({})
    assert q.node_tags(w)[TAG_RAY_NODE_STATUS] == "setting-up"
    assert (q.internal_ip(head), q.internal_ip(w)) == ("127.0.0.3", "127.0.0.2")
    assert not q.cluster_dir.node(w).orphaned()


def test_completing_and_finished_jobs_are_terminated(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    a, b = p.create_node({}, WORKER_TAGS, 2)
    f.set_state(a, "COMPLETING")
    f.finish(b, "TIMEOUT")
    # Neither was ever listed active: listed once more (see below), then not.
    assert p.non_terminated_nodes({}) == [a, b]
    assert p.non_terminated_nodes({}) == []


def test_job_script_runs_the_agent_with_resources(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    p.create_node_with_resources_and_labels(
        {"partition": "gpu", "time": "1:00:00"}, WORKER_TAGS, 1, {"CPU": 2, "GPU": 1}, {}
    )
    script = render(f.submitted[-1])
    assert "#SBATCH --job-name=ray-c1" in script
    assert "#SBATCH --partition=gpu" in script
    assert "#SBATCH --cpus-per-task=2" in script
    assert "#SBATCH --gres=gpu:1" in script
    assert "#SBATCH --time=1:00:00" in script
    assert "/opt/venv/bin/python -m ray_slurm_provider.agent --spec" in script
    assert (tmp_path / "state" / "c1" / "auth_token").stat().st_mode & 0o777 == 0o600
    token = (tmp_path / "state" / "c1" / "auth_token").read_text()
    assert token not in script


def test_rejected_submission_quotes_slurm(tmp_path: Path) -> None:
    p, _ = make(tmp_path)
    with pytest.raises(Exception, match="Invalid partition name specified"):
        p.create_node({"partition": "nope"}, WORKER_TAGS, 1)
    assert p.non_terminated_nodes({}) == []


def test_bad_node_config_names_key_path(tmp_path: Path) -> None:
    p, _ = make(tmp_path)
    with pytest.raises(ConfigError, match=r"node_config\.cpu: unknown key.*cpus"):
        p.create_node({"cpu": 2}, WORKER_TAGS, 1)


def _cluster(**provider: Any) -> dict[str, Any]:
    return {
        "cluster_name": "c1",
        "provider": {"type": "external", "module": "x", **provider},
        "head_node_type": "head",
        "available_node_types": {
            "head": {"resources": {}, "node_config": {}},
            "w": {
                "resources": {"CPU": 1},
                "node_config": {"partition": "cpu"},
                "worker_setup_commands": ["echo typed"],
            },
        },
        "initialization_commands": ["echo init"],
        "worker_setup_commands": ["echo setup"],
        "worker_start_ray_commands": ["ray start --address=$RAY_HEAD_IP:$RAY_GCS_PORT"],
    }


def test_bootstrap_copies_worker_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "ray_slurm_provider.provider.bootstrap._cluster_info", lambda *_: FakeSlurm().cluster_info()
    )
    out = SlurmNodeProvider.bootstrap_config(_cluster())
    types = out["provider"]["_node_types"]
    assert types["w"]["commands"] == {
        "initialization": ["echo init"],
        "setup": ["echo typed"],
        "start": ["ray start --address=$RAY_HEAD_IP:$RAY_GCS_PORT"],
    }
    assert types["head"]["commands"]["setup"] == ["echo setup"]
    assert out["provider"]["disable_node_updaters"] is True
    assert out["head_start_ray_commands"]


def test_bootstrap_rejects_unknown_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "ray_slurm_provider.provider.bootstrap._cluster_info", lambda *_: FakeSlurm().cluster_info()
    )
    cfg = _cluster()
    cfg["available_node_types"]["w"]["node_config"]["partition"] = "gpux"
    with pytest.raises(click.ClickException, match=r"partition: 'gpux'.*valid choices: cpu, gpu"):
        SlurmNodeProvider.bootstrap_config(cfg)


def test_fillout_resources_from_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "ray_slurm_provider.provider.bootstrap._cluster_info", lambda *_: FakeSlurm().cluster_info()
    )
    cfg = _cluster()
    del cfg["available_node_types"]["w"]["resources"]
    cfg["available_node_types"]["w"]["node_config"]["partition"] = "gpu"
    out = SlurmNodeProvider.fillout_available_node_types_resources(cfg)
    res = out["available_node_types"]["w"]["resources"]
    assert res["CPU"] >= 1 and res["GPU"] == 2 and res["memory"] > 0
    assert out["available_node_types"]["w"]["node_config"]["gpus"] == 2


# --- issue 14.10: listing races ------------------------------------------------------------
class RacingSlurm(FakeSlurm):
    """Runs `during` after the listing was taken, before it is returned: another thread of
    the autoscaler creating a node while this listing is in flight."""

    during: Any = None

    def list_jobs(self, job_name: str) -> list[Any]:
        jobs = super().list_jobs(job_name)
        if self.during is not None:
            cb, self.during = self.during, None
            cb()
        return jobs


def test_a_node_created_while_a_listing_is_in_flight_survives_it(tmp_path: Path) -> None:
    p, f = make(tmp_path, RacingSlurm())
    created: list[str] = []
    f.during = lambda: created.extend(
        p.create_node_with_resources_and_labels({}, WORKER_TAGS, 1, {"CPU": 1}, {}))
    listed = p.non_terminated_nodes({})
    (new,) = created
    assert new in listed and not p.is_terminated(new)
    assert p.node_tags(new)[TAG_RAY_USER_NODE_TYPE] == "cpu_worker"
    assert p.non_terminated_nodes({}) == [new]  # and the next listing sees it from Slurm


def test_a_created_node_slurm_no_longer_lists_is_listed_once_more_then_dropped(
        tmp_path: Path) -> None:
    """Issue 15: a worker preempted within one tick of its launch was never listed, so
    autoscaler v2 (which matches its launch requests to listed nodes by type) kept waiting
    for it: the replacement came only when the request timed out (120 s, measured on the
    sandbox). Listed once more, v2 sees the node come and go and asks again at once."""
    p, f = make(tmp_path)
    (new,) = p.create_node_with_resources_and_labels({}, WORKER_TAGS, 1, {"CPU": 1}, {})
    f.jobs.pop(new)  # gone before any listing saw it (preempted, failed at once)
    assert p.non_terminated_nodes({}) == [new]
    assert p.node_tags(new)[TAG_RAY_USER_NODE_TYPE] == "cpu_worker"
    assert p.non_terminated_nodes({}) == [] and p.is_terminated(new)
    assert p.non_terminated_nodes({}) == []


class DeafSlurm(FakeSlurm):
    """scancel answers success but the job lives on (e.g. a controller that lost it)."""

    def cancel(self, job_ids: Any) -> None:
        self.calls["cancel"] += 1


def test_a_cancelled_job_that_still_lives_shows_up_again(tmp_path: Path) -> None:
    p, f = make(tmp_path, DeafSlurm())
    p._clock = f.clock.now
    (w,) = p.create_node_with_resources_and_labels({}, WORKER_TAGS, 1, {"CPU": 1}, {})
    f.start(w, "n1")
    p.terminate_node(w)
    assert p.non_terminated_nodes({}) == []  # hidden while Slurm takes its time to end it
    f.clock.advance(SlurmNodeProvider.GONE_TTL_S + 1)
    assert p.non_terminated_nodes({}) == [w]  # still alive long after: the autoscaler sees it


def test_forgets_cancelled_jobs_once_slurm_has_dropped_them(tmp_path: Path) -> None:
    p, _ = make(tmp_path)
    ids = list(p.create_node_with_resources_and_labels({}, WORKER_TAGS, 3, {"CPU": 1}, {}))
    p.terminate_nodes(ids)
    p.non_terminated_nodes({})
    assert [r for r in p._nodes.values() if r.phase is Phase.CANCELLING] == []


@pytest.mark.parametrize("state", ["REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "SUSPENDED",
                                   "REQUEUE_FED", "RESV_DEL_HOLD"])
def test_held_stopped_and_suspended_jobs_are_nodes_ray_down_cancels(tmp_path: Path,
                                                                   state: str) -> None:
    """Issue 14.12: jobs in these states still hold (or will again hold) an allocation; when
    the listing did not show them, `ray down` never cancelled them."""
    from ray_slurm_provider.slurm.client import LIST_STATES

    p, f = make(tmp_path)
    (w,) = p.create_node_with_resources_and_labels({}, WORKER_TAGS, 1, {"CPU": 1}, {})
    f.start(w, "n1")
    f.set_state(w, state, "JobHeldUser")
    assert state in LIST_STATES.split(",")  # squeue is asked for them
    assert p.non_terminated_nodes({}) == [w]
    p.terminate_nodes(p.non_terminated_nodes({}))  # what `ray down` does
    assert f.jobs[w].job.state == "CANCELLED"


def test_a_cached_config_never_runs_another_checkouts_python(tmp_path: Path) -> None:
    """Issue 14.15: Ray's config cache (keyed on the YAML's text) kept `provider.python` from
    another checkout; `ray up` then ran every node on that checkout's venv, silently."""
    import json
    import sys

    from ray_slurm_provider.cluster import AUTO_PYTHON_KEY
    from ray_slurm_provider.provider.transfer import copy_bootstrap_config

    p, f = make(tmp_path, python="/old/checkout/.venv/bin/python", **{AUTO_PYTHON_KEY: True})
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    assert f.jobs[head].spec.command[0] == sys.executable  # `ray up`'s own Python
    cached = tmp_path / "ray-bootstrap.json"
    cached.write_text(json.dumps({"provider": {"python": "/old/checkout/.venv/bin/python",
                                               AUTO_PYTHON_KEY: True}}))
    copy_bootstrap_config(str(cached), str(tmp_path / "boot.json"))
    assert json.loads((tmp_path / "boot.json").read_text())["provider"]["python"] == \
        sys.executable  # and so the head's autoscaler gives it to the workers
    # A Python the user chose is kept.
    p2, f2 = make(tmp_path / "2", python="/site/venv/bin/python")
    (head2,) = p2.create_node({}, HEAD_TAGS, 1)
    assert f2.jobs[head2].spec.command[0] == "/site/venv/bin/python"


def test_a_worker_first_listed_completing_is_listed_once_more(tmp_path: Path) -> None:
    """Issue 15, seen on the accounting sandbox: a scavenger worker preempted within a tick
    of its launch was first listed COMPLETING (PreemptMode=CANCEL), never active, so v2's
    launch request waited 120 s for it. A head is not kept (v2 launches no heads)."""
    p, f = make(tmp_path)
    (w,) = p.create_node_with_resources_and_labels({}, WORKER_TAGS, 1, {"CPU": 1}, {})
    (h,) = p.create_node({}, HEAD_TAGS, 1)
    f.start(w, "n2")
    f.set_state(w, "COMPLETING")
    f.start(h, "n1")
    f.set_state(h, "COMPLETING")
    assert p.non_terminated_nodes({}) == [w]
    assert p.non_terminated_nodes({}) == []
