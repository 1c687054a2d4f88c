"""Benchmarks of issue 8 (P1-P6), run against the local Slurm sandbox; see BENCHMARKS.md."""
