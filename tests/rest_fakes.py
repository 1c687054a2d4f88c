"""A slurmrestd stand-in that answers from recorded or documented responses (no sockets)."""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray_slurm_provider.slurm.rest.client import RestSlurmClient
from ray_slurm_provider.slurm.rest.http import HttpRequest, HttpResponse

FIX = Path(__file__).resolve().parent / "fixtures"
V38 = FIX / "slurmrestd-22.05" / "v0.0.38"
V41 = FIX / "slurmrestd-shapes" / "v0.0.41"
NOT_FOUND = HttpResponse(404, b"Unable find requested URL. Please view /openapi/v3 for API "
                              b"reference.")
URL = "http://rest.test:6820"


def make_jwt(exp: int = 4102444800, user: str = "root") -> str:
    """An (unsigned) JWT shaped like `scontrol token`'s; expires in 2100 by default."""
    def part(d: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")

    return f"{part({'alg': 'HS256', 'typ': 'JWT'})}.{part({'exp': exp, 'sun': user})}.c2ln"


TOKEN = make_jwt()


def recorded(directory: Path, name: str) -> HttpResponse:
    data = json.loads((directory / f"{name}.json").read_text())
    body = data["body"]
    raw = body if isinstance(body, str) else json.dumps(body)
    return HttpResponse(int(data["status"]), raw.encode())


Answer = HttpResponse | BaseException


@dataclass
class FakeRest:
    """Routes "METHOD path-after-/slurm/<v>/" to answers; other versions answer 404."""

    version: str
    answers: dict[str, list[Answer]] = field(default_factory=dict)
    requests: list[HttpRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, key: str, *answers: Answer) -> None:
        self.answers[key] = list(answers)

    def __call__(self, req: HttpRequest) -> HttpResponse:
        with self.lock:
            self.requests.append(req)
        prefix = f"{URL}/slurm/"
        assert req.url.startswith(prefix), req.url
        version, _, path = req.url[len(prefix):].partition("/")
        if version != self.version:
            return NOT_FOUND
        key = f"{req.method} {path}"
        with self.lock:
            queue = self.answers.get(key)
            if not queue:
                raise AssertionError(f"unexpected request {key}")
            answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def paths(self) -> list[str]:
        return [f"{r.method} {r.url.removeprefix(URL)}" for r in self.requests]

    def bodies(self, key: str) -> list[Any]:
        return [json.loads(r.body or b"null") for r in self.requests
                if f"{r.method} {r.url.rsplit('/slurm/', 1)[1].split('/', 1)[1]}" == key]


def v38_server() -> FakeRest:
    f = FakeRest("v0.0.38")
    for name in ("ping", "jobs", "nodes", "partitions", "submit"):
        method = "POST" if name == "submit" else "GET"
        path = "job/submit" if name == "submit" else name
        f.set(f"{method} {path}", recorded(V38, name))
    f.set("DELETE job/999999", recorded(V38, "delete_unknown"))
    for j in ("102", "103"):
        f.set(f"DELETE job/{j}", recorded(V38, "delete_held"))
    return f


def v41_server() -> FakeRest:
    f = FakeRest("v0.0.41")
    for name in ("ping", "jobs", "nodes", "partitions"):
        f.set(f"GET {name}", recorded(V41, name))
    f.set("POST job/submit", recorded(V41, "submit"))
    return f


def client(server: FakeRest, user: str = "root", clock: float = 1796000905.0 + 30,
           **kw: Any) -> RestSlurmClient:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "USER": user,
           "SLURM_JWT": make_jwt(user=user),
           "SLURM_JOB_ID": "1", "RAY_ADDRESS": "x", "SLURM_CONF": "/etc/slurm/slurm.conf",
           "BASH_FUNC_module%%": "() { :; }", "LANG": "C.UTF-8"}
    env.update(kw.pop("env", {}))
    return RestSlurmClient(URL, send=server, env=env, clock=lambda: clock, cwd="/work", **kw)
