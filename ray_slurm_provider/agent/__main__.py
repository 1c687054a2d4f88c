"""`python -m ray_slurm_provider.agent --spec '<json>'`: the last line of every job script."""

import sys

from ray_slurm_provider.agent.agent import main

sys.exit(main())
