"""Opt-in environment presets for the ranks: fabric, NCCL, socket interfaces.

Nothing here is applied unless named with `--profile` (the seed set its EFA variables on every
rank unconditionally). Profiles are applied in the order given; a later one wins on a shared
key. Parameterised profiles take `name=value`.

`GLOO_SOCKET_IFNAME` takes plain interface names only: the `^docker,lo` exclude syntax that
NCCL accepts makes gloo fail with "Unable to find address for: ^docker", and Megatron creates
gloo groups even when it trains on NCCL. `socket=^docker,lo` therefore sets NCCL only.
Pure logic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: Fixed presets.
PROFILES: dict[str, dict[str, str]] = {
    # AWS EFA through libfabric, as in the seed's container (its Dockerfile ENV lines).
    "efa": {
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "FI_EFA_FORK_SAFE": "1",
        "NCCL_BUFFSIZE": "8388608",
        "NCCL_P2P_NET_CHUNKSIZE": "524288",
    },
    # What Megatron expects on GPUs: one CUDA connection per device (needed for the
    # ordering of TP communication overlap), quiet NCCL.
    "megatron": {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_DEBUG": "WARN"},
    # Verbose NCCL start-up: which transport, which NICs.
    "nccl-debug": {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"},
    # A failed or timed-out collective aborts the process instead of hanging it, so the
    # launcher sees the failure and restarts the gang.
    "nccl-fail-fast": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                       "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
}

#: Parameterised presets: name -> help.
PARAM_PROFILES: dict[str, str] = {
    "socket": "NCCL_SOCKET_IFNAME=VALUE; also GLOO_SOCKET_IFNAME when VALUE is plain names",
    "gloo-socket": "GLOO_SOCKET_IFNAME=VALUE (plain interface names only)",
    "nccl-ib-hca": "NCCL_IB_HCA=VALUE (e.g. mlx5_0,mlx5_1)",
}


class ProfileError(ValueError):
    """An unknown profile or a value a library would reject."""


def is_plain_ifnames(value: str) -> bool:
    """True for `eth0,lo`; False for NCCL's prefix/exclude forms (`^docker`, `=eth0`)."""
    items = [v.strip() for v in value.split(",")]
    return bool(value.strip()) and all(v and v[0] not in "^=" for v in items)


def check_gloo_ifname(value: str) -> None:
    if not is_plain_ifnames(value):
        raise ProfileError(
            f"GLOO_SOCKET_IFNAME={value!r}: gloo takes plain interface names (eth0,lo); "
            "the ^/= prefixes are NCCL-only syntax")


def profile_env(spec: str) -> dict[str, str]:
    """The variables of one profile spec (`efa`, `socket=eth0`)."""
    name, sep, value = spec.partition("=")
    name = name.strip()
    if not sep:
        if name in PROFILES:
            return dict(PROFILES[name])
        if name in PARAM_PROFILES:
            raise ProfileError(f"profile {name!r} needs a value: {name}=VALUE")
        raise ProfileError(f"unknown profile {spec!r}; choose from {', '.join(known())}")
    value = value.strip()
    if not value:
        raise ProfileError(f"profile {name!r}: empty value")
    if name == "socket":
        env = {"NCCL_SOCKET_IFNAME": value}
        if is_plain_ifnames(value):
            env["GLOO_SOCKET_IFNAME"] = value
        return env
    if name == "gloo-socket":
        check_gloo_ifname(value)
        return {"GLOO_SOCKET_IFNAME": value}
    if name == "nccl-ib-hca":
        return {"NCCL_IB_HCA": value}
    raise ProfileError(f"unknown profile {name!r}; choose from {', '.join(known())}")


def known() -> list[str]:
    return sorted(PROFILES) + [f"{p}=VALUE" for p in sorted(PARAM_PROFILES)]


def resolve(specs: Iterable[str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Merge profiles in order, then explicit `extra` variables (which win)."""
    env: dict[str, str] = {}
    for spec in specs:
        env.update(profile_env(spec))
    if extra:
        env.update(extra)
    if "GLOO_SOCKET_IFNAME" in env:
        check_gloo_ifname(env["GLOO_SOCKET_IFNAME"])
    return env


def parse_env_assignments(items: Iterable[str]) -> dict[str, str]:
    """`KEY=VALUE` strings from the command line."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise ProfileError(f"--env {item!r}: expected KEY=VALUE")
        out[key] = value
    return out
