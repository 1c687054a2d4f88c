"""What the sandbox looks like on disk: its layout, and the slurm.conf/gres.conf/epilog it renders.

Pure functions and dataclasses; nothing here starts a process. Findings on Slurm 22.05.8
(Debian 12) that shaped these files:

- Every node gets its own loopback address (``NodeAddr=127.0.0.(K+1)``) and its **own port**
  (``Port=6831+K-1``). slurmd listens on ``0.0.0.0:<port>``; one shared port with
  ``CommunicationParameters=NoInAddrAny`` does not work (every slurmd binds the address of
  ``gethostname()``, so only one node comes up).
- Fake GPUs: gres.conf ``File=`` must point at character devices. Symlinks to ``/dev/null``
  work (``--gres=gpu:2`` gives ``CUDA_VISIBLE_DEVICES=0,1``). Regular files are rejected
  ("is not a valid character or block device") and ``Count=`` without ``File=`` (with or
  without ``Flags=CountOnly``) leaves the nodes INVAL/DRAIN with "gres/gpu count reported
  lower than configured (0 < 2)".
- ``SlurmdParameters=config_overrides`` makes slurmd report the configured CPUs/RealMemory,
  so nodes larger than the machine (and many of them) come up idle instead of INVAL.
- ``SelectTypeParameters=CR_CPU_Memory`` with ``DefMemPerCPU`` makes memory a consumable
  resource: a job with ``--mem`` books that much of its node, a job without gets
  ``DefMemPerCPU`` per CPU (not the whole node), so several jobs still share a node.
- Ports: slurmctld 6817, slurmrestd 6820, slurmd 6831+ (all shifted by ``port_offset``, so a
  second sandbox can run beside the first); ``SrunPortRange`` 60001-63000. All stay below
  Ray's worker ports (10002-19999) and the provider's port blocks (24000-33000).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from ray_slurm_provider.sandbox import accounting, pyslurmwheel, roots, strict
from ray_slurm_provider.sandbox.layout import Layout

CLUSTER_NAME = accounting.CLUSTER_NAME
CTLD_PORT = 6817
REST_HOST = "127.0.0.1"
REST_PORT = 6820
SLURMD_BASE_PORT = 6831
SRUN_PORT_RANGE = "60001-63000"
KILL_WAIT_S = 10
MAX_NODES = 250  # 127.0.0.2 .. 127.0.0.251
MAX_USERS = 16
MAX_PORT = 10001  # Ray's default worker ports start at 10002
MIN_JOB_AGE_S = 600  # the plain sandbox keeps finished jobs listed (strict: sandbox/strict.py)


def node_name(k: int) -> str:
    """Name of node K (1-based)."""
    return f"n{k}"


def node_addr(k: int) -> str:
    """Loopback address of node K: n1 is 127.0.0.2, n2 127.0.0.3, ..."""
    return f"127.0.0.{k + 1}"


def node_port(k: int, port_offset: int = 0) -> int:
    """slurmd port of node K: n1 6831, n2 6832, ... (plus the offset)."""
    return SLURMD_BASE_PORT + port_offset + k - 1


def hostlist(n: int) -> str:
    """Slurm host list for nodes n1..nN."""
    return "n1" if n == 1 else f"n[1-{n}]"


@dataclass(frozen=True)
class SandboxSpec:
    """The shape of the cluster; saved as ``sandbox.json`` so later calls know it."""

    nodes: int = 3
    gpus_per_node: int = 2
    cpus_per_node: int = 2
    memory_mb_per_node: int = 4000
    docker: bool = False
    port_offset: int = 0  # added to every daemon port
    users: int = 0  # throwaway Unix users (sandbox/users.py)
    slurm: str = roots.HOST_RELEASE  # the Slurm release (sandbox/roots.py)
    accounting: bool = False  # slurmdbd on MariaDB, QOSes, typed GPUs (sandbox/accounting.py)
    pyxis: bool = False  # enroot and the pyxis SPANK plugin (sandbox/pyxis.py)
    pyslurm: bool = False  # pyslurm built against the release (sandbox/pyslurmwheel.py)
    login: bool = False  # an sshd as the login node (sandbox/login.py)
    strict: bool = False  # rate limits, short MinJobAge, PrivateData (sandbox/strict.py)
    cgroups: bool = False  # task/cgroup confining cores and RAM (22.05 only: render_cgroup_conf)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be 1..{MAX_NODES}, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0, got {self.gpus_per_node}")
        if self.cpus_per_node < 1:
            raise ValueError(f"cpus_per_node must be >= 1, got {self.cpus_per_node}")
        if self.memory_mb_per_node < 1:
            raise ValueError(f"memory_mb_per_node must be >= 1, got {self.memory_mb_per_node}")
        if not 0 <= self.users <= MAX_USERS:
            raise ValueError(f"users must be 0..{MAX_USERS}, got {self.users}")
        roots.check_release(self.slurm)
        if self.accounting and roots.in_root(self.slurm):
            raise ValueError(f"--accounting runs only with the host's Slurm "
                             f"{roots.HOST_RELEASE} or one built from source "
                             f"({', '.join(roots.SOURCE)}): the roots carry no slurmdbd")
        if self.docker and roots.in_root(self.slurm):
            raise ValueError(f"--docker runs only with the host's Slurm {roots.HOST_RELEASE} "
                             f"(Slurm {self.slurm} lives in a root without a docker CLI)")
        if self.pyxis and self.slurm != roots.HOST_RELEASE:
            raise ValueError(f"--pyxis runs only with the host's Slurm {roots.HOST_RELEASE} "
                             f"(pyxis is built against the host's spank.h)")
        if self.pyslurm:
            pyslurmwheel.check_release(self.slurm)
        if self.strict:
            strict.check_release(self.slurm)
        if self.cgroups and self.slurm != roots.HOST_RELEASE:
            raise ValueError(f"--cgroups runs only with the host's Slurm {roots.HOST_RELEASE}: "
                             "newer slurmd fails on this machine's cgroup v1 layout")
        if self.login and self.users < 1:
            raise ValueError("--login needs --users N (N >= 1): the login node admits the "
                             "sandbox's users only")
        if self.port_offset < 0 or node_port(self.nodes, self.port_offset) > MAX_PORT:
            raise ValueError(f"port_offset {self.port_offset} puts slurmd ports past {MAX_PORT} "
                             "(Ray's worker port range starts at 10002)")

    @property
    def ctld_port(self) -> int:
        return CTLD_PORT + self.port_offset

    @property
    def rest_port(self) -> int:
        return REST_PORT + self.port_offset

    @property
    def rest_url(self) -> str:
        return f"http://{REST_HOST}:{self.rest_port}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> SandboxSpec:
        data = json.loads(text)
        return cls(
            nodes=int(data["nodes"]),
            gpus_per_node=int(data["gpus_per_node"]),
            cpus_per_node=int(data["cpus_per_node"]),
            memory_mb_per_node=int(data["memory_mb_per_node"]),
            docker=bool(data["docker"]),
            port_offset=int(data.get("port_offset", 0)),
            users=int(data.get("users", 0)),
            slurm=str(data.get("slurm", roots.HOST_RELEASE)),
            accounting=bool(data.get("accounting", False)),
            pyxis=bool(data.get("pyxis", False)),
            pyslurm=bool(data.get("pyslurm", False)),
            login=bool(data.get("login", False)),
            strict=bool(data.get("strict", False)),
            cgroups=bool(data.get("cgroups", False)),
        )

    @property
    def in_root(self) -> bool:
        return roots.in_root(self.slurm)

    @property
    def from_source(self) -> bool:
        """Built from source into the cache; runs on the host (sandbox/source.py)."""
        return roots.from_source(self.slurm)

    @property
    def own_clients(self) -> bool:
        """The release's client commands live in the state dir's bin/, first on PATH."""
        return self.in_root or self.from_source


def render_slurm_conf(layout: Layout, spec: SandboxSpec) -> str:
    """The sandbox's slurm.conf."""
    hosts = hostlist(spec.nodes)
    def_mem_per_cpu = max(1, spec.memory_mb_per_node // spec.cpus_per_node)
    lines = [
        "# Generated by ray_slurm_provider.sandbox; rewritten on every `up`.",
        f"ClusterName={CLUSTER_NAME}",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={spec.ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={layout.munge_socket}",
        "AuthAltTypes=auth/jwt",
        f"AuthAltParameters=jwt_key={layout.jwt_key}",
        f"StateSaveLocation={layout.ctld_dir}",
        f"SlurmdSpoolDir={layout.spool_dir}/%n",
        f"SlurmctldPidFile={layout.run_dir}/slurmctld.pid",
        f"SlurmdPidFile={layout.run_dir}/slurmd-%n.pid",
        f"SlurmctldLogFile={layout.log_dir}/slurmctld.log",
        f"SlurmdLogFile={layout.log_dir}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "SlurmdParameters=config_overrides",
        f"SrunPortRange={SRUN_PORT_RANGE}",
        "ProctrackType=proctrack/linuxproc",
        f"TaskPlugin={'task/cgroup,task/affinity' if spec.cgroups else 'task/none'}",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU_Memory",
        f"DefMemPerCPU={def_mem_per_cpu}",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "ReturnToService=2",
        f"KillWait={KILL_WAIT_S}",
        f"MinJobAge={strict.MIN_JOB_AGE_S if spec.strict else MIN_JOB_AGE_S}",
        "InactiveLimit=0",
        "GresTypes=gpu",
    ]
    if spec.docker:
        lines.append(f"Epilog={layout.epilog}")
    if spec.accounting:
        lines += accounting.slurm_conf_lines(layout, spec.port_offset)
    if spec.pyxis:
        lines.append(f"PlugStackConfig={layout.plugstack_conf}")
    if spec.strict:
        lines += strict.slurm_conf_lines()
    for k in range(1, spec.nodes + 1):
        kind, count = node_gpus(spec, k)
        gres = f" Gres=gpu:{kind + ':' if kind else ''}{count}" if count else ""
        lines.append(
            f"NodeName={node_name(k)} NodeHostname=localhost NodeAddr={node_addr(k)}"
            f" Port={node_port(k, spec.port_offset)} CPUs={spec.cpus_per_node}"
            f" RealMemory={spec.memory_mb_per_node}{gres} State=UNKNOWN"
        )
    lines.append(f"PartitionName=cpu Nodes={hosts} Default=YES MaxTime=INFINITE State=UP")
    if spec.gpus_per_node > 0:
        lines.append(f"PartitionName=gpu Nodes={hosts} MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def render_cgroup_conf(cgroups: bool = False) -> str:
    """cgroup.conf: no cgroup plugin. Newer slurmd (24.11 on) fails on this machine's cgroup
    v1 layout otherwise ("Unexpected fs type on /sys/fs/cgroup/systemd"); jobs are tracked by
    proctrack/linuxproc either way. With `cgroups` (22.05, the host's, measured: each step
    gets a cpuset and a memory cgroup under /sys/fs/cgroup/*/slurm_<node>/uid_<uid>/job_<id>)
    task/cgroup confines a job to its cores and its memory."""
    if not cgroups:
        return "# Generated by ray_slurm_provider.sandbox.\nCgroupPlugin=disabled\n"
    return ("# Generated by ray_slurm_provider.sandbox.\nCgroupPlugin=cgroup/v1\n"
            "CgroupMountpoint=/sys/fs/cgroup\nConstrainCores=yes\nConstrainRAMSpace=yes\n")


def node_gpus(spec: SandboxSpec, k: int) -> tuple[str, int]:
    """Node K's GPU type ("" untyped) and count. With accounting GPUs are typed, as at a real
    site: the last node (of two or more) has one a100, the others `gpus_per_node` h100."""
    g = spec.gpus_per_node
    if not spec.accounting or g <= 0:
        return "", g
    if spec.nodes >= 2 and k == spec.nodes:
        return accounting.GPU_TYPES[1], 1
    return accounting.GPU_TYPES[0], g


def fake_gpu_files(layout: Layout, spec: SandboxSpec, k: int) -> list[str]:
    """Paths of node K's fake GPU devices (each a symlink to /dev/null)."""
    d = layout.fake_gpu_dir(node_name(k))
    return [os.path.join(d, f"nvidia{i}") for i in range(node_gpus(spec, k)[1])]


def render_gres_conf(layout: Layout, spec: SandboxSpec) -> str:
    """The sandbox's gres.conf: one ``File=`` line per node, or nothing without GPUs."""
    lines = ["# Generated by ray_slurm_provider.sandbox.", "AutoDetect=off"]
    for k in range(1, spec.nodes + 1):
        kind, g = node_gpus(spec, k)
        if g <= 0:
            break
        d = layout.fake_gpu_dir(node_name(k))
        files = f"{d}/nvidia0" if g == 1 else f"{d}/nvidia[0-{g - 1}]"
        typed = f" Type={kind}" if kind else ""
        lines.append(f"NodeName={node_name(k)} Name=gpu{typed} File={files}")
    return "\n".join(lines) + "\n"


def render_epilog(layout: Layout) -> str:
    """Slurm Epilog: remove the finished job's containers (label ``slurm.job_id``).

    It runs as root after every job, even a SIGKILLed one. It always exits 0: a failing
    Epilog would drain the node.
    """
    return f"""#!/bin/sh
# Generated by ray_slurm_provider.sandbox: remove the containers of job $SLURM_JOB_ID.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
DOCKER_HOST={layout.docker_host}
export PATH DOCKER_HOST
[ -n "$SLURM_JOB_ID" ] || exit 0
ids=$(timeout 20 docker ps -aq --filter "label=slurm.job_id=$SLURM_JOB_ID" 2>/dev/null) || exit 0
if [ -n "$ids" ]; then
    timeout 30 docker rm -f $ids >/dev/null 2>&1
fi
exit 0
"""


def render_env_sh(env: dict[str, str]) -> str:
    """``export`` lines for a shell (values single-quoted). PATH keeps the sourcing shell's
    own: only its first entry (the release's client wrappers) is put in front."""
    lines = ["# Generated by ray_slurm_provider.sandbox: source this file."]
    for key in sorted(env):
        first = env[key].split(os.pathsep, 1)[0] if key == "PATH" else env[key]
        value = first.replace("'", "'\\''")
        lines.append(f"export {key}='{value}'" + (':"$PATH"' if key == "PATH" else ""))
    return "\n".join(lines) + "\n"
