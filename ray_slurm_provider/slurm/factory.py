"""The Slurm client a cluster's config asks for (`provider.slurm_api`).

Constructing a client never talks to Slurm and never imports optional packages: the REST
client negotiates its API version on first use, and the pyslurm back end imports pyslurm on
first use (so a missing or mismatched pyslurm surfaces as a `SlurmError` from the first call,
never as an import error in the head's autoscaler).
"""

from __future__ import annotations

from ray_slurm_provider.config import ProviderConfig
from ray_slurm_provider.slurm.client import SlurmClient


def make_client(pcfg: ProviderConfig | None = None, *, timeout: float = 30.0) -> SlurmClient:
    """A fresh client for `pcfg.slurm_api` (default config: the CLI back end)."""
    pcfg = pcfg or ProviderConfig()
    api = pcfg.slurm_api
    if api == "rest":
        from ray_slurm_provider.slurm.rest.client import RestSlurmClient

        r = pcfg.rest
        from ray_slurm_provider.slurm.rest.http import session_send

        return RestSlurmClient(r.url, jwt_file=r.jwt_file, jwt_env=r.jwt_env, user=r.user,
                               timeout=timeout,
                               send=session_send(proxy=r.proxy, ca_file=r.ca_file))
    if api == "pyslurm":
        from ray_slurm_provider.slurm.pyslurm import PyslurmSlurmClient

        return PyslurmSlurmClient()
    from ray_slurm_provider.slurm.cli import CliSlurmClient

    return CliSlurmClient(timeout=timeout)
