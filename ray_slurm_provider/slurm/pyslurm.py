"""`SlurmClient` over pyslurm (optional extra `ray-slurm-provider[pyslurm]`, GPL-2.0).

pyslurm links libslurm, so its release must match the cluster's Slurm release exactly:
pyslurm X.Y.z builds only against Slurm X.Y headers (PyPI ships only sdists; 25.11.x needs
Slurm 25.11; for older Slurm install the matching tag from github.com/PySlurm/pyslurm or your
site's package). It is imported on first use, never at module import, and every failure to
load it, or a release that does not match the nodes' slurmd, is a `PermanentSlurmError` that
says so.

The pyslurm API used (pyslurm >= 23.2 "core" API): `__version__`, `RPCError`,
`JobSubmitDescription(**attributes).submit()` (the attributes in `description`),
`Jobs.load().values()` (Job: id, name, user_name, state, state_reason,
allocated_nodes, batch_host, time_limit [min], run_time_remaining [s], submit_time,
start_time [epoch], partition, comment), `Job(id).cancel()`, `Nodes.load().values()` (Node:
name, address, state, total_cpus, real_memory, configured_gres {name: count}, partitions,
slurm_version), `Partitions.load().values()` (Partition: name, nodes, max_time,
default_time [min or "UNLIMITED"], is_default, state). Checked against pyslurm 25.11.2 on the
sandbox's Slurm 25.11.7 (`sandbox up --slurm 25.11 --pyslurm`; tests/fixtures/pyslurm-25.11/):
a Node's release is `slurm_version` and a Partition's limit `max_time` there (the fake had
`version` and `max_time_limit`, which 25.11.2 does not have).

A job is submitted from the JobSpec's fields, like the REST back end's: slurmctld reads no
`#SBATCH` lines, and pyslurm's own `load_sbatch_options` reads them only from a script FILE
(it refuses script text) and skips the options it does not know. The user's own options
(`sbatch_options`, `extra_directives`) are set through `_OPTIONS`; one it lacks is an error
naming it, never dropped.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from types import ModuleType
from typing import Any

from ray_slurm_provider import proc
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.client import (
    LIST_STATES,
    ClusterInfo,
    EndedJob,
    Job,
    Node,
    PermanentSlurmError,
    SlurmError,
    TransientSlurmError,
    classify,
    is_job_gone,
    job_environment,
)
from ray_slurm_provider.slurm.rest import parse as rest_parse
from ray_slurm_provider.slurm.script import render, user_options
from ray_slurm_provider.slurm.spec import JobSpec
from ray_slurm_provider.units import parse_duration

INSTALL_HINT = (
    "pyslurm X.Y works only with Slurm X.Y: `pip install pyslurm==<your Slurm X.Y>.*` builds "
    "against your Slurm headers and libslurmfull (PyPI has only 25.11.x, for Slurm 25.11; for "
    "older releases install the matching tag from https://github.com/PySlurm/pyslurm or your "
    "site's package), or use provider.slurm_api: cli or rest"
)
_STATES = frozenset(LIST_STATES.split(","))
logger = logging.getLogger(__name__)

#: The user's sbatch options -> JobSubmitDescription attributes (each documented as "same as
#: --<option> from sbatch", so they take sbatch's values); flags map to the value to set.
#: The same options the REST back end translates (rest/fields.py).
_OPTIONS: dict[str, str] = {
    "comment": "comment", "wckey": "wckey", "mail-user": "mail_user", "mail-type": "mail_types",
    "dependency": "dependencies", "chdir": "working_directory", "input": "standard_in",
    "licenses": "licenses", "ntasks-per-node": "ntasks_per_node",
    "mem-per-cpu": "memory_per_cpu", "gpus": "gpus",
}
_FLAGS: dict[str, tuple[str, Any]] = {"hold": ("priority", 0)}


def major_minor(version: str) -> str:
    """"24.5.1" / "24.05.3" -> "24.05"; "" when not a version."""
    m = re.match(r"^(\d+)\.(\d+)", version.strip())
    return f"{int(m.group(1))}.{int(m.group(2)):02d}" if m else ""


class PyslurmSlurmClient:
    """Talks to slurmctld through pyslurm; constructing it imports nothing."""

    def __init__(self, *, module: ModuleType | None = None) -> None:
        self._mod = module
        self._lock = threading.Lock()
        self._checked = False
        self._release = ""
        self._addrs: dict[str, str] = {}

    # --- loading --------------------------------------------------------------------------

    def lib(self) -> Any:
        """pyslurm, imported on first use (after a child process imported it: see
        `probe_import`); PermanentSlurmError when missing or broken."""
        with self._lock:
            if self._mod is None:
                probe_import()
                try:
                    self._mod = importlib.import_module("pyslurm")
                except ModuleNotFoundError as e:
                    raise PermanentSlurmError(
                        f"provider.slurm_api is pyslurm but pyslurm is not installed ({e}); "
                        f"{INSTALL_HINT}", command="pyslurm") from e
                except (ImportError, OSError) as e:
                    raise PermanentSlurmError(
                        f"pyslurm is installed but cannot load against this machine's libslurm "
                        f"({e}); it was built for another Slurm release. {INSTALL_HINT}",
                        command="pyslurm") from e
                # Said once per process: the monitor log then shows which transport the
                # head's autoscaler runs on, as the REST client's "speaks vX" line does.
                logger.info("pyslurm %s loaded from %s",
                            getattr(self._mod, "__version__", "?"),
                            getattr(self._mod, "__file__", "?"))
            return self._mod

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        lib = self.lib()
        try:
            return fn(*args)
        except lib.RPCError as e:
            raise classify(f"{what}: {e}", "pyslurm") from e

    def _check_version(self, nodes: Iterable[Any]) -> None:
        """Refuse a pyslurm whose release differs from the nodes' slurmd release."""
        if self._checked:
            return
        ours = major_minor(str(getattr(self.lib(), "__version__", "")))
        theirs = {major_minor(_node_release(n)) for n in nodes} - {""}
        if ours and theirs and ours not in theirs:
            raise PermanentSlurmError(
                f"pyslurm {self.lib().__version__} is for Slurm {ours}, but this cluster runs "
                f"Slurm {', '.join(sorted(theirs))}. {INSTALL_HINT}", command="pyslurm")
        self._checked = True

    # --- SlurmClient ----------------------------------------------------------------------

    def ended_job(self, job_id: str) -> EndedJob | None:
        """How `job_id` ended, as the CLI back end reads it (scontrol, else sacct): pyslurm's
        job record has no final end for a job slurmctld no longer lists."""
        return CliSlurmClient().ended_job(job_id)

    def submit(self, spec: JobSpec, *, comment: str = "") -> str:
        kw = description(spec, comment)
        desc = self.lib().JobSubmitDescription(**kw)
        with _process_env_as(sys.modules.get(type(desc).__module__), kw["environment"]):
            return str(self._call("submitting a job", desc.submit))

    def list_jobs(self, job_name: str) -> list[Job]:
        if not job_name or "," in job_name:
            raise ValueError(f"job name must be non-empty and without commas: {job_name!r}")
        lib = self.lib()
        records = self._call("listing jobs", lib.Jobs.load)
        user = _user()
        jobs = []
        for j in records.values():
            if j.name != job_name or j.user_name != user:
                continue
            state = str(j.state or "").upper()
            if state not in _STATES:
                continue
            limit = j.time_limit if isinstance(j.time_limit, int) else None
            left = j.run_time_remaining if isinstance(j.run_time_remaining, int) else None
            jobs.append(Job(
                job_id=str(j.id), name=str(j.name), state=state,
                reason="" if j.state_reason in (None, "None") else str(j.state_reason),
                nodes=str(j.allocated_nodes or ""), batch_host=str(j.batch_host or ""),
                time_limit_s=None if limit is None else limit * 60,
                time_left_s=(None if limit is None else limit * 60) if state == "PENDING"
                else (None if left is None else max(0, left)),
                submit_time=rest_parse.stamp(j.submit_time or None),
                start_time=rest_parse.stamp(j.start_time or None),
                partition=str(j.partition or ""), comment=str(j.comment or "")))
        hosts = {j.batch_host for j in jobs if j.batch_host}
        if hosts and not hosts <= self._addrs.keys():
            self.node_addresses()
        return [replace(j, node_addr=self._addrs.get(j.batch_host, "")) for j in jobs]

    def cancel(self, job_ids: Iterable[str]) -> None:
        ids = sorted({str(j).strip() for j in job_ids})
        bad = [j for j in ids if not j.isdigit()]
        if bad:
            raise ValueError(f"not Slurm job ids: {bad}")
        lib = self.lib()
        for j in ids:
            try:
                self._call(f"cancelling job {j}", lib.Job(int(j)).cancel)
            except SlurmError as e:
                if not is_job_gone(e.slurm_message):
                    raise

    def cluster_info(self) -> ClusterInfo:
        lib = self.lib()
        nodes = self._nodes()
        parts = self._call("listing partitions", lib.Partitions.load)
        out = tuple(rest_parse.build_partition(
            str(p.name), str(p.nodes or ""), nodes,
            max_time_s=_minutes(p.max_time), default_time_s=_minutes(p.default_time),
            default=bool(p.is_default), state=str(p.state or "UP")) for p in parts.values())
        return ClusterInfo(self._release, out)

    def node_address(self, name: str) -> str | None:
        return self.node_addresses().get(name)

    def node_addresses(self) -> Mapping[str, str]:
        self._nodes()
        return dict(self._addrs)

    def _nodes(self) -> list[tuple[Node, list[str]]]:
        lib = self.lib()
        raw = list(self._call("listing nodes", lib.Nodes.load).values())
        self._check_version(raw)
        self._release = next((r for r in map(_node_release, raw) if r), "")
        nodes = []
        for n in raw:
            gres = n.configured_gres or {}
            gres_s = ",".join(f"{k}:{v}" for k, v in gres.items()) if isinstance(gres, Mapping) \
                else str(gres)
            nodes.append((Node(name=str(n.name), addr=str(n.address or n.name),
                               state=str(n.state or "").upper(), cpus=int(n.total_cpus or 0),
                               memory_mb=int(n.real_memory or 0), gres=gres_s),
                          [str(p) for p in (n.partitions or [])]))
        self._addrs = {node.name: node.addr for node, _ in nodes}
        return nodes


_ENV_LOCK = threading.Lock()
#: Slurm retries a SLURM_CONF that names a missing file for 60 s before it exits.
PROBE_TIMEOUT_S = 90.0


def probe_import() -> None:
    """Import pyslurm in a child process first: ``import pyslurm`` reads the Slurm
    configuration at once and, when it finds none, exits the process ("Could not establish a
    configuration source": measured with pyslurm 25.11.2), which must never be the
    autoscaler's. The child's failure becomes a SlurmError in Slurm's words."""
    argv = [sys.executable, "-c", "import pyslurm"]
    try:
        res = proc.run(argv, timeout=PROBE_TIMEOUT_S, check=False)
    except proc.CommandError as e:
        raise TransientSlurmError(f"import pyslurm in a child process: {e}",
                                  command="pyslurm") from e
    if res.returncode == 0:
        return
    text = (res.stderr.strip() or res.stdout.strip() or f"exit code {res.returncode}")
    last = text.splitlines()[-1]
    if "No module named 'pyslurm'" in text:
        raise PermanentSlurmError(f"provider.slurm_api is pyslurm but pyslurm is not "
                                  f"installed ({last}); {INSTALL_HINT}", command="pyslurm")
    if "ImportError" in text or "OSError" in text:
        raise PermanentSlurmError(
            f"pyslurm is installed but cannot load against this machine's libslurm ({last}); "
            f"it was built for another Slurm release. {INSTALL_HINT}", command="pyslurm")
    err = classify(f"import pyslurm exits the process: {text[-1000:]} (it reads the Slurm "
                   "configuration on import: is SLURM_CONF or /etc/slurm/slurm.conf there?)",
                   "pyslurm")
    raise err


@contextlib.contextmanager
def _process_env_as(module: ModuleType | None, env: Mapping[str, str]) -> Iterator[None]:
    """pyslurm gives a job whose environment is a dict every SLURM_* variable of the
    process first (submission.pyx: `_set_environment` reads its module's `pyenviron`, which
    is os.environ): let that name be the job's scrubbed environment while it submits. A
    pyslurm without the name is left alone (the user guide says what it then adds)."""
    if module is None or not isinstance(getattr(module, "pyenviron", None), Mapping):
        yield
        return
    with _ENV_LOCK:
        saved = module.pyenviron
        setattr(module, "pyenviron", env)  # noqa: B010 (a module attribute mypy cannot see)
        try:
            yield
        finally:
            setattr(module, "pyenviron", saved)  # noqa: B010


def _signal(value: str | None) -> str | None:
    """sbatch's `[flags:]sig[@time]` with the signal named as Python's `signal.Signals` does:
    pyslurm looks the name up there, so "TERM" is refused and "SIGTERM" taken."""
    if value is None:
        return None
    m = re.fullmatch(r"(?P<flags>[A-Za-z]+:)?(?P<sig>[A-Za-z0-9]+)(?P<time>@\d+)?", value)
    if m is None or m["sig"].isnumeric() or m["sig"].upper().startswith("SIG"):
        return value
    return f"{m['flags'] or ''}SIG{m['sig'].upper()}{m['time'] or ''}"


def description(spec: JobSpec, comment: str = "") -> dict[str, Any]:
    """The JobSubmitDescription attributes for `spec` (ScriptError if it is invalid)."""
    gres = [g for g in (spec.gres, spec.gpus_per_node and f"gpu:{spec.gpus_per_node}") if g]
    typed = {
        "partitions": spec.partition, "account": spec.account, "qos": spec.qos,
        "time_limit": _time_minutes(spec.time), "nodes": spec.nodes, "ntasks": spec.ntasks,
        "cpus_per_task": spec.cpus_per_task, "memory_per_node": spec.mem,
        # pyslurm has no gpus_per_node: its docs say to ask for GPUs per node as GRES.
        "gres_per_node": ",".join(gres) or None, "constraints": spec.constraint,
        "resource_sharing": "no" if spec.exclusive else None,
        "reservations": spec.reservation, "required_nodes": spec.nodelist,
        "excluded_nodes": spec.exclude, "signal": _signal(spec.signal),
        "standard_output": spec.output, "standard_error": spec.error,
        "log_files_open_mode": spec.open_mode, "is_requeueable": spec.requeue,
    }
    # Not "ALL" (pyslurm copies the process's environment as it is), but what the CLI back
    # end's sbatch exports (and `submit` keeps pyslurm from adding the process's SLURM_*).
    kw: dict[str, Any] = {"script": render(spec), "name": spec.job_name,
                          "environment": job_environment(os.environ)}
    kw.update((k, v) for k, v in typed.items() if v is not None)
    for key, value in user_options(spec):
        if key in _FLAGS:
            if value is not None:
                raise _unsupported(f"--{key}={value}", "a flag takes no value")
            attr, flag = _FLAGS[key]
            kw[attr] = flag
        elif key in _OPTIONS:
            if value is None:
                raise _unsupported(f"--{key}", "needs a value")
            kw[_OPTIONS[key]] = value
        else:
            raise _unsupported(f"--{key}", "no translation")
    if comment:
        kw["comment"] = comment
    return kw


def _unsupported(option: str, why: str) -> PermanentSlurmError:
    return PermanentSlurmError(
        f"#SBATCH {option}: {why}; slurmctld does not read #SBATCH lines, so the pyslurm back "
        "end sets each option itself and cannot set this one. Drop it from the node config or "
        "use provider.slurm_api: cli", command="pyslurm")


def _time_minutes(time: str | None) -> int | None:
    """--time as whole minutes: pyslurm 25.11.2 takes an integer only ("TypeError: an
    integer is required" for "10", measured). Unlimited: unset, the partition's limit."""
    if time is None:
        return None
    seconds = parse_duration(time)
    return None if seconds is None else -(-seconds // 60)


def _node_release(node: Any) -> str:
    """The node's slurmd release: `slurm_version` (pyslurm 25.11), `version` before."""
    return str(getattr(node, "slurm_version", None) or getattr(node, "version", None) or "")


def _minutes(value: Any) -> int | None:
    return value * 60 if isinstance(value, int) and not isinstance(value, bool) else None


def _user() -> str:
    import getpass
    import os

    return os.environ.get("USER") or getpass.getuser()
