"""Where a run's controller lives in Ray: its namespace and actor name.

Kept apart from ``controller`` so that the short ``treegrpo scale`` job, which only looks the
actor up, does not import torch and transformers on the cluster."""

NAMESPACE = "treegrpo"


def controller_name(run_name: str) -> str:
    """The named actor of run ``run_name`` (in namespace ``NAMESPACE``)."""
    return f"treegrpo-controller-{run_name}"
