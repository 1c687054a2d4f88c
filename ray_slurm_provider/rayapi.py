"""Every use of Ray's private API and of Ray behaviour the package relies on, in one place.

Ray does not promise to keep `ray._private` or `ray.autoscaler._private` stable. Each name
here has a unit test in tests/unit/test_rayapi.py that pins the behaviour relied on (by
running Ray's code, not by reading its source), so a Ray upgrade that changes it fails there
first. Ray is imported inside the functions: the agent and the login node's quick commands
import this module without paying for Ray's autoscaler.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: `ray.autoscaler._private.commands.POLL_INTERVAL` in Ray 2.60: what `ray down`'s teardown
#: loop sleeps after every terminate_nodes call.
RAY_DOWN_POLL_S = 5
_COMMANDS = "ray.autoscaler._private.commands"

#: The config keys whose commands Ray's updater runs on a new head, in its order. Ray's config
#: preparation has already put `setup_commands` in front of `head_setup_commands`.
HEAD_COMMAND_KEYS = ("initialization_commands", "head_setup_commands", "head_start_ray_commands")


def bootstrap_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config as `ray up` resolves it (Ray's defaults, its merge of the setup commands,
    then the provider's own bootstrap hook), from a copy, without Ray's config cache. Ray's
    progress lines go to stderr."""
    from ray.autoscaler._private.commands import _bootstrap_config

    with contextlib.redirect_stdout(sys.stderr):
        resolved: dict[str, Any] = _bootstrap_config(copy.deepcopy(dict(config)),
                                                     no_config_cache=True)
    return resolved


def config_cache_path(config: Mapping[str, Any]) -> Path:
    """Where `ray up` (commands._bootstrap_config) caches its resolution of the raw `config`:
    the prepared config's SHA-256, in the temp dir."""
    import hashlib
    import tempfile

    from ray.autoscaler._private.util import prepare_config

    prepared = prepare_config(copy.deepcopy(dict(config)))
    key = hashlib.sha256(json.dumps([prepared], sort_keys=True).encode("utf-8")).hexdigest()
    return Path(tempfile.gettempdir(), f"ray-config-{key}")


def drop_config_cache(config_file: str) -> None:
    """Remove Ray's cached resolution of the YAML at `config_file`. `ray down` has no
    --no-config-cache: without this it would resolve the YAML with values from before an
    edit of a defaults file."""
    import yaml

    try:
        path = config_cache_path(yaml.safe_load(Path(config_file).read_text()))
    except Exception:
        return  # Ray refuses the YAML: its own command says why
    path.unlink(missing_ok=True)


def merge_setup_commands(config: dict[str, Any]) -> None:
    """Ray's own step of `ray up`'s preparation that puts `setup_commands` in front of
    `head_setup_commands` and of `worker_setup_commands`, in place (a missing key counts as
    empty); `ray-slurm render` shows what runs after it."""
    from ray.autoscaler._private.util import merge_setup_commands as ray_merge

    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
        config.setdefault(key, [])
    ray_merge(config)  # type: ignore[no-untyped-call]


def head_commands(resolved: Mapping[str, Any]) -> list[str]:
    """The commands Ray's updater runs on a new head, in its order, from a config that went
    through `bootstrap_config` (which merged the setup commands: they are not added again)."""
    return [str(c) for key in HEAD_COMMAND_KEYS for c in resolved.get(key) or []]


def start_env_names() -> tuple[str, str]:
    """The variables through which Ray's updater hands `ray start` the node type's resources
    and labels (JSON): (resources, labels)."""
    from ray._private.ray_constants import (
        LABELS_ENVIRONMENT_VARIABLE,
        RESOURCES_ENVIRONMENT_VARIABLE,
    )

    return str(RESOURCES_ENVIRONMENT_VARIABLE), str(LABELS_ENVIRONMENT_VARIABLE)


def runner_error(msg: str, code: int | None, cmd: str) -> Exception:
    """The error Ray's NodeUpdater expects from a command runner whose command failed."""
    from ray.autoscaler._private.subprocess_output_util import ProcessRunnerError

    err: Exception = ProcessRunnerError(  # type: ignore[no-untyped-call]
        msg, "ssh_command_failed", code=code, command=cmd)
    return err


def shorten_ray_down_poll(seconds: float) -> bool:
    """Make `ray down`'s teardown loop sleep `seconds` instead of Ray's RAY_DOWN_POLL_S in this
    process; whether it did. Only where Ray's commands module is loaded (a `ray down`) and
    still has Ray's own value: a Ray that changed it, or a second call, leaves it alone."""
    commands = sys.modules.get(_COMMANDS)
    if commands is None or getattr(commands, "POLL_INTERVAL", None) != RAY_DOWN_POLL_S:
        return False
    commands.POLL_INTERVAL = seconds  # type: ignore[attr-defined]
    return True


def config_schema() -> dict[str, Any]:
    """The JSON Schema `ray up` checks a cluster config against (the file Ray ships beside
    `ray.autoscaler`, which its validate_config reads)."""
    import ray.autoscaler

    schema: dict[str, Any] = json.loads(
        (Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    return schema


def resources_per_node() -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """(available, total) resources of each live node by node id, from the connected
    driver's GCS (not public API; callers treat any exception as "not known")."""
    from ray._private import state

    available = state.available_resources_per_node()  # type: ignore[no-untyped-call]
    total = state.total_resources_per_node()  # type: ignore[no-untyped-call]
    return available, total


def explain_launch_errors() -> bool:
    """Make autoscaler v2 keep the words of a failed launch; whether it is done.

    Ray 2.60's NodeProviderAdapter records a provider's exception from `create_node` as a
    LaunchNodeError whose message ends in empty details (the exception only as its
    `__cause__`); the reconciler then records `launch failed with <that message>`, which is
    all `ray status -v` shows. Its `poll_errors` is wrapped (once per process) so that each
    such error carries its cause's words: a NodeLaunchException's `(category) description`."""
    try:
        from ray.autoscaler.v2.instance_manager.node_provider import (
            LaunchNodeError,
            NodeProviderAdapter,
        )
    except ImportError:  # a Ray without autoscaler v2
        return False
    poll = NodeProviderAdapter.poll_errors
    if hasattr(poll, "__wrapped__"):
        return True

    @functools.wraps(poll)
    def poll_errors(self: Any) -> list[Any]:
        return [_explained(e, LaunchNodeError) for e in poll(self)]

    NodeProviderAdapter.poll_errors = poll_errors  # type: ignore[method-assign]
    return True


def _explained(error: Any, launch_node_error: Any) -> Any:
    """A LaunchNodeError with empty details again, with its cause's words as the details."""
    cause = error.__cause__
    if not isinstance(error, launch_node_error) or cause is None or not str(error).endswith(": "):
        return error
    words = (f"({cause.category}) {cause.description}" if hasattr(cause, "description")
             else str(cause))
    return launch_node_error(error.node_type, error.count, error.request_id, error.timestamp_ns,
                             details=words, cause=cause)


def autoscaler_event(message: str) -> bool:
    """Add `message` (a warning) to this process's autoscaler event stream; whether there
    was one. Ray's monitor makes the stream (`logs/events/event_AUTOSCALER.log`); with
    autoscaler v2 Ray prints it on every driver (`(autoscaler +Ns) ...`), so a Ray job's
    output (`ray-slurm run`) has it too. Elsewhere (`ray up`, the CLI) nothing is written."""
    try:
        from ray._private.event import event_logger
    except ImportError:
        return False
    adapter = event_logger._event_logger.get("AUTOSCALER")  # made by the monitor, if any
    if adapter is None:
        return False
    adapter.warning(message)
    return True


def use_auth(env: Mapping[str, str]) -> None:
    """Point this process's Ray at a cluster's auth (`auth.auth_env`'s variables): set them
    and make Ray read them again. Ray caches the mode and the token when it first reads them,
    so a notebook that imported Ray before would otherwise connect without the token."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    os.environ.update(env)
    Config.initialize("")  # before the token cache, as Ray's own test helper does it
    AuthenticationTokenLoader.instance().reset_cache()
