"""``treegrpo bench budget``: chain GRPO against Tree-GRPO at matched rollout cost.

From the same warm start, every arm trains the same number of updates on the same prompts (seed
by seed): chain GRPO with G = 2, 3, 4, 8, 16 chains per prompt, Tree-GRPO with the paper's shapes
(M, N, L) = (1,2,1), (2,2,1), (2,6,1), (4,5,1) (nominal budgets 2, 4, 8, 16 chain-equivalents).
Chain G = 3 is the control of budget 2: as many leaves as tree (1,2,1). Two warm starts: the
preset's (``standard``) and a ``low``-success one (fewer warm-start steps). Along each run the
held-out EM is evaluated at 25/50/75/100% of its updates (greedy on every question, and sampled at
the training temperature), next to the measured cost so far (generated tokens, tool calls, prefill
tokens, training wall time).

Comparisons, paired by seed (same warm start, prompts and evaluation questions):

- equal updates: the final evaluations;
- equal measured generated tokens / equal training wall time: the arm that spent more is read, by
  linear interpolation along its evaluations, where the other one stopped.

Pre-registered headline: tree (1,2,1) minus chain G = 2, greedy held-out EM at matched generated
tokens, from the low warm start, mean and 95% CI over the headline seeds.

Node selection and budget allocation (issue 17, not in the default arms): ``tree-MxNxL-RULE`` with
RULE entropy or uncertainty (``tree.select``), and an ``-adaptive`` suffix for
``tree.allocate=adaptive`` (``tree-MxNxL-adaptive``: uniform choice, adaptive allocation), at
(1,2,1) and (2,2,1). Each is compared, paired by seed, with the uniform tree of its shape and the
chains of its budget: the share of prompts whose leaves' rewards differ, and EM as above. Every run
also records the planner's share of its rollout wall time (selection and allocation).

Runs go to OUT/runs/START/ARM/seedN.json as they finish; a rerun skips those that exist, so a
stopped suite loses nothing. Then OUT/results.json, OUT/results.md and OUT/budget_efficiency.png.
A preset may have a suite of its own (``SUITES``): ``--preset smollm2-135m-search-qa`` runs the
real-model suite pre-registered in the README, whose runs keep their trees in
OUT/saved/START/ARM/seedN (``treegrpo trees`` and ``treegrpo bench profile --run`` open them).

    treegrpo bench budget [--quick] [--preset tiny-multihop] [--out DIR] [--workers 2]
                          [--steps N] [--seeds N] [--arms chain-2,tree-1x2x1] [--starts low]

The pre-registered selection comparison (README): ``--starts low --arms
chain-2,chain-3,tree-1x2x1,tree-1x2x1-entropy,tree-1x2x1-uncertainty,tree-1x2x1-adaptive,
tree-1x2x1-entropy-adaptive,tree-1x2x1-uncertainty-adaptive --out benchmarks/results/budget-select``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports this module to build its parser: torch etc. load lazily
    from treegrpo_ray.cluster.local_run import LocalRun
    from treegrpo_ray.config import JobConfig


COSTS = ("generated_tokens", "tool_calls", "prefill_tokens", "cached_tokens", "leaves")
# what a run learned from, averaged over its updates: the share of prompts whose leaves' rewards
# differ (the only ones with a nonzero group advantage) and the mean leaf reward
SIGNALS = {"groups_with_variance": "tree/groups_with_variance", "train_reward": "tree/reward_mean"}
# a run's rollout wall time and the planner's part of it (selection and allocation), summed
ROLLOUT_TIMES = {"rollout_seconds": "rollout/seconds", "planner_seconds": "rollout/planner_seconds"}


@dataclass(frozen=True)
class Arm:
    """One method at one budget: ``budget`` is the nominal cost in chain-equivalents; ``select`` /
    ``allocate``: the tree's node selection rule and budget allocation (``tree.select``,
    ``tree.allocate``)."""

    name: str
    method: str  # "chain" or "tree"
    budget: int
    overrides: tuple[str, ...]
    select: str = "uniform"
    allocate: str = "fixed"


def _chain(g: int) -> Arm:
    return Arm(f"chain-{g}", "chain", g, (f"tree.m={g}", "tree.n=0", "ppo.advantage=chain"))


def _tree(
    m: int,
    n: int,
    l: int,  # noqa: E741 - the paper's name
    budget: int,
    select: str = "uniform",
    allocate: str = "fixed",
) -> Arm:
    """``tree-MxNxL``, with ``-SELECT`` unless uniform and ``-adaptive`` for that allocation."""
    overrides: tuple[str, ...] = (f"tree.m={m}", f"tree.n={n}", f"tree.l={l}", "ppo.advantage=tree")
    name = f"tree-{m}x{n}x{l}"
    if select != "uniform":
        name, overrides = f"{name}-{select}", (*overrides, f"tree.select={select}")
    if allocate != "fixed":
        name, overrides = f"{name}-{allocate}", (*overrides, f"tree.allocate={allocate}")
    return Arm(name, "tree", budget, overrides, select, allocate)


PAPER_ARMS = (
    _chain(2),
    _chain(3),
    _chain(4),
    _chain(8),
    _chain(16),
    _tree(1, 2, 1, 2),
    _tree(2, 2, 1, 4),
    _tree(2, 6, 1, 8),
    _tree(4, 5, 1, 16),
)
# Every selection rule x allocation but the paper's (uniform, fixed), at budgets 2 and 4.
SELECTION_ARMS = tuple(
    _tree(*shape, budget, select, allocate)
    for shape, budget in (((1, 2, 1), 2), ((2, 2, 1), 4))
    for select in ("uniform", "entropy", "uncertainty")
    for allocate in ("fixed", "adaptive")
    if (select, allocate) != ("uniform", "fixed")
)
ARMS = {a.name: a for a in (*PAPER_ARMS, *SELECTION_ARMS)}
# (tree arm, chain arm) at the same nominal budget; chain-3 is budget 2's equal-leaves control.
PAIRS = (
    ("tree-1x2x1", "chain-2"),
    ("tree-1x2x1", "chain-3"),
    ("tree-2x2x1", "chain-4"),
    ("tree-2x6x1", "chain-8"),
    ("tree-4x5x1", "chain-16"),
)
HEADLINE = {"start": "low", "tree": "tree-1x2x1", "chain": "chain-2", "metric": "greedy_em"}
STRETCH = ("tree-2x2x1", "chain-16")  # the paper's headline: tree at budget 4 >= chain at 16
# (selection arm, reference): the uniform tree of its shape and the chains of its budget.
SELECTION_PAIRS = tuple(
    (arm.name, reference)
    for arm in SELECTION_ARMS
    for reference in (
        ("tree-1x2x1", "chain-2", "chain-3") if arm.budget == 2 else ("tree-2x2x1", "chain-4")
    )
)
# The pre-registered selection comparison (README): low start, the budget-2 arms.
SELECTION_TARGETS: dict[str, Any] = {
    "start": "low",
    "uniform": "tree-1x2x1",
    "control": "chain-3",
    "arms": tuple(a.name for a in SELECTION_ARMS if a.budget == 2),
    "share_gain": 0.05,  # primary: at least +5 points of prompts with reward variance
    "token_slack": 1.05,  # ... at no more than 5% more generated tokens per prompt
    "overhead": 0.05,  # cost: planner time at most 5% of rollout wall time
}
# Arms that get the headline seeds from the low start.
HEADLINE_ARMS = ("tree-1x2x1", "chain-2", "chain-3", *SELECTION_TARGETS["arms"])


@dataclass(frozen=True)
class Settings:
    """What one suite runs. ``starts`` maps a warm-start name to its config overrides."""

    steps: int
    prompts_per_step: int
    seeds: int
    headline_seeds: int  # seeds of the headline arms (and their control) from the low start
    eval_questions: int
    eval_samples: int  # sampled chains per question in the final evaluation
    starts: dict[str, tuple[str, ...]]
    arms: tuple[str, ...] = tuple(a.name for a in PAPER_ARMS)
    eval_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    sampled_along: bool = True  # sampled EM at every evaluation (False: warm start and end only)
    save_trees_every: int = 0  # runs keep the trees of these updates (0: none)
    headline_arms: tuple[str, ...] = HEADLINE_ARMS  # the arms given headline_seeds (low start)


LOW_START = ("warmstart.steps=400",)  # measured: greedy 63%, sampled 12.6% held-out EM
FULL = Settings(
    steps=40,
    prompts_per_step=16,
    seeds=3,
    headline_seeds=6,
    eval_questions=1024,
    eval_samples=2,
    starts={"standard": (), "low": LOW_START},
)
QUICK = replace(FULL, steps=4, seeds=1, headline_seeds=1, eval_questions=128, eval_samples=1)
# The real-model suite (issue 28, pre-registered in the README): the preset's own protocol warm
# start (10 steps; measured greedy 5.0%, sampled 7.5% held-out EM), the budget-2 and budget-4
# arms, 6 seeds for the headline pair and 3 for the others, every held-out question, greedy EM at
# 75% of the updates (near where matched tokens are read) and greedy and sampled EM at the start
# and the end, every update's trees kept.
SMOLLM2 = Settings(
    steps=8,
    prompts_per_step=4,
    seeds=3,
    headline_seeds=6,
    eval_questions=200,
    eval_samples=1,
    starts={"low": ()},
    arms=("tree-1x2x1", "chain-2", "chain-3", "tree-2x2x1", "chain-4"),
    eval_fractions=(0.75, 1.0),
    sampled_along=False,
    save_trees_every=1,
    headline_arms=("tree-1x2x1", "chain-2"),
)
SUITES = {"smollm2-135m-search-qa": SMOLLM2}  # a preset's own suite; any other runs FULL


@dataclass(frozen=True)
class Job:
    """One training run of the suite."""

    preset: str
    start: str
    arm: str
    seed: int
    settings: Settings

    @property
    def key(self) -> str:
        return f"{self.start}/{self.arm}/seed{self.seed}"

    def config(self) -> JobConfig:
        from treegrpo_ray.config import load_config

        s = self.settings
        overrides = [
            *s.starts[self.start],
            *ARMS[self.arm].overrides,
            f"name=budget-{self.start}-{self.arm}-{self.seed}",
            f"train.seed={self.seed}",
            f"train.steps={s.steps}",
            f"train.prompts_per_step={s.prompts_per_step}",
            "train.max_policy_lag=0",
            "cluster.torch_threads=1",
            f"train.save_trees_every={s.save_trees_every}",
        ]
        return load_config(self.preset, overrides)


def jobs(preset: str, settings: Settings) -> list[Job]:
    """Every run: all arms x starts x seeds, plus the extra seeds of the headline arms."""
    out = []
    for start in settings.starts:
        for arm in settings.arms:
            headline = start == HEADLINE["start"] and arm in settings.headline_arms
            seeds = max(settings.seeds, settings.headline_seeds) if headline else settings.seeds
            out += [Job(preset, start, arm, seed, settings) for seed in range(seeds)]
    return out


def eval_steps(settings: Settings) -> list[int]:
    """Updates after which a run is evaluated (25/50/75/100% of its updates, at least 1)."""
    return sorted({max(1, round(f * settings.steps)) for f in settings.eval_fractions})


def evaluate(run: LocalRun, settings: Settings, final: bool, along: bool) -> dict[str, float]:
    """Greedy EM on every held-out question; sampled EM on each question once (``eval_samples``
    times in the final evaluation: more samples where the headline is read), and only at the
    start and the end unless ``settings.sampled_along``; ``along``: an evaluation between them."""
    greedy = {"greedy_em": run.evaluate(settings.eval_questions, temperature=0.0)}
    if along and not settings.sampled_along:
        return greedy
    samples = settings.eval_samples if final else 1
    sampled = [
        run.evaluate(settings.eval_questions, run.cfg.sampling.temperature, repeat=k)
        for k in range(samples)
    ]
    return greedy | {"sampled_em": statistics.fmean(sampled)}


def _stored(path: Path, compute: Callable[[], dict[str, float]]) -> dict[str, float]:
    """``compute()``, kept at ``path`` (JSON) for the runs that ask next; a run that asks while
    another computes it waits for that one (a lock file beside it) instead of computing it too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.with_suffix(".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text())
        result = compute()
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(result))
        partial.replace(path)
        return result


def warm_start_evaluation(run: LocalRun, job: Job, out: Path) -> dict[str, float]:
    """The evaluation before training, the same for every arm of a (start, seed): computed by the
    first of them, read by the others from OUT/warm/START/: ``seedN.json`` (sampled EM) and
    ``greedy.json`` (greedy decoding of one warm start is the same for every seed)."""
    questions, temperature = job.settings.eval_questions, run.cfg.sampling.temperature
    folder = out / "warm" / job.start
    seed = _stored(
        folder / f"seed{job.seed}.json",
        lambda: {"sampled_em": run.evaluate(questions, temperature)},
    )
    if "greedy_em" in seed:  # suites recorded before the greedy evaluation was shared
        return seed
    greedy = _stored(
        folder / "greedy.json", lambda: {"greedy_em": run.evaluate(questions, temperature=0.0)}
    )
    return greedy | seed


def run_job(job: Job, out: Path) -> dict[str, Any]:
    """Train one arm, evaluating along the way; returns its record (costs are per prompt)."""
    from treegrpo_ray.cluster.local_run import LocalRun
    from treegrpo_ray.learners.policies import resolve_model_path

    started = time.perf_counter()
    cfg = job.config()
    settings = job.settings
    saved = out / "saved" / job.key if settings.save_trees_every else None
    run = LocalRun(cfg, resolve_model_path(cfg, progress=False), save_trees_to=saved)
    cost = dict.fromkeys(COSTS, 0.0)  # totals so far
    points = [{"step": 0, "prompts": 0, "train_seconds": 0.0, **cost}]
    points[0].update(warm_start_evaluation(run, job, out))
    signal: dict[str, list[float]] = {name: [] for name in SIGNALS}
    rollout = dict.fromkeys(ROLLOUT_TIMES, 0.0)
    for step in range(1, settings.steps + 1):
        metrics = run.step()
        for name, key in SIGNALS.items():
            signal[name].append(metrics[key])
        for name, key in ROLLOUT_TIMES.items():
            rollout[name] += metrics[key]
        for key in cost:
            cost[key] += metrics[f"budget/{key}"]
        if step in eval_steps(settings):
            prompts = step * settings.prompts_per_step
            point = {"step": step, "prompts": prompts, "train_seconds": run.train_seconds}
            point.update(cost)
            final = step == settings.steps
            point.update(evaluate(run, settings, final=final, along=not final))
            points.append(point)
    arm = ARMS[job.arm]
    return {
        "start": job.start,
        "arm": job.arm,
        "method": arm.method,
        "budget": arm.budget,
        "select": arm.select,
        "allocate": arm.allocate,
        "seed": job.seed,
        "seconds_per_update": run.train_seconds / settings.steps,
        "wall_seconds": time.perf_counter() - started,  # the whole run, evaluations included
        **{name: statistics.fmean(values) for name, values in signal.items()},
        **rollout,
        "planner_share": rollout["planner_seconds"] / max(rollout["rollout_seconds"], 1e-9),
        "points": points,
    }


def _prepare_warm_starts(preset: str, settings: Settings, log: Callable[[str], None]) -> None:
    """Build (or find cached) each warm start once, before runs share them."""
    from treegrpo_ray.config import load_config
    from treegrpo_ray.learners.policies import resolve_model_path

    for start, overrides in settings.starts.items():
        started = time.perf_counter()
        cfg = load_config(preset, list(overrides))
        path = resolve_model_path(cfg, progress=False)
        log(f"warm start '{start}': {path} ({time.perf_counter() - started:.0f} s)")


def run_suite(
    preset: str,
    settings: Settings,
    out: Path,
    workers: int = 2,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every missing job (``workers`` processes), then aggregate and write the report."""
    from treegrpo_ray.experiments.budget_report import write_report

    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    _prepare_warm_starts(preset, settings, log)
    todo = [j for j in jobs(preset, settings) if not (out / "runs" / f"{j.key}.json").exists()]
    todo.sort(key=lambda j: j.seed)  # seed by seed: a stopped suite leaves complete pairs
    log(f"{len(jobs(preset, settings))} runs, {len(todo)} to do, {workers} at a time")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        running = {pool.submit(run_job, job, out): job for job in todo}
        for done, future in enumerate(as_completed(running), 1):  # kept as each one ends
            job, record = running[future], future.result()
            path = out / "runs" / f"{job.key}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=1))
            final = record["points"][-1]
            log(
                f"[{done}/{len(todo)}] {job.key}: greedy {100 * final['greedy_em']:.1f} "
                f"sampled {100 * final['sampled_em']:.1f}, "
                f"{final['generated_tokens'] / final['prompts']:.0f} tokens/prompt "
                f"({time.perf_counter() - started:.0f} s)"
            )
    records = [
        json.loads((out / "runs" / f"{j.key}.json").read_text()) for j in jobs(preset, settings)
    ]
    settings_dict = asdict(settings) | {"preset": preset}
    return write_report(records, settings_dict, out, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treegrpo bench budget", description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 updates, 1 seed")
    parser.add_argument("--preset", default="tiny-multihop", help="task/model preset or YAML")
    parser.add_argument("--out", default="benchmarks/results/budget", help="output directory")
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (processes)")
    parser.add_argument("--steps", type=int, help="override the updates per run")
    parser.add_argument("--seeds", type=int, help="override the seeds per arm (and headline)")
    parser.add_argument(
        "--arms",
        type=_names(ARMS),
        help="the arms, comma-separated (default: the paper's "
        f"{','.join(a.name for a in PAPER_ARMS)}; also {','.join(a.name for a in SELECTION_ARMS)})",
    )
    parser.add_argument(
        "--starts", type=_names(FULL.starts), help="a subset of the warm starts: standard,low"
    )


def _names(known: Iterable[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated subset of ``known``."""
    known = tuple(known)

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown or 'empty list'}; choose from {','.join(known)}"
            )
        return names

    return parse


def run_from_args(args: argparse.Namespace) -> int:
    settings = QUICK if args.quick else SUITES.get(args.preset, FULL)
    if args.steps:
        settings = replace(settings, steps=args.steps)
    if args.seeds:
        settings = replace(settings, seeds=args.seeds, headline_seeds=args.seeds)
    if args.arms:
        settings = replace(settings, arms=args.arms)
    if args.starts:
        starts = {name: settings.starts[name] for name in args.starts}
        settings = replace(settings, starts=starts)
    summary = run_suite(args.preset, settings, Path(args.out), args.workers)
    print(summary["line"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
