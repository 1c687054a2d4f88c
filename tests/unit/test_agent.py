"""The node agent's start logic, in-process with fake `ray start` children (no Slurm)."""

from __future__ import annotations

import ast
import contextlib
import io
import os
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.agent import head as head_role
from ray_slurm_provider.agent.agent import Agent, slurm_client
from ray_slurm_provider.agent.head import HeadAgent
from ray_slurm_provider.agent.worker import WorkerAgent
from ray_slurm_provider.nodespec import NodeSpec
from ray_slurm_provider.slurm.spec import JobSpec
from ray_slurm_provider.state import HeadInfo, StartRequest, read_json
from tests.fakes import FakeSlurm


class FakeChild:
    pid = 0  # end_session leaves session 0 alone (the kernel's threads)

    def __init__(self, lines: list[str], code: int) -> None:
        self.stdout = io.StringIO("".join(lines))
        self.code = code

    def wait(self) -> int:
        return self.code

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        pass

    def kill(self) -> None:
        pass


def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, children: list[FakeChild],
          attempts: int = 3) -> tuple[WorkerAgent, list[list[str]]]:
    spec = NodeSpec(kind="worker", node_type="w", cluster_name="c1",
                    state_dir=str(tmp_path), ports_base=25000, attempts=attempts,
                    temp_dir_root=str(tmp_path / "tmp"))
    a = WorkerAgent(spec, {"SLURM_JOB_ID": "9", "SLURM_CPUS_ON_NODE": "1",
                           "HOME": str(tmp_path)})
    a.cdir.write_head(HeadInfo(job_id="1", ip="127.0.0.2", gcs_port=25000))
    started: list[list[str]] = []

    def start(argv: list[str], env: Any = None, new_session: bool = False) -> FakeChild:
        started.append(list(argv))
        return children.pop(0)

    monkeypatch.setattr(proc, "start", start)
    monkeypatch.setattr(Agent, "node_ip", lambda self: "127.0.0.3")
    monkeypatch.setattr(a, "pause", lambda s: None)  # the retry backoff
    return a, started


def test_failed_starts_are_retried_then_ray_runs(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    timed_out = ["The current node timed out during startup.\n"]
    a, started = agent(tmp_path, monkeypatch, [
        FakeChild(timed_out, 1), FakeChild(timed_out, 1),
        FakeChild(["Ray runtime started.\n"], 0)])
    seen: dict[str, Any] = {}
    orig = a.mark_started

    def mark(argv: list[str], env: dict[str, str]) -> None:
        orig(argv, env)
        seen["ray"] = read_json(a.ndir.path / "ray.json")  # the JSON other processes read

    a.mark_started = mark  # type: ignore[method-assign]
    assert a.main() == 0
    assert len(started) == 3
    assert seen["ray"] == {"ip": "127.0.0.3", "job_id": "9"}
    assert not a.ndir.ray_up()  # Ray gone -> no longer reported up


def test_gives_up_and_ends_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    a, started = agent(tmp_path, monkeypatch, [FakeChild([], 1), FakeChild([], 1)], attempts=2)
    assert a.main() == 1
    assert len(started) == 2
    assert "giving up: Ray never started on this node" in capsys.readouterr().out


def test_worker_without_head_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    a, started = agent(tmp_path, monkeypatch, [], attempts=1)
    a.cdir.clear_head()
    assert a.main() == 1 and started == []
    assert "no running head found" in capsys.readouterr().out


def test_head_start_is_retried_before_ray_up_hears_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = NodeSpec(kind="head", node_type="head", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, attempts=3, temp_dir_root=str(tmp_path / "tmp"))
    a = HeadAgent(spec, {"SLURM_JOB_ID": "5", "HOME": str(tmp_path)})
    children = [FakeChild(["The current node timed out during startup.\n"], 1),
                FakeChild(["Ray runtime started.\n"], 0)]
    monkeypatch.setattr(proc, "start", lambda argv, env=None, new_session=False: children.pop(0))
    monkeypatch.setattr(Agent, "node_ip", lambda self: "127.0.0.3")
    monkeypatch.setattr(a, "pause", lambda s: None)
    monkeypatch.setattr(head_role, "wait_port_free", lambda *args: None)
    monkeypatch.setattr(HeadAgent, "watch", lambda self, req_id: None)
    assert a.head_once(StartRequest(id="r1", ray_start=["ray", "start", "--head"])) == 0
    assert children == []
    assert read_json(a.ndir.path / "result.json") == {"id": "r1", "ok": True}


# --- the agent asks Slurm the way the cluster is configured -------------------------------


def test_jobs_carry_the_clusters_slurm_client_to_the_agent(tmp_path: Path) -> None:
    from ray_slurm_provider.cluster import NodeType
    from ray_slurm_provider.config import NodeConfig, ProviderConfig, RestConfig
    from ray_slurm_provider.jobs import build_job
    from ray_slurm_provider.slurm.rest.client import RestSlurmClient

    rest = RestConfig(url="http://rest:6820", jwt_file=str(tmp_path / "jwt"), user="me")
    job = build_job(ProviderConfig(slurm_api="rest", rest=rest, state_dir=str(tmp_path)), "c1",
                    NodeType("w", NodeConfig(), resources={"CPU": 1}), kind="worker",
                    python="py")
    spec = NodeSpec.from_json(job.command[-1])
    assert spec.slurm_api == "rest"
    assert spec.rest == {"url": "http://rest:6820", "jwt_file": str(tmp_path / "jwt"),
                         "jwt_env": "SLURM_JWT", "user": "me", "ca_file": None, "proxy": None}
    client = slurm_client(spec)
    assert isinstance(client, RestSlurmClient)
    assert (client.base_url, client.user) == ("http://rest:6820", "me")


def test_a_spec_from_before_the_client_choice_uses_the_cli(tmp_path: Path) -> None:
    from ray_slurm_provider.slurm.cli import CliSlurmClient

    old = ('{"kind":"worker","node_type":"w","cluster_name":"c1","ports_base":25000,'
           f'"state_dir":"{tmp_path}"}}')
    spec = NodeSpec.from_json(old)
    assert (spec.slurm_api, spec.rest) == ("cli", {})
    assert isinstance(slurm_client(spec), CliSlurmClient)


def docker_worker(tmp_path: Path) -> tuple[WorkerAgent, FakeSlurm]:
    """A worker with a docker container whose agent asks a FakeSlurm."""
    spec = NodeSpec(kind="worker", node_type="w", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, temp_dir_root=str(tmp_path / "tmp"),
                    container={"runtime": "docker", "image": "img"})
    a = WorkerAgent(spec, {"SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n1",
                           "HOME": str(tmp_path)})
    fake = FakeSlurm()
    a.slurm = fake
    return a, fake


def test_node_address_and_container_sweep_ask_the_agents_client(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, fake = docker_worker(tmp_path)
    assert a.node_ip() == fake.nodes["n1"].addr
    other = fake.submit(JobSpec("ray-c1", ["true"]))
    assert a.container is not None
    swept: list[set[str]] = []
    monkeypatch.setattr(a.container, "prepare", lambda: None)
    monkeypatch.setattr(a.container, "sweep", lambda active: swept.append(active()))
    a.prepare_container()
    assert swept == [{other}] and fake.calls["list_jobs"] == 1


# --- what the agent imports -------------------------------------------------------------------


def package_imports(module: str) -> set[str]:
    """The package's modules that `module` imports, directly or not: any import statement,
    in functions and TYPE_CHECKING blocks too, except in a package's `__init__` functions
    (the provider's names the YAML's entry point, lazily)."""
    root = Path(__file__).resolve().parents[2]
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        path = root / name.replace(".", "/")
        init = path.is_dir()
        path = path / "__init__.py" if init else path.with_suffix(".py")
        if name in seen or not path.exists():
            continue
        seen.add(name)
        nodes = list(ast.iter_child_nodes(ast.parse(path.read_text())))
        while nodes:
            node = nodes.pop()
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif not (init and isinstance(node, ast.FunctionDef)):
                nodes += ast.iter_child_nodes(node)
    return {m for m in seen if m.startswith("ray_slurm_provider")} - {module}


def test_the_agent_imports_nothing_of_the_provider_or_the_cli() -> None:
    deps = package_imports("ray_slurm_provider.agent.__main__")
    assert {"ray_slurm_provider.agent.head", "ray_slurm_provider.agent.worker"} <= deps
    assert not {d for d in deps
                if d.startswith(("ray_slurm_provider.provider", "ray_slurm_provider.cli"))}


# --- issue 14.3: a TERM during setup stops at the next step boundary --------------------------
def test_term_during_setup_never_starts_ray(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    a, started = agent(tmp_path, monkeypatch, [])

    class Setup(FakeChild):
        """The first setup command: Slurm's TERM arrives while it runs."""

        def __init__(self) -> None:
            super().__init__(["one\n"], -15)

        def poll(self) -> int | None:
            return None  # still running when the TERM comes

    killed: list[int] = []
    monkeypatch.setattr(proc, "kill_tree", lambda pid, sig=9: killed.append(sig) or 1)
    setup = Setup()
    setup.pid = 4242  # type: ignore[attr-defined]
    children: list[Any] = [setup]

    def start(argv: list[str], env: Any = None, new_session: bool = False) -> Any:
        started.append(list(argv))
        child = children.pop(0)
        if child is setup:
            a.on_term(15, None)  # what the terminator thread does on the TERM
        return child

    monkeypatch.setattr(proc, "start", start)
    a.spec.start_commands = ["echo one", "echo two", "ray start --address=x:1"]
    assert a.run() == 0
    assert [s[-1] for s in started] == ["echo one"]  # no second command, and no Ray
    assert killed == [15]  # the running setup command was told to stop, not left to SIGKILL


def test_term_during_the_retry_back_off_never_starts_ray_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, started = agent(tmp_path, monkeypatch, [
        FakeChild(["The current node timed out during startup.\n"], 1),
        FakeChild(["Ray runtime started.\n"], 0)])
    monkeypatch.setattr(a, "pause", lambda s: a.on_signal(15, None))
    a.run()
    assert len(started) == 1


def test_the_signal_handler_does_no_io(tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler that prints or reads files can deadlock or raise in the middle of the main
    thread's own I/O; it only sets a flag and writes one byte to a pipe."""
    a, _ = agent(tmp_path, monkeypatch, [])

    def io(*_: Any, **__: Any) -> Any:
        raise AssertionError("I/O in the signal handler")

    monkeypatch.setattr(head_role, "log", io, raising=False)
    monkeypatch.setattr("ray_slurm_provider.agent.agent.log", io)
    monkeypatch.setattr(a.cdir, "read_head", io)
    a.child = FakeChild([], 0)
    a.on_signal(15, None)
    assert a.terminating


# --- issue 14.2: a Slurm hiccup at node start ---------------------------------------------------
def test_node_address_survives_a_controller_stall_and_asks_for_one_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray_slurm_provider.agent.netaddr import node_ip
    from ray_slurm_provider.slurm.client import TransientSlurmError

    fake = FakeSlurm()
    for _ in range(3):  # slurmctld does not answer for a while
        fake.fail_next("node_address", TransientSlurmError("x", "Unable to contact slurm "
                                                                  "controller", "scontrol"))
    waited: list[float] = []
    assert node_ip({"SLURMD_NODENAME": "n2"}, None, fake, pause=waited.append) == "127.0.0.3"
    assert len(waited) == 3 and fake.calls["node_address"] == 4
    assert fake.calls["node_addresses"] == 0  # one node, never the whole table


def test_a_permanent_slurm_error_at_start_is_a_failed_attempt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray_slurm_provider.slurm.client import PermanentSlurmError

    a, started = agent(tmp_path, monkeypatch, [FakeChild(["Ray runtime started.\n"], 0)])
    calls = iter([PermanentSlurmError("x", "Invalid node name specified", "scontrol")])

    def flaky(self: Agent) -> str:
        err = next(calls, None)
        if err is not None:
            raise err
        return "127.0.0.3"

    monkeypatch.setattr(Agent, "node_ip", flaky)
    assert a.run() == 0 and len(started) == 1  # retried like a failed `ray start`


def test_the_prefix_of_ray_start_runs_in_rays_own_shell(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14.4: `ulimit -n 65536; cd /x; ray start` ran the ulimit and cd in shells of their
    own, so Ray never got them."""
    import subprocess

    a, started = agent(tmp_path, monkeypatch, [FakeChild(["Ray runtime started.\n"], 0)])
    a.spec.start_commands = ["ulimit -n 512 && cd /tmp && ray start --address=x:1"]
    assert a.run() == 0
    (argv,) = started
    assert argv[:2] == ["bash", "-c"] and "ulimit -n 512 && cd /tmp &&" in argv[2]
    assert "--address=x:1" in argv and argv[argv.index("--address=x:1") - 1] == "start"
    # The argv really runs the prefix in the shell that becomes `ray`.
    probe = [*argv[:3], argv[3], "bash", "-c", 'echo "$(ulimit -n) $PWD"']
    out = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["512", "/tmp"]


def test_the_sweep_never_removes_the_container_of_a_completing_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13.1: a job still COMPLETING (draining) is not active, and its container was
    removed by the next job's sweep on that node."""
    a, fake = docker_worker(tmp_path)
    draining = fake.submit(JobSpec("ray-c1", ["true"]))
    fake.start(draining)
    fake.set_state(draining, "COMPLETING")
    assert a.container is not None
    swept: list[set[str]] = []
    monkeypatch.setattr(a.container, "prepare", lambda: None)
    monkeypatch.setattr(a.container, "sweep", lambda active: swept.append(active()))
    a.prepare_container()
    assert swept == [{fake.jobs[draining].job.numeric_id}]


def test_the_head_takes_the_next_block_when_a_port_of_its_own_is_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13.5: 800 hashed blocks collide once a few dozen clusters share a node, and only
    the GCS port was checked (a taken dashboard port failed silently)."""
    from ray_slurm_provider import ports

    spec = NodeSpec(kind="head", node_type="head", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, attempts=1, temp_dir_root=str(tmp_path / "tmp"))
    a = HeadAgent(spec, {"SLURM_JOB_ID": "5", "HOME": str(tmp_path)})
    started: list[list[str]] = []

    def start(argv: list[str], env: Any = None, new_session: bool = False) -> FakeChild:
        started.append(list(argv))
        return FakeChild(["Ray runtime started.\n"], 0)

    monkeypatch.setattr(proc, "start", start)
    monkeypatch.setattr(Agent, "node_ip", lambda self: "127.0.0.3")
    monkeypatch.setattr(ports, "can_bind", lambda host, port: port != 25001)  # dashboard
    monkeypatch.setattr(head_role, "wait_port_free", lambda *args: None)
    monkeypatch.setattr(HeadAgent, "watch", lambda self, req_id: None)
    written: list[Any] = []
    monkeypatch.setattr(a.cdir, "write_head", written.append)
    assert a.head_once(StartRequest(id="r1", ray_start=["ray", "start", "--head"])) == 0
    (argv,) = started
    assert "--port=25010" in argv and "--dashboard-port=25011" in argv
    (head,) = written  # what workers, `ray-slurm env` and `ray up` read
    assert (head.gcs_port, head.dashboard_port) == (25010, 25011)


# --- issue 13.2: Ray's temp dirs live in a private parent -------------------------------------
def test_the_temp_dir_parent_is_private_and_refused_when_it_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray 2.60 makes its temp, session and sockets dirs 0777 without the sticky bit, and
    `/tmp/rsp-<job>` was predictable: another user could pre-create it or rebind Ray's
    sockets. Each user's jobs now live under `<root>/rsp-<uid>/`, 0700, checked."""
    import os
    import stat

    from ray_slurm_provider.agent.tempdir import private_parent
    from ray_slurm_provider.jobs import temp_dir

    root = tmp_path / "tmp"
    root.mkdir()
    uid = os.getuid()
    assert temp_dir(str(root), "15") == f"{root}/rsp-{uid}/15"
    parent = private_parent(temp_dir(str(root), "15"))
    assert parent == root / f"rsp-{uid}"
    st = parent.lstat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == uid
    assert private_parent(temp_dir(str(root), "16")) == parent  # taken again as it is
    parent.chmod(0o777)  # someone widened it (or made it: the next check)
    with pytest.raises(RuntimeError, match=rf"{parent} .*mode 777.*chmod 700"):
        private_parent(temp_dir(str(root), "17"))
    parent.chmod(0o700)
    monkeypatch.setattr(os, "getuid", lambda: uid + 4242)  # as if another user made it
    with pytest.raises(RuntimeError, match=rf"{parent} is owned by uid {uid}"):
        private_parent(f"{parent}/18")
    monkeypatch.undo()
    parent.rmdir()
    parent.symlink_to(tmp_path)  # a link planted where the dir should be
    with pytest.raises(RuntimeError, match="not a directory of its own"):
        private_parent(temp_dir(str(root), "19"))


def test_the_head_is_watched_from_before_ray_start(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A head that goes while a worker's `ray start` still connects to it (seen in CI: the
    one-shot head scancelled as its workers started) must end the worker then, not after
    Ray's own GCS retries or Slurm's time limit: the watch starts before `ray start`, once,
    and ends when the agent does."""
    events: list[str] = []
    a, started = agent(tmp_path, monkeypatch, [FakeChild([], 1), FakeChild([], 1)], attempts=2)
    real_start = proc.start  # the agent's fake, which records into `started`
    monkeypatch.setattr(proc, "start", lambda argv, env=None, new_session=False: (
        events.append("start"), real_start(argv, env))[1])
    watches: list[Any] = []

    def watch(cdir: Any, head: Any, alive: Any, on_gone: Any, node: Any = None,
              **kw: Any) -> None:
        events.append("watch")
        watches.append(alive)

    monkeypatch.setattr("ray_slurm_provider.agent.headwatch.start", watch)
    assert watches == [] and a.main() == 1
    assert events == ["watch", "start", "start"] and len(started) == 2
    assert not watches[0]()  # the agent has returned: the watch ends


# --- a `ray start` that ends while daemons it started still hold its output ------------------
def _fds(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone
        return []


def test_ray_starts_orphans_are_ended_so_the_agent_never_blocks_on_their_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A TERM while `ray start` is still starting ends it before it can stop the daemons it
    has started; they keep its stdout open, so the agent's read never ends (until Slurm's
    SIGKILL, which proctrack/linuxproc does not pass on to orphans). Here the child (real
    processes) exits at once and leaves a `sleep` holding the pipe, as such a daemon would."""
    spec = NodeSpec(kind="worker", node_type="w", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, temp_dir_root=str(tmp_path / "tmp"))
    a = WorkerAgent(spec, {"SLURM_JOB_ID": "9", "HOME": str(tmp_path)})
    monkeypatch.setattr(proc, "ORPHAN_GRACE_S", 0.05)
    pids: list[int] = []

    def started() -> None:
        pids.extend(int(p) for p in (tmp_path / "pid").read_text().split())

    script = f"sleep 300 & echo $! > {tmp_path}/pid; echo 'Ray runtime started.'; exit 3"
    try:
        assert a.run_ray(["bash", "-c", script], {"PATH": "/usr/bin:/bin"}, started) == 3
        # Its read ended: the sleep holds nothing open any more (it is dying or gone).
        assert pids and all(_fds(p) == [] for p in pids)
        assert f"ending 1 process(es) `ray start` left behind: {pids}" in capsys.readouterr().out
    finally:
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, 9)



# --- a raylet killed leaves its workers: they end before the temp dir goes -----------------
def test_what_ray_left_in_its_session_ends_before_the_temp_dir_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI saw a task fail with FileNotFoundError (Ray's own getsize of the worker's log):
    its raylet had been SIGKILLed, the agent removed the temp dir, and the worker, still
    running, reached for its log. A failure no retry covers: the driver failed."""
    from ray_slurm_provider.agent import agent as agent_mod

    a, _ = agent(tmp_path, monkeypatch, [FakeChild(["x\n"], 1)], attempts=1)
    sessions: list[bool] = []
    real_start = proc.start  # the agent's fake

    def start(argv: list[str], env: Any = None, new_session: bool = False) -> Any:
        sessions.append(new_session)
        return real_start(argv, env=env)

    monkeypatch.setattr(proc, "start", start)
    events: list[str] = []

    def end_session(sid: int) -> list[int]:
        events.append(f"end session {sid}")
        return [4242]

    monkeypatch.setattr(proc, "end_session", end_session)
    monkeypatch.setattr(agent_mod, "finish", lambda *_: events.append("remove temp dir"))
    assert a.main() == 1
    assert sessions == [True]  # `ray start` leads its own session
    assert events == [f"end session {FakeChild.pid}", "remove temp dir"]


# --- issue 29: a throttled controller at the agent ----------------------------------------------
TIMED_OUT = "squeue: error: slurm_load_jobs: Socket timed out on send/recv operation"


def test_a_one_shots_end_cancels_the_workers_through_a_throttled_controller(
        tmp_path: Path) -> None:
    from ray_slurm_provider.slurm.client import TransientSlurmError

    fake = FakeSlurm()
    head = fake.submit(JobSpec("ray-c1", ["true"]))
    worker = fake.submit(JobSpec("ray-c1", ["true"]))
    spec = NodeSpec(kind="head", node_type="h", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000)
    a = HeadAgent(spec, {"SLURM_JOB_ID": head, "HOME": str(tmp_path)})
    a.slurm = fake
    waits: list[float] = []
    a.pause = waits.append  # type: ignore[method-assign]
    fake.fail_next("list_jobs", TransientSlurmError(TIMED_OUT))
    fake.fail_next("cancel", TransientSlurmError("scancel: error: Socket timed out"))
    a.end_cluster(StartRequest(id="r", ray_start=["ray"], entrypoint=["python", "a.py"]))
    assert fake.cancelled[-1] == [worker] and len(waits) == 2
    assert fake.job(head).state == "PENDING"


def test_a_container_sweep_that_slurm_did_not_answer_removes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed listing is never "no jobs": the sweep skips this round, and says so."""

    a, fake = docker_worker(tmp_path)
    assert a.container is not None
    ran: list[list[str]] = []
    monkeypatch.setattr(a.container, "prepare", lambda: None)
    monkeypatch.setattr(a.container.rt, "list_cluster", lambda ctx: ["docker", "ps"])
    monkeypatch.setattr(a.container.rt, "parse_listing", lambda ctx, out: [("ray-c1-7", "7")])
    monkeypatch.setattr(a.container, "_run", lambda argv, timeout=0: ran.append(argv) or
                        proc.Result(argv, 0, "", ""))
    fake.set_outage(True)
    said: list[str] = []
    monkeypatch.setattr("ray_slurm_provider.agent.agent.log", said.append)
    a.prepare_container()
    assert ran == [["docker", "ps"]]  # listed the containers, removed none
    assert any("could not sweep old containers" in s for s in said), said


def test_the_containers_slurm_probe_asks_a_throttled_controller_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A slow answer is no "the autoscaler cannot reach Slurm from its container"."""
    from ray_slurm_provider.agent import probe
    from ray_slurm_provider.slurm.client import PermanentSlurmError, TransientSlurmError

    fake = FakeSlurm()
    fake.submit(JobSpec("ray-c1", ["true"]))
    monkeypatch.setattr(probe, "client_for", lambda d: fake)
    waits: list[float] = []
    fake.fail_next("list_jobs", TransientSlurmError(TIMED_OUT))
    assert probe.main([str(tmp_path), "c1"], sleep=waits.append) == 0
    assert "ok: 1 job(s)" in capsys.readouterr().out and len(waits) == 1
    fake.fail_next("list_jobs", PermanentSlurmError("x", "Invalid user", "squeue"))
    assert probe.main([str(tmp_path), "c1"], sleep=waits.append) == 1
    assert "Slurm said: Invalid user" in capsys.readouterr().out and len(waits) == 1
