"""The typed configuration model: the single source of validation, defaults and docs.

Two sections of a Ray cluster YAML belong to this provider: `provider:` (cluster-wide
settings) and `available_node_types.<name>.node_config` (the Slurm job of one node type).
The models are frozen pydantic dataclasses; each field's type decides what YAML value it takes
(schema.py: a duration is a string only, a name may be a whole number) and carries its doc
(`Field(description=...)`), from which `cli/docs.py` renders the reference and `cli/schema.py`
the JSON Schema. The whole cluster YAML is parsed once, into cluster.ClusterConfig.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from ray_slurm_provider.schema import (
    Bool,
    ConfigError,
    Duration,
    Int,
    Num,
    SbatchOptions,
    Str,
    Text,
    doc,
    load,
)

__all__ = ["ConfigError", "load", "parse_node_config", "parse_provider"]  # re-exported

#: Unknown keys are refused (schema.load names them first, with a did-you-mean).
_MODEL = ConfigDict(extra="forbid")
#: Value ranges live on the types, so the JSON Schema carries them too.
NonNegative = Annotated[Int, Field(ge=0)]
Positive = Annotated[Int, Field(ge=1)]
Fraction = Annotated[Num, Field(gt=0.0, lt=1.0)]
Port = Annotated[Int, Field(ge=1024, le=65525)]
Url = Annotated[Str, Field(pattern=r"^https?://")]


def _one_or_more(n: int) -> int:
    if n < 1:
        raise PydanticCustomError("nodes", "{n} is less than 1; valid: 1 (one node per job) or "
                                  "more (a gang of that many nodes)", {"n": n})
    return n


#: `nodes`: its own message (a gang type is the usual reason to touch it).
Nodes = Annotated[Int, AfterValidator(_one_or_more), Field(json_schema_extra={"minimum": 1})]


@dataclass(frozen=True, config=_MODEL)
class PortsConfig:
    base: Port | None = doc(
        "First port of this cluster's block of 10 on the head node (GCS = base, dashboard = "
        "base+1, Ray client = base+2, autoscaler metrics = base+3, dashboard metrics = base+4). "
        "Default: derived from the user and cluster name in 24000-31990, so two clusters on "
        "one node do not clash.",
        None)


@dataclass(frozen=True, config=_MODEL)
class AuthConfig:
    mode: Literal["token", "disabled"] = doc(
        "Ray token authentication. `token` (default) creates one random token per cluster in a "
        "0600 file and hands its path to every Ray process; `disabled` turns it off explicitly.",
        "token")


@dataclass(frozen=True, config=_MODEL)
class RestConfig:
    """`provider.rest`: how the `rest` transport reaches slurmrestd."""

    url: Url | None = doc(
        "Base URL of slurmrestd, e.g. `http://slurm-rest.example.org:6820` (the API version "
        "is negotiated from the server). Default: the `RAY_SLURM_REST_URL` environment "
        "variable.",
        None)
    jwt_file: Str | None = doc(
        "File holding the Slurm JWT (`scontrol token`), mode 0600 and owned by you; read on "
        "every request, so a refreshed token is picked up without a restart. Use a path on the "
        "shared filesystem so the head's autoscaler finds it too. Default: the "
        "`RAY_SLURM_JWT_FILE` environment variable; without either, `jwt_env` is used.",
        None)
    jwt_env: Str = doc(
        "Environment variable holding the JWT when no `jwt_file` is set. Never export "
        "`SLURM_JWT` in a shell that runs `srun`: srun then authenticates by JWT and task launch "
        "fails; use a file or another variable name.",
        "SLURM_JWT")
    user: Str | None = doc(
        "Slurm user name sent with the token (`X-SLURM-USER-NAME`); also the user whose jobs "
        "the provider lists. Default: the token's own user (its `sun` claim), else the user "
        "running the provider.",
        None)
    ca_file: Str | None = doc(
        "CA bundle that signs slurmrestd's https certificate (a site's own CA).", None)
    proxy: Str | None = doc(
        "HTTP proxy to reach slurmrestd through. Default: none; `http_proxy` and friends "
        "in the environment are never used, so the JWT goes to slurmrestd alone.", None)


@dataclass(frozen=True, config=_MODEL)
class SshConfig:
    """`provider.ssh`: the login node, reached over SSH from a laptop or a notebook."""

    host: Str = doc("The login node's host name or address (required).")
    port: Annotated[Int, Field(ge=1, le=65535)] = doc("Its SSH port.", 22)
    user: Str | None = doc("Your user on the login node. Default: ssh's own (`~/.ssh/config`, "
                           "else your local user name).", None)
    identity_file: Str | None = doc(
        "Private key to log in with (`ssh -i`). Default: ssh's own.", None)
    jump_host: Str | None = doc(
        "A bastion to hop through (`ssh -J`, e.g. `me@gateway.example.org:22`).", None)
    known_hosts: Str | None = doc(
        "known_hosts file holding the login node's host key. Default: ssh's own "
        "(`~/.ssh/known_hosts`). An unknown key stops with its fingerprint and how to accept "
        "it; host keys are always checked.", None)
    control_persist_s: NonNegative = doc(
        "How long the one multiplexed connection (ControlMaster) stays open after its last "
        "use.", 600)


@dataclass(frozen=True, config=_MODEL)
class ProviderConfig:
    """The `provider:` section."""

    type: Literal["external"] = doc("Must be `external` (Ray's key).", "external")
    module: Str = doc(
        "Must be `ray_slurm_provider.provider.SlurmNodeProvider` (Ray's key).",
        "ray_slurm_provider.provider.SlurmNodeProvider")
    slurm_api: Literal["cli", "rest", "pyslurm"] = doc(
        "How the provider talks to Slurm: `cli` runs sbatch/squeue/scancel/scontrol; `rest` "
        "calls slurmrestd with a JWT (see `rest`), so a head without Slurm client tools can "
        "still scale; `pyslurm` uses the optional pyslurm bindings, which must match the "
        "cluster's Slurm release exactly (this package's `pyslurm` extra).",
        "cli")
    rest: RestConfig = doc(
        "slurmrestd settings for `slurm_api: rest`.", default_factory=RestConfig
    )
    ssh: SshConfig | None = doc(
        "Run `ray up` from a laptop: every Slurm command, and every read, write and lock of the "
        "cluster directory, happens on this login node over one multiplexed SSH connection "
        "(the provider's calls run there with `provider.python`, which must be the login "
        "node's). `ray up`, `ray exec` (with `--port-forward`), `ray get-head-ip`, `ray "
        "submit`, `ray rsync-down`, `ray dashboard`, `ray down`, the Python API and `ray-slurm "
        "doctor`, `validate`, `env` (tunnels), `status`, `logs` and `report` work over it; "
        "`ray attach` and `ray-slurm run`/`sbatch` do not yet. The head's autoscaler and the "
        "node agents ignore it.", None)
    state_dir: Str = doc(
        "Directory on a filesystem shared by the login node and the compute nodes (your home, "
        "usually) where each cluster keeps its tags, handoff files, token and logs: "
        "`<state_dir>/<cluster_name>/`.",
        "~/.ray_slurm")
    python: Str | None = doc(
        "Python executable (with ray and ray_slurm_provider installed) that jobs use to run "
        "the node agent. Default: the Python running `ray up`.",
        None)
    temp_dir_root: Str = doc(
        "Node-local directory under which each node gets a short Ray temp dir "
        "(`<root>/rsp-<uid>/<job id>`, the parent private to you); keep it short, Unix socket "
        "paths are limited to ~107 bytes.",
        "/tmp")
    node_ip_interface: Str | None = doc(
        "Take each node's Ray IP from this network interface (multi-NIC nodes) instead of "
        "Slurm's NodeAddr.",
        None)
    drain_timeout_s: NonNegative = doc(
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S for every node: how long Ray drains on SIGTERM. "
        "Keep it below Slurm's KillWait.",
        5)
    ray_logs_max_mb: NonNegative = doc(
        "When a node's job ends, its Ray session logs are copied from the node-local temp dir "
        "to `<state_dir>/<cluster>/ray-logs/<job id>/` (`ray-slurm logs CONFIG JOB --ray`), "
        "at most this many MB per node (small files first, big ones keep their end). 0: off.",
        100)
    ray_start_attempts: Positive = doc(
        "How many times a worker retries a failed `ray start` before its job ends.", 3
    )
    head_wait_s: NonNegative = doc(
        "How long `ray up` waits for a queued head job to start, saying why it waits; then it "
        "cancels the job, so it never starts later to hold an allocation nobody uses.", 3600)
    head_start_timeout_s: NonNegative = doc(
        "How long a running head job waits for `ray up` to hand it the start command before "
        "it gives up and ends.",
        1800)
    oneshot_runs_kept: NonNegative = doc(
        "Each `ray-slurm sbatch` run is its own cluster with its own directory "
        "`<state_dir>/<cluster_name>-<run id>/` (logs, staged working dir). Of a config's runs "
        "that have ended, the newest this many keep their directory; older ones are removed "
        "by the next `ray-slurm sbatch`, `run` or `status` of that config.",
        20)
    object_store_fraction: Fraction = doc(
        "Object store size as a fraction of the node's memory, when `object_store_memory` is "
        "not set for the node type.",
        0.3)
    environment: dict[str, Text] = doc(
        "Environment variables for every node's job.", default_factory=dict
    )
    ports: PortsConfig = doc("Per-cluster Ray port block.", default_factory=PortsConfig)
    auth: AuthConfig = doc("Ray authentication.", default_factory=AuthConfig)
    # Keys Ray's core reads from `provider:`; accepted and passed through untouched.
    use_internal_ips: Bool = doc("Ray's key; Slurm nodes have only internal IPs.", True)
    disable_node_updaters: Bool = doc(
        "Ray's key; forced to true: workers start themselves in their batch step.", True
    )
    disable_launch_config_check: Bool = doc("Ray's key (v1 autoscaler).", False)
    foreground_node_launch: Bool = doc("Ray's key.", False)
    worker_liveness_check: Bool = doc("Ray's key (v1 autoscaler).", True)


@dataclass(frozen=True, config=_MODEL)
class ContainerConfig:
    """`node_config.container`: the container a node's Ray runs in (its life = the job's)."""

    runtime: Literal["none", "docker", "podman", "apptainer", "enroot", "pyxis"] = doc(
        "Container runtime; `none` runs Ray directly in the job (conda, venv, modules).", "none"
    )
    image: Str | None = doc(
        "Image: a registry reference or local tag (docker, podman, pyxis), or a file on a "
        "shared filesystem: `.tar`/`.tar.gz` (docker, podman: loaded once per node), "
        "`.sif` (apptainer), `.sqsh` (enroot, pyxis).",
        None)
    image_tag: Str | None = doc(
        "The tag a `.tar` image contains: when it is already on the node, loading is skipped.",
        None)
    mounts: list[Str] = doc(
        "Bind mounts `src:dst[:ro]`. The cluster directory and the node's Ray temp dir are "
        "always mounted at the same path.",
        default_factory=list)
    environment: dict[str, Text] = doc(
        "Environment of the container (passed by name, so values never show in `ps`).",
        default_factory=dict)
    run_options: list[Str] = doc(
        "Extra options for the runtime's run command (e.g. `--cap-add=SYS_PTRACE`).",
        default_factory=list)
    runtime_args: list[Str] = doc(
        "Global options placed before the run command (e.g. podman `--root`, docker `-H`).",
        default_factory=list)
    shm_size: Text | None = doc("Size of /dev/shm (docker/podman `--shm-size`).", None)
    ipc_host: Bool = doc(
        "Share the host's IPC namespace and /dev/shm (docker/podman `--ipc=host`): Ray's "
        "object store needs a large /dev/shm, Docker's default is 64 MB.",
        True)
    ulimits: dict[str, Text] = doc(
        "ulimits (docker/podman `--ulimit name=soft:hard`), e.g. `{nofile: 65536:65536}`.",
        default_factory=dict)
    gpus: Bool = doc(
        "Give the container exactly the GPUs Slurm allocated to the job (never the host's "
        "others): docker `--gpus device=<ids>`, podman CDI devices, apptainer `--nv`, "
        "enroot `NVIDIA_VISIBLE_DEVICES=<ids>` (its NVIDIA hook), pyxis through Slurm.",
        True)
    privileged: Bool = doc("Privileged container (opt-in; the seed's script ran one).", False)
    run_as_user: Bool = doc(
        "docker/podman: run as the job's user and group (`--user uid:gid`) instead of the "
        "image's default (often root), so files and Slurm submissions stay the user's.",
        True)
    devices: list[Str] = doc(
        "Host devices to pass in (opt-in), e.g. `/dev/infiniband/uverbs0` or `/dev/gdrdrv`.",
        default_factory=list)
    host_python: Bool = doc(
        "Bind the Python environment that runs the node agent (its prefix, its venv and this "
        "package) into the container at the same paths, and run Ray from it: a site image "
        "supplies the system libraries (CUDA, NCCL), your shared venv supplies Python and Ray.",
        False)
    ray_command: Str = doc("The `ray` executable inside the image.", "ray")
    python_command: Str = doc("The Python inside the image (startup checks).", "python3")
    slurm_access: Literal["mount", "none"] = doc(
        "How the head's autoscaler reaches Slurm from inside its container: `mount` binds the "
        "host's Slurm config directory and munge socket (the image must carry Slurm client "
        "tools of the same major version, or mount them via `mounts`); `none` when the "
        "cluster uses `provider.slurm_api: rest`. The head checks it at startup and says "
        "clearly when it does not work.",
        "mount")
    binary: Str | None = doc("Path of the runtime's executable (default: found on PATH).", None)


@dataclass(frozen=True, config=_MODEL)
class NodeConfig:
    """`available_node_types.<name>.node_config`: the Slurm job of one node type."""

    partition: Text | None = doc("Slurm partition (`--partition`); default: the cluster's.", None)
    account: Text | None = doc("Slurm account (`--account`).", None)
    qos: Text | None = doc("Slurm QOS (`--qos`).", None)
    time: Duration | None = doc(
        "Time limit (`--time`), a quoted string: `time: \"4:00:00\"`, `\"2-00:00:00\"`, "
        "`\"60\"` (minutes). A number is refused: YAML 1.1 reads an unquoted 4:00:00 as "
        "14400. Default: the partition's.", None)
    drain_before_limit_s: Int = doc(
        "Seconds before the time limit at which Slurm sends SIGTERM (`--signal=B:TERM@<s>`; "
        "a gang job: `TERM@<s>`, to every node's agent): "
        "Ray drains and the node leaves, so the autoscaler replaces it while demand remains. "
        "`0` turns it off. Slurm may signal up to a minute early.",
        60)
    nodes: Nodes = doc(
        "Slurm nodes per job (`--nodes`). 2 or more makes a gang type: one job of N nodes is "
        "N Ray nodes (ids `<job>.<k>`), started only once Slurm has all N, ended as one; "
        "`cpus`, `gpus` and `mem` are per node; the type's `min_workers`/`max_workers` count "
        "nodes and must be multiples of N. An `upscaling_speed` the YAML leaves unset "
        "becomes the largest N (`ray up`; `validate` says so); one set below N is refused.",
        1)
    cpus: Int | None = doc(
        "CPUs of the job (`--cpus-per-task`); default: `resources.CPU`, else the partition's "
        "CPUs per node.",
        None)
    mem: Text | None = doc("Memory of the job (`--mem`, e.g. `16G`, `0` for all).", None)
    gpus: Int | None = doc("GPUs of the job (`--gres=gpu:N`); default: `resources.GPU`.", None)
    gpu_type: Text | None = doc("GPU type in the GRES request (`--gres=gpu:<type>:N`).", None)
    constraint: Text | None = doc("Node features (`--constraint`).", None)
    exclusive: Bool = doc("Whole nodes (`--exclusive`).", False)
    reservation: Text | None = doc("Slurm reservation (`--reservation`).", None)
    nodelist: Text | None = doc("Only these nodes (`--nodelist`).", None)
    exclude: Text | None = doc("Never these nodes (`--exclude`).", None)
    object_store_memory: Int | None = doc("Ray object store size in bytes.", None)
    sbatch_options: SbatchOptions = doc(
        "Any other sbatch long option, `{option: value}` (`{mail-type: END}`); a duration "
        "(`time-min`) is a quoted string, as `time` is.",
        default_factory=dict)
    extra_directives: list[Str] = doc(
        "Raw extra `#SBATCH` option lines, each starting with `--`.", default_factory=list
    )
    environment: dict[str, Text] = doc(
        "Environment variables of this node type's job.", default_factory=dict
    )
    container: ContainerConfig = doc(
        "The container this node type's Ray runs in.", default_factory=ContainerConfig
    )
    prologue: list[Str] = doc(
        "Shell lines run at the top of the job before anything else (module load, conda "
        "activate). Trusted: they are your own commands.",
        default_factory=list)


def parse_provider(data: Mapping[str, Any]) -> ProviderConfig:
    """The `provider:` section, type- and value-checked."""
    return load(ProviderConfig, data, "provider")


def parse_node_config(data: Mapping[str, Any] | None, node_type: str) -> NodeConfig:
    """One node type's `node_config`, type- and value-checked."""
    return load(NodeConfig, data or {}, f"available_node_types.{node_type}.node_config")
