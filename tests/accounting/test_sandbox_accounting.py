"""The accounting sandbox itself: the database, the associations and QOSes `up --accounting`
makes, and a database that cannot start stopping `up` with nothing left running."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox import Sandbox, SandboxError, accounting
from ray_slurm_provider.sandbox.procs import owned_processes

pytestmark = [pytest.mark.accounting, pytest.mark.integration]


def test_the_site_the_sandbox_plays(sandbox: Sandbox) -> None:
    env = {**os.environ, **sandbox.env()}
    qos = proc.run(["sacctmgr", "-n", "-P", "show", "qos",
                    "format=Name,Priority,Preempt,PreemptMode,MaxSubmitJobsPU"], env=env,
                   timeout=60).stdout.split()
    assert {"normal|0||cluster|", "high|1000|scavenger|cluster|", "scavenger|0||cancel|",
            "limited|0||cluster|2"} <= set(qos), qos
    assoc = proc.run(["sacctmgr", "-n", "-P", "show", "assoc", "format=Account,User"], env=env,
                     timeout=60).stdout.split()
    u1, u2 = (u.name for u in sandbox.users())  # rsp-u1, rsp-u2 (another prefix at an offset)
    assert {f"team-a|{u1}", f"team-b|{u2}", "team-a|root", "team-b|root"} <= set(assoc)
    gres = proc.run(["sinfo", "-h", "-N", "-p", "gpu", "-o", "%N %G"], env=env,
                    timeout=60).stdout.splitlines()
    assert gres == ["n1 gpu:h100:2", "n2 gpu:h100:2", "n3 gpu:a100:1"]


def test_a_database_that_cannot_start_stops_up_and_leaves_nothing(sandbox: Sandbox) -> None:
    state = tempfile.mkdtemp(prefix="rsp-acct-fail-", dir="/tmp")
    offset = sandbox.spec.port_offset + 350
    sb = Sandbox(state, nodes=1, gpus_per_node=0, accounting=True, port_offset=offset)
    with socket.socket() as taken:  # someone else's server on the database's port
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", accounting.DB_PORT + offset))
        taken.listen()
        try:
            with pytest.raises(SandboxError, match=rf"cannot start mariadb: TCP port "
                               rf"{accounting.DB_PORT + offset} is already in use"):
                sb.up()
            assert owned_processes(sb.state_dir) == []  # munged, started first, is stopped
            assert os.path.isdir(sb.layout.log_dir)  # the logs stay for the user to read
            assert sb.status().daemons and not any(sb.status().daemons.values())
        finally:
            sb.down()
    assert not os.path.exists(state)
