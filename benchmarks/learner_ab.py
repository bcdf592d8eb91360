"""Two learner settings (``ppo.*``) in one SmolLM2 learner, alternating update by update.

The learner of the SmolLM2 preset (compiled layers, oneDNN, LoRA) updates on one step's saved
trees of a run, again and again, switching between two ``ppo`` settings before each update in
the order A, B, then (A, B, B, A) ``--rounds`` times, so both see the same trees, weights within
a few updates of each other and the same background load; the first update of each is left out
(compiles). An arm is ``KEY=VALUE`` of ``ppo`` (``attention=blocks``, ``trees_per_row=one``...);
``attention`` also switches the model's attention implementation, as the learner sets it.
Printed per update: the reference pass and the optimisation seconds; at the end their medians
per arm.

    python -m benchmarks.learner_ab --step 30 --arms trees_per_row=many trees_per_row=one \
        [--run benchmarks/results/smollm2-search-qa-v7]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from treegrpo_ray.config import load_config
from treegrpo_ray.learners.forward import attention_implementation
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.learners.policies import resolve_model_path
from treegrpo_ray.saved_trees import read_saved_trees, saved_trees_as_trees


def _switch(learner: Learner, arm: str) -> None:
    """Set the ``ppo`` setting ``arm`` (``KEY=VALUE``) on ``learner``."""
    key, value = arm.split("=", 1)
    learner.ppo = learner.ppo.model_validate({**learner.ppo.model_dump(), key: value})
    if key == "attention":
        learner.model.set_attn_implementation(attention_implementation(value, learner.device))
    if key == "kl_coef":  # a LoRA learner's reference is its adapter disabled: nothing to build
        learner.reference = learner.ppo.uses_reference()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", default="benchmarks/results/smollm2-search-qa-v7")
    parser.add_argument("--step", type=int, default=30)
    parser.add_argument("--arms", nargs=2, default=["attention=blocks", "attention=sdpa"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config("smollm2-135m-search-qa", [f"cluster.torch_threads={args.threads}"])
    learner = Learner.from_config(cfg, resolve_model_path(cfg, progress=False))
    table, _ = read_saved_trees(Path(args.run), args.step)
    trees = saved_trees_as_trees(table)
    a, b = args.arms
    times: dict[str, list[tuple[float, float]]] = {a: [], b: []}
    for arm in [a, b, *[a, b, b, a] * args.rounds]:
        _switch(learner, arm)
        metrics = learner.update(trees)
        times[arm].append((metrics["timing/ref_logprobs"], metrics["timing/optimize"]))
        print(arm, *(round(t, 2) for t in times[arm][-1]), flush=True)
    for arm, runs in times.items():
        ref, optimize = (statistics.median(t[i] for t in runs[1:]) for i in (0, 1))
        print(f"{arm}: median reference pass {ref:.2f} s, optimisation {optimize:.2f} s")


if __name__ == "__main__":
    main()
