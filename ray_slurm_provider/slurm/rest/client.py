"""`SlurmClient` over slurmrestd (JWT auth), for heads and login nodes without Slurm tools.

* Constructing a client does nothing: the URL, token and API version are resolved on the
  first call, and the version is negotiated once: GET /slurm/<v>/ping for each version of
  `SUPPORTED_VERSIONS`, newest first; the first that is not a 404 wins.
* The JWT is read on every request (file or variable, see rest_http.read_token), so a token
  refreshed on disk is used at once.
* `list_jobs` is ONE GET /slurm/<v>/jobs, filtered here by job name, user and state (the
  slurmctld endpoint has no name or user filter), and raises on any error in the answer.
* `submit` sets each field of the JobSpec in the request (rest/job.py) and sends the job's
  environment explicitly: the submitting process's environment scrubbed exactly as the CLI
  back end scrubs sbatch's (SLURM_*, RAY_*, ... dropped; SLURM_CONF kept) and without the
  token's own variable. slurmrestd has no --export=ALL; what the request carries (plus the
  SLURM_* variables slurmd sets, and the spec's own variables, which the script exports) is
  all the job gets.
* `cancel` is one DELETE per job (slurmrestd 22.05 has no bulk cancel); jobs already gone are
  fine.
* `ended_job` is one GET job/<id> (slurmctld keeps an ended job for MinJobAge); for a job it
  has forgotten, accounting's sacct, as the CLI back end (slurm/sacct.py).
* Node addresses come from GET /slurm/<v>/nodes and are cached like the CLI back end's.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from ray_slurm_provider.slurm.client import (
    JOB_ID_RE,
    LIST_STATES,
    ClusterInfo,
    EndedJob,
    Job,
    Node,
    PermanentSlurmError,
    SlurmError,
    is_job_gone,
    job_environment,
)
from ray_slurm_provider.slurm.rest import http as rest_http
from ray_slurm_provider.slurm.rest import job as rest_job
from ray_slurm_provider.slurm.rest import parse as rest_parse
from ray_slurm_provider.slurm.sacct import Accounting
from ray_slurm_provider.slurm.spec import JobSpec

logger = logging.getLogger(__name__)

#: API versions this client speaks, newest first (see rest_parse for the two shape families).
#: v0.0.39 is left out on purpose: every Slurm that serves it also serves v0.0.38 or v0.0.40.
SUPPORTED_VERSIONS = ("v0.0.44", "v0.0.43", "v0.0.42", "v0.0.41", "v0.0.40", "v0.0.38")
URL_ENV = "RAY_SLURM_REST_URL"
JWT_FILE_ENV = "RAY_SLURM_JWT_FILE"
_LIST_STATES = frozenset(LIST_STATES.split(","))


def pin_env_defaults(provider: dict[str, Any], env: Mapping[str, str] | None = None) -> None:
    """At `ray up`: write RAY_SLURM_REST_URL / RAY_SLURM_JWT_FILE into an unset
    `provider.rest.url` / `jwt_file`. The head's autoscaler reads the provider section, not
    the login node's environment (RAY_* variables never reach jobs)."""
    if provider.get("slurm_api") != "rest":
        return
    src = os.environ if env is None else env
    rest = provider.setdefault("rest", {})
    for key, var in (("url", URL_ENV), ("jwt_file", JWT_FILE_ENV)):
        if not rest.get(key) and src.get(var):
            rest[key] = src[var]


class RestSlurmClient:
    """Talks to slurmrestd; constructing it runs nothing and opens no connection."""

    def __init__(self, url: str | None = None, *, jwt_file: str | None = None,
                 jwt_env: str = "SLURM_JWT", user: str | None = None, timeout: float = 30.0,
                 env: Mapping[str, str] | None = None, send: rest_http.Send | None = None,
                 versions: Iterable[str] = SUPPORTED_VERSIONS,
                 clock: Any = time.time, cwd: str | None = None) -> None:
        self._url = url
        self._jwt_file = jwt_file
        self._jwt_env = jwt_env
        self._user = user
        self._timeout = timeout
        self._env = dict(env) if env is not None else None  # None: os.environ at call time
        self._send = send or rest_http.session_send()
        self._warned = False  # about a plain-http URL, once
        self._versions = tuple(versions)
        self._clock = clock
        self._cwd = cwd
        self._version: str | None = None
        self._version_lock = threading.Lock()
        self._addr_lock = threading.Lock()
        self._fetch_lock = threading.Lock()
        self._addrs: dict[str, str] = {}
        self._noted: set[str] = set()

    # --- plumbing -------------------------------------------------------------------------

    def environ(self) -> Mapping[str, str]:
        return self._env if self._env is not None else os.environ

    @property
    def base_url(self) -> str:
        url = self._url or self.environ().get(URL_ENV, "")
        if not url:
            raise PermanentSlurmError(
                f"no slurmrestd URL: set provider.rest.url (or {URL_ENV}), e.g. "
                "http://slurm-rest.example.org:6820", command="slurmrestd")
        if not self._warned:
            self._warned = True
            warning = rest_http.cleartext_warning(url)
            if warning:
                logger.warning(warning)
        return url.rstrip("/")

    def _token(self) -> str:
        jwt_file = self._jwt_file or self.environ().get(JWT_FILE_ENV) or None
        return rest_http.read_token(jwt_file, self._jwt_env, self.environ())

    def _user_for(self, token: str) -> str:
        sun = rest_http.jwt_claims(token).get("sun")
        return self._user or (str(sun) if sun else "") or self.environ().get("USER") \
            or getpass.getuser()

    @property
    def user(self) -> str:
        """`rest.user`, else the token's own user (its `sun` claim), else $USER."""
        return self._user or self._user_for(self._token())

    def _headers(self) -> dict[str, str]:
        token = self._token()
        return {"X-SLURM-USER-NAME": self._user_for(token), "X-SLURM-USER-TOKEN": token,
                "Accept": "application/json", "Content-Type": "application/json"}

    def _call(self, method: str, path: str, what: str, body: Any = None,
              version: str | None = None) -> tuple[int, Any]:
        v = version or self.api_version()
        req = rest_http.HttpRequest(
            method, f"{self.base_url}/slurm/{v}/{path}", self._headers(),
            None if body is None else json.dumps(body).encode(), self._timeout)
        return rest_http.request(self._send, req, what)

    def api_version(self) -> str:
        """The negotiated API version (asked once per client)."""
        with self._version_lock:
            if self._version is None:
                self._version = self._negotiate()
            return self._version

    def _negotiate(self) -> str:
        for v in self._versions:
            try:
                self._call("GET", "ping", f"probing slurmrestd API {v}", version=v)
            except PermanentSlurmError as e:
                if "(HTTP 404" in str(e):
                    continue
                raise
            logger.info("slurmrestd at %s speaks %s", self.base_url, v)
            return v
        raise PermanentSlurmError(
            f"slurmrestd at {self.base_url} serves none of the API versions this client "
            f"speaks ({', '.join(self._versions)}); see its /openapi/v3 for what it serves, "
            "or use provider.slurm_api: cli", command="slurmrestd")

    def job_environment(self) -> dict[str, str]:
        """What a submitted job's environment holds (see the module docstring)."""
        return job_environment(self.environ(), drop=[self._jwt_env])

    # --- SlurmClient ----------------------------------------------------------------------

    def submit(self, spec: JobSpec, *, comment: str = "") -> str:
        if "\n" in comment:
            raise ValueError("the job comment must be one line")
        v = self.api_version()
        notes: list[str] = []
        body = rest_job.job_description(
            spec, api_version=v, environment=self.job_environment(),
            cwd=self._cwd or os.getcwd(), comment=comment, notes=notes)
        for note in notes:
            if note not in self._noted:
                self._noted.add(note)
                logger.warning("%s", note)
        _, data = self._call("POST", "job/submit", "submitting a job", body)
        job_id = data.get("job_id")
        if not isinstance(job_id, int) or job_id <= 0:
            rest_http.raise_errors(data, "submitting a job")
            raise PermanentSlurmError(f"slurmrestd accepted the job but returned no job id: "
                                      f"{json.dumps(data)[:300]}", command="slurmrestd")
        for text in rest_http.error_texts(data):  # e.g. "Job is in held state, ..."
            logger.info("slurmrestd about job %s: %s", job_id, text)
        return str(job_id)

    def list_jobs(self, job_name: str) -> list[Job]:
        if not job_name or "," in job_name:
            raise ValueError(f"job name must be non-empty and without commas: {job_name!r}")
        jobs = [j for j in self._user_jobs(job_name) if j.state in _LIST_STATES]
        hosts = {j.batch_host for j in jobs if j.batch_host}
        if not hosts:
            return jobs
        addrs = self._addresses_for(hosts)
        return [replace(j, node_addr=addrs.get(j.batch_host, "")) for j in jobs]

    def ended_job(self, job_id: str) -> EndedJob | None:
        """How `job_id` ended: slurmctld's record while it keeps the job (GET job/<id>), else
        accounting (sacct), as the CLI back end asks. See `EndReader`."""
        if not JOB_ID_RE.match(job_id):
            raise ValueError(f"not a Slurm job id: {job_id!r}")
        what = f"asking how job {job_id} ended"
        try:
            _, data = self._call("GET", f"job/{job_id}", what)
            rest_http.raise_errors(data, what)
        except PermanentSlurmError as e:
            if not is_job_gone(e.slurm_message):
                raise
            return Accounting(timeout=self._timeout, env=self._env).ended_job(job_id)
        try:
            return rest_parse.ended(data.get("jobs") or [], job_id, self._clock())
        except (ValueError, AttributeError, TypeError) as e:
            raise PermanentSlurmError(f"cannot read slurmrestd's job {job_id}: {e}",
                                      command="slurmrestd") from e

    def user_job_ids(self) -> set[str]:
        """Every id of this user's jobs slurmrestd lists, any name, any state (UserJobs)."""
        return {i for j in self._user_jobs(None) for i in (j.job_id, j.numeric_id)}

    def _user_jobs(self, job_name: str | None) -> list[Job]:
        """This user's jobs slurmrestd lists (named `job_name` unless None), in any state."""
        _, data = self._call("GET", "jobs", "listing jobs")
        rest_http.raise_errors(data, "listing jobs")
        records = data.get("jobs")
        if not isinstance(records, list):
            raise PermanentSlurmError("slurmrestd's job list has no 'jobs' array",
                                      command="slurmrestd")
        now, user = self._clock(), self.user
        try:
            return [rest_parse.job(r, now) for r in records if r.get("user_name") == user
                    and (job_name is None or r.get("name") == job_name)]
        except (ValueError, AttributeError, TypeError) as e:
            raise PermanentSlurmError(f"cannot read slurmrestd's job list: {e}",
                                      command="slurmrestd") from e

    def cancel(self, job_ids: Iterable[str]) -> None:
        ids = sorted({str(j).strip() for j in job_ids})
        bad = [j for j in ids if not JOB_ID_RE.match(j)]
        if bad:
            raise ValueError(f"not Slurm job ids: {bad}")
        failures: list[SlurmError] = []
        for j in ids:
            try:
                _, data = self._call("DELETE", f"job/{j}", f"cancelling job {j}")
                rest_http.raise_errors(data, f"cancelling job {j}")
            except SlurmError as e:
                if not is_job_gone(e.slurm_message):
                    failures.append(e)
        if failures:
            raise failures[0] if len(failures) == 1 else type(failures[0])(
                "; ".join(str(f) for f in failures), failures[0].slurm_message, "slurmrestd")

    def cluster_info(self) -> ClusterInfo:
        nodes, release = self._nodes()
        _, data = self._call("GET", "partitions", "listing partitions")
        rest_http.raise_errors(data, "listing partitions")
        try:
            parts = rest_parse.partitions(data.get("partitions") or [], nodes)
        except (ValueError, AttributeError, TypeError) as e:
            raise PermanentSlurmError(f"cannot read slurmrestd's partitions: {e}",
                                      command="slurmrestd") from e
        return ClusterInfo(release or rest_parse.version(data), parts)

    def node_address(self, name: str) -> str | None:
        return self.node_addresses().get(name)

    def node_addresses(self) -> Mapping[str, str]:
        self._nodes()
        with self._addr_lock:
            return dict(self._addrs)

    # --- helpers --------------------------------------------------------------------------

    def _nodes(self) -> tuple[list[tuple[Node, list[str]]], str]:
        _, data = self._call("GET", "nodes", "listing nodes")
        rest_http.raise_errors(data, "listing nodes")
        try:
            nodes = [rest_parse.node(r) for r in data.get("nodes") or []]
        except (ValueError, AttributeError, TypeError) as e:
            raise PermanentSlurmError(f"cannot read slurmrestd's nodes: {e}",
                                      command="slurmrestd") from e
        with self._addr_lock:
            self._addrs = {n.name: n.addr for n, _ in nodes}
        return nodes, rest_parse.version(data)

    def _addresses_for(self, hosts: set[str]) -> dict[str, str]:
        with self._addr_lock:
            if hosts <= self._addrs.keys():
                return dict(self._addrs)
        with self._fetch_lock:
            with self._addr_lock:
                if hosts <= self._addrs.keys():
                    return dict(self._addrs)
            self._nodes()
            with self._addr_lock:
                return dict(self._addrs)
