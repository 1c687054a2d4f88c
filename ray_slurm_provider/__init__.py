"""Ray on Slurm: a Ray cluster-launcher NodeProvider where every Ray node is a Slurm job."""

__version__ = "0.1.0"
