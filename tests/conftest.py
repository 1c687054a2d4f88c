"""Shared test setup: the session-wide Slurm sandbox and the no-skips-in-CI rule.

Tests marked ``integration`` or ``e2e`` get the ``sandbox`` fixture automatically. It reuses a
sandbox that already runs at ``$RAY_SLURM_SANDBOX_DIR`` (default /tmp/rsp-sandbox; CI starts
one with ``ray-slurm sandbox up``) and leaves it running; otherwise it starts one (3 nodes,
2 fake GPUs each, a private dockerd when docker.io is installed) and stops it at the end.
``RAY_SLURM_SANDBOX_PORT_OFFSET`` shifts the ports of a sandbox the fixture starts, so a test
run can live beside another sandbox.

When ``CI`` is set, a skipped test is a failed test (``RAY_SLURM_ALLOW_SKIPS=1`` relaxes that).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Generator, Iterator

import pytest

from ray_slurm_provider.provider.defaults import ENV as DEFAULTS_ENV
from ray_slurm_provider.sandbox import Sandbox, SandboxError, default_state_dir
from ray_slurm_provider.sandbox.procs import exists

# No site or personal defaults file of this machine leaks into a test (and every `ray up`
# the tests run inherits this); the tests of defaults name their files.
os.environ[DEFAULTS_ENV] = ""
# Ray's autoscaler ticks every 2 s instead of 5 in the test clusters (the head job inherits
# `ray up`'s environment): every scale-up and scale-down waits for a tick. Modules that
# count ticks set Ray's default back on their cluster (harness.RAY_DEFAULT_TICK).
os.environ.setdefault("AUTOSCALER_UPDATE_INTERVAL_S", "2")

SANDBOX_MARKERS = ("integration", "e2e", "accounting")
PORT_OFFSET_ENV = "RAY_SLURM_SANDBOX_PORT_OFFSET"
#: Another session's outage test may have a daemon stopped for a moment: wait this long for a
#: partly running sandbox to recover before repairing it.
SHARED_RECOVERY_S = 60.0
#: The modules whose tests run as the sandbox's users, with a Python built for them.
USER_VENV_MODULES = ("test_two_users", "test_apptainer", "test_laptop_tunnels", "test_strict")


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _no_skips() -> bool:
    return _truthy("CI") and not _truthy("RAY_SLURM_ALLOW_SKIPS")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a real GPU (CI runs -m 'not gpu')")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if _no_skips() and report.skipped and not hasattr(report, "wasxfail"):
        _skip_to_failure(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    if _no_skips() and report.skipped:
        _skip_to_failure(report)
    return report


def _skip_to_failure(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI, which counts as a failure "
                       f"(RAY_SLURM_ALLOW_SKIPS=1 allows it): {reason}")


@pytest.fixture(autouse=True)
def _sandbox_for_marked_tests(request: pytest.FixtureRequest) -> None:
    if any(request.node.get_closest_marker(m) for m in SANDBOX_MARKERS):
        request.getfixturevalue("sandbox")


def _shared_sandbox(state_dir: str) -> Sandbox | None:
    """The sandbox someone else runs at `state_dir`, or None when nothing runs there."""
    try:
        sb = Sandbox.from_state_dir(state_dir)
    except SandboxError:
        return None
    status = sb.status()
    if not any(pid is not None for pid in status.daemons.values()):
        return None
    deadline = time.monotonic() + SHARED_RECOVERY_S
    while not status.running and time.monotonic() < deadline:
        time.sleep(0.5)
        status = sb.status()
    if not status.running:
        sb.up()  # repair; starts only what is dead
    return sb


def _start_sandbox(state_dir: str) -> Sandbox:
    sb = Sandbox(state_dir, nodes=3, gpus_per_node=2,
                 docker=shutil.which("dockerd") is not None, users=2,
                 port_offset=int(os.environ.get(PORT_OFFSET_ENV, "0")))
    try:
        sb.up()
    except Exception:
        sb.down()
        raise
    return sb


@pytest.fixture(scope="session")
def sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """The local Slurm sandbox, its env exported into os.environ for the whole session."""
    state_dir = default_state_dir()
    started = False
    try:
        sb = _shared_sandbox(state_dir)
        if sb is None:
            sb = _start_sandbox(state_dir)
            started = True
    except (SandboxError, ValueError) as e:
        message = f"the Slurm sandbox is unavailable: {e}"
        if _truthy("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    modules = {getattr(item.module, "__name__", "") for item in request.session.items
               if isinstance(item, pytest.Function)}
    if sb.users() and any(m.endswith(USER_VENV_MODULES) for m in modules):
        from tests.e2e.users import prepare_user_venv  # imports Ray: only when needed
        prepare_user_venv(sb)  # ~1 min of pip, overlapped with the tests before them
    saved = {k: os.environ.get(k) for k in [*sb.env(), "SLURM_JWT"]}
    os.environ.pop("SLURM_JWT", None)  # with it, srun authenticates by JWT and task launch fails
    os.environ.update(sb.env())
    try:
        yield sb
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if started:
            pids = [p for p in sb.status().daemons.values() if p is not None]
            sb.down()
            alive = [p for p in pids if exists(p)]
            assert not alive, f"sandbox down left daemons running: {alive}"
            assert not os.path.exists(sb.state_dir), f"down left {sb.state_dir}"


@pytest.fixture(scope="session")
def login_sandbox(sandbox: Sandbox) -> Sandbox:
    """The session's sandbox with its login node (`up --login`); one started without it
    gets its sshd added (`up` on a running sandbox starts only what the shape adds)."""
    if not sandbox.users():
        pytest.skip("the login node needs the sandbox's users (sandbox up --users N)")
    sb = Sandbox.from_state_dir(sandbox.state_dir)
    if not sb.spec.login:
        s = sb.spec
        sb = Sandbox(sb.state_dir, nodes=s.nodes, gpus_per_node=s.gpus_per_node,
                     cpus_per_node=s.cpus_per_node, memory_mb_per_node=s.memory_mb_per_node,
                     docker=s.docker, port_offset=s.port_offset, users=s.users, slurm=s.slurm,
                     accounting=s.accounting, pyxis=s.pyxis, pyslurm=s.pyslurm,
                     login=True)
        sb.up(install=True)  # openssh-server, as the phase's own `up --install` would
    return sb
