"""Fixtures of the integration suites that several modules share."""

from __future__ import annotations

import pytest

from ray_slurm_provider.sandbox import Sandbox


@pytest.fixture(scope="module")
def login_sandbox(sandbox: Sandbox) -> Sandbox:
    """The session's sandbox with its login node (`up --login`); one started without it
    gets its sshd added (`up` on a running sandbox starts only what the shape adds)."""
    if not sandbox.users():
        pytest.skip("the login node needs the sandbox's users (sandbox up --users N)")
    sb = Sandbox.from_state_dir(sandbox.state_dir)
    if not sb.spec.login:
        s = sb.spec
        sb = Sandbox(sb.state_dir, nodes=s.nodes, gpus_per_node=s.gpus_per_node,
                     cpus_per_node=s.cpus_per_node, memory_mb_per_node=s.memory_mb_per_node,
                     docker=s.docker, port_offset=s.port_offset, users=s.users, slurm=s.slurm,
                     accounting=s.accounting, pyxis=s.pyxis, login=True)
        sb.up(install=True)  # openssh-server, as the phase's own `up --install` would
    return sb
