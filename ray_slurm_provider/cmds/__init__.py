"""`ray-slurm` commands that inspect a cluster config: validate, render, status, logs, doctor.

Each module has a `register(subparsers)` (listed in cli.COMMAND_MODULES) and keeps its logic
in functions that take a loaded `Cluster` and return lines or records, so tests can call them
with fakes.
"""
