"""sbatch values -> slurmrestd job fields, in the shape of each API version.

v0.0.38 (Slurm 22.05) takes plain numbers and strings; v0.0.40 and later take numbers as
{"set", "infinite", "number"} objects, flags as lists and GPUs as TRES strings. `LEGACY` names
the old family. Every value that cannot be translated raises `unsupported`, a
PermanentSlurmError naming the sbatch option, so nothing a job asks for is silently dropped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from ray_slurm_provider.slurm.client import PermanentSlurmError
from ray_slurm_provider.units import mem_mb, parse_duration

LEGACY = "v0.0.38"
_SIGNAL = re.compile(r"^(?:(R|B|RB|BR):)?([A-Za-z0-9]+)(?:@(\d+))?$")


def unsupported(option: str, why: str) -> PermanentSlurmError:
    return PermanentSlurmError(
        f"#SBATCH {option}: {why}; slurmrestd does not read #SBATCH lines, so the REST transport "
        "translates each option and this one has no translation. Drop it from the node config "
        "or use provider.slurm_api: cli", command="slurmrestd")


def num(value: int | None, legacy: bool, infinite: bool = False) -> Any:
    if legacy:
        return value
    return {"set": value is not None or infinite, "infinite": infinite, "number": value or 0}


def memory(key: str, value: str, legacy: bool) -> Any:
    try:
        return num(mem_mb(value), legacy)
    except ValueError:
        raise unsupported(f"--{key}={value}", "not a memory size") from None


def time_limit(value: str, legacy: bool) -> dict[str, Any]:
    try:
        seconds = parse_duration(value)
    except ValueError:
        raise unsupported(f"--time={value}", "not a Slurm time") from None
    if seconds is None:
        if legacy:
            raise unsupported(f"--time={value}", f"slurmrestd {LEGACY} cannot say UNLIMITED "
                              "(leave `time` unset to get the partition's limit)")
        return {"time_limit": num(None, False, infinite=True)}
    return {"time_limit": num(math.ceil(seconds / 60), legacy)}


def add_tres(desc: dict[str, Any], field: str, item: str) -> None:
    """Append `item` to the comma-separated TRES list `desc[field]`."""
    desc[field] = f"{desc[field]},{item}" if desc.get(field) else item


def gres_items(value: str) -> list[str]:
    return [i if i.startswith("gres/") else f"gres/{i}" for i in value.split(",") if i]


def signal(value: str, legacy: bool) -> dict[str, Any]:
    """--signal; v0.0.38 gets only a signal without `B:`/`R:` (the caller notes the rest)."""
    m = _SIGNAL.match(value)
    if not m:
        raise unsupported(f"--signal={value}", "not a signal specification")
    where, sig, delay = m.groups()
    if legacy:
        if where:
            return {}
        return {"signal": f"{sig}@{delay}" if delay else sig}
    out: dict[str, Any] = {"kill_warning_signal": sig,
                           "kill_warning_delay": num(int(delay or 60), False)}
    if where and "B" in where:
        out["kill_warning_flags"] = ["BATCH_JOB"]
    return out


# --- the user's own options (JobSpec.sbatch_options / extra_directives) -----------------------
# Only options a user may set: the typed fields own the rest (script.RESERVED_OPTIONS).

_VERBATIM: dict[str, str] = {
    "comment": "comment", "wckey": "wckey", "mail-user": "mail_user",
    "dependency": "dependency", "chdir": "current_working_directory",
    "input": "standard_input", "licenses": "licenses",
}
_INTS: dict[str, str] = {"ntasks-per-node": "tasks_per_node"}
_Handler = Callable[[str, bool], dict[str, Any]]  # (value, legacy) -> fields
_VALUED: dict[str, _Handler] = {
    "mem-per-cpu": lambda v, legacy: {"memory_per_cpu": memory("mem-per-cpu", v, legacy)},
    "mail-type": lambda v, legacy: {
        "mail_type": v if legacy else [t.upper() for t in v.split(",")]},
}
_FLAGS: dict[str, dict[str, Any]] = {"hold": {"hold": True}}


def _need(key: str, value: str | None) -> str:
    if value is None or value == "":
        raise unsupported(f"--{key}", "needs a value")
    return value


def translate(desc: dict[str, Any], key: str, value: str | None, legacy: bool) -> None:
    """Set the fields of the user's sbatch option `--key[=value]` in `desc`."""
    if key in _FLAGS:
        if value is not None:
            raise unsupported(f"--{key}={value}", "a flag takes no value")
        desc.update(_FLAGS[key])
    elif key in _VERBATIM:
        desc[_VERBATIM[key]] = _need(key, value)
    elif key in _INTS:
        v = _need(key, value)
        if not v.isdigit():
            raise unsupported(f"--{key}={v}", "not a whole number")
        desc[_INTS[key]] = int(v)
    elif key in _VALUED:
        desc.update(_VALUED[key](_need(key, value), legacy))
    elif key == "gpus":
        if legacy:
            desc["gpus"] = _need(key, value)
        else:
            add_tres(desc, "tres_per_job", f"gres/gpu:{_need(key, value)}")
    else:
        raise unsupported(f"--{key}", "no translation")
