"""`sandbox up --strict`: the controller settings of a strict site (issue 29).

- per-user RPC rate limiting (``SlurmctldParameters=rl_enable``, since 23.02). Names and
  defaults from Slurm 25.11's ``src/slurmctld/rate_limit.c``: a bucket of
  ``rl_bucket_size`` tokens (default 30) per uid, ``rl_refill_rate`` tokens (default 2) added
  every ``rl_refill_period`` seconds (default 1). The sandbox's bucket is far smaller, so
  throttling really happens under test. root and SlurmUser are exempt, so only a sandbox
  user (``--users``) is ever throttled;
- a short ``MinJobAge``: finished jobs leave ``squeue`` within seconds and only ``sacct``
  (with ``--accounting``) still knows them;
- ``PrivateData=jobs``: a user sees only their own jobs (root and SlurmUser see all).
"""

from __future__ import annotations

from ray_slurm_provider.sandbox import roots

#: Releases whose slurmctld knows rl_enable (23.02 on) among those the sandbox runs.
RELEASES = ("25.11", "26.05")
BUCKET_SIZE = 10
REFILL_RATE = 1
REFILL_PERIOD_S = 1
MIN_JOB_AGE_S = 30
PRIVATE_DATA = "jobs"
#: The settings, as `scontrol show config` names them: `sandbox status` prints these.
CONFIG_KEYS = ("SlurmctldParameters", "MinJobAge", "PrivateData")


def check_release(release: str) -> None:
    """ValueError unless `release` has rl_enable."""
    roots.check_release(release)
    if release not in RELEASES:
        raise ValueError(f"--strict needs a Slurm with RPC rate limiting (rl_enable, 23.02 "
                         f"on): --slurm {' or '.join(RELEASES)}, not {release}")


def slurmctld_parameters() -> str:
    return (f"rl_enable,rl_bucket_size={BUCKET_SIZE},rl_refill_rate={REFILL_RATE},"
            f"rl_refill_period={REFILL_PERIOD_S}")


def slurm_conf_lines() -> list[str]:
    """What slurm.conf adds (MinJobAge replaces the plain sandbox's)."""
    return [
        f"SlurmctldParameters={slurmctld_parameters()}",
        f"PrivateData={PRIVATE_DATA}",
    ]


def config_lines(show_config: str) -> list[str]:
    """The strict settings' lines of `scontrol show config` output."""
    keep = []
    for line in show_config.splitlines():
        key = line.split("=", 1)[0].strip()
        if key in CONFIG_KEYS:
            keep.append(" ".join(line.split()))
    return keep
