"""Every check of a cluster config, in one ordered pipeline, before anything is submitted.

`run(config, info=..., associations=..., env=...)` returns the parsed cluster (None when the model
refuses it) and the findings, in order: (level error|warning, key path, message). `ray up`
(bootstrap.validate, also behind `ray-slurm run` and `sbatch`), `ray-slurm validate` and the
head's autoscaler at start (`check_section`) all call it; the head has only its provider
section, so the rules that need the whole YAML are skipped there.

Stages, in order; one with errors ends the run, as later rules assume what it checked:
1. model: names, types, unknown keys and value ranges (config.py, through
   cluster.parse_cluster); Ray's scaling keys; start commands; gang types.
2. Ray's own schema (`ray/autoscaler/ray-schema.json` of the installed Ray).
3. values: temp dir length, time format, memory, drain lead time, images, and every job's
   fields as the batch-script renderer would check them; with Slurm's view requested on
   the login node (the whole YAML, not over REST), an Enroot/Pyxis image file exists and is
   a squashfs, and with the CLI pyxis is loaded (`srun --help` lists --container-image).
4. live, when Slurm's view is given: partitions exist, time/GPUs/CPUs/memory fit them;
   accounts and QOSes against the user's associations (when those are given). Those rules
   live in provider/fit.py (what a partition's nodes have); this module orders them.
Warnings (a partition without a time limit, autoscaler v1 co-location) never end a run.
Each message names the key path, the bad value and what is allowed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ray_slurm_provider import proc, rayapi, shellcmd
from ray_slurm_provider.cluster import (
    ClusterConfig,
    NodeType,
    parse_cluster,
    parse_provider_section,
)
from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.jobs import build_job, temp_dir_root_max
from ray_slurm_provider.provider.fit import (
    check_account_qos,
    check_live,
    check_partitions,
    node_mem_mb,
    time_limit_s,
)
from ray_slurm_provider.runtimes import images
from ray_slurm_provider.slurm.client import ClusterInfo, SlurmError
from ray_slurm_provider.slurm.sacct import NoAccounting
from ray_slurm_provider.slurm.script import ScriptError
from ray_slurm_provider.slurm.script import validate as validate_spec

Level = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    """One problem: its level, the key path it is about, and what is wrong and allowed;
    `rule` names the check (the stage's order is the pipeline's)."""

    level: Level
    key: str
    message: str
    rule: str = ""

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def finding(e: ConfigError | str, rule: str, level: Level = "error") -> Finding:
    key, _, message = str(e).partition(": ")
    return Finding(level, key, message, rule)


def raise_first(findings: Iterable[Finding]) -> None:
    """The first error as ConfigError (`ray up` stops at it)."""
    for f in findings:
        if f.level == "error":
            raise ConfigError(str(f), key=f.key)

# --- stage 1: the model and the keys across it ------------------------------------------

def _number(raw: Mapping[str, Any], key: str, path: str, *, integer: bool = False,
            above_zero: bool = False) -> float | None:
    """A Ray scaling key: the type and range Ray's own schema does not enforce."""
    value = raw.get(key)
    if value is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{path}: expected {'an integer' if integer else 'a number'}, "
                          f"got {value!r}")
    if above_zero and value <= 0:
        raise ConfigError(f"{path}: {value} is not above 0")
    if value < 0:
        raise ConfigError(f"{path}: {value} is negative; valid: 0 or more")
    return float(value)


def check_scaling(raw: Mapping[str, Any]) -> None:
    """Ray's scaling keys: a negative `max_workers` passes Ray's own checks and the type then
    silently never scales; `min_workers` above `max_workers` can never be met."""
    _number(raw, "max_workers", "max_workers", integer=True)
    _number(raw, "idle_timeout_minutes", "idle_timeout_minutes")
    _number(raw, "upscaling_speed", "upscaling_speed", above_zero=True)
    for t, nt in (raw.get("available_node_types") or {}).items():
        if not isinstance(nt, Mapping):
            continue
        where = f"available_node_types.{t}"
        low = _number(nt, "min_workers", f"{where}.min_workers", integer=True)
        high = _number(nt, "max_workers", f"{where}.max_workers", integer=True)
        if low is not None and high is not None and low > high:
            raise ConfigError(f"{where}.min_workers: {int(low)} is more than its max_workers "
                              f"{int(high)}; valid: 0 to {int(high)}")


def check_gangs(raw: Mapping[str, Any], node_types: Mapping[str, NodeType]) -> None:
    """A gang type (`nodes: N` >= 2) starts and ends whole groups: its scaling keys must be
    multiples of N, or the autoscaler could ask for a part of a group; the head is one node."""
    head = str(raw.get("head_node_type", ""))
    for t, nt in node_types.items():
        n, where = nt.node_config.nodes, f"available_node_types.{t}"
        if n == 1:
            continue
        if t == head:
            raise ConfigError(f"{where}.node_config.nodes: the head is one node; valid: 1")
        raw_nt = (raw.get("available_node_types") or {}).get(t) or {}
        if raw_nt.get("max_workers") is None:
            raise ConfigError(f"{where}.max_workers: a gang type (nodes: {n}) needs its own "
                              f"max_workers, a multiple of {n}")
        for key in ("min_workers", "max_workers"):
            value = int(raw_nt.get(key) or 0)
            if value % n:
                top = int(raw_nt["max_workers"])
                valid = ", ".join(str(k) for k in range(0, max(top, value) + n, n)[:6])
                raise ConfigError(
                    f"{where}.{key}: {value} is not a multiple of {where}.node_config.nodes "
                    f"{n} (a gang type starts whole groups of {n} nodes); valid: {valid}")
        # Autoscaler v2 releases at most ceil(upscaling_speed * running) queued nodes of a
        # type per tick (at least 1): below N it asks for part of a group, the group's other
        # nodes arrive unasked, and the requests still queued then count as surplus against
        # max_workers, for which v2 terminates nodes, a fresh member among them (seen live).
        # Unset, bootstrap_config sets it (gang_speed); only a value the YAML sets is checked.
        speed = raw.get("upscaling_speed")
        if isinstance(speed, (int, float)) and speed < n:
            raise ConfigError(
                f"upscaling_speed: {speed} is below {where}.node_config.nodes {n}: the "
                "autoscaler would ask for part of a gang group at a time and then terminate "
                f"nodes of it as surplus; valid: {n} or more, or leave it unset (`ray up` "
                "then sets the largest `nodes`)")


def gang_speed(raw: Mapping[str, Any], cluster: ClusterConfig) -> tuple[int, str] | None:
    """The `upscaling_speed` bootstrap_config sets when the YAML leaves it unset and a node
    type is a gang: the largest `nodes` (a smaller one asks for part of a group, see
    check_gangs), with the line that says so; None otherwise. Ray fills in no default of its
    own before the provider sees the config (tests/unit/test_rayapi.py)."""
    if "upscaling_speed" in raw:
        return None
    gangs = [(nt.node_config.nodes, t) for t, nt in cluster.node_types.items()
             if nt.node_config.nodes > 1]
    if not gangs:
        return None
    n, t = max(gangs, key=lambda g: g[0])
    return n, (f"upscaling_speed: not set in the YAML, so `ray up` sets it to {n}, the "
               f"largest gang `nodes` (available_node_types.{t}.node_config.nodes), so that "
               f"the autoscaler asks for whole groups; other node types scale up faster too "
               f"(up to ceil({n} x their running nodes) at a time instead of one); set "
               f"upscaling_speed ({n} or more) to choose")


def check_start_commands(raw: Mapping[str, Any]) -> None:
    """Nothing may follow `ray start` in its command: Ray runs it with --block here (it lives
    as long as the job), so what follows would silently never run."""
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for i, cmd in enumerate(str(c) for c in raw.get(key) or []):
            prog = shellcmd.parse(cmd)
            after = prog.rest if prog.ray_start is not None else []
            if after:
                raise ConfigError(
                    f"{key}[{i}]: {'; '.join(after)!r} follows `ray start`, which never "
                    "returns here (the node agent runs it with --block for the job's life); "
                    "put it before `ray start` or in the setup commands")




def check_head_type(cluster: ClusterConfig) -> None:
    """`head_node_type` names one of the node types."""
    if cluster.head_type not in cluster.node_types:
        raise ConfigError(f"head_node_type: {cluster.head_type!r} is not one of "
                          f"available_node_types ({', '.join(cluster.node_types)})")


# --- stage 2: Ray's own schema ----------------------------------------------------------------

def check_ray_schema(config: Mapping[str, Any]) -> None:
    """Ray's own config schema (the one `ray up` applies), with the key path in the error."""
    import jsonschema

    try:
        jsonschema.validate(dict(config), rayapi.config_schema())
    except jsonschema.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ConfigError(f"{where}: {e.message}") from None


# --- stage 3: values --------------------------------------------------------------------------

#: A container image reference or file: reaches the runtime's argv, where a leading `-` would
#: be taken as an option (`--privileged`); blanks and control characters are never part of one.
IMAGE = re.compile(r"[A-Za-z0-9_./~][!-~]*")
#: JobSpec field (named in a ScriptError) -> the config key it comes from.
_SOURCE = {
    "job_name": "cluster_name", "output": "provider.state_dir", "command": "provider.python",
    "environment": "provider.environment / {nc}.environment", "signal": "{nc}.drain_before_limit_s",
    "gres": "{nc}.gpus / {nc}.gpu_type", "cpus_per_task": "{nc}.cpus / resources.CPU",
    "mem": "{nc}.mem / resources.memory",
    "setup": "{nc}.prologue / initialization_commands / worker_setup_commands",
}


def check_temp_dir(cluster: ClusterConfig) -> None:
    """Ray's Unix sockets live below the node's temp dir."""
    pcfg = cluster.provider
    if len(pcfg.temp_dir_root.rstrip("/")) > temp_dir_root_max():
        raise ConfigError(
            f"provider.temp_dir_root: {pcfg.temp_dir_root!r} is longer than "
            f"{temp_dir_root_max()} characters; Ray's Unix socket paths below it would pass "
            "Linux's 107-byte limit (valid: a short node-local path such as /tmp)")


def check_static(cluster: ClusterConfig) -> None:
    """Stage 3 at once, raising the first problem."""
    check_temp_dir(cluster)
    for t in cluster.node_types:
        check_node_values(cluster, t)


def check_node_values(cluster: ClusterConfig, t: str) -> None:
    """Checks of one node type that need no Slurm: formats, lead time, and its job's fields
    as the batch script renderer would check them."""
    pcfg, nt = cluster.provider, cluster.node_type(t)
    ncfg, nc = nt.node_config, f"available_node_types.{t}.node_config"
    limit = time_limit_s(ncfg, nc)
    node_mem_mb(ncfg, nc)
    if ncfg.drain_before_limit_s < 0:
        raise ConfigError(f"{nc}.drain_before_limit_s: {ncfg.drain_before_limit_s} is "
                          "negative; valid: 0 (off) or seconds before the time limit")
    if limit is not None and ncfg.drain_before_limit_s >= limit:
        raise ConfigError(
            f"{nc}.drain_before_limit_s: {ncfg.drain_before_limit_s}s is not shorter than "
            f"the time limit {ncfg.time!r}; valid: 0 to {limit - 1}")
    for key in ("image", "image_tag"):
        img = getattr(ncfg.container, key)
        if img is not None and not IMAGE.fullmatch(img):
            raise ConfigError(
                f"{nc}.container.{key}: {img!r} is not an image reference or file; valid: "
                "e.g. nvcr.io/nvidia/pytorch:24.05-py3, a local tag or a path, printable "
                "ASCII without blanks, not starting with '-'")
    try:
        validate_spec(build_job(pcfg, cluster.name, nt, kind=cluster.kind(t),
                           python=pcfg.python or sys.executable))
    except ScriptError as e:
        field = str(e).split(":", 1)[0].removeprefix("JobSpec.").split("[", 1)[0]
        where = _SOURCE.get(field, f"{{nc}}.{field}").format(nc=nc)
        raise ConfigError(f"{where}: {str(e).split(': ', 1)[-1]}") from None

def check_image_file(cluster: ClusterConfig, t: str) -> None:
    """An Enroot or Pyxis image that names a file: it exists and is a squashfs. Only where
    `ray up` runs beside Slurm (not over REST from a laptop, which does not see the
    cluster's filesystem; the job's agent checks there)."""
    if cluster.provider.slurm_api == "rest":
        return
    c = cluster.node_type(t).node_config.container
    why = images.problem(c.runtime, c.image or "")
    if why:
        raise ConfigError(f"available_node_types.{t}.node_config.container.image: {why}")


def check_pyxis_loaded(cluster: ClusterConfig, srun_help: Lazy) -> list[Finding]:
    """A Pyxis node type needs pyxis in Slurm's plugstack: `srun --help` then lists
    `--container-image`. Only with the CLI on the login node (srun parses the option there).
    An srun that fails (no slurm.conf: it reads the plugstack from there) is a warning."""
    typed = [t for t, nt in cluster.node_types.items()
             if nt.node_config.container.runtime == "pyxis"]
    if cluster.provider.slurm_api != "cli" or not typed:
        return []
    key = f"available_node_types.{typed[0]}.node_config.container.runtime"
    try:
        text = str(srun_help())
    except proc.CommandError as e:
        first = (e.stderr or str(e)).strip().splitlines()[:1]
        return [Finding("warning", key, f"pyxis not checked: `srun --help` failed: "
                        f"{first[0] if first else e}", "pyxis")]
    if "--container-image" in text:
        return []
    return [Finding("error", key, "'pyxis' needs the pyxis SPANK plugin, but `srun --help` "
                    "here lists no --container-image: add pyxis to Slurm's plugstack.conf "
                    "(docs/containers.md, Pyxis), or use runtime enroot", "pyxis")]


def srun_help() -> str:
    return proc.run(["srun", "--help"], timeout=30).stdout


def v1_colocation_warning(cluster: ClusterConfig, env: Mapping[str, str]) -> str | None:
    """Autoscaler v1 (`RAY_UP_enable_autoscaler_v2=0`) keys load and idleness by node IP, so
    two Ray nodes on one host merge and a busy one can be terminated as idle. Slurm places
    jobs side by side unless they take whole nodes."""
    if env.get("RAY_UP_enable_autoscaler_v2") != "0":
        return None  # v2 matches each raylet to its job id
    shared = [t for t, nt in cluster.node_types.items() if not nt.node_config.exclusive]
    if not shared:
        return None
    keys = ", ".join(f"available_node_types.{t}.node_config.exclusive" for t in shared)
    return ("autoscaler v1 tells Ray nodes apart by IP, and Slurm may place two of this "
            "cluster's jobs on one node: they then count as one, and a busy node can be "
            f"terminated as idle. Set {keys} to true, or use autoscaler v2 (the default)")


# --- the pipeline -----------------------------------------------------------------------------

#: The rules of stage 4, whose findings depend on Slurm's view (cli/validate.py shows them
#: per node type).
LIVE_RULES = frozenset({"slurm", "partition", "limits", "accounting"})
Lazy = Callable[[], Any]


def _try(rule: str, check: Callable[..., object], *args: Any) -> list[Finding]:
    try:
        check(*args)
    except ConfigError as e:
        return [finding(e, rule)]
    return []


def _errors(found: Iterable[Finding]) -> bool:
    return any(f.level == "error" for f in found)


def _model(config: Mapping[str, Any]) -> tuple[ClusterConfig | None, list[Finding]]:
    """Stages 1 and 2 on the whole YAML."""
    cluster = None
    try:
        cluster = parse_cluster(config)
        found = []
    except ConfigError as e:
        found = [finding(e, "model")]
    found += _try("scaling", check_scaling, config)
    found += _try("start commands", check_start_commands, config)
    if cluster is not None:
        found += _try("head type", check_head_type, cluster)
        found += _try("gangs", check_gangs, config, cluster.node_types)
    if not _errors(found):
        found += _try("ray schema", check_ray_schema, config)
    return cluster, found


def node_type_live(cluster: ClusterConfig, info: ClusterInfo, t: str) -> list[Finding]:
    """Stage 4 for node type `t`: its partition, then its limits against the partition."""
    named = _try("partition", check_partitions, cluster, info, [t])
    if named:
        return named
    try:
        return [finding(w, "limits", "warning") for w in check_live(cluster, info, only=[t])]
    except ConfigError as e:
        return [finding(e, "limits")]


def check_accounts(cluster: ClusterConfig, associations: Lazy) -> list[Finding]:
    """Each node type's `account` and `qos` against the user's associations; one warning, in
    Slurm's words, when the cluster keeps no accounting."""
    wanted = {t: nt.node_config for t, nt in cluster.node_types.items()
              if nt.node_config.account is not None or nt.node_config.qos is not None}
    if not wanted:
        return []
    try:
        assocs = associations()
    except SlurmError as e:
        why = e.slurm_message if isinstance(e, NoAccounting) else str(e)
        return [Finding("warning", "accounting", f"account and qos not checked: {why}",
                        "accounting")]
    out = []
    for t, ncfg in wanted.items():
        problem = check_account_qos(assocs, ncfg.account, ncfg.qos,
                                    f"available_node_types.{t}.node_config")
        if problem is not None:
            out.append(finding(problem, "accounting"))
    return out


def run(config: Mapping[str, Any] | None, cluster: ClusterConfig | None = None, *,
        info: ClusterInfo | Lazy | None = None, associations: Lazy | None = None,
        env: Mapping[str, str] | None = None,
        pyxis_help: Lazy = srun_help) -> tuple[ClusterConfig | None, list[Finding]]:
    """Every check, in order: the whole YAML `config` (or, on the head, its parsed provider
    section `cluster`); Slurm's view `info` (or a function that asks for it) and the user's
    `associations` (a function) when given; `env` for the autoscaler-version warning;
    `pyxis_help` gives `srun --help`'s text (checked with Slurm's view, for pyxis types).
    Returns the parsed cluster (None when the model refuses it) and the findings."""
    found: list[Finding] = []
    if config is not None:
        cluster, found = _model(config)
    if cluster is None or _errors(found):
        return cluster, found
    found += _try("values", check_temp_dir, cluster)
    for t in cluster.node_types:
        found += _try("values", check_node_values, cluster, t)
    if _errors(found):
        return cluster, found
    # On the login node, against the site (not offline: example configs name sites' files;
    # not on the head: its container may not see the file).
    if config is not None and info is not None:
        for t in cluster.node_types:
            found += _try("image", check_image_file, cluster, t)
        found += check_pyxis_loaded(cluster, pyxis_help)
    if _errors(found):
        return cluster, found
    if callable(info):
        try:
            info = info()
        except SlurmError as e:
            found.append(Finding("warning", "slurm", f"could not check against Slurm: {e}",
                                 "slurm"))
            info = None
    if isinstance(info, ClusterInfo):
        for t in cluster.node_types:
            found += node_type_live(cluster, info, t)
    if associations is not None:
        found += check_accounts(cluster, associations)
    warning = v1_colocation_warning(cluster, env) if env is not None else None
    if warning:
        first = next(t for t, nt in cluster.node_types.items() if not nt.node_config.exclusive)
        found.append(Finding("warning", f"available_node_types.{first}.node_config.exclusive",
                             warning, "autoscaler v1"))
    return cluster, found


def validate(config: Mapping[str, Any], *, info: ClusterInfo | Lazy | None = None,
             associations: Lazy | None = None,
             env: Mapping[str, str] | None = None) -> list[Finding]:
    """The findings of `run` on the whole YAML."""
    return run(config, info=info, associations=associations, env=env)[1]


def check_section(provider: Mapping[str, Any], cluster_name: str) -> ClusterConfig:
    """The head's autoscaler at start: its provider section (with the node types bootstrap
    copied in) through the same pipeline; ConfigError on the first error."""
    cluster, found = run(None, parse_provider_section(provider, cluster_name))
    raise_first(found)
    assert cluster is not None
    return cluster
