"""Experiments on top of the trainer, run as ``treegrpo bench ...``: the budget suite (chain GRPO
vs Tree-GRPO at matched cost) and its report, the branch-value profile, and the side-by-side with
TRL. They drive in-process runs (``cluster/local_run.py``) and the pure statistics of
``treegrpo_ray/budget_stats.py`` and ``treegrpo_ray/branch_profile.py``; nothing in the trainer
imports them."""
