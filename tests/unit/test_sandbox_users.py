"""The sandbox's throwaway users: names per sandbox, the GECOS marker rules (never create over
or delete someone else's user), dockerd's socket group. useradd/userdel and the passwd
database are faked; `tests/e2e/test_two_users.py` uses real users."""

from __future__ import annotations

import grp
import json
import pwd
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox import SandboxError, daemons, users
from ray_slurm_provider.sandbox.config import SandboxSpec
from ray_slurm_provider.sandbox.layout import Layout


class FakeAccounts:
    """A passwd/group database and the commands that change it."""

    def __init__(self) -> None:
        self.users: dict[str, pwd.struct_passwd] = {}
        self.groups: dict[str, list[str]] = {}
        self.calls: list[list[str]] = []

    def getpwnam(self, name: str) -> pwd.struct_passwd:
        return self.users[name]

    def getgrnam(self, name: str) -> grp.struct_group:
        if name not in self.groups:
            raise KeyError(name)
        return grp.struct_group((name, "x", 2000, self.groups[name]))

    def add(self, name: str, gecos: str, home: str) -> None:
        uid = 1500 + len(self.users)
        self.users[name] = pwd.struct_passwd((name, "x", uid, uid, gecos, home, "/bin/bash"))

    def run(self, argv: list[str], **_: Any) -> proc.Result:
        self.calls.append(argv)
        if argv[0] == "groupadd":
            self.groups[argv[1]] = []
        elif argv[0] == "useradd":
            name, home = argv[-1], argv[argv.index("--home-dir") + 1]
            self.add(name, argv[argv.index("--comment") + 1], home)
            Path(home).mkdir(parents=True)
            self.groups[argv[argv.index("--groups") + 1]].append(name)
        elif argv[0] == "userdel":
            del self.users[argv[-1]]
            for members in self.groups.values():
                if argv[-1] in members:
                    members.remove(argv[-1])
        elif argv[0] == "groupdel":
            del self.groups[argv[1]]
        return proc.Result(argv, 0, "", "")


@pytest.fixture
def accounts(monkeypatch: pytest.MonkeyPatch) -> FakeAccounts:
    fake = FakeAccounts()
    monkeypatch.setattr(users.pwd, "getpwnam", fake.getpwnam)
    monkeypatch.setattr(users.grp, "getgrnam", fake.getgrnam)
    monkeypatch.setattr(users.proc, "run", fake.run)
    return fake


def test_names_are_per_sandbox() -> None:
    assert users.user_names(2) == ["rsp-u1", "rsp-u2"]
    assert users.group_name() == "rsp-sbx"
    assert users.user_names(1, port_offset=100) == ["rsp100-u1"]
    assert users.group_name(100) == "rsp100-sbx"


def test_ensure_creates_users_with_homes_in_the_state_dir(tmp_path: Path,
                                                          accounts: FakeAccounts) -> None:
    layout = Layout(str(tmp_path))
    made = users.ensure(layout, 2)
    assert [u.name for u in made] == ["rsp-u1", "rsp-u2"]
    assert made[0].home == str(tmp_path / "home" / "rsp-u1")
    assert accounts.groups["rsp-sbx"] == ["rsp-u1", "rsp-u2"]
    assert users.load(layout) == made
    assert json.loads(Path(layout.users_file).read_text())[1]["name"] == "rsp-u2"
    # Idempotent: a second `up` creates nothing.
    before = len(accounts.calls)
    assert users.ensure(layout, 2) == made
    assert len(accounts.calls) == before


def test_ensure_refuses_a_user_of_the_same_name_that_is_not_ours(
        tmp_path: Path, accounts: FakeAccounts) -> None:
    accounts.groups["rsp-sbx"] = []
    accounts.add("rsp-u1", "Real Person", "/home/rsp-u1")
    with pytest.raises(SandboxError, match="rsp-u1 exists and is not this sandbox's"):
        users.ensure(Layout(str(tmp_path)), 1)


def test_remove_deletes_only_users_carrying_this_sandboxs_marker(
        tmp_path: Path, accounts: FakeAccounts) -> None:
    layout = Layout(str(tmp_path))
    users.ensure(layout, 2)
    # rsp-u2 was replaced by someone else's user of the same name since `up`.
    accounts.users["rsp-u2"] = pwd.struct_passwd(("rsp-u2", "x", 1600, 1600, "someone",
                                                  "/home/x", "/bin/sh"))
    assert users.remove(layout) == []
    assert "rsp-u1" not in accounts.users
    assert "rsp-u2" in accounts.users
    assert ["userdel", "--force", "rsp-u2"] not in accounts.calls
    assert "rsp-sbx" in accounts.groups  # rsp-u2 is still a member: the group stays


def test_remove_without_users_touches_nothing(tmp_path: Path, accounts: FakeAccounts) -> None:
    accounts.groups["rsp-sbx"] = []
    assert users.remove(Layout(str(tmp_path))) == []
    assert accounts.calls == []


def test_dockerd_socket_belongs_to_the_users_group_only_with_users(tmp_path: Path) -> None:
    layout = Layout(str(tmp_path))
    plain = daemons.argv_for("dockerd", layout, SandboxSpec(docker=True))
    assert "--group" not in plain
    shared = daemons.argv_for("dockerd", layout, SandboxSpec(docker=True, users=2))
    assert shared[shared.index("--group") + 1] == "rsp-sbx"


def test_users_are_part_of_the_shape() -> None:
    spec = SandboxSpec(users=2)
    assert SandboxSpec.from_json(spec.to_json()) == spec
    old = json.loads(spec.to_json())
    del old["users"]
    assert SandboxSpec.from_json(json.dumps(old)).users == 0
    with pytest.raises(ValueError):
        SandboxSpec(users=-1)
