"""Synchronous versus streaming pipeline on the tiny preset: the same number of updates each.

``sync``: ``max_policy_lag`` 0 and 1 rollout worker (rollout and learner alternate).
``streaming``: ``max_policy_lag`` 1 and 2 rollout workers (workers generate the next steps while
the learner trains). Both arms use one torch thread per process and the same seeds, warm start and
held-out set; runs alternate arms (both see the same background load). Reported per arm, medians
over ``--reps`` runs: trees per second into the learner (trees of steps 2..N over the time between
the first and the last update, so start-up and the evaluations before training are left out),
the learner's idle fraction (time waiting on the queue), the rollout idle fraction, the mean tree
staleness, and the final held-out EM (greedy and sampled at the training temperature).

    python benchmarks/pipeline.py [--steps 20] [--reps 3] [--out benchmarks/results/pipeline]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from treegrpo_ray.cluster.train import train
from treegrpo_ray.config import load_config

ARMS = {
    "sync": ["train.max_policy_lag=0", "cluster.rollout_workers=1"],
    "streaming": [
        "train.max_policy_lag=1",
        "cluster.rollout_workers=2",
        "cluster.rollout_cpus=0.5",
    ],
}


def run_once(arm: str, rep: int, args: argparse.Namespace) -> dict:
    """One training run of ``arm``; returns its pipeline figures."""
    overrides = [
        f"name=pipeline-{arm}-{rep}",
        f"train.steps={args.steps}",
        f"train.output_dir={args.out}/runs",
        "train.eval_every=0",
        f"train.final_eval_questions={args.eval_questions}",
        "cluster.torch_threads=1",
        *ARMS[arm],
    ]
    cfg = load_config("tiny-multihop", overrides)
    summary = train(cfg, progress=False, overwrite=True)
    lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    span = records[-1]["timing/elapsed_s"] - records[0]["timing/elapsed_s"]
    trees = sum(r["tree/groups"] for r in records[1:]) * cfg.tree.m
    return {
        "arm": arm,
        "rep": rep,
        "trees_per_s": trees / span,
        "learner_idle_frac": statistics.fmean(r["learner/idle_frac"] for r in records[1:]),
        "rollout_idle_frac": statistics.fmean(r["rollout/idle_frac"] for r in records[1:]),
        "staleness": statistics.fmean(r["tree/staleness"] for r in records),
        "greedy_em": summary["after/eval/greedy_em"],
        "sampled_em": summary["after/eval/sampled_em"],
        "wall_s": summary["wall_seconds"],
    }


def medians(runs: list[dict]) -> list[dict]:
    rows = []
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        keys = [k for k in mine[0] if k not in ("arm", "rep")]
        rows.append(
            {"arm": arm, "runs": len(mine)}
            | {k: statistics.median(r[k] for r in mine) for k in keys}
        )
    return rows


def markdown(rows: list[dict], steps: int) -> str:
    head = (
        f"| arm ({steps} updates) | runs | trees/s into learner | learner idle | rollout idle | "
        "staleness | greedy EM | sampled EM | wall s |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['arm']} | {r['runs']} | {r['trees_per_s']:.2f} | {r['learner_idle_frac']:.2f} | "
        f"{r['rollout_idle_frac']:.2f} | {r['staleness']:.2f} | {100 * r['greedy_em']:.1f} | "
        f"{100 * r['sampled_em']:.1f} | {r['wall_s']:.0f} |\n"
        for r in rows
    )
    return head + body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/pipeline")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--eval-questions", type=int, default=512)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for rep in range(args.reps):
        for arm in ARMS:
            runs.append(run_once(arm, rep, args))
            print(json.dumps(runs[-1]), flush=True)
            rows = medians(runs) if len({r["arm"] for r in runs}) == len(ARMS) else []
            config = {k: v for k, v in vars(args).items() if k != "out"}
            (out / "results.json").write_text(
                json.dumps({"config": config, "runs": runs, "medians": rows}, indent=2)
            )
            if rows:
                (out / "results.md").write_text(markdown(rows, args.steps))
    print(markdown(medians(runs), args.steps))


if __name__ == "__main__":
    main()
