"""Peak memory of a rollout worker (and a learner rank) against the load, beside the plan.

Each case runs in a fresh process (the kernel's peak resident memory, ``VmHWM``, is per
process): a ``RolloutWorker`` of the preset expands one lease of ``prompts`` prompt groups with
the tree shape and engine bounds of the case; optionally a learner rank then takes one update on
those trees in another fresh process. Both import ray first, as Ray's workers do. Beside each
measured peak: the plan's estimate for the same settings (``treegrpo_ray.memory_plan``), and the
engine's own peak KV bytes; and the plan's load-aware estimate (``expected_rollout_worker``)
from the episode lengths of one case's trees (``--load-case``, the lightest by default): what a
short run predicts for heavier loads.

    python -m benchmarks.rollout_memory --out benchmarks/results/rollout_memory
    python -m benchmarks.rollout_memory --cases 4:2,6,1 12:2,6,1:unbounded --learner 4:2,6,1
    python -m benchmarks.rollout_memory --preset tiny-multihop --cases 4:1,2,1 --learner 4:1,2,1

A case is PROMPTS:M,N,L[:BOUND], BOUND one of ``default`` (the engine's defaults), ``unbounded``
(no KV or sequence bound: the engine as it was before issue 34) or a KV budget in GiB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import treegrpo_ray  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads)

PRESET = "smollm2-135m-search-qa"
DEFAULT_CASES = [
    "4:2,6,1",
    "4:2,6,1:unbounded",
    "12:2,6,1",
    "12:2,6,1:unbounded",
    "36:2,6,1",
    "36:2,6,1:1",
    "72:2,6,1",
]
DEFAULT_LEARNER = ["4:2,6,1"]
UNBOUNDED = ["engine.max_num_seqs=100000", "engine.max_kv_bytes=1000000000000"]


def overrides(case: str) -> list[str]:
    """The config overrides of a case ``PROMPTS:M,N,L[:BOUND]``."""
    prompts, shape, *bound = case.split(":")
    m, n, l_ = shape.split(",")
    sets = [f"train.prompts_per_step={prompts}", f"tree.m={m}", f"tree.n={n}", f"tree.l={l_}"]
    if bound and bound[0] == "unbounded":
        sets += UNBOUNDED
    elif bound and bound[0] != "default":
        sets.append(f"engine.max_kv_bytes={int(float(bound[0]) * 2**30)}")
    return sets


def _peak_rss() -> int:
    from treegrpo_ray.metrics import peak_rss_bytes

    return peak_rss_bytes()


def rollout_child(preset: str, case: str, trees_path: str) -> dict:
    """Expand one lease of the case; its figures and the plan's estimate."""
    import ray  # noqa: F401  (a Ray worker's runtime holds it)

    from treegrpo_ray.actors.rollout_worker import RolloutWorker
    from treegrpo_ray.actors.schedule import Lease, load_task
    from treegrpo_ray.cluster.plan import model_sizes
    from treegrpo_ray.config import load_config
    from treegrpo_ray.learners.policies import resolve_model_path
    from treegrpo_ray.memory_plan import RolloutLoad, rollout_worker_plan
    from treegrpo_ray.tree import batch_info, trees_from_arrow

    cfg = load_config(preset, overrides(case))
    path = resolve_model_path(cfg, progress=False)
    worker = RolloutWorker.from_config(cfg, path)
    samples = load_task(cfg.task).train_samples()
    groups = tuple((g, samples[g % len(samples)]) for g in range(cfg.train.prompts_per_step))
    start = time.perf_counter()
    table = worker.expand(Lease(0, groups, seed=1000))
    seconds = time.perf_counter() - start
    Path(trees_path).write_bytes(_arrow_bytes(table))
    plan = rollout_worker_plan(cfg, model_sizes(cfg), workers_on_node=1)
    generated = sum(b.generated_tokens for b in batch_info(table).budgets.values())
    engine = worker.engine
    return {
        "case": case,
        "leaves": cfg.train.prompts_per_step * cfg.tree.shape().leaves_per_prompt,
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds,
        "peak_rss_bytes": _peak_rss(),
        "peak_kv_bytes": getattr(engine, "peak_kv_bytes", 0),
        "kv_budget_bytes": cfg.engine.kv_budget(),
        "cache_bytes": engine.cache_stats().bytes,
        "memory_throttles": engine.cache_stats().memory_throttles,
        "plan_bytes": plan.nbytes,
        "plan": {t.what: t.nbytes for t in plan.terms},
        "load": asdict(RolloutLoad.of_trees(trees_from_arrow(table))),
    }


def learner_child(preset: str, case: str, trees_path: str) -> dict:
    """One learner update on the trees a rollout case wrote; its peak and the plan's."""
    import pyarrow as pa
    import ray  # noqa: F401

    from treegrpo_ray.cluster.plan import model_sizes
    from treegrpo_ray.config import load_config
    from treegrpo_ray.learners.learner import Learner
    from treegrpo_ray.learners.policies import resolve_model_path
    from treegrpo_ray.memory_plan import learner_plan
    from treegrpo_ray.tree import trees_from_arrow

    cfg = load_config(preset, overrides(case))
    learner = Learner.from_config(cfg, resolve_model_path(cfg, progress=False))
    with pa.ipc.open_stream(Path(trees_path).read_bytes()) as reader:
        trees = trees_from_arrow(reader.read_all())
    start = time.perf_counter()
    metrics = learner.update(trees)
    plan = learner_plan(cfg, model_sizes(cfg), ranks_on_node=1)
    return {
        "case": case,
        "seconds": time.perf_counter() - start,
        "unique_tokens": metrics["learner/tokens"],
        "peak_rss_bytes": _peak_rss(),
        "plan_bytes": plan.nbytes,
        "plan": {t.what: t.nbytes for t in plan.terms},
    }


def replan(results: dict, load_case: str) -> None:
    """Recompute each case's plan, and its expected peak from the episode lengths of
    ``load_case``'s trees, with this checkout's ``memory_plan`` (the measured figures do not
    depend on it)."""

    from treegrpo_ray.cluster.plan import model_sizes
    from treegrpo_ray.config import load_config
    from treegrpo_ray.memory_plan import (
        RolloutLoad,
        expected_rollout_worker,
        learner_plan,
        rollout_worker_plan,
    )

    loads = {r["case"]: r["load"] for r in results["rollouts"] if "load" in r}
    load = RolloutLoad(**loads[load_case]) if load_case in loads else None
    results["load_case"] = load_case if load else None
    for role, records in (("rollout", results["rollouts"]), ("learner", results["learners"])):
        for record in records:
            cfg = load_config(results["preset"], overrides(record["case"]))
            sizes = model_sizes(cfg)
            if role == "rollout":
                plan = rollout_worker_plan(cfg, sizes, workers_on_node=1)
                if load is not None:
                    expected = expected_rollout_worker(cfg, sizes, 1, load, evaluation=False)
                    record["expected_bytes"] = expected.nbytes
                    record["expected"] = {t.what: t.nbytes for t in expected.terms}
            else:
                plan = learner_plan(cfg, sizes, ranks_on_node=1)
            record["plan_bytes"] = plan.nbytes
            record["plan"] = {t.what: t.nbytes for t in plan.terms}


def _arrow_bytes(table: object) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:  # type: ignore[attr-defined]
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _child(role: str, preset: str, case: str, trees_path: str) -> dict:
    command = ["-m", "benchmarks.rollout_memory", "--preset", preset, "--child", role]
    out = subprocess.run(
        [sys.executable, *command, case, trees_path],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rollouts: list[dict], learners: list[dict]) -> str:
    gb = 1e9
    rows = [
        "| case (prompts:m,n,l:bound) | leaves | peak RSS GB | plan GB | measured / plan | "
        "expected GB | measured / expected | engine peak KV GB | KV budget GB | "
        "throttled steps | generated tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rollouts:
        plan, ratio, expected, budget = "-", "-", "- | -", "none"
        if not r["case"].endswith(":unbounded"):  # no bound: nothing to plan
            plan, ratio = (
                f"{r['plan_bytes'] / gb:.2f}",
                f"{r['peak_rss_bytes'] / r['plan_bytes']:.2f}",
            )
            budget = f"{r['kv_budget_bytes'] / gb:.2f}"
            if "expected_bytes" in r:
                expected = (
                    f"{r['expected_bytes'] / gb:.2f} | "
                    f"{r['peak_rss_bytes'] / r['expected_bytes']:.2f}"
                )
        rows.append(
            f"| {r['case']} | {r['leaves']} | {r['peak_rss_bytes'] / gb:.2f} | {plan} | {ratio} | "
            f"{expected} | {r['peak_kv_bytes'] / gb:.2f} | {budget} | "
            f"{r['memory_throttles']:.0f} | {r['tokens_per_s']:.1f} |"
        )
    for r in learners:
        rows.append(
            f"| learner on {r['case']} ({r['unique_tokens']:.0f} tokens) | | "
            f"{r['peak_rss_bytes'] / gb:.2f} | {r['plan_bytes'] / gb:.2f} | "
            f"{r['peak_rss_bytes'] / r['plan_bytes']:.2f} | | | | | | |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default=PRESET)
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--learner", nargs="*", default=DEFAULT_LEARNER)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rollout_memory"))
    parser.add_argument(
        "--load-case",
        help="the case whose trees' episode lengths give every case's expected peak "
        "(default: the first case)",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument(
        "--replan", action="store_true", help="recompute the plans of OUT/results.json, rewrite"
    )
    args = parser.parse_args()
    if args.replan:
        results = json.loads((args.out / "results.json").read_text())
        replan(results, args.load_case or results["rollouts"][0]["case"])
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
        (args.out / "table.md").write_text(table(results["rollouts"], results["learners"]) + "\n")
        print(table(results["rollouts"], results["learners"]))
        return
    if args.child:
        role, case, trees_path = args.child
        child = rollout_child if role == "rollout" else learner_child
        print(json.dumps(child(args.preset, case, trees_path)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rollouts, learners = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for case in args.cases:
            trees = f"{scratch}/{case.replace(':', '_').replace(',', '-')}.arrow"
            rollouts.append(_child("rollout", args.preset, case, trees))
            print(json.dumps(rollouts[-1]), flush=True)
            if case in args.learner:
                learners.append(_child("learner", args.preset, case, trees))
                print(json.dumps(learners[-1]), flush=True)
            results = {"preset": args.preset, "rollouts": rollouts, "learners": learners}
            replan(results, args.load_case or args.cases[0])
            (args.out / "results.json").write_text(json.dumps(results, indent=2))
            (args.out / "table.md").write_text(table(rollouts, learners) + "\n")
    print(table(rollouts, learners))


if __name__ == "__main__":
    main()
