"""HTTP plumbing of the REST back end: the JWT, one JSON round trip, and typed errors.

Everything goes through a `Send` callable (`session_send()` by default) so unit tests replay
recorded slurmrestd answers without a socket. Errors keep slurmrestd's own words:

* no answer (connection refused, reset, timeout), HTTP 502/503/504, 408 and 429 are
  transient;
* HTTP 401/403 (the token), 404 (the endpoint) and other 4xx are permanent;
* any other answer with Slurm errors in its body is classified by Slurm's words, as the CLI
  back end classifies stderr: slurmrestd 22.05 answers HTTP 500 for "Invalid partition name
  specified", which retrying would not fix, and also for a dead slurmctld ("Unable to contact
  slurm controller"), which it would.
* slurmrestd 22.05's read endpoints (jobs, nodes, partitions, ping) lose the reason and say
  only "Unspecified error" both while slurmctld is unreachable (seen in the sandbox) and when
  slurmctld rejects the token. That answer is taken as transient, with both causes named;
  the usual token failures are caught before sending instead: `read_token` refuses a token
  that is not a JWT or whose `exp` has passed.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import socket
import time
import urllib.error
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray_slurm_provider.slurm.client import (
    PermanentSlurmError,
    SlurmError,
    TransientSlurmError,
    classify,
)

TOKEN_HINT = (
    "get a token with `scontrol token lifespan=86400` (it prints SLURM_JWT=...), store the part "
    "after '=' in a file with mode 0600 and set provider.rest.jwt_file (or RAY_SLURM_JWT_FILE) "
    "to its path"
)
_TRANSIENT_STATUS = frozenset({408, 429, 502, 503, 504})


@dataclass(frozen=True)
class HttpRequest:
    method: str
    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes | None = None
    timeout: float = 30.0


@dataclass(frozen=True)
class HttpResponse:
    status: int
    body: bytes


#: One HTTP round trip; raises OSError (URLError, TimeoutError, ...) when nothing answers.
Send = Callable[[HttpRequest], HttpResponse]


def session_send(*, proxy: str | None = None, ca_file: str | None = None) -> Send:
    """`Send` over one requests.Session. Nothing comes from the environment (`trust_env` off):
    an `http_proxy` on a login node would otherwise receive the JWT, so a proxy is used only
    when the config names one. `ca_file` verifies a site's own CA (https). HTTP error
    statuses are answers, not exceptions; no answer raises an OSError, as `request` expects."""
    import requests

    session = requests.Session()
    session.trust_env = False
    if proxy:
        session.proxies = {"http": proxy, "https": proxy}
    verify: bool | str = ca_file or True

    def send(req: HttpRequest) -> HttpResponse:
        try:
            r = session.request(req.method, req.url, data=req.body, headers=dict(req.headers),
                                timeout=req.timeout, verify=verify, allow_redirects=False)
        except requests.Timeout as e:
            raise TimeoutError(str(e)) from e
        except requests.RequestException as e:
            raise (_socket_error(e) or ConnectionError(str(e))) from e
        return HttpResponse(int(r.status_code), bytes(r.content))

    return send


def _socket_error(e: BaseException) -> OSError | None:
    """The socket error under requests' and urllib3's wrappers (a refused connection, an
    unknown host): what `request` classifies by."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, socket.gaierror | ConnectionRefusedError | ConnectionResetError):
            return x
        todo += [c for c in (x.__cause__, x.__context__, getattr(x, "reason", None))
                 if isinstance(c, BaseException)]
        todo += [a for a in x.args if isinstance(a, BaseException)]
    return None


def cleartext_warning(url: str) -> str | None:
    """What to say when the JWT would cross the network unencrypted (plain http to a host
    that is not this one)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "http" or host == "localhost" or host == "::1" or host.startswith("127."):
        return None
    return (f"slurmrestd at {url} is plain http: your Slurm JWT goes over the network in clear "
            "text with every request; use https:// (with provider.rest.ca_file for a site CA)")


def read_token(jwt_file: str | None, jwt_env: str, env: Mapping[str, str]) -> str:
    """The JWT from `jwt_file` (0600, yours) or else from the variable `jwt_env`."""
    if jwt_file:
        path = Path(os.path.expanduser(jwt_file))
        try:
            st = path.stat()
            text = path.read_text()
        except FileNotFoundError:
            raise PermanentSlurmError(f"JWT file {path} does not exist; {TOKEN_HINT}",
                                      command="slurmrestd") from None
        except OSError as e:
            raise PermanentSlurmError(f"cannot read JWT file {path}: {e}",
                                      command="slurmrestd") from e
        if st.st_mode & 0o077:
            raise PermanentSlurmError(
                f"JWT file {path} is readable by others (mode {st.st_mode & 0o777:o}); anyone "
                f"who reads it can act as you in Slurm: run `chmod 600 {path}`",
                command="slurmrestd")
        if st.st_uid != os.getuid():
            raise PermanentSlurmError(f"JWT file {path} is not owned by you (uid {st.st_uid})",
                                      command="slurmrestd")
        token = text.strip().removeprefix("SLURM_JWT=")
        if not token:
            raise PermanentSlurmError(f"JWT file {path} is empty; {TOKEN_HINT}",
                                      command="slurmrestd")
        check_jwt(token, f"the JWT in {path}")
        return token
    token = env.get(jwt_env, "").strip()
    if not token:
        raise PermanentSlurmError(
            f"no Slurm JWT: neither provider.rest.jwt_file (or RAY_SLURM_JWT_FILE) nor "
            f"${jwt_env} is set; {TOKEN_HINT}", command="slurmrestd")
    check_jwt(token, f"the JWT in ${jwt_env}")
    return token


def jwt_claims(token: str) -> dict[str, Any]:
    """The (unverified) claims of a JWT; ValueError when it is not one."""
    parts = token.split(".")
    if len(parts) != 3:
        raise ValueError("not a JWT (expected three dot-separated parts)")
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload))
    except (ValueError, TypeError) as e:
        raise ValueError(f"not a JWT (its payload does not decode: {e})") from None
    if not isinstance(claims, dict):
        raise ValueError("not a JWT (its payload is not a JSON object)")
    return claims


def check_jwt(token: str, where: str, now: float | None = None) -> None:
    """Refuse what slurmctld would refuse anyway, with a clearer message."""
    try:
        claims = jwt_claims(token)
    except ValueError as e:
        raise PermanentSlurmError(f"{where} is {e}; {TOKEN_HINT}", command="slurmrestd") from e
    exp = claims.get("exp")
    if isinstance(exp, (int, float)) and exp < (time.time() if now is None else now):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(exp))
        raise PermanentSlurmError(f"{where} expired at {when}; {TOKEN_HINT}",
                                  command="slurmrestd")


def error_texts(data: Any) -> list[str]:
    """slurmrestd's own error messages from a response body ("errors": [...])."""
    if not isinstance(data, Mapping):
        return []
    out = []
    for e in data.get("errors") or []:
        if not isinstance(e, Mapping):
            out.append(str(e))
            continue
        desc = str(e.get("description") or "").strip()
        err = str(e.get("error") or "").strip()
        text = desc if err and err in desc else ": ".join(p for p in (desc, err) if p)
        if text:
            out.append(text)
    return out


def request(send: Send, req: HttpRequest, what: str) -> tuple[int, Any]:
    """One round trip: (status, parsed JSON body). Raises typed errors for what no caller can
    use: no answer, auth failures, missing endpoints, non-JSON bodies, failing statuses."""
    try:
        resp = send(req)
    except TimeoutError as e:
        raise TransientSlurmError(f"{what}: slurmrestd gave no answer within {req.timeout:g}s",
                                  "timed out", "slurmrestd") from e
    except urllib.error.URLError as e:
        raise _no_answer(what, req.url, e.reason) from e
    except OSError as e:
        raise _no_answer(what, req.url, e) from e
    text = resp.body.decode("utf-8", errors="replace")
    try:
        data: Any = json.loads(text) if text.strip() else None
    except ValueError:
        data = None
    words = "; ".join(error_texts(data)) or text.strip()[:500] or f"HTTP {resp.status}"
    if resp.status in (401, 403):
        raise PermanentSlurmError(
            f"{what}: slurmrestd refused the token (HTTP {resp.status}: {words}); {TOKEN_HINT}",
            words, "slurmrestd")
    if resp.status == 404:
        raise PermanentSlurmError(f"{what}: slurmrestd has no {req.url} (HTTP 404: {words})",
                                  words, "slurmrestd")
    if resp.status in _TRANSIENT_STATUS:
        raise TransientSlurmError(f"{what}: slurmrestd answered HTTP {resp.status}: {words}",
                                  words, "slurmrestd")
    if resp.status >= 400:
        if error_texts(data):
            raise _typed(f"{what}: {words}", words)
        cls = TransientSlurmError if resp.status >= 500 else PermanentSlurmError
        raise cls(f"{what}: slurmrestd answered HTTP {resp.status}: {words}", words,
                  "slurmrestd")
    if not isinstance(data, Mapping):
        raise PermanentSlurmError(f"{what}: slurmrestd answered something that is not a JSON "
                                  f"object: {text[:200]!r}", command="slurmrestd")
    return resp.status, data


def raise_errors(data: Any, what: str) -> None:
    """Raise (typed by Slurm's words) when the body carries errors."""
    texts = error_texts(data)
    if texts:
        words = "; ".join(texts)
        raise _typed(f"{what}: {words}", words)


def _typed(message: str, words: str) -> SlurmError:
    if all(t.strip().endswith("Unspecified error") for t in words.split("; ")):
        return TransientSlurmError(
            f"{message} (slurmrestd says this both when slurmctld is unreachable and when "
            "slurmctld rejected the JWT; `ray-slurm doctor CONFIG` tells them apart)",
            words, "slurmrestd")
    err = classify(words, "slurmrestd")
    return type(err)(message, words, "slurmrestd")


def _no_answer(what: str, url: str, reason: object) -> SlurmError:
    if isinstance(reason, socket.gaierror) and reason.errno != socket.EAI_AGAIN:
        return PermanentSlurmError(f"{what}: cannot resolve the host of {url} ({reason}); check "
                                   "provider.rest.url", str(reason), "slurmrestd")
    if isinstance(reason, TimeoutError):
        return TransientSlurmError(f"{what}: slurmrestd at {url} gave no answer in time",
                                   "timed out", "slurmrestd")
    if isinstance(reason, ConnectionRefusedError) or getattr(reason, "errno", None) in (
            errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH):
        return TransientSlurmError(f"{what}: cannot reach slurmrestd at {url}: {reason} "
                                   "(connection refused: is slurmrestd running?)",
                                   f"connection refused: {reason}", "slurmrestd")
    if "ssl" in type(reason).__name__.lower() or "certificate" in str(reason).lower():
        return PermanentSlurmError(f"{what}: TLS to {url} failed: {reason}", str(reason),
                                   "slurmrestd")
    return TransientSlurmError(f"{what}: no answer from slurmrestd at {url}: {reason}",
                               f"connection failure: {reason}", "slurmrestd")
