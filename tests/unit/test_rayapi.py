"""The Ray behaviour rayapi relies on, pinned by running Ray's own code (issue 25.4).

Each test fails when a Ray upgrade changes what the package relies on; none reads Ray's
source text. No Ray cluster is started.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import NODE_KIND_WORKER, TAG_RAY_NODE_KIND

from ray_slurm_provider import rayapi

SANDBOX_YAML = Path(__file__).resolve().parents[2] / "cluster-configs" / "sandbox.yaml"
NODE_TYPES = {"head": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
              "w": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 2}}


class FakeProvider(NodeProvider):
    """Nodes in a dict; the command runner records what it is asked to run."""

    nodes: dict[str, dict[str, str]] = {}
    ran: list[str] = []
    envs: dict[str, Any] = {}
    fail: str = ""

    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        return [n for n, t in self.nodes.items()
                if all(t.get(k) == v for k, v in tag_filters.items())]

    def terminate_nodes(self, node_ids: list[str]) -> None:
        for n in node_ids:
            self.nodes.pop(n, None)

    def is_terminated(self, node_id: str) -> bool:
        return node_id not in self.nodes

    def node_tags(self, node_id: str) -> dict[str, str]:
        return dict(self.nodes[node_id])

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        self.nodes[node_id].update(tags)

    def get_command_runner(self, *args: Any, **kwargs: Any) -> Any:
        provider = self

        class Runner:
            def run(self, cmd: str, **kw: Any) -> str:
                provider.ran.append(cmd)
                provider.envs[cmd] = kw.get("environment_variables")
                if cmd == provider.fail:
                    raise rayapi.runner_error("it failed", 3, cmd)
                return ""

            def run_init(self, **kw: Any) -> bool:
                return False

            def run_rsync_up(self, *a: Any, **kw: Any) -> None:
                return None

        return Runner()


def config(**extra: Any) -> dict[str, Any]:
    """The sandbox's config (it has every key Ray's schema wants) on the fake provider."""
    base = yaml.safe_load(SANDBOX_YAML.read_text())
    base.update(cluster_name="rayapi-test", max_workers=2, head_node_type="head",
                provider={"type": "external", "module": f"{__name__}.FakeProvider"},
                available_node_types=json.loads(json.dumps(NODE_TYPES)))
    return {**base, **extra}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Ray's config cache goes to a temp dir of the test's own; Ray's provider cache and the
    fake's class-level state start empty."""
    from ray.autoscaler._private import providers

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(providers, "_provider_instances", {})
    monkeypatch.setattr(FakeProvider, "nodes", {})
    monkeypatch.setattr(FakeProvider, "ran", [])
    monkeypatch.setattr(FakeProvider, "envs", {})
    monkeypatch.setattr(FakeProvider, "fail", "")


def test_bootstrap_config_puts_setup_commands_before_the_heads_once() -> None:
    """head_commands does not add setup_commands: Ray's preparation already did."""
    resolved = rayapi.bootstrap_config(config(
        initialization_commands=["echo init"], setup_commands=["mkdir /tmp/x"],
        head_setup_commands=["echo h"], head_start_ray_commands=["ray start --head"]))
    assert resolved["head_setup_commands"] == ["mkdir /tmp/x", "echo h"]
    assert rayapi.head_commands(resolved) == [
        "echo init", "mkdir /tmp/x", "echo h", "ray start --head"]


def test_the_config_cache_is_where_ray_up_writes_and_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """drop_config_cache (ray-slurm run before `ray down`, issue 26.4) removes the file Ray's
    own _bootstrap_config caches a resolution in and loads it from."""
    from ray.autoscaler._private.commands import _bootstrap_config

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    raw = config(setup_commands=["echo cached"])
    path = rayapi.config_cache_path(raw)
    assert not path.exists()
    _bootstrap_config(json.loads(json.dumps(raw)))  # Ray writes its cache
    assert path.is_file()
    hit = _bootstrap_config(json.loads(json.dumps(raw)))  # and reads it back from there
    assert hit["provider"]["_config_cache_path"] == str(path)
    yml = tmp_path / "c.yaml"
    yml.write_text(yaml.safe_dump(raw))
    rayapi.drop_config_cache(str(yml))
    assert not path.exists()


class SeeingProvider(FakeProvider):
    """Records the config Ray hands the provider's bootstrap hook."""

    seen: list[dict[str, Any]] = []

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        SeeingProvider.seen.append(json.loads(json.dumps(cluster_config)))
        return cluster_config


def test_ray_up_hands_the_provider_upscaling_speed_only_when_the_yaml_sets_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What bootstrap_config relies on to fill `upscaling_speed` for a gang (issue 26.5):
    for an external provider Ray's preparation (prepare_config -> fillout_defaults, whose
    defaults have no upscaling_speed) does not fill it in before the provider's hook."""
    monkeypatch.setattr(SeeingProvider, "seen", [])
    module = {"type": "external", "module": f"{__name__}.SeeingProvider"}
    unset = config(provider=module)
    del unset["upscaling_speed"]
    assert "upscaling_speed" not in rayapi.bootstrap_config(unset)
    rayapi.bootstrap_config(config(provider=module, upscaling_speed=4))
    assert [c.get("upscaling_speed") for c in SeeingProvider.seen] == [None, 4]


def test_merge_setup_commands_is_the_merge_of_rays_own_preparation() -> None:
    """`ray-slurm render` merges as `ray up` does: setup_commands before the head's and the
    workers' own, once."""
    commands = {"setup_commands": ["s"], "head_setup_commands": ["h"],
                "worker_setup_commands": ["w"]}
    resolved = rayapi.bootstrap_config(config(**commands))
    merged = dict(commands)
    rayapi.merge_setup_commands(merged)
    for key in commands:
        assert merged[key] == resolved[key]
    assert merged["worker_setup_commands"] == ["s", "w"]
    bare: dict[str, Any] = {}
    rayapi.merge_setup_commands(bare)
    assert bare == {"setup_commands": [], "head_setup_commands": [], "worker_setup_commands": []}


def updater(provider: FakeProvider, **commands: list[str]) -> Any:
    from ray.autoscaler._private.updater import NodeUpdater

    return NodeUpdater(node_id="1", provider_config={"type": "external"}, provider=provider,
                       auth_config={}, cluster_name="c", file_mounts={},
                       runtime_hash="h", file_mounts_contents_hash="", is_head_node=True,
                       **commands)


def test_rays_updater_runs_initialization_then_setup_then_start_commands() -> None:
    """The order HEAD_COMMAND_KEYS (and so `ray-slurm sbatch`'s head) follows."""
    p = FakeProvider({}, "c")
    p.nodes["1"] = {}
    updater(p, initialization_commands=["i"], setup_commands=["s1", "s2"],
            ray_start_commands=["ray start --head"]).do_update()
    assert p.ran == ["uptime", "i", "s1", "s2", "ray start --head"]
    assert rayapi.HEAD_COMMAND_KEYS == (
        "initialization_commands", "head_setup_commands", "head_start_ray_commands")


def test_rays_updater_takes_runner_error_as_a_failed_command() -> None:
    """A runner's rayapi.runner_error is Ray's ProcessRunnerError: the updater reports the
    command as failed (its own ClickException), the next commands do not run."""
    p = FakeProvider({}, "c")
    p.nodes["1"] = {}
    p.fail = "s1"
    with pytest.raises(click.ClickException, match="Setup command failed"):
        updater(p, initialization_commands=[], setup_commands=["s1", "s2"],
                ray_start_commands=["ray start"]).do_update()
    assert p.ran == ["uptime", "s1"]
    err = rayapi.runner_error("m", 3, "cmd")
    assert (err.msg_type, err.code, err.command) == (  # type: ignore[attr-defined]
        "ssh_command_failed", 3, "cmd")


def ray_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             provider: NodeProvider | None = None) -> list[float]:
    """Run Ray's own `ray down` loop (workers only: no `ray stop` on a head) on two of
    FakeProvider's workers, or on the workers of `provider`; what it slept."""
    from ray.autoscaler._private import commands

    naps: list[float] = []
    fake_time = types.SimpleNamespace(
        **{**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")},
           "sleep": naps.append})
    monkeypatch.setattr(commands, "time", fake_time)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # Ray's config cache
    if provider is None:
        FakeProvider.nodes.update({"1": {TAG_RAY_NODE_KIND: NODE_KIND_WORKER},
                                   "2": {TAG_RAY_NODE_KIND: NODE_KIND_WORKER}})
    else:
        monkeypatch.setattr(commands, "_get_node_provider", lambda cfg, name: provider)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config()))
    commands.teardown_cluster(str(path), yes=True, workers_only=True,
                              override_cluster_name=None, keep_min_workers=False)
    assert FakeProvider.nodes == {}
    return naps


def test_ray_down_sleeps_poll_interval_after_each_terminate_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What shorten_ray_down_poll relies on: Ray's teardown loop sleeps its POLL_INTERVAL
    (RAY_DOWN_POLL_S) after each terminate_nodes call, read when it sleeps."""
    from ray.autoscaler._private import commands

    monkeypatch.setattr(commands, "POLL_INTERVAL", commands.POLL_INTERVAL)  # restored after
    assert ray_down(tmp_path, monkeypatch) == [rayapi.RAY_DOWN_POLL_S]
    assert rayapi.shorten_ray_down_poll(0.1)
    assert not rayapi.shorten_ray_down_poll(0.2)  # once; a value Ray did not set stays
    assert ray_down(tmp_path, monkeypatch) == [0.1]


def test_the_start_variables_are_the_ones_rays_updater_sets() -> None:
    """`ray-slurm sbatch` hands the head's `ray start` the variables Ray's updater would."""
    p = FakeProvider({}, "c")
    p.nodes["1"] = {}
    updater(p, initialization_commands=[], setup_commands=[], ray_start_commands=["ray start"],
            node_resources={"CPU": 1}, node_labels={"a": "b"}).do_update()
    resources, labels = rayapi.start_env_names()
    env = p.envs["ray start"]
    assert env[resources] == {"CPU": 1} and env[labels] == {"a": "b"}
    assert (resources, labels) == ("RAY_OVERRIDE_RESOURCES", "RAY_OVERRIDE_LABELS")


def test_resources_per_node_reads_the_gcs_by_node_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's per-node views decode the GCS's messages into {node id (hex): {name: amount}}."""
    from ray._private import state
    from ray.core.generated import gcs_pb2

    node = bytes(range(28))
    avail = gcs_pb2.AvailableResources(node_id=node, resources_available={"CPU": 1.0})
    total = gcs_pb2.TotalResources(node_id=node, resources_total={"CPU": 2.0, "GPU": 1.0})
    accessor = types.SimpleNamespace(
        get_all_available_resources=lambda: [avail.SerializeToString()],
        get_all_total_resources=lambda: [total.SerializeToString()])
    monkeypatch.setattr(state.state, "_connect_and_get_accessor", lambda: accessor)
    assert rayapi.resources_per_node() == ({node.hex(): {"CPU": 1.0}},
                                           {node.hex(): {"CPU": 2.0, "GPU": 1.0}})


def test_config_schema_is_the_one_rays_validate_config_applies() -> None:
    """`ray-slurm validate` checks what `ray up` would: a key Ray's schema does not know is
    refused by Ray's own check and by the schema rayapi reads."""
    import jsonschema
    from ray.autoscaler._private.util import validate_config

    bad = {**config(), "no_such_key": 1}
    with pytest.raises(jsonschema.ValidationError) as rays:
        validate_config(bad)
    with pytest.raises(jsonschema.ValidationError) as ours:
        jsonschema.validate(bad, rayapi.config_schema())
    assert "no_such_key" in ours.value.message and ours.value.message == rays.value.message
    assert ours.value.schema == rays.value.schema
    jsonschema.validate(config(), rayapi.config_schema())


class RaisingProvider(FakeProvider):
    """A provider whose every launch fails with a NodeLaunchException."""

    def create_node_with_resources_and_labels(self, node_config: dict[str, Any],
                                              tags: dict[str, str], count: int,
                                              resources: dict[str, float],
                                              labels: dict[str, str]) -> dict[str, Any]:
        from ray.autoscaler.node_launch_exception import NodeLaunchException

        raise NodeLaunchException("JobDiedAtStart", "the job's last line", None)


def test_v2_drops_a_launch_errors_words_unless_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    """rayapi.explain_launch_errors: Ray 2.60's NodeProviderAdapter keeps the provider's
    exception only as the LaunchNodeError's __cause__ (empty details), and the reconciler
    records str(error); wrapped, the error's message ends in the cause's words."""
    from ray.autoscaler.v2.instance_manager.node_provider import NodeProviderAdapter

    from tests.unit.test_launch_errors import ConfigReader

    poll = NodeProviderAdapter.poll_errors
    monkeypatch.setattr(NodeProviderAdapter, "poll_errors", getattr(poll, "__wrapped__", poll))

    def failed_launch() -> str:
        adapter = NodeProviderAdapter(RaisingProvider({}, "c"), ConfigReader())  # type: ignore[arg-type]
        adapter.launch({"w": 2}, "req-1")
        adapter._main_executor.shutdown(wait=True)
        adapter._node_launcher_executors.shutdown(wait=True)
        (error,) = adapter.poll_errors()
        assert error.node_type == "w" and error.count == 2 and error.request_id == "req-1"
        return str(error)

    assert failed_launch() == "Failed to launch 2 nodes of type w with request id req-1: "
    assert rayapi.explain_launch_errors() and rayapi.explain_launch_errors()  # once
    assert failed_launch() == ("Failed to launch 2 nodes of type w with request id req-1: "
                               "(JobDiedAtStart) the job's last line")


def test_autoscaler_event_goes_into_the_monitors_event_stream(tmp_path: Path) -> None:
    """rayapi.autoscaler_event: the event logger Ray's monitor makes for the AUTOSCALER
    source is kept per process under that name, and its file holds one JSON event a line."""
    from ray._private.event import event_logger
    from ray.core.generated.event_pb2 import Event

    assert not rayapi.autoscaler_event("nobody listens")  # no monitor in this process
    event_logger.get_event_logger(Event.SourceType.AUTOSCALER, str(tmp_path))
    try:
        assert rayapi.autoscaler_event("type w is held back")
    finally:
        adapter = event_logger._event_logger.pop("AUTOSCALER")
        for handler in adapter.logger.handlers[:]:
            adapter.logger.removeHandler(handler)
            handler.close()
    (line,) = (tmp_path / "events" / "event_AUTOSCALER.log").read_text().splitlines()
    event = event_logger.parse_event(line)
    assert event is not None and event.message == "type w is held back"
    assert event.severity == Event.Severity.WARNING


# --- autoscaler v1 keeps a worker alive by its IP (issue 26 item 7) ----------------------------

class V1:
    """Ray's own autoscaler v1 (StandardAutoscaler) over the provider `section` names, on the
    test's clock. `tick(t, beats)` puts a heartbeat from each raylet address in `beats` into
    its load metrics, as its monitor does (keyed by the address the raylet bound: `ray start
    --node-ip-address`), then runs one update at second `t`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, section: dict[str, Any],
                 **extra: Any) -> None:
        from ray.autoscaler._private import autoscaler, load_metrics, providers
        from ray.autoscaler._private.autoscaler import StandardAutoscaler

        self.now = 0.0
        clock = types.SimpleNamespace(
            **{**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")},
               "time": lambda: self.now})
        monkeypatch.setattr(autoscaler, "time", clock)
        monkeypatch.setattr(load_metrics, "time", clock)
        monkeypatch.setattr(providers, "_provider_instances", {})
        # As bootstrap_config leaves it (workers start themselves); no launch hash to match,
        # and launches in this thread.
        provider = {**section, "disable_node_updaters": True,
                    "disable_launch_config_check": True, "foreground_node_launch": True}
        cfg = config(provider=provider, **extra)
        self.metrics = load_metrics.LoadMetrics()
        gcs = types.SimpleNamespace(drain_nodes=lambda *a, **kw: [])
        self.autoscaler = StandardAutoscaler(lambda: cfg, self.metrics, gcs,
                                             update_interval_s=0)

    @property
    def provider(self) -> Any:
        return self.autoscaler.provider

    def tick(self, at: float, beats: list[str]) -> None:
        self.now = at
        for ip in beats:
            self.metrics.update(ip, bytes(28), {"CPU": 1.0}, {"CPU": 1.0}, 0.0)
        self.autoscaler.update()
        assert self.autoscaler.num_failures == 0, "the update raised (logged above)"

    def kept(self, beats: list[str], seconds: int = 60) -> list[float]:
        """Tick every 5 s for `seconds`, heartbeats from `beats` each time; for each node
        listed at the start, the last tick (s) whose listing still had it."""
        ids = list(self.provider.non_terminated_nodes({}))
        last = dict.fromkeys(ids, -1.0)
        for t in range(0, seconds + 1, 5):
            self.tick(float(t), beats)
            for node_id in self.provider.non_terminated_nodes({}):
                last[node_id] = float(t)
        return [last[i] for i in ids]


class AddressedProvider(FakeProvider):
    """The fake with an address per node."""

    ips: dict[str, str] = {}

    def internal_ip(self, node_id: str) -> str:
        return self.ips[node_id]

    def external_ip(self, node_id: str) -> str:
        return self.ips[node_id]


@pytest.mark.parametrize(("address", "kept"), [("10.1.2.3", 60.0), ("127.0.0.2", 25.0)])
def test_v1_keeps_a_worker_while_its_internal_ip_is_the_one_its_heartbeats_carry(
        monkeypatch: pytest.MonkeyPatch, address: str, kept: float) -> None:
    """Ray's v1 over a fake provider whose internal_ip is set per node: it matches a worker
    to its raylet's heartbeats by `provider.internal_ip(node)` alone. Up-to-date, it is
    marked active once under that address; if its raylet (bound to 10.1.2.3) reports under
    another, the worker is terminated as "lost contact with raylet" once
    AUTOSCALER_HEARTBEAT_TIMEOUT_S (30 s) have passed. Why SlurmNodeProvider.internal_ip
    answers the address the node's Ray bound: test_provider.py, and v1 over the real
    provider in tests/integration/test_node_address.py."""
    from ray.autoscaler._private.constants import AUTOSCALER_HEARTBEAT_TIMEOUT_S
    from ray.autoscaler.tags import (
        NODE_KIND_HEAD,
        STATUS_UP_TO_DATE,
        TAG_RAY_NODE_STATUS,
        TAG_RAY_USER_NODE_TYPE,
    )

    assert AUTOSCALER_HEARTBEAT_TIMEOUT_S == 30
    up = {TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE}
    FakeProvider.nodes.update({
        "h": {TAG_RAY_NODE_KIND: NODE_KIND_HEAD, TAG_RAY_USER_NODE_TYPE: "head", **up},
        "w": {TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: "w", **up}})
    monkeypatch.setattr(AddressedProvider, "ips", {"h": "10.1.2.1", "w": address})
    v1 = V1(monkeypatch, {"type": "external", "module": f"{__name__}.AddressedProvider"})
    assert v1.kept(["10.1.2.1", "10.1.2.3"]) == [60.0, kept]


def test_use_auth_makes_ray_read_the_clusters_token_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A notebook imports Ray (which reads the auth mode) before it learns the cluster's
    token: use_auth makes Ray's cached mode and token follow the variables set after."""
    from ray._raylet import AuthenticationTokenLoader, Config, get_authentication_mode

    token = tmp_path / "auth_token"
    token.write_text("t0k3n")
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    Config.initialize("")
    try:
        off = get_authentication_mode()
        rayapi.use_auth({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
        assert get_authentication_mode() != off
        headers = AuthenticationTokenLoader.instance().get_token_for_http_header()
        assert "t0k3n" in str(headers)
    finally:
        monkeypatch.undo()
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def test_a_home_token_switches_ray_start_head_to_token_mode_only_without_a_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the provider sets RAY_AUTH_MODE on every node, `disabled` included (auth.auth_env;
    tests/e2e/test_ray_up.py shows it on a real cluster): from Ray 2.59 `ray start --head`
    turns token auth on by itself when `~/.ray/auth_token` exists and the mode is unset, and
    keeps to the mode when it is set."""
    setup = pytest.importorskip("ray._private.authentication.authentication_token_setup")
    switch = getattr(setup, "maybe_enable_token_auth_if_token_available", None)
    if switch is None:
        pytest.skip("this Ray (before 2.59) never switches the mode by itself")
    from ray._raylet import AuthenticationTokenLoader, Config

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("leftover")
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    AuthenticationTokenLoader.instance().reset_cache()
    try:
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
        assert switch(warn_if_disabled=False) is False
        monkeypatch.delenv("RAY_AUTH_MODE")
        assert switch(warn_if_disabled=False) is True  # the home's token switched it on
        assert os.environ.get("RAY_AUTH_MODE") == "token"
    finally:
        monkeypatch.undo()
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
