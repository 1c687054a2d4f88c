"""The `ray-slurm` command: runs in the user's shell (login node). Imports the provider's
checks and the ground; nothing imports it."""
