"""Chain GRPO vs Tree-GRPO at matched measured cost: the script form of ``treegrpo bench budget``.

    python benchmarks/budget_efficiency.py [--quick] [--arms ...] [--out benchmarks/results/budget]

The suite itself is ``treegrpo_ray.experiments.budget_suite``; results live in ``benchmarks/results/``.
"""

import sys

from treegrpo_ray.experiments.budget_suite import main

if __name__ == "__main__":
    sys.exit(main())
