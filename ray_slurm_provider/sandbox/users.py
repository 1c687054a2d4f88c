"""Throwaway Unix users for the sandbox (``ray-slurm sandbox up --users N``).

A shared cluster in miniature: N ordinary users (``rsp-u1`` ...) with homes under the state
dir (``<state>/home/<user>``, 0755 as at many sites), who submit through the sandbox's
munge and, with ``--docker``, reach its dockerd through one group (``rsp-sbx``), the way a
site's ``docker`` group works. ``<state>/shared`` (0755, root's) is the analogue of a site's
shared software tree: root installs there what every user runs.

Every user carries a marker in its GECOS field naming the state dir; ``down`` deletes only
users with that marker, and ``up`` refuses a name that exists without it (someone else's).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
from dataclasses import asdict, dataclass

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox.layout import Layout
from ray_slurm_provider.sandbox.procs import SandboxError

_MARKER = "ray-slurm sandbox"


@dataclass(frozen=True)
class SandboxUser:
    """One throwaway user: name, ids and home."""

    name: str
    uid: int
    gid: int
    home: str


def prefix(port_offset: int) -> str:
    """Name prefix of a sandbox's users and group; a second sandbox (another port offset)
    gets its own, so two sandboxes never share or delete each other's users."""
    return "rsp" if port_offset == 0 else f"rsp{port_offset}"


def user_names(count: int, port_offset: int = 0) -> list[str]:
    return [f"{prefix(port_offset)}-u{k}" for k in range(1, count + 1)]


def group_name(port_offset: int = 0) -> str:
    """The group whose members may use the sandbox's dockerd socket."""
    return f"{prefix(port_offset)}-sbx"


def marker(layout: Layout) -> str:
    return f"{_MARKER} {layout.root}"


def _run(argv: list[str]) -> None:
    try:
        proc.run(argv, timeout=60)
    except proc.CommandError as e:
        raise SandboxError(f"{argv[0]} failed: {e}") from e


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def ensure(layout: Layout, count: int, port_offset: int = 0) -> list[SandboxUser]:
    """Create the group and the `count` users that do not exist yet; return all of them.

    Existing users are kept (their homes too), so `up` stays idempotent.
    """
    if count <= 0:
        return []
    group = group_name(port_offset)
    if not _group_exists(group):
        _run(["groupadd", group])
    os.makedirs(layout.home_dir, exist_ok=True)
    os.chmod(layout.home_dir, 0o755)
    os.makedirs(layout.shared_dir, exist_ok=True)
    os.chmod(layout.shared_dir, 0o755)
    users = []
    for name in user_names(count, port_offset):
        home = os.path.join(layout.home_dir, name)
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            _run(["useradd", "--create-home", "--home-dir", home, "--shell", "/bin/bash",
                  "--comment", marker(layout), "--user-group", "--groups", group, name])
            pw = pwd.getpwnam(name)
        if pw.pw_gecos != marker(layout):
            raise SandboxError(f"user {name} exists and is not this sandbox's (GECOS "
                               f"{pw.pw_gecos!r}); remove it or use another --port-offset")
        # 0755, as at many sites: what keeps other users out of a cluster must be the
        # provider's own modes, not the home's.
        os.chmod(pw.pw_dir, 0o755)
        users.append(SandboxUser(name, pw.pw_uid, pw.pw_gid, pw.pw_dir))
    _save(layout, users)
    return users


def _save(layout: Layout, users: list[SandboxUser]) -> None:
    tmp = layout.users_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump([asdict(u) for u in users], f, indent=2)
    os.replace(tmp, layout.users_file)


def load(layout: Layout) -> list[SandboxUser]:
    """The users `ensure` recorded (none when the sandbox was started without --users)."""
    try:
        with open(layout.users_file) as f:
            return [SandboxUser(**u) for u in json.load(f)]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError) as e:
        raise SandboxError(f"unreadable {layout.users_file}: {e}") from e


def remove(layout: Layout, port_offset: int = 0) -> list[str]:
    """Delete the recorded users that carry this sandbox's marker, then its group (if no
    user is left in it). Returns what could not be deleted, for the caller to report."""
    users = load(layout)
    if not users:
        return []
    failed = []
    for user in users:
        try:
            if pwd.getpwnam(user.name).pw_gecos != marker(layout):
                continue  # not ours any more: never delete someone else's user
        except KeyError:
            continue
        try:
            # --force: the user's last cancelled job may still be exiting; its files die with
            # the state dir, which holds the home.
            proc.run(["userdel", "--force", user.name], timeout=60)
        except proc.CommandError as e:
            failed.append(f"{user.name}: {e}")
    group = group_name(port_offset)
    try:
        members = grp.getgrnam(group).gr_mem
    except KeyError:
        members = None
    if members is not None and not members and not failed:
        try:
            proc.run(["groupdel", group], timeout=60)
        except proc.CommandError as e:
            failed.append(f"group {group}: {e}")
    return failed
