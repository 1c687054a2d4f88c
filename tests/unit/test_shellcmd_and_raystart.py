"""Reading Ray's command strings, and the `ray start` line the agent builds from them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ray_slurm_provider import shellcmd
from ray_slurm_provider.agent.raystart import allocation, ray_start_argv
from ray_slurm_provider.nodespec import NodeSpec
from ray_slurm_provider.ports import port_block
from ray_slurm_provider.state import ClusterDir


def test_split_respects_quotes() -> None:
    cmd = "export A='x; y'; echo \"a && b\" && ray start --head; ray stop || true"
    assert shellcmd.split_top_level(cmd) == [
        "export A='x; y'",
        'echo "a && b"',
        "ray start --head",
        "ray stop",
        "true",
    ]


def test_parse_ray_up_head_start() -> None:
    cmd = (
        "export RAY_enable_autoscaler_v2=1; export RAY_CLOUD_INSTANCE_ID=42; "
        "ulimit -n 65536; ray start --head --autoscaling-config=~/ray_bootstrap_config.yaml"
    )
    p = shellcmd.parse(cmd)
    assert p.exports == {"RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": "42"}
    assert p.before == []  # issue 14.4: the ulimit must reach Ray: it runs in Ray's own shell
    assert p.prefix.endswith("ulimit -n 65536;")
    assert p.ray_start == [
        "ray",
        "start",
        "--head",
        "--autoscaling-config=~/ray_bootstrap_config.yaml",
    ]


def test_parse_exec_stop_is_scoped() -> None:
    p = shellcmd.parse(
        "ray stop; ray teardown ~/ray_bootstrap_config.yaml --yes "
        "--workers-only; sudo shutdown -h now"
    )
    assert p.ray_stop and p.shutdown and p.ray_start is None
    assert p.rest == ["ray teardown ~/ray_bootstrap_config.yaml --yes --workers-only"]


def test_plain_command_untouched() -> None:
    p = shellcmd.parse("uptime")
    assert p.rest == ["uptime"] and not p.ray_stop and p.ray_start is None


_PLAIN = st.text(alphabet="ab =;&|\n$-", max_size=8)
_QUOTED = st.builds(lambda q, t: q + t + q, st.sampled_from(["'", '"']),
                    st.text(alphabet="ab ;&|\n$", max_size=6))
_WORDS = st.sampled_from(["ray start --head", "ray stop", "export A=1", "sudo shutdown"])
_COMMAND = st.lists(st.one_of(_PLAIN, _QUOTED, _WORDS), max_size=5).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(_COMMAND, max_size=4))
def test_a_command_list_parses_as_its_join(cmds: list[str]) -> None:
    """The agent parses `worker_start_ray_commands` without joining them first: the same
    program as the join, but for where the plain shell before `ray start` runs (the earlier
    commands in shells of their own, `ray start`'s own command's part in Ray's shell)."""
    def shell_before(p: shellcmd.Program) -> list[str]:
        return p.before + [s for s in shellcmd.split_top_level(p.prefix)
                           if shellcmd.parse(s).rest == [s]]  # plain shell only

    assume(sum("ray start" in c for c in cmds) <= 1)  # one `ray start`, as Ray's lists have
    one, joined = shellcmd.parse_commands(cmds), shellcmd.parse("; ".join(cmds))
    assert shell_before(one) == shell_before(joined)
    assert replace(one, before=[], prefix="") == replace(joined, before=[], prefix="")


def test_an_open_quote_stays_in_its_own_command() -> None:
    # Joined, the quote would swallow `ray start` (Ray runs each command on its own).
    p = shellcmd.parse_commands(["echo 'x", "ray start --address=h:1"])
    assert p.before == ["echo 'x"] and p.ray_start == ["ray", "start", "--address=h:1"]


def test_flags() -> None:
    argv = ["ray", "start", "--port", "1", "--head"]
    assert shellcmd.get_flag(argv, "--port") == "1"
    assert shellcmd.set_flag(argv, "--port", "2") == ["ray", "start", "--head", "--port=2"]


def test_allocation_from_slurm_env() -> None:
    env = {"SLURM_CPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_MEM_PER_NODE": "2000"}
    assert allocation(env) == (4, 2, 2000 * 1024 * 1024)
    assert allocation({}) == (None, None, None)


def _spec(kind: str, **kw: object) -> NodeSpec:
    return NodeSpec(
        kind=kind, node_type="t", cluster_name="c1", state_dir="/s", ports_base=25000, **kw
    )  # type: ignore[arg-type]


def test_worker_start_gets_allocation_ports_and_ids(tmp_path: Path) -> None:
    prog = shellcmd.parse("ray start --address=$RAY_HEAD_IP:$RAY_GCS_PORT")
    env = {
        "SLURM_CPUS_ON_NODE": "2",
        "CUDA_VISIBLE_DEVICES": "0",
        "SLURM_MEM_PER_NODE": "1000",
        "HOME": "/home/u",
    }
    argv, renv = ray_start_argv(
        _spec("worker", resources={"CPU": 1, "acc": 2}),
        prog,
        env=env,
        job_id="77",
        node_ip="127.0.0.3",
        head_ip="127.0.0.2",
        temp_dir="/tmp/rsp-77",
        cluster_dir=ClusterDir(str(tmp_path), "c1"),
    )
    assert argv[1:3] == ["start", "--address=127.0.0.2:25000"]
    assert "--node-ip-address=127.0.0.3" in argv
    assert "--num-cpus=1" in argv  # the node type's resources win over the allocation
    assert "--num-gpus=1" in argv
    # Issue 14.6: the object store comes out of the allocation, not on top of it.
    mib = 1024 * 1024
    assert f"--memory={700 * mib}" in argv and f"--object-store-memory={300 * mib}" in argv
    assert '--resources={"acc": 2}' in argv
    assert "--temp-dir=/tmp/rsp-77" in argv and argv[-1] == "--block"
    assert "--dashboard-agent-listen-port=0" in argv
    assert renv["RAY_CLOUD_INSTANCE_ID"] == "77" and renv["RAY_NODE_TYPE_NAME"] == "t"
    assert renv["RAY_AUTH_MODE"] == "token"
    assert renv["RAY_AUTH_TOKEN_PATH"].endswith("c1/auth_token")
    assert "RAY_AUTH_TOKEN" not in renv


def test_head_start_gets_port_block_and_cluster_bootstrap(tmp_path: Path) -> None:
    prog = shellcmd.parse(
        "export RAY_enable_autoscaler_v2=1; ray start --head "
        "--autoscaling-config=~/ray_bootstrap_config.yaml --port=6379"
    )
    cdir = ClusterDir(str(tmp_path), "c1")
    argv, renv = ray_start_argv(
        _spec("head", auth_mode="disabled"),
        prog,
        env={},
        job_id="5",
        node_ip="127.0.0.2",
        head_ip="127.0.0.2",
        temp_dir="/tmp/rsp-5",
        cluster_dir=cdir,
    )
    assert "--port=6379" in argv  # the user's explicit choice is kept
    assert f"--autoscaling-config={cdir.bootstrap_config}" in argv
    assert "--dashboard-host=127.0.0.2" in argv and "--dashboard-port=25001" in argv
    assert renv["RAY_enable_autoscaler_v2"] == "1"
    assert renv["AUTOSCALER_METRIC_PORT"] == "25003"
    # A worker job that ends before any listing saw it (it died at once, or its node went
    # DOWN) left v2's launch request waiting 10 minutes, with the type's slot taken.
    assert renv["RAY_AUTOSCALER_RECONCILE_REQUEST_STATUS_TIMEOUT_S"] == "120"
    assert renv["RAY_AUTH_MODE"] == "disabled"
    # Issue 18 (P5): Ray hands a launch of k nodes of a type over in create calls of <= 5
    # nodes; each call is one sbatch, so the head asks for k at once (one job array).
    assert renv["AUTOSCALER_MAX_LAUNCH_BATCH"] == "1000"
    _, renv = ray_start_argv(_spec("head", auth_mode="disabled"), prog,
                             env={"AUTOSCALER_MAX_LAUNCH_BATCH": "7"}, job_id="5",
                             node_ip="127.0.0.2", head_ip="127.0.0.2", temp_dir="/tmp/rsp-5",
                             cluster_dir=cdir)
    assert renv["AUTOSCALER_MAX_LAUNCH_BATCH"] == "7"  # the user's own setting wins


def test_port_blocks_differ_per_cluster_and_are_stable() -> None:
    a, b = port_block("one", user="u"), port_block("two", user="u")
    assert a != b and port_block("one", user="u") == a
    assert 24000 <= a.base < 32000 and port_block("x", 30000).base == 30000


def test_memory_and_object_store_fit_the_allocation_with_every_source(tmp_path: Path) -> None:
    """Issue 14.6: Ray was offered 130 % of the job's memory."""
    mib = 1024 * 1024

    def flags(**kw: object) -> dict[str, int]:
        argv, _ = ray_start_argv(
            _spec("worker", **kw), shellcmd.parse("ray start --address=x:1"),
            env={"SLURM_CPUS_ON_NODE": "1", "SLURM_MEM_PER_NODE": "4000"}, job_id="1",
            node_ip="127.0.0.3", head_ip="127.0.0.2", temp_dir="/tmp/rsp-1",
            cluster_dir=ClusterDir(str(tmp_path), "c1"))
        return {k: int(shellcmd.get_flag(argv, k) or 0)
                for k in ("--memory", "--object-store-memory")}

    auto = flags()
    assert auto == {"--memory": 2800 * mib, "--object-store-memory": 1200 * mib}
    pinned = flags(object_store_memory=1000 * mib)
    assert pinned == {"--memory": 3000 * mib, "--object-store-memory": 1000 * mib}
    # `resources.memory` (what `ray up` fills in: the allocation less the store) is kept.
    given = flags(resources={"memory": 2800 * mib})
    assert given == {"--memory": 2800 * mib, "--object-store-memory": 1200 * mib}
    for f in (auto, pinned, given):
        assert sum(f.values()) <= 4000 * mib


# --- issue 14.4: compound start commands ------------------------------------------------------
def test_the_prefix_of_ray_start_is_kept_raw_for_its_own_shell() -> None:
    p = shellcmd.parse_commands(["pip list > /dev/null",
                                 "ulimit -n 65536 || true; cd /scratch && source env.sh && "
                                 "ray start --address=$RAY_HEAD_IP:$RAY_GCS_PORT"])
    assert p.before == ["pip list > /dev/null"]  # an earlier command: its own shell, as Ray does
    assert p.prefix == "ulimit -n 65536 || true; cd /scratch && source env.sh &&"
    assert p.ray_start is not None and p.ray_start[:2] == ["ray", "start"]
    assert shellcmd.parse("ray start --head").prefix == ""


def test_what_follows_ray_start_is_refused_with_the_key_path() -> None:
    import pytest

    from ray_slurm_provider.provider.validation import check_start_commands
    from ray_slurm_provider.schema import ConfigError

    base = {"cluster_name": "c", "available_node_types": {"w": {"resources": {"CPU": 1}}}}
    with pytest.raises(ConfigError, match=r"worker_start_ray_commands\[1\]: .*never returns"):
        check_start_commands({**base, "worker_start_ray_commands": [
            "echo hi", "ray start --address=$RAY_HEAD_IP:$RAY_GCS_PORT; echo done"]})
    with pytest.raises(ConfigError, match=r"head_start_ray_commands\[0\]: .*never returns"):
        check_start_commands({**base, "head_start_ray_commands": ["ray start --head && touch up"]})
    check_start_commands({**base, "head_start_ray_commands": ["ulimit -n 4096; ray start --head"]})


def test_ray_stop_before_ray_start_never_runs_bare_in_rays_shell() -> None:
    """Ray's examples start workers with `ray stop; ray start ...`: the prefix that runs in
    Ray's own shell must never carry the bare `ray stop` (it would kill every Ray process
    of the user on the node, other clusters' too)."""
    p = shellcmd.parse("ulimit -n 4096; ray stop; ray start --address=h:1")
    assert p.ray_stop and "ray stop" not in p.prefix and p.prefix.startswith("ulimit -n 4096")
    assert shellcmd.parse("ray stop; ray start --address=h:1").prefix == ""


# --- issue 13.5: every port of the block is checked; a taken block is skipped -----------------
def test_a_block_with_any_port_taken_is_skipped_unless_pinned() -> None:
    import pytest

    from ray_slurm_provider.ports import PortBlock, free_block

    first = PortBlock(24000)
    taken = {24003}  # only the autoscaler metrics port: Ray would fail late, or silently
    block = free_block("127.0.0.3", first, pinned=False,
                       can_bind=lambda host, port: port not in taken)
    assert block.base == 24010
    assert free_block("127.0.0.3", first, pinned=False, can_bind=lambda h, p: True) == first
    with pytest.raises(RuntimeError, match=r"24003 .*provider\.ports\.base"):
        free_block("127.0.0.3", first, pinned=True, can_bind=lambda h, p: p not in taken)
    last = PortBlock(31990)  # the search wraps around the range
    assert free_block("h", last, pinned=False, can_bind=lambda h, p: p < 31990).base == 24000


def test_a_port_left_in_time_wait_by_the_last_head_is_free() -> None:
    """A head that stopped a moment ago leaves its ports in TIME_WAIT; Ray's servers bind
    them again (SO_REUSEADDR), so the next head keeps its block instead of moving."""
    import socket

    from ray_slurm_provider.ports import can_bind

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end of the pair goes to TIME_WAIT
    client.close()
    assert not can_bind("127.0.0.1", port)  # still listening: taken
    server.close()
    assert can_bind("127.0.0.1", port)
