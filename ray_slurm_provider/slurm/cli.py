"""`SlurmClient` over the Slurm command-line tools (sbatch, squeue, scancel, scontrol, sinfo).

Text formats with explicit fields and delimiters are used on purpose: they read the same on
every Slurm from 21.08 on, need no JSON-C build option, and cost far less than `--json`, which
dumps every field of every job.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from ray_slurm_provider import proc
from ray_slurm_provider.slurm import parse
from ray_slurm_provider.slurm.client import (
    JOB_ID_RE,
    KEEP_VARS,
    LIST_STATES,
    SCRUB_PREFIXES,
    ClusterInfo,
    EndedJob,
    Job,
    Node,
    Partition,
    PermanentSlurmError,
    SlurmError,
    TransientSlurmError,
    classify,
    is_job_gone,
    unreachable,
)
from ray_slurm_provider.slurm.sacct import Accounting, controller_end
from ray_slurm_provider.slurm.script import JobSpec, render
from ray_slurm_provider.slurm.ssh import SshError
from ray_slurm_provider.units import parse_duration

_INSTALL_HINT = (
    "install the Slurm client (e.g. `apt-get install slurm-client`) or mount your site's Slurm "
    "binaries, /etc/slurm and the munge socket, or use the REST transport (slurm_api: rest)"
)


#: Empty answers of `scontrol show federation` in a row before listings skip the federation
#: (squeue --local): an answer the controller lost prints nothing too (_learn_local).
NO_FEDERATION_ANSWERS = 2


class CliSlurmClient:
    """Talks to Slurm by running its commands; constructing it runs nothing."""

    def __init__(self, *, timeout: float = 30.0, env: Mapping[str, str] | None = None,
                 binaries: Mapping[str, str] | None = None,
                 remote: proc.Remote | None = None) -> None:
        self._timeout = timeout
        # provider.ssh: every command runs on the login node, through this one connection.
        self._remote = remote
        self._base_env = dict(env) if env is not None else None  # None: os.environ at call time
        self._binaries = dict(binaries or {})
        self._addr_lock = threading.Lock()  # guards _addrs
        self._fetch_lock = threading.Lock()  # one node-table fetch at a time
        self._addrs: dict[str, str] = {}
        self._listing = threading.local()  # a SqueueCache per calling thread
        self._local: bool | None = None  # squeue --local (`_local_flag`); None: not known yet
        self._no_federation_seen = 0  # empty answers of `scontrol show federation` so far

    # --- plumbing -------------------------------------------------------------------------

    def command_env(self) -> dict[str, str]:
        """The environment every command runs with (scrubbed, standard time format)."""
        return proc.clean_env(
            self._base_env if self._base_env is not None else os.environ,
            drop_prefixes=SCRUB_PREFIXES, keep=KEEP_VARS,
            extra={"SLURM_TIME_FORMAT": "standard"},
        )

    def _run_raw(self, name: str, args: Sequence[str], input: str | None = None) -> proc.Result:
        argv = [self._binaries.get(name, name), *args]
        try:
            if self._remote is not None:  # the login node's own environment, our time format
                return self._remote.run(argv, timeout=self._timeout, input=input,
                                        env={"SLURM_TIME_FORMAT": "standard"})
            return proc.run(argv, timeout=self._timeout, input=input, env=self.command_env())
        except SshError as e:
            raise unreachable(str(e), e.transient, name) from e
        except proc.CommandNotFound as e:
            raise PermanentSlurmError(
                f"{argv[0]}: command not found; {_INSTALL_HINT}", command=name) from e
        except proc.CommandTimeout as e:
            # What it printed so far tells a dead controller from, e.g., a missing slurm.conf
            # (22.05 retries that for 60 s, "retrying in 1sec up to 60sec").
            said = (e.stderr or "").strip()
            msg = f"{name}: no answer within {self._timeout:g}s"
            raise TransientSlurmError(f"{msg}; it said: {said}" if said else msg,
                                      said, name) from e

    def _run(self, name: str, args: Sequence[str], input: str | None = None) -> str:
        try:
            return self._run_raw(name, args, input).stdout
        except proc.CommandFailed as e:
            raise classify(_words(e), name) from e

    # --- SlurmClient ----------------------------------------------------------------------

    def submit(self, spec: JobSpec, *, comment: str = "") -> str:
        """Run `sbatch --parsable` with the rendered script on stdin; return the job id.

        A timeout raises TransientSlurmError although the job may have been queued; callers
        find such jobs again by name with `list_jobs`.
        """
        return self._sbatch(render(spec), [], comment)

    def ended_job(self, job_id: str) -> EndedJob | None:
        """How `job_id` ended: slurmctld's record while it keeps the job (MinJobAge; no wait
        for slurmdbd, no accounting needed), else accounting (sacct). See `EndReader`."""
        try:
            return controller_end(self._run("scontrol", ["show", "job", "-o", job_id]))
        except PermanentSlurmError as e:
            if not is_job_gone(e.slurm_message):
                raise
        return Accounting(timeout=self._timeout, env=self._base_env,
                          remote=self._remote).ended_job(job_id)

    def submit_array(self, spec: JobSpec, count: int, *, comment: str = "") -> list[str]:
        """ONE `sbatch --array=0-<count-1>`: `count` jobs in one controller RPC.

        Returns the task ids `<array id>_<task>`, the ids squeue (%i), scancel and the job's
        own SLURM_ARRAY_JOB_ID/SLURM_ARRAY_TASK_ID agree on. Timeouts: as `submit`.
        """
        if count < 1:
            raise ValueError(f"an array needs at least one task, got {count}")
        array_id = self._sbatch(render(spec), [f"--array=0-{count - 1}"], comment)
        return [f"{array_id}_{i}" for i in range(count)]

    def _sbatch(self, script: str, extra: list[str], comment: str) -> str:
        """The job name is the script's own `#SBATCH --job-name` (script.render writes it);
        the comment goes on the command line, where it overrides any `--comment` the user's
        extra directives set."""
        if "\n" in comment:
            raise ValueError("the job comment must be one line (squeue prints one per job)")
        args = ["--parsable", *extra]
        if comment:
            args.append(f"--comment={comment}")
        out = self._run("sbatch", args, input=script)
        try:
            return parse.parse_sbatch(out)
        except ValueError as e:
            raise PermanentSlurmError(str(e), command="sbatch") from e

    def list_jobs(self, job_name: str) -> list[Job]:
        """This user's jobs named `job_name` in active states (plus COMPLETING); one squeue.

        `--array`: every array task on its own line, pending ones too (without it squeue
        folds the pending tasks of an array into one `123_[4-7]` line).
        """
        if not job_name or "," in job_name:
            raise ValueError(f"job name must be non-empty and without commas: {job_name!r}")
        out = self._run("squeue", [
            "--me", "--array", "--noheader", *self._local_flag(), f"--name={job_name}",
            f"--states={LIST_STATES}", f"--format={parse.SQUEUE_FORMAT}",
        ])
        if self._local is None:
            self._learn_local()
        with self._addr_lock:
            cached = self._addrs  # replaced, never mutated: safe to read after the lock
        fetched = not cached and f"{parse.DELIM}RUNNING{parse.DELIM}" in out
        if fetched:
            # The first listing with a running job: fetch the node table before parsing, so
            # each job gets its address as it is built instead of being rebuilt afterwards.
            self._addresses_for({""})  # "" is never a node: the table is fetched
            with self._addr_lock:
                cached = self._addrs
        try:
            cache = getattr(self._listing, "cache", None)
            if cache is None:
                cache = self._listing.cache = parse.SqueueCache()
            jobs = cache.parse(out, cached)
        except ValueError as e:
            raise PermanentSlurmError(f"cannot parse squeue output: {e}", command="squeue") from e
        # Addresses came from the cached node table; fetch it only for a host not in it yet
        # (jobs the cache kept were looked up in this same table when first parsed).
        missing = {j.batch_host for j in cache.fresh if j.batch_host and j.batch_host not in cached}
        if not missing or fetched:  # a table fetched just now has no more to tell
            return jobs
        addrs = self._addresses_for(missing)
        return [replace(j, node_addr=addrs.get(j.batch_host, "")) if j.batch_host else j
                for j in jobs]

    def _local_flag(self) -> list[str]:
        """["--local"] once the cluster is known to be in no federation: squeue then skips
        REQUEST_FED_INFO, which 25.11's squeue sends on every call otherwise (3 RPCs a
        listing instead of 2: P7, issue 29; a rate-limited user's bucket pays for each)."""
        return ["--local"] if self._local else []

    def _learn_local(self) -> None:
        """Ask, right after a listing the controller answered, whether the cluster is in a
        federation. In one, a job may run on a sibling and be known here only as REVOKED, so
        squeue must keep asking the federation. `scontrol show federation` prints nothing when
        the cluster is in none, but also (exit 0, no stderr: scontrol_print_federation) when
        the controller's answer was lost; so only NO_FEDERATION_ANSWERS empty answers in a
        row make --local. One that names a federation decides at once; one that fails or
        says anything on stderr leaves it unknown, to be asked after the next listing."""
        try:
            res = self._run_raw("scontrol", ["show", "federation"])
        except (proc.CommandFailed, SlurmError):
            return
        if res.stderr.strip():
            return
        if res.stdout.strip():
            self._local = False
            return
        self._no_federation_seen += 1
        if self._no_federation_seen >= NO_FEDERATION_ANSWERS:
            self._local = True

    def user_job_ids(self) -> set[str]:
        """Every id of this user's jobs squeue lists, any name, any state (UserJobs)."""
        out = self._run("squeue", ["--me", "--array", "--noheader", "--states=all",
                                   "--format=%i %A"])
        ids = set(out.split())
        bad = sorted(i for i in ids if not JOB_ID_RE.match(i))
        if bad:  # a shorter list would read as "those jobs are gone"
            raise PermanentSlurmError(f"cannot parse squeue output: {bad[:3]}", command="squeue")
        return ids

    def cancel(self, job_ids: Iterable[str]) -> None:
        """One scancel for all ids; jobs that are already gone are not an error."""
        ids = sorted({str(j).strip() for j in job_ids})
        if not ids:
            return
        bad = [j for j in ids if not JOB_ID_RE.match(j)]
        if bad:
            # scancel would say "Invalid job id", which reads like "already gone".
            raise ValueError(f"not Slurm job ids: {bad}")
        try:
            res = self._run_raw("scancel", ids)
        except proc.CommandFailed as e:
            _raise_unless_gone(_words(e), e)
            return
        # scancel may also report per-job errors on stderr with exit code 0.
        _raise_unless_gone(res.stderr, None)

    def cluster_info(self) -> ClusterInfo:
        """Version, partitions and nodes (three commands; callers cache the result)."""
        version_out = self._run("sinfo", ["--version"])
        nodes = self._nodes()
        part_out = self._run("scontrol", ["show", "partition", "--oneliner"])
        try:
            records = parse.parse_scontrol_records(part_out, "PartitionName")
            return ClusterInfo(parse.parse_version(version_out),
                               tuple(_partition(r, nodes) for r in records))
        except (ValueError, KeyError) as e:
            raise PermanentSlurmError(f"cannot parse cluster info: {e}", command="scontrol") from e

    def node_addresses(self) -> Mapping[str, str]:
        """Node name -> NodeAddr, fetched fresh (and refreshing the cache)."""
        self._nodes()
        with self._addr_lock:
            return dict(self._addrs)

    def node_address(self, name: str) -> str | None:
        """`scontrol show node <name>`: one node's record, not the whole table."""
        out = self._run("scontrol", ["show", "node", name, "--oneliner"])
        for r in parse.parse_scontrol_records(out, "NodeName"):
            if r.get("NodeName") == name:
                return _node(r).addr
        return None

    # --- helpers --------------------------------------------------------------------------

    def _nodes(self) -> list[tuple[Node, list[str]]]:
        out = self._run("scontrol", ["show", "node", "--oneliner"])
        nodes = [(_node(r), [p for p in r.get("Partitions", "").split(",") if p])
                 for r in parse.parse_scontrol_records(out, "NodeName")]
        with self._addr_lock:
            self._addrs = {n.name: n.addr for n, _ in nodes}
        return nodes

    def _addresses_for(self, hosts: set[str]) -> dict[str, str]:
        """The cached address table, fetched first if a host is not in it yet (node
        addresses rarely change). Concurrent callers share one fetch."""
        with self._addr_lock:
            if hosts <= self._addrs.keys():
                return dict(self._addrs)
        with self._fetch_lock:
            with self._addr_lock:
                if hosts <= self._addrs.keys():  # another thread fetched it meanwhile
                    return dict(self._addrs)
            self._nodes()
            with self._addr_lock:
                return dict(self._addrs)


def _words(e: proc.CommandFailed) -> str:
    """Slurm's own message from a failed command."""
    return (e.stderr or "").strip() or (e.stdout or "").strip() or str(e)


def _raise_unless_gone(stderr: str, cause: proc.CommandFailed | None) -> None:
    lines = [ln.strip() for ln in stderr.splitlines() if "error" in ln.lower()]
    if cause is not None and not lines:
        lines = [_words(cause)]
    bad = [ln for ln in lines if not is_job_gone(ln)]
    if bad:
        raise classify("\n".join(bad), "scancel") from cause


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0


def _node(r: dict[str, str]) -> Node:
    name = r["NodeName"]
    gres = r.get("Gres", "")
    return Node(name=name, addr=r.get("NodeAddr") or name, state=r.get("State", ""),
                cpus=_int(r.get("CPUTot", "0")), memory_mb=_int(r.get("RealMemory", "0")),
                gres="" if gres == "(null)" else gres)


def _partition(r: dict[str, str], nodes: list[tuple[Node, list[str]]]) -> Partition:
    name = r["PartitionName"]
    members = [n for n, parts in nodes if name in parts]
    if not members and r.get("Nodes", "(null)") not in ("", "(null)"):
        # Older scontrol prints no Partitions= per node: expand the partition's host list.
        wanted = set(parse.expand_hostlist(r["Nodes"]))
        members = [n for n, _ in nodes if n.name in wanted]
    # Per-node sizes are the smallest member's: a job asking for that much fits on every node.
    smallest = min(members, key=lambda n: (parse.parse_gres_gpus(n.gres), n.cpus, n.memory_mb),
                   default=None)
    return Partition(
        name=name,
        nodes=tuple(members),
        cpus_per_node=min((n.cpus for n in members), default=0),
        memory_mb_per_node=min((n.memory_mb for n in members), default=0),
        gpus_per_node=parse.parse_gres_gpus(smallest.gres) if smallest else 0,
        gres=smallest.gres if smallest else "",
        max_time_s=parse_duration(r.get("MaxTime", "UNLIMITED")),
        default_time_s=parse_duration(r.get("DefaultTime", "NONE")),
        default=r.get("Default", "NO").upper() == "YES",
        state=r.get("State", "UP"),
    )
