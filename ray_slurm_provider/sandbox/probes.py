"""Questions the sandbox asks its daemons: is the controller up, which nodes are idle, does
slurmrestd answer, is dockerd there. Plus `wait_until`, the only way the sandbox waits.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox.procs import SandboxError

#: Node states (``sinfo %t``, without the "*" not-responding flag) that count as up.
READY_STATES = frozenset({"idle", "mix", "alloc", "comp", "resv", "plnd"})


def wait_until(
    cond: Callable[[], bool],
    timeout_s: float,
    what: str,
    detail: Callable[[], str] | None = None,
) -> None:
    """Poll `cond` (fast at first, then every 0.25 s) until true; raise SandboxError at the
    deadline, naming `what` and adding `detail()` (e.g. a log tail)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while not cond():
        if time.monotonic() >= deadline:
            extra = detail() if detail is not None else ""
            raise SandboxError(f"timed out after {timeout_s:g}s waiting for {what}"
                               + (f"\n{extra}" if extra else ""))
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


def _quiet(argv: list[str], env: Mapping[str, str], timeout: float = 10.0) -> proc.Result | None:
    try:
        return proc.run(argv, env=env, timeout=timeout, check=False)
    except proc.CommandError:
        return None


def controller_up(env: Mapping[str, str]) -> bool:
    """True when ``scontrol ping`` says the controller is UP."""
    res = _quiet(["scontrol", "ping"], env)
    return res is not None and res.returncode == 0 and "is UP" in res.stdout


def node_states(env: Mapping[str, str]) -> dict[str, str]:
    """Node name -> compact state (``sinfo %t``: "idle", "mix", "down*", ...); {} if the
    controller does not answer."""
    res = _quiet(["sinfo", "-N", "-h", "-o", "%N %t"], env)
    if res is None or res.returncode != 0:
        return {}
    states: dict[str, str] = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def node_ready(state: str) -> bool:
    """True for a responding node that can run jobs (idle, mix, alloc, ...)."""
    return not state.endswith("*") and state.rstrip("~#!%$@^-") in READY_STATES


def listening_tcp_ports() -> set[int]:
    """Every TCP port some process on this machine listens on (from /proc/net/tcp{,6})."""
    ports: set[int] = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return ports


def rest_status(url: str, token: str | None, version: str, path: str = "ping") -> int | None:
    """HTTP status of ``GET <url>/slurm/<version>/<path>`` (with the JWT when given), or None
    when nothing answers."""
    req = urllib.request.Request(f"{url}/slurm/{version}/{path}")
    if token is not None:
        req.add_header("X-SLURM-USER-NAME", "root")
        req.add_header("X-SLURM-USER-TOKEN", token)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError):
        return None


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._socket_path)
        self.sock = sock


def docker_api(socket_path: str, method: str, path: str, timeout: float = 30.0) -> tuple[int, str]:
    """One Docker Engine API call over the daemon's unix socket; (status, body)."""
    conn = _UnixHTTPConnection(socket_path, timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def docker_up(socket_path: str) -> bool:
    """True when dockerd answers ``/_ping`` on its socket."""
    try:
        status, body = docker_api(socket_path, "GET", "/_ping", timeout=5)
    except OSError:
        return False
    return status == 200 and body.strip() == "OK"


def docker_remove_all(socket_path: str) -> int:
    """Force-remove every container of this (private) dockerd; return how many."""
    status, body = docker_api(socket_path, "GET", "/containers/json?all=1")
    if status != 200:
        raise SandboxError(f"dockerd: listing containers failed ({status}): {body.strip()}")
    ids = [c["Id"] for c in json.loads(body)]
    for cid in ids:
        status, body = docker_api(socket_path, "DELETE", f"/containers/{cid}?force=1&v=1")
        if status not in (204, 404):
            raise SandboxError(f"dockerd: removing {cid[:12]} failed ({status}): {body.strip()}")
    return len(ids)


def log_tail(path: str, lines: int = 15) -> str:
    """The last lines of a log file, for error messages."""
    try:
        with open(path, errors="replace") as f:
            tail = f.readlines()[-lines:]
    except OSError:
        return ""
    return f"--- last lines of {path} ---\n" + "".join(tail).rstrip()
