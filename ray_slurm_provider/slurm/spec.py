"""`JobSpec`: what one Slurm batch job asks for and runs, the typed input of the Slurm seam.

Every back end takes it as it is: the CLI renders it into a batch script (script.render), REST
and pyslurm set each field in their request. script.validate says which values are allowed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class JobSpec:
    """One batch job. The directive fields are sbatch's long options of the same name
    (`cpus_per_task` is --cpus-per-task); None leaves an option to Slurm's default."""

    job_name: str
    command: Sequence[str]  # argv the script exec's as its last line
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    nodes: int = 1
    ntasks: int = 1
    cpus_per_task: int | None = None
    mem: str | None = None
    gres: str | None = None
    gpus_per_node: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    reservation: str | None = None
    nodelist: str | None = None
    exclude: str | None = None
    signal: str | None = None
    output: str | None = None
    error: str | None = None
    open_mode: str | None = None
    requeue: bool | None = None  # None: the cluster's default; False: --no-requeue
    #: The user's own sbatch options: {"mail-type": "END", "no-kill": None (a flag)} ...
    sbatch_options: Mapping[str, str | None] = field(default_factory=dict)
    #: ... and free-form ones, each "--option[=value]" (optionally after "#SBATCH ").
    extra_directives: Sequence[str] = ()
    environment: Mapping[str, str] = field(default_factory=dict)  # exported by the script
    setup: Sequence[str] = ()  # trusted shell lines run before the command
    shebang: str = "#!/bin/bash"
