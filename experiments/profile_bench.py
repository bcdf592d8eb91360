"""``treegrpo bench profile``: the branch-value profile of a policy on a task, and what it predicts.

From a run's saved trees (``--run RUN``) or from a rollout-only probe of the preset's starting
policy (``--probe``: trees of shape ``--shape``, default 4x2x1, on the first ``--prompts`` training
prompts of ``train.seed``; nothing trains), it measures per branch point (agent steps shared) the
share rho of the outcome variance decided before it with a 95% interval, and the share d of a
chain's generated tokens before it (``treegrpo_ray/branch_profile.py`` gives the estimators), and
predicts, for each arm of the budget suite, the share of prompts whose leaves' rewards differ, its
generated tokens in chains, its effective number of independent chains (2 x share / share of
chain-2) and the tree-minus-chain share at equal generated tokens. With ``--budget-suite DIR`` (a budget
suite's output) the runs' measured shares and tokens stand beside the predictions.

Writes OUT/profile.json, OUT/profile.md and OUT/profile.png; a probe's trees go to
OUT/probe.parquet and are read again by a rerun (delete the file to probe anew).

    treegrpo bench profile --probe [--preset P] [--set KEY=VALUE ...] [--shape 4x2x1]
                           [--prompts 64] [--out DIR] [--budget-suite DIR] [--arms chain-2,...]
    treegrpo bench profile --run runs/NAME [--out DIR] [--budget-suite DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports this module to build its parser: torch etc. load lazily
    from treegrpo_ray.branch_profile import Prediction, PromptLeaves
    from treegrpo_ray.tree import Tree

DEFAULT_ARMS = ("chain-2", "chain-3", "chain-4", "tree-1x2x1", "tree-2x2x1")
# (tree, chain) pairs whose share gap the report reads
GAPS = (("tree-1x2x1", "chain-2"), ("tree-1x2x1", "chain-3"), ("tree-2x2x1", "chain-4"))


def run_trees(run_dir: Path) -> dict[object, PromptLeaves]:
    """Every saved update of ``run_dir``, its prompts keyed by (step, group)."""
    from treegrpo_ray.branch_profile import prompt_leaves
    from treegrpo_ray.saved_trees import read_saved_trees, saved_steps, saved_trees_as_trees

    prompts = {}
    for step in saved_steps(run_dir):
        table, _ = read_saved_trees(run_dir, step)
        prompts.update(prompt_leaves(saved_trees_as_trees(table), key=step))
    return prompts


def probe_trees(
    preset: str, overrides: list[str], shape: str, prompts: int, out: Path
) -> list[Tree]:
    """Trees of ``shape`` (MxNxL) from the preset's starting policy on the first ``prompts``
    training prompts, in leases of ``cfg.lease_size()``; read from OUT/probe.parquet when a
    previous probe left it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from treegrpo_ray.tree import trees_from_arrow

    path = out / "probe.parquet"
    if path.exists():
        print(f"probe: reading {path} (delete it to probe anew)", flush=True)
        return trees_from_arrow(pq.read_table(path))
    tables = list(_probe_tables(preset, overrides, shape, prompts))
    out.mkdir(parents=True, exist_ok=True)
    table = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    temp = path.with_suffix(".tmp")
    pq.write_table(table, temp, compression="zstd")
    temp.replace(path)
    return trees_from_arrow(table)


def _probe_tables(preset: str, overrides: list[str], shape: str, prompts: int) -> Any:
    import time

    from treegrpo_ray.actors.rollout_worker import RolloutWorker
    from treegrpo_ray.actors.schedule import load_task, step_leases, training_order
    from treegrpo_ray.config import load_config
    from treegrpo_ray.learners.policies import resolve_model_path

    m, n, rounds = _shape(shape)
    tree = [f"tree.m={m}", f"tree.n={n}", f"tree.l={rounds}", "tree.select=uniform"]
    cfg = load_config(preset, [*overrides, *tree, f"train.prompts_per_step={prompts}"])
    samples = load_task(cfg.task).train_samples()
    worker = RolloutWorker.from_config(cfg, resolve_model_path(cfg, progress=True))
    order = training_order(len(samples), cfg.train.seed)
    leases = step_leases(samples, order, 0, prompts, cfg.lease_size(), cfg.train.seed)
    started = time.perf_counter()
    for done, lease in enumerate(leases, 1):
        yield worker.expand(lease)
        print(
            f"probe: lease {done}/{len(leases)} ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"shape {text!r}: give MxNxL, e.g. 4x2x1")
    m, n, rounds = map(int, parts)
    if m < 2 or rounds != 1:
        raise argparse.ArgumentTypeError(
            f"shape {text!r}: the profile needs M >= 2 (independent chains) and L = 1"
        )
    return m, n, rounds


def measured_arms(suite: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Per start and arm of a budget suite's runs: mean share of prompts with reward variance
    over updates and seeds, generated tokens per prompt, and the seeds."""
    found: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for path in sorted((suite / "runs").glob("*/*/seed*.json")):
        record = json.loads(path.read_text())
        if "groups_with_variance" in record:
            found[(record["start"], record["arm"])].append(record)
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for (start, arm), records in found.items():
        out[start][arm] = {
            "share": statistics.fmean(r["groups_with_variance"] for r in records),
            "tokens_per_prompt": statistics.fmean(
                r["points"][-1]["generated_tokens"] / r["points"][-1]["prompts"] for r in records
            ),
            "seeds": len(records),
        }
    return dict(out)


def measured_gap_at_equal_tokens(arms: dict[str, dict[str, float]], tree: str) -> float | None:
    """A measured tree arm's share minus that of the measured chain arms, interpolated by
    generated tokens per prompt at the tree's; None when its tokens lie outside theirs."""
    from treegrpo_ray.budget_stats import interpolate

    points = sorted(
        (v["tokens_per_prompt"], v["share"]) for a, v in arms.items() if a.startswith("chain")
    )
    x = arms[tree]["tokens_per_prompt"]
    if len(points) < 2 or not points[0][0] <= x <= points[-1][0]:
        return None
    xs, ys = zip(*points, strict=True)
    return arms[tree]["share"] - interpolate(xs, ys, x)


def profile(
    prompts: dict[object, PromptLeaves], arms: tuple[str, ...], measured: dict | None
) -> dict[str, Any]:
    """The profile and the predictions as one JSON-able dict."""
    from treegrpo_ray.branch_profile import Profile, depth_profile, prompt_mix

    groups = list(prompts.values())
    depths = depth_profile(groups)
    mix = prompt_mix(groups)
    chains = [c for p in groups for c in p.chains]
    by_arm = {arm: Profile(mix, depths, chains).predict(arm) for arm in arms}
    return {
        "prompts": len(groups),
        "leaves": sum(len(p.rewards) for p in groups),
        "mix": {"levels": mix.levels, "differ": mix.differ, "within": mix.within},
        "success_rates": sorted(p.success_rate for p in groups),
        "share_in_data": statistics.fmean(p.has_variance for p in groups),
        "chain_steps": statistics.fmean(c.steps for c in chains),
        "chain_tokens": statistics.fmean(c.tokens for c in chains),
        "depths": [asdict(d) for d in depths],
        "predictions": [asdict(p) for p in by_arm.values()],
        "gaps": _gaps(by_arm, measured),
        "measured": measured or {},
    }


def _gaps(by_arm: dict[str, Prediction], measured: dict | None) -> list[dict[str, Any]]:
    """Per (tree, chain) pair of ``GAPS`` among the arms: predicted and measured share gaps."""
    out = []
    for tree, chain in GAPS:
        if tree not in by_arm or chain not in by_arm:
            continue
        row: dict[str, Any] = {
            "tree": tree,
            "chain": chain,
            "predicted_share_gap": by_arm[tree].share - by_arm[chain].share,
        }
        for start, arms in (measured or {}).items():
            if tree in arms and chain in arms:
                row[f"measured_share_gap/{start}"] = arms[tree]["share"] - arms[chain]["share"]
        out.append(row)
    return out


def _pct(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "—"
    return f"{100 * value:+.1f}" if sign else f"{100 * value:.1f}"


def markdown(result: dict[str, Any], source: str) -> str:
    """The report: the depth table, the predictions (and measured shares) per arm, the gaps."""
    mix = result["mix"]
    lines = [
        f"# Branch-value profile ({source})",
        "",
        f"{result['prompts']} prompts, {result['leaves']} leaves; reward levels "
        + ", ".join(f"{level:g}: {_pct(share)}%" for level, share in mix["levels"].items())
        + f"; two independent leaves differ (D_0) {_pct(mix['differ'])}%, a share "
        f"{mix['within']:.2f} of that spread lies within prompts; mean success rate "
        f"{_pct(statistics.fmean(result['success_rates']))}%; "
        f"original chains: {result['chain_steps']:.2f} agent steps, "
        f"{result['chain_tokens']:.0f} generated tokens; prompts whose leaves differ in these "
        f"trees: {_pct(result['share_in_data'])}%.",
        "",
        "| branch after step t | leaf pairs | disagreement | rho_t (95% CI) | d_t (tokens before) "
        "| branch pays (rho < d) |",
        "|---|---|---|---|---|---|",
    ]
    for d in result["depths"]:
        rho = (
            "—" if d["rho"] is None else f"{d['rho']:.3f} ({d['rho_low']:.3f}, {d['rho_high']:.3f})"
        )
        pays = (
            ""
            if d["shared_steps"] == 0 or d["rho"] is None
            else ("yes" if d["rho"] < d["token_share"] else "no")
        )
        lines.append(
            f"| {d['shared_steps']} | {d['pairs']} | {d['disagreement']:.3f} | {rho} | "
            f"{d['token_share']:.3f} | {pays} |"
        )
    starts = sorted(result["measured"])
    head = "".join(
        f" measured ({s}) | tokens/prompt ({s}) | measured at equal tokens ({s}) |" for s in starts
    )
    lines += [
        "",
        "| arm | predicted share with variance (%) | tokens (chains) | effective chains | "
        "predicted tree - chains at equal tokens |" + head,
        "|---|---|---|---|---|" + "---|---|---|" * len(starts),
    ]
    for row in result["predictions"]:
        chain = row["arm"].startswith("chain")
        cells = [
            row["arm"],
            _pct(row["share"]),
            f"{row['chains_of_tokens']:.2f}",
            f"{row['effective_chains']:.2f}",
            "—" if chain else _pct(row["gap_at_equal_tokens"], sign=True),
        ]
        for start in starts:
            arms = result["measured"][start]
            got = arms.get(row["arm"])
            if got is None:
                cells += ["—", "—", "—"]
                continue
            gap = None if chain else measured_gap_at_equal_tokens(arms, row["arm"])
            cells += [
                f"{_pct(got['share'])} (n={got['seeds']})",
                f"{got['tokens_per_prompt']:.0f}",
                "—" if chain else _pct(gap, sign=True),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| tree vs chain | predicted share gap | measured |", "|---|---|---|"]
    for gap in result["gaps"]:
        seen = ", ".join(
            f"{key.split('/')[1]}: {_pct(value, sign=True)}"
            for key, value in gap.items()
            if key.startswith("measured_share_gap/")
        )
        lines.append(
            f"| {gap['tree']} - {gap['chain']} | {_pct(gap['predicted_share_gap'], sign=True)} | "
            f"{seen or '—'} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Left: rho_t (with its interval) and d_t by branch point; right: predicted (and measured)
    share of prompts with reward variance per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    depths = [d for d in result["depths"] if d["rho"] is not None]
    steps = [d["shared_steps"] for d in depths]
    rho = [d["rho"] for d in depths]
    errors = [
        [r - d["rho_low"] for r, d in zip(rho, depths, strict=True)],
        [d["rho_high"] - r for r, d in zip(rho, depths, strict=True)],
    ]
    left.errorbar(steps, rho, yerr=errors, marker="o", capsize=3, label="rho_t (decided before)")
    left.plot(steps, [d["token_share"] for d in depths], "s--", label="d_t (tokens before)")
    left.set_xlabel("branch after agent step t")
    left.set_ylabel("share")
    left.legend()
    arms = [row["arm"] for row in result["predictions"]]
    xs = range(len(arms))
    right.bar(xs, [100 * row["share"] for row in result["predictions"]], 0.4, label="predicted")
    for i, start in enumerate(sorted(result["measured"])):
        seen = [result["measured"][start].get(a, {}).get("share") for a in arms]
        right.bar(
            [x + 0.4 * (i + 1) for x in xs],
            [100 * s if s is not None else 0 for s in seen],
            0.4,
            label=f"measured ({start})",
        )
    right.set_xticks(list(xs), arms, rotation=20)
    right.set_ylabel("prompts with reward variance (%)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", type=Path, metavar="RUN", help="a run directory with saved trees")
    source.add_argument(
        "--probe", action="store_true", help="probe the preset's starting policy (trains nothing)"
    )
    parser.add_argument("--preset", default="tiny-multihop", help="task/model preset or YAML")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    parser.add_argument("--shape", default="4x2x1", type=str, help="the probe's tree shape MxNx1")
    parser.add_argument("--prompts", type=int, default=64, help="prompts the probe expands")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/profile"))
    parser.add_argument(
        "--budget-suite", type=Path, metavar="DIR", help="a budget suite's output: measured shares"
    )
    parser.add_argument(
        "--arms",
        default=",".join(DEFAULT_ARMS),
        help="arms to predict, comma-separated chain-G / tree-MxNx1",
    )


def run_from_args(args: argparse.Namespace) -> int:
    from treegrpo_ray.branch_profile import Shape, prompt_leaves

    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    for arm in arms:
        Shape.of_arm(arm)  # a clear error before any rollout
    if args.probe:
        _shape(args.shape)
        trees = probe_trees(args.preset, args.set, args.shape, args.prompts, args.out)
        prompts = prompt_leaves(trees)
        source = f"probe {args.shape} of {args.preset} {' '.join(args.set)}".strip()
    else:
        prompts = run_trees(args.run)
        source = f"saved trees of {args.run}"
    measured = measured_arms(args.budget_suite) if args.budget_suite else None
    result = profile(prompts, arms, measured) | {"source": source}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(result, indent=1))
    (args.out / "profile.md").write_text(markdown(result, source))
    plot(result, args.out / "profile.png")
    print(markdown(result, source))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treegrpo bench profile", description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
