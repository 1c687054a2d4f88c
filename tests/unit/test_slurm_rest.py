"""RestSlurmClient against recorded slurmrestd 22.05 answers (v0.0.38) and v0.0.41 shapes."""

from __future__ import annotations

import errno
import json
import os
import socket
import urllib.error
from pathlib import Path

import pytest

from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.client import (
    PermanentSlurmError,
    SlurmClient,
    TransientSlurmError,
)
from ray_slurm_provider.slurm.rest.http import HttpResponse
from ray_slurm_provider.slurm.script import JobSpec, render
from tests.rest_fakes import (
    TOKEN,
    URL,
    V38,
    V41,
    client,
    make_jwt,
    recorded,
    v38_server,
    v41_server,
)

TRUE = JobSpec("j", ["true"])


def test_is_a_slurm_client_and_init_runs_nothing() -> None:
    server = v38_server()
    c = client(server)
    assert isinstance(c, SlurmClient)
    assert server.requests == []


def test_negotiates_newest_supported_version_once() -> None:
    server = v38_server()
    c = client(server)
    assert c.api_version() == "v0.0.38"
    c.list_jobs("rsp-record-rest")
    probes = [p for p in server.paths() if p.endswith("/ping")]
    assert probes == [f"GET /slurm/{v}/ping" for v in
                      ("v0.0.44", "v0.0.43", "v0.0.42", "v0.0.41", "v0.0.40", "v0.0.38")]
    c.cluster_info()
    assert [p for p in server.paths() if p.endswith("/ping")] == probes  # asked once

    assert client(v41_server()).api_version() == "v0.0.41"


def test_no_supported_version() -> None:
    server = v38_server()
    with pytest.raises(PermanentSlurmError, match="serves none of the API versions"):
        client(server, versions=("v0.0.41",)).api_version()


def test_headers_carry_user_and_token_read_per_request(tmp_path: Path) -> None:
    server = v38_server()
    tok = tmp_path / "jwt"
    first, second = make_jwt(user="alice"), make_jwt(exp=4102444801, user="alice")
    tok.write_text(f"SLURM_JWT={first}\n")
    tok.chmod(0o600)
    c = client(server, user="bob", jwt_file=str(tok))  # $USER=bob, the token is alice's
    c.api_version()
    assert server.requests[-1].headers["X-SLURM-USER-NAME"] == "alice" == c.user
    assert server.requests[-1].headers["X-SLURM-USER-TOKEN"] == first
    tok.write_text(second)
    c.node_addresses()
    assert server.requests[-1].headers["X-SLURM-USER-TOKEN"] == second
    from ray_slurm_provider.slurm.rest.client import RestSlurmClient

    explicit = RestSlurmClient(URL, user="carol", jwt_file=str(tok), send=server, env={})
    explicit.node_addresses()
    assert server.requests[-1].headers["X-SLURM-USER-NAME"] == "carol" == explicit.user


def test_token_from_env_and_env_file_variable(tmp_path: Path) -> None:
    server = v38_server()
    c = client(server)
    c.api_version()
    assert server.requests[-1].headers["X-SLURM-USER-TOKEN"] == TOKEN
    tok = tmp_path / "jwt"
    tok.write_text(make_jwt(user="f"))
    tok.chmod(0o600)
    c = client(server, env={"RAY_SLURM_JWT_FILE": str(tok)})
    c.node_addresses()
    assert server.requests[-1].headers["X-SLURM-USER-TOKEN"] == make_jwt(user="f")


@pytest.mark.parametrize(("token", "match"), [
    (make_jwt(exp=1_000_000_000), "expired at 2001"),
    ("not-a-token", "not a JWT"),
    ("a.%%%.c", "not a JWT"),
])
def test_bad_tokens_are_refused_before_sending(token: str, match: str) -> None:
    server = v38_server()
    with pytest.raises(PermanentSlurmError, match=match):
        client(server, env={"SLURM_JWT": token}).list_jobs("x")
    assert server.requests == []


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_token_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    tok = tmp_path / "jwt"
    tok.write_text("x")
    tok.chmod(mode)
    server = v38_server()
    with pytest.raises(PermanentSlurmError, match=f"chmod 600 {tok}"):
        client(server, jwt_file=str(tok)).list_jobs("x")
    assert server.requests == []  # the token never left the machine


def test_missing_token_and_url_say_how_to_fix(tmp_path: Path) -> None:
    server = v38_server()
    with pytest.raises(PermanentSlurmError, match="scontrol token"):
        client(server, jwt_file=str(tmp_path / "none")).list_jobs("x")
    with pytest.raises(PermanentSlurmError, match=r"\$MY_JWT is set"):
        client(server, jwt_env="MY_JWT").list_jobs("x")
    from ray_slurm_provider.slurm.rest.client import RestSlurmClient

    with pytest.raises(PermanentSlurmError, match=r"provider\.rest\.url"):
        RestSlurmClient(send=server, env={"SLURM_JWT": "t"}).list_jobs("x")


def test_list_jobs_v38_one_request_filtered_by_name_user_and_state() -> None:
    server = v38_server()
    c = client(server)
    c.api_version()
    server.requests.clear()
    jobs = {j.job_id: j for j in c.list_jobs("rsp-record-rest")}
    assert [p for p in server.paths()] == ["GET /slurm/v0.0.38/jobs", "GET /slurm/v0.0.38/nodes"]
    held, run = jobs["102"], jobs["103"]
    assert (held.state, held.reason, held.active, held.running) == (
        "PENDING", "JobHeldUser", True, False)
    assert held.comment == '{"tag": "held; with spaces"}'
    assert held.batch_host == held.node_addr == held.nodes == "" and held.start_time == ""
    assert held.time_limit_s is None and held.time_left_s is None
    assert (run.state, run.nodes, run.batch_host, run.node_addr) == (
        "RUNNING", "n1", "n1", "127.0.0.2")
    assert run.time_limit_s == 600 and run.time_left_s == 570  # clock: 30 s after the start
    assert run.partition == "cpu" and run.comment == "running" and run.submit_time
    # Addresses are cached: the next listing is one request.
    server.requests.clear()
    c.list_jobs("rsp-record-rest")
    assert server.paths() == ["GET /slurm/v0.0.38/jobs"]
    # Another user's jobs of the same name, and cancelled jobs, are not listed.
    assert client(v38_server(), user="bob").list_jobs("rsp-record-rest") == []
    assert client(v38_server()).list_jobs("ray-e2e") == []


def test_list_jobs_v41_states_and_numbers() -> None:
    c = client(v41_server(), user="alice", clock=1762940100 + 600)
    jobs = {j.job_id: j for j in c.list_jobs("ray-demo")}
    assert set(jobs) == {"501", "502", "503", "507"}  # not bob's 505, not COMPLETED 504
    assert jobs["503"].state == "COMPLETING" and not jobs["503"].active
    assert jobs["502"].state == "RUNNING" and jobs["502"].time_left_s == 3000
    assert jobs["502"].node_addr == "10.0.0.1"
    assert (jobs["501"].reason, jobs["501"].time_limit_s) == ("Priority", 7200)
    assert jobs["507"].time_limit_s is None  # infinite


def test_list_jobs_raises_on_every_error() -> None:
    server = v38_server()
    c = client(server)
    c.api_version()
    server.set("GET jobs", recorded(V38, "jobs_bad_token"))
    with pytest.raises(TransientSlurmError, match="unreachable and when slurmctld rejected"):
        c.list_jobs("x")  # 22.05 says "Unspecified error" for both
    server.set("GET jobs", recorded(V38, "jobs_no_token"))
    with pytest.raises(PermanentSlurmError, match=r"refused the token.*Authentication failure"):
        c.list_jobs("x")
    server.set("GET jobs", HttpResponse(200, b'{"jobs": [], "errors": [{"error": "boom"}]}'))
    with pytest.raises(PermanentSlurmError, match="boom"):
        c.list_jobs("x")
    server.set("GET jobs", HttpResponse(200, b'{"jobs": [{"name": "x", "user_name": "root"}]}'))
    with pytest.raises(PermanentSlurmError, match="cannot read"):
        c.list_jobs("x")
    server.set("GET jobs", HttpResponse(200, b"<html>proxy</html>"))
    with pytest.raises(PermanentSlurmError, match="not a JSON object"):
        c.list_jobs("x")


@pytest.mark.parametrize("answer", [
    urllib.error.URLError(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")),
    TimeoutError("timed out"),
    urllib.error.URLError(TimeoutError("timed out")),
    ConnectionResetError(errno.ECONNRESET, "reset"),
    HttpResponse(503, b"Service Unavailable"),
    HttpResponse(502, b"Bad Gateway"),
    HttpResponse(500, b""),
])
def test_no_answer_is_transient(answer: BaseException | HttpResponse) -> None:
    server = v38_server()
    c = client(server)
    c.api_version()
    server.set("GET jobs", answer)
    with pytest.raises(TransientSlurmError):
        c.list_jobs("x")


def test_controller_down_is_transient_in_slurms_words() -> None:
    server = v41_server()
    server.set("GET jobs", recorded(V41, "jobs_ctld_down"))
    with pytest.raises(TransientSlurmError) as ei:
        client(server, user="alice").list_jobs("ray-demo")
    assert "Unable to contact slurm controller" in ei.value.slurm_message
    server.set("GET jobs", recorded(V41, "jobs_bad_token"))
    with pytest.raises(PermanentSlurmError, match="Protocol authentication error"):
        client(server, user="alice").list_jobs("ray-demo")


@pytest.mark.parametrize("name", ["jobs", "nodes", "partitions", "submit", "delete"])
def test_recorded_controller_outage_v38_is_transient(name: str) -> None:
    server = v38_server()
    c = client(server)
    c.api_version()
    answer = recorded(V38, f"ctld_down_{name}")
    for key in ("GET jobs", "GET nodes", "GET partitions", "POST job/submit",
                "DELETE job/999999"):
        server.set(key, answer)
    call = {"jobs": lambda: c.list_jobs("x"), "nodes": c.node_addresses,
            "partitions": c.cluster_info, "submit": lambda: c.submit(TRUE),
            "delete": lambda: c.cancel(["999999"])}[name]
    with pytest.raises(TransientSlurmError) as ei:
        call()
    if name in ("submit", "delete"):
        assert "Unable to contact slurm controller" in ei.value.slurm_message


def test_unresolvable_host_is_permanent() -> None:
    server = v38_server()
    c = client(server)
    c.api_version()
    server.set("GET nodes", urllib.error.URLError(socket.gaierror(-2, "Name or service not known")))
    with pytest.raises(PermanentSlurmError, match=r"provider\.rest\.url"):
        c.node_addresses()


def test_submit_v38_translates_directives_and_sends_scrubbed_env() -> None:
    server = v38_server()
    c = client(server)
    spec = JobSpec("rsp-x", ["sleep", "300"], time="10", mem="100", partition="cpu")
    job_id = c.submit(spec, comment='ray-slurm:{"a":"b c"}')
    assert job_id == "103"
    (body,) = server.bodies("POST job/submit")
    assert body["script"] == render(spec)  # what sbatch gets on the CLI back end
    job = body["job"]
    assert job["name"] == "rsp-x" and job["comment"] == 'ray-slurm:{"a":"b c"}'
    assert (job["time_limit"], job["memory_per_node"], job["partition"]) == (10, 100, "cpu")
    assert job["current_working_directory"] == "/work"
    env = job["environment"]
    assert env["PATH"] == "/usr/bin:/bin" and env["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    for gone in ("SLURM_JWT", "SLURM_JOB_ID", "RAY_ADDRESS", "BASH_FUNC_module%%"):
        assert gone not in env


def test_submit_held_answer_with_a_warning_is_success() -> None:
    server = v38_server()
    server.set("POST job/submit", recorded(V38, "submit_held"))
    held = JobSpec("j", ["sleep", "1"], sbatch_options={"hold": None})
    assert client(server).submit(held) == "102"


def test_submit_errors_keep_slurms_words() -> None:
    server = v38_server()
    server.set("POST job/submit", recorded(V38, "submit_bad_partition"))
    with pytest.raises(PermanentSlurmError) as ei:
        client(server).submit(JobSpec("j", ["true"], partition="nosuchpartition"))
    assert "Invalid partition name specified" in ei.value.slurm_message
    server.set("POST job/submit", recorded(V38, "submit_no_environment"))
    with pytest.raises(PermanentSlurmError, match="environment must be set"):
        client(server).submit(TRUE)


def test_submit_refuses_untranslatable_options_before_sending() -> None:
    server = v38_server()
    c = client(server)
    c.api_version()
    server.requests.clear()
    with pytest.raises(PermanentSlurmError, match="--nodelist"):
        c.submit(JobSpec("j", ["true"], nodelist="n1"))
    with pytest.raises(PermanentSlurmError, match="--no-kill"):
        c.submit(JobSpec("j", ["true"], sbatch_options={"no-kill": None}))
    with pytest.raises(ValueError):
        c.submit(TRUE, comment="a\nb")
    with pytest.raises(ValueError, match=r"JobSpec\.partition"):  # ScriptError
        c.submit(JobSpec("j", ["true"], partition="a b"))
    assert server.requests == []


def test_submit_v41_body_shape() -> None:
    server = v41_server()
    c = client(server, user="alice")
    spec = JobSpec("j", ["true"], time="1-00:00:00", gres="gpu:2", nodelist="cn1",
                   requeue=False, exclusive=True)
    assert c.submit(spec) == "508"
    (body,) = server.bodies("POST job/submit")
    assert "script" not in body and body["job"]["script"] == render(spec)
    job = body["job"]
    assert job["time_limit"] == {"set": True, "infinite": False, "number": 1440}
    assert job["tres_per_node"] == "gres/gpu:2" and job["required_nodes"] == "cn1"
    assert job["requeue"] is False and job["shared"] == ["none"]
    assert "PATH=/usr/bin:/bin" in job["environment"]


def test_cancel_is_idempotent_and_raises_real_errors() -> None:
    server = v38_server()
    c = client(server)
    c.cancel(["999999", "102"])
    c.cancel([])
    assert sorted(p for p in server.paths() if p.startswith("DELETE")) == [
        "DELETE /slurm/v0.0.38/job/102", "DELETE /slurm/v0.0.38/job/999999"]
    server.set("DELETE job/103", HttpResponse(500, json.dumps({"errors": [
        {"error": "Access/permission denied", "error_number": 2002}]}).encode()))
    with pytest.raises(PermanentSlurmError, match="permission denied"):
        c.cancel(["103"])
    server.set("DELETE job/103", urllib.error.URLError(ConnectionRefusedError(111, "refused")))
    with pytest.raises(TransientSlurmError):
        c.cancel(["103"])
    with pytest.raises(ValueError):
        c.cancel(["1; rm"])


def test_cluster_info_v38_equals_the_cli_back_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    info = client(v38_server()).cluster_info()
    assert info.version == "22.05.8"
    cpu, gpu = info.partition("cpu"), info.partition("gpu")
    assert cpu is not None and gpu is not None and info.partition(None) == cpu
    assert gpu.gpus_per_node == 2 and cpu.max_time_s is None
    assert [n.name for n in cpu.nodes] == ["n1", "n2", "n3"]
    # The same cluster through the CLI back end (its recorded 22.05 outputs).
    from tests.unit.test_slurm_cli import FakeRun

    fake = FakeRun()
    fake.set("sinfo", "sinfo_version")
    fake.set("scontrol show node", "scontrol_show_node")
    fake.set("scontrol show partition", "scontrol_show_partition")
    from ray_slurm_provider import proc

    monkeypatch.setattr(proc, "run", fake)
    cli = CliSlurmClient().cluster_info()

    def shape(i: object) -> object:
        return [(p.name, p.cpus_per_node, p.memory_mb_per_node, p.gpus_per_node, p.gres,
                 p.max_time_s, p.default_time_s, p.default, p.state,
                 [(n.name, n.addr, n.cpus, n.memory_mb, n.gres) for n in p.nodes])
                for p in i.partitions]  # type: ignore[attr-defined]

    assert shape(info) == shape(cli)


def test_cluster_info_v41_shapes() -> None:
    info = client(v41_server(), user="alice").cluster_info()
    assert info.version == "24.11.5"
    batch, gpu = info.partition("batch"), info.partition("gpu")
    assert batch is not None and gpu is not None
    assert (batch.max_time_s, batch.default_time_s) == (172800, 3600)
    assert (gpu.max_time_s, gpu.default_time_s) == (None, None)
    assert info.partition(None) is None  # v0.0.41 does not say which partition is the default
    assert [n.name for n in gpu.nodes] == ["cn1", "cn2"] and gpu.gpus_per_node == 4
    assert batch.gpus_per_node == 0  # cn3 has no GPUs
    assert [n.state for n in gpu.nodes] == ["MIXED", "IDLE+DRAIN"]


def test_fixtures_exist() -> None:
    assert sorted(p.name for p in V38.glob("*.json"))
    assert sorted(p.name for p in V41.glob("*.json"))
    assert os.path.isdir(V38) and URL.startswith("http")


def test_pin_env_defaults_only_for_rest() -> None:
    from ray_slurm_provider.slurm.rest.client import pin_env_defaults

    env = {"RAY_SLURM_REST_URL": "http://r:1", "RAY_SLURM_JWT_FILE": "/s/jwt"}
    provider: dict[str, object] = {"slurm_api": "rest", "rest": {"url": "http://mine:2"}}
    pin_env_defaults(provider, env)
    assert provider["rest"] == {"url": "http://mine:2", "jwt_file": "/s/jwt"}
    cli: dict[str, object] = {}
    pin_env_defaults(cli, env)
    assert cli == {}


def test_cancel_takes_array_task_ids() -> None:
    """Issue 14.11: `ray down` of a cluster with array tasks (`<array>_<task>`) aborted with a
    ValueError. slurmrestd 22.05 cancels one task by that id (checked on the sandbox)."""
    server = v38_server()
    for j in ("7_3", "8"):
        server.set(f"DELETE job/{j}", recorded(V38, "delete_held"))
    client(server).cancel(["7_3", "8"])
    assert sorted(p for p in server.paths() if p.startswith("DELETE")) == [
        "DELETE /slurm/v0.0.38/job/7_3", "DELETE /slurm/v0.0.38/job/8"]


# --- issue 13.4: the token never goes through a proxy it was not told to use ----------------
class _Recorder:
    """A loopback HTTP server that records the requests (and their token header) it gets."""

    def __init__(self) -> None:
        import http.server
        import threading

        seen = self.seen = []  # type: list[tuple[str, str]]

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append((self.path, self.headers.get("X-SLURM-USER-TOKEN", "")))
                body = b'{"meta": {}, "errors": [], "pings": []}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_token_never_goes_through_an_environment_proxy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`http_proxy`/`https_proxy`, often set on login nodes, sent the JWT to the proxy."""
    from ray_slurm_provider.slurm.rest import http as rest_http

    server, proxy = _Recorder(), _Recorder()
    try:
        for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
            monkeypatch.setenv(var, proxy.url)
        for var in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(var, raising=False)
        send = rest_http.session_send()
        resp = send(rest_http.HttpRequest("GET", server.url + "/slurm/v0.0.38/ping",
                                          {"X-SLURM-USER-TOKEN": TOKEN}, timeout=10))
        assert resp.status == 200
        assert proxy.seen == [] and server.seen == [("/slurm/v0.0.38/ping", TOKEN)]
        # A proxy set in the config is used: the site chose it.
        via = rest_http.session_send(proxy=proxy.url)
        via(rest_http.HttpRequest("GET", server.url + "/x", {}, timeout=10))
        assert len(proxy.seen) == 1
    finally:
        server.close()
        proxy.close()


def test_plain_http_to_another_host_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from ray_slurm_provider.slurm.rest import http as rest_http

    caplog.set_level(logging.WARNING)
    assert rest_http.cleartext_warning("http://127.0.0.1:6820") is None
    assert rest_http.cleartext_warning("https://rest.example.org:6820") is None
    warning = rest_http.cleartext_warning("http://rest.example.org:6820")
    assert warning is not None and "in clear text" in warning and "https://" in warning


def test_the_session_keeps_the_socket_errors_that_classify_no_answer() -> None:
    """requests wraps a refused connection in its own errors ("Max retries exceeded ..."):
    the transport hands on the socket error, so a dead slurmrestd is still "connection
    refused" (transient) and an unknown host still a permanent config error."""
    import socket as socket_mod

    from ray_slurm_provider.slurm.rest import http as rest_http

    with socket_mod.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    send = rest_http.session_send()
    with pytest.raises(TransientSlurmError, match="connection refused"):
        rest_http.request(send, rest_http.HttpRequest("GET", f"http://127.0.0.1:{port}/x"),
                          "listing jobs")
    with pytest.raises(PermanentSlurmError, match="cannot resolve the host"):
        rest_http.request(send, rest_http.HttpRequest("GET", "http://no-such-host.invalid/x"),
                          "listing jobs")
