"""Old entry point kept for jobs queued before the agent moved (`-m ray_slurm_provider.node`)."""
import sys

from ray_slurm_provider.agent.__main__ import main

sys.exit(main())
