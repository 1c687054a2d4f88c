"""The cluster directory: state shared by the login node, the head and the workers.

Slurm itself holds each node's immutable identity (job name `ray-<cluster>`, creation tags in
the job comment). What changes over a node's life lives here, on a filesystem that the login
node and the compute nodes share (the user's home on any HPC site):

    <state_dir>/<cluster>/
        auth_token                 0600 Ray token
        ray_bootstrap_config.yaml  the head's autoscaler config (per cluster, not per user)
        head.json                  HeadInfo: written by the head agent once Ray is up
        teardown                   the head's job was cancelled: workers skip Ray's drain
        logs/<job id>.out          every job's output (an array task's id: <array>_<task>)
        nodes/<job id>/tags.json   tags Ray set after creation; tags.gen changes with each
        nodes/<job id>/agent.json  AgentInfo: the node agent is alive
        nodes/<job id>/ray.json    RayUp: Ray is up on that node
        nodes/<job id>/start.json  StartRequest: `ray up` (or `ray-slurm sbatch`) -> head agent
        nodes/<job id>/result.json StartResult: head agent -> `ray up`, how the start went
        nodes/<job id>/ray-stop    `ray stop` (handoff.py) -> the head agent: stop this job's Ray
        nodes/<job id>/released    a gang member the autoscaler let go: its task ends with 0
        nodes/<job id>/orphan      Slurm ended the job but its Ray runs on: headwatch stops it
        nodes/<job id>/stop        legacy: all three of the above (see below)
        ray-logs/<job id>/         the node's Ray session logs, kept when its job ends

Every file that crosses a process boundary has one typed reader and writer here (NodeDir,
ClusterDir). Their JSON must stay as it is: agents of jobs queued with an older release, and
the other side of each hand-off, read it.

Legacy `stop` (remove after the next release): the previous release wrote one `stop` file
for all three markers. Agents of jobs queued with it read only `stop`, so each marker's
writer also writes `stop`; and a `stop` with no new marker beside it (written by the
previous release) counts as each of the three in its reader.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import filelock

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

R = TypeVar("R", bound="DataclassInstance")
logger = logging.getLogger(__name__)

_AGENT = "agent.json"
_RAY = "ray.json"
_START = "start.json"
_RESULT = "result.json"
_RAY_STOP = "ray-stop"
_RELEASED = "released"
_ORPHAN = "orphan"
_LEGACY_STOP = "stop"  # remove after the next release (module docstring)
_MARKERS = (_RAY_STOP, _RELEASED, _ORPHAN)
_TAGS = "tags.json"
_HEAD = "head.json"
_TEARDOWN = "teardown"


def poll_interval(waited_s: float) -> float:
    """Hand-off polling: fast while the other side likely waits (it adds to `ray up`)."""
    return 0.05 if waited_s < 30.0 else 0.5


def write_json(path: Path, data: Any, mode: int = 0o644) -> None:
    """Atomic write: readers on other nodes never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, sort_keys=True)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: str | Path) -> Any:
    """The file's JSON, or None when it does not exist (yet)."""
    try:
        with open(path) as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


#: How long update_json waits for another process's update before it gives up (OSError).
LOCK_WAIT_S = 30.0
#: Without flock, a lock file older than this is taken for one whose holder died (an update
#: holds it for milliseconds).
STALE_LOCK_S = 60.0
#: What flock(2) says where the filesystem cannot lock (Lustre without -o flock, NFSv3
#: without lockd): the update then takes a lock file instead (SoftFileLock).
NO_FLOCK = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
_SOFT_TRY_S = 1.0  # between looks at whether the lock file is stale
_flockless: set[int] = set()  # filesystems (st_dev) where flock failed: said once, not retried


def update_json(path: Path, fn: Callable[[Any], Any], mode: int = 0o644) -> Any:
    """Read, change and write back a JSON file that other processes (on other nodes) update
    too, under the lock file `.<name>.lock` beside it (`.<name>.softlock` where flock is
    missing), so that no update is lost. `fn` gets
    the file's JSON (None when there is none) and returns what to write; returns that.
    OSError when the lock cannot be had within LOCK_WAIT_S; ValueError if malformed."""
    with _locked(path.with_name(f".{path.name}.lock")):
        data = fn(read_json(path))
        write_json(path, data, mode)
    return data


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Hold `lock`: flock where the filesystem has it, else a lock file (see NO_FLOCK)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fs = os.stat(lock.parent).st_dev
    if fs not in _flockless:
        hard = filelock.FileLock(str(lock), timeout=LOCK_WAIT_S)
        try:
            hard.acquire()
        except filelock.Timeout as e:
            raise OSError(errno.ETIMEDOUT, f"{lock} held for over {LOCK_WAIT_S:g} s") from e
        except (OSError, NotImplementedError) as e:  # filelock 3 raises ENOSYS as the latter
            if isinstance(e, OSError) and e.errno not in NO_FLOCK:
                raise
            _flockless.add(fs)
            logger.warning("the filesystem of %s cannot lock with flock (%s): using lock "
                           "files there, broken when older than %g s", lock.parent, e,
                           STALE_LOCK_S)
        else:
            try:
                yield
            finally:
                hard.release()
            return
    # Beside, not on, the flock file: that one stays once made, and would look held.
    soft = _soft_acquire(lock.with_name(lock.name.replace(".lock", ".softlock")))
    try:
        yield
    finally:
        soft.release()


def locked(lock: Path) -> contextlib.AbstractContextManager[None]:
    """Hold the lock file `lock` (as update_json does): for appends other processes make too."""
    return _locked(lock)


def _soft_acquire(lock: Path, clock: Callable[[], float] = time.time) -> filelock.BaseFileLock:
    """A held SoftFileLock on `lock`, breaking a lock file older than STALE_LOCK_S."""
    deadline = clock() + LOCK_WAIT_S
    while True:
        soft = filelock.SoftFileLock(str(lock), timeout=_SOFT_TRY_S)
        try:
            soft.acquire()
            return soft
        except filelock.Timeout:
            if clock() >= deadline:
                raise OSError(errno.ETIMEDOUT,
                              f"{lock} held for over {LOCK_WAIT_S:g} s") from None
            _break_stale(lock, clock())


def _break_stale(lock: Path, now: float) -> None:
    """Remove `lock` if it is older than STALE_LOCK_S. It is renamed aside first and checked:
    a fresh lock another process took meanwhile is put back."""
    try:
        st = os.stat(lock)
    except FileNotFoundError:
        return
    if now - st.st_mtime < STALE_LOCK_S:
        return
    aside = lock.with_name(f"{lock.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return
    if os.stat(aside).st_ino != st.st_ino:
        with contextlib.suppress(FileExistsError):
            os.link(aside, lock)
    else:
        logger.warning("broke the stale lock %s (%.0f s old)", lock, now - st.st_mtime)
    aside.unlink(missing_ok=True)


def _read(path: str | Path, cls: type[R]) -> R | None:
    """A typed hand-off file, or None when it does not exist; ValueError if malformed. Keys
    the type does not know are ignored and a missing key takes its field's default (other
    releases' writers); a missing key without one is malformed."""
    return _typed(read_json(path), cls, str(path))


def _typed(data: Any, cls: type[R], where: str) -> R | None:
    if not isinstance(data, dict):
        return None
    names = {f.name for f in fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError as e:
        raise ValueError(f"{where}: malformed ({e})") from e


def parse_head(text: str, where: str) -> HeadInfo | None:
    """head.json's text as read elsewhere (the login node's, over provider.ssh)."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}: malformed ({e})") from e
    return _typed(data, HeadInfo, where)


@dataclass(frozen=True)
class AgentInfo:
    """agent.json: the job's agent runs (a step can run there now); how `ray exec` enters it."""

    host: str
    pid: int
    kind: str  # "head" | "worker"
    job_id: str = ""  # the numeric SLURM_JOB_ID (srun's for an array task); older agents: ""
    container_mounts: list[str] = field(default_factory=list)  # the node container's binds
    container_gpus: list[str] = field(default_factory=list)
    container_path: str = ""
    temp_dir: str = ""  # the Ray temp dir the agent made (agent/tempdir.py); older agents: ""


@dataclass(frozen=True)
class RayUp:
    """ray.json: Ray is up on the node, bound to `ip`: the node's address for the provider
    (autoscaler v1 matches heartbeats by it) and for `ray-slurm status`."""

    ip: str
    job_id: str


@dataclass(frozen=True)
class StartRequest:
    """start.json: the head's start program, from `ray up` (the runner) to the head agent."""

    id: str
    ray_start: list[str]  # argv of `ray start ...`
    exports: dict[str, str] = field(default_factory=dict)  # raw, still to be expanded
    env: dict[str, str] = field(default_factory=dict)
    before: list[str] = field(default_factory=list)  # shell commands to run first
    prefix: str = ""  # shell that precedes `ray start` in its command: runs in Ray's shell
    # `ray-slurm sbatch`: once Ray is up, run this as a Ray job; the head job ends with it.
    entrypoint: list[str] = field(default_factory=list)
    runtime_env: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StartResult:
    """result.json: how a start request went, from the head agent back to `ray up`."""

    id: str
    ok: bool
    error: str | None = None  # written only with a failure

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "ok": self.ok,
                **({"error": self.error} if self.error is not None else {})}


@dataclass(frozen=True)
class HeadInfo:
    """head.json: where the cluster's head runs, written by the head agent once Ray is up."""

    job_id: str
    ip: str
    gcs_port: int
    dashboard_port: int = 8265  # Ray's defaults, as `ray start` has them
    client_port: int = 10001

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- where they are --------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeDir:
    """One node's files: `nodes/<node id>/` (the id as the provider lists it)."""

    path: Path

    def write_agent(self, info: AgentInfo) -> None:
        write_json(self.path / _AGENT, asdict(info))

    def read_agent(self) -> AgentInfo | None:
        return _read(self.path / _AGENT, AgentInfo)

    def agent_up(self) -> bool:
        return (self.path / _AGENT).exists()

    def write_ray_up(self, up: RayUp) -> None:
        write_json(self.path / _RAY, asdict(up))

    def read_ray_up(self) -> RayUp | None:
        return _read(self.path / _RAY, RayUp)

    def ray_up(self) -> bool:
        return (self.path / _RAY).exists()

    def clear_ray_up(self) -> None:
        (self.path / _RAY).unlink(missing_ok=True)

    def write_start(self, req: StartRequest) -> None:
        # 0600: the environment `ray up` passes may hold secrets.
        write_json(self.path / _START, asdict(req), mode=0o600)

    def read_start(self) -> StartRequest | None:
        return _read(self.path / _START, StartRequest)

    def write_result(self, res: StartResult) -> None:
        write_json(self.path / _RESULT, res.to_dict())

    def read_result(self) -> StartResult | None:
        return _read(self.path / _RESULT, StartResult)

    # --- markers: each file one meaning (OSError from a writer: the node dir is gone) ---
    def _mark(self, name: str) -> None:
        (self.path / name).touch()
        (self.path / _LEGACY_STOP).touch()  # an agent of the previous release reads this

    def _marked(self, name: str) -> bool:
        if (self.path / name).exists():
            return True
        # A legacy `stop` alone was written by the previous release: it meant all three.
        return (self.path / _LEGACY_STOP).exists() and not any(
            (self.path / m).exists() for m in _MARKERS)

    def request_ray_stop(self) -> None:
        """`ray stop` on this node (handoff.py): the agent stops this job's Ray only."""
        self._mark(_RAY_STOP)

    def ray_stop_requested(self) -> bool:
        return self._marked(_RAY_STOP)

    def clear_ray_stop(self) -> None:
        """The head agent took a new start request: an earlier `ray stop` is done."""
        (self.path / _RAY_STOP).unlink(missing_ok=True)
        (self.path / _LEGACY_STOP).unlink(missing_ok=True)

    def release(self) -> None:
        """A gang member the autoscaler let go: its agent stops Ray and ends with exit 0."""
        self._mark(_RELEASED)

    def released(self) -> bool:
        return self._marked(_RELEASED)

    def mark_orphan(self) -> None:
        """Slurm ended this job but its Ray still runs: the agent's head watch stops it."""
        self._mark(_ORPHAN)

    def orphaned(self) -> bool:
        return self._marked(_ORPHAN)


class ClusterDir:
    """Paths of one cluster's shared state."""

    def __init__(self, state_dir: str, cluster_name: str) -> None:
        self.root = Path(os.path.expanduser(state_dir)) / cluster_name
        # `tags` and `ray_up` run for every node on every autoscaler tick: plain strings
        # there, pathlib costs more than the system calls (bench/p4_listing_cpu.py).
        self._nodes_dir = os.path.join(self.root, "nodes")
        self._tags_gen = os.path.join(self.root, "tags.gen")

    def create(self) -> None:
        for d in (self.root, self.logs, self.root / "nodes"):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def bootstrap_config(self) -> Path:
        return self.root / "ray_bootstrap_config.yaml"

    def log(self, job_id: str) -> Path:
        return self.logs / f"{job_id}.out"

    def ray_logs(self, job_id: str) -> Path:
        return self.root / "ray-logs" / job_id

    def node(self, job_id: str) -> NodeDir:
        return NodeDir(self.root / "nodes" / job_id)

    @property
    def head_file(self) -> Path:
        return self.root / _HEAD

    def write_head(self, info: HeadInfo) -> None:
        write_json(self.head_file, info.to_dict())

    def read_head(self) -> HeadInfo | None:
        """The running head, or None; ValueError if the file is malformed."""
        return _read(self.head_file, HeadInfo)

    def clear_head(self, job_id: str | None = None) -> None:
        """Remove head.json; with `job_id`, only while it names that job (not a newer head)."""
        if job_id is not None:
            info = self.read_head()
            if info is None or info.job_id != job_id:
                return
        self.head_file.unlink(missing_ok=True)

    def mark_teardown(self) -> None:
        """Written when the head's job is cancelled (`ray down`): workers that get SIGTERM
        then stop Ray at once instead of draining towards a GCS that is going away."""
        try:
            (self.root / _TEARDOWN).touch()
        except OSError:
            pass  # best effort: workers also see head.json go

    def teardown_marked(self) -> bool:
        return (self.root / _TEARDOWN).exists()

    def clear_teardown(self) -> None:
        (self.root / _TEARDOWN).unlink(missing_ok=True)

    def tags(self, job_id: str) -> dict[str, str]:
        try:
            with open(f"{self._nodes_dir}/{job_id}/{_TAGS}") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        return dict(data) if isinstance(data, dict) else {}

    def set_tags(self, job_id: str, tags: dict[str, str]) -> None:
        """Merge `tags` into the node's tags (`ray up` and the head's autoscaler both set
        them: under update_json's lock, neither loses the other's)."""
        update_json(self.node(job_id).path / _TAGS,
                    lambda old: {**(old if isinstance(old, dict) else {}), **tags})
        # Readers in other processes re-read the tags files only when this changed.
        write_json(self.root / "tags.gen", os.urandom(8).hex())

    def tags_generation(self) -> str:
        """Changes whenever any node's tags.json is written (one small read per tick)."""
        try:
            with open(self._tags_gen) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def ray_up(self, job_id: str) -> bool:
        """NodeDir.ray_up without building one (per node per tick)."""
        return os.path.exists(f"{self._nodes_dir}/{job_id}/{_RAY}")

    def ray_up_time(self, node_id: str) -> float | None:
        """When the node's ray.json was written (its Ray came up); None without one."""
        try:
            return os.stat(f"{self._nodes_dir}/{node_id}/{_RAY}").st_mtime
        except OSError:
            return None

    def ray_ip(self, node_id: str) -> str | None:
        """The address the node's Ray bound (NodeDir.read_ray_up's): None without ray.json
        (not up), "" when it is there but names no address (unreadable, not an object, no
        string `ip`): up, as ray_up says, its address unknown. No NodeDir built: the
        provider reads every node's once (10,000 on a restarted head's first tick under
        autoscaler v1)."""
        path = f"{self._nodes_dir}/{node_id}/{_RAY}"
        try:
            up = _read(path, RayUp)
        except (OSError, ValueError):
            return ""
        if up is None:  # no file, or JSON that is no object (null reads as no file)
            return "" if os.path.exists(path) else None
        return up.ip if isinstance(up.ip, str) else ""

    def released(self, node_id: str) -> bool:
        """NodeDir.released (per gang member per changed listing)."""
        return self.node(node_id).released()

    def forget(self, job_ids: list[str]) -> None:
        """Drop the state of nodes that are gone for good."""
        for j in job_ids:
            shutil.rmtree(self.node(j).path, ignore_errors=True)

    def known_nodes(self) -> list[str]:
        d = self.root / "nodes"
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []
