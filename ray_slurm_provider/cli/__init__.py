"""The `ray-slurm` command and the Python API (`api.py`, `ray_slurm_provider.SlurmCluster`):
run in the user's shell or notebook (login node). Import the provider's checks and the ground;
only the package's lazy `SlurmCluster` imports `api.py`."""
