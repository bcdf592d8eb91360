"""Aggregate the budget suite's runs: results.json, results.md, budget_efficiency.png and, when
runs recorded it, signal.png (share of prompts with reward variance against generated tokens).

A run record (``budget_suite.run_job``) holds its evaluation points: step, prompts, cost totals so
far (``generated_tokens``, ``tool_calls``, ``prefill_tokens``, ...), training wall time
``train_seconds``, ``greedy_em`` and ``sampled_em``. Point 0 is the warm start. Newer records also
hold the per-run signals (``groups_with_variance``, ``train_reward``: means over updates), the
tree's ``select`` / ``allocate`` rules and ``planner_share``, the planner's share of rollout time.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from treegrpo_ray.budget_stats import detectable_difference, matched_difference, mean_ci

METRICS = ("greedy_em", "sampled_em")
SIGNALS = ("groups_with_variance", "train_reward")  # per run, the mean over its updates
# matching -> the costs (summed) the curves are matched on (None: the final evaluations, equal
# updates); "compute": generated tokens plus the prefill tokens the engine computed
MATCHINGS: dict[str, tuple[str, ...] | None] = {
    "updates": None,
    "tokens": ("generated_tokens",),
    "compute": ("generated_tokens", "prefill_tokens"),
    "wall": ("train_seconds",),
}
PAIRS_KEY = "pairs"
SELECTION_KEY = "selection"  # selection arm vs its uniform tree and chains


def _by_arm(records: list[dict]) -> dict[tuple[str, str], dict[int, dict]]:
    """(start, arm) -> seed -> record."""
    out: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for r in records:
        out[(r["start"], r["arm"])][r["seed"]] = r
    return out


def arm_summary(runs: dict[int, dict]) -> dict[str, Any]:
    """Final EM (mean, 95% CI over seeds), measured cost per prompt, seconds per update."""
    finals = [r["points"][-1] for r in runs.values()]
    first = next(iter(runs.values()))
    out: dict[str, Any] = {
        "method": first["method"],
        "budget": first["budget"],
        "select": first.get("select", "uniform"),  # absent from records before issue 17
        "allocate": first.get("allocate", "fixed"),
        "seeds": sorted(runs),
        "updates": finals[0]["step"],
        "seconds_per_update": statistics.fmean(r["seconds_per_update"] for r in runs.values()),
    }
    for cost in ("generated_tokens", "tool_calls", "prefill_tokens", "leaves"):
        out[f"{cost}_per_prompt"] = statistics.fmean(p[cost] / p["prompts"] for p in finals)
    for metric in METRICS:
        out[metric] = mean_ci([p[metric] for p in finals]).to_dict()
    for signal in (*SIGNALS, "planner_share"):  # absent from runs recorded before they were kept
        if all(signal in r for r in runs.values()):
            out[signal] = mean_ci([r[signal] for r in runs.values()]).to_dict()
    out["curve"] = [
        {
            "step": points[0]["step"],
            "generated_tokens": statistics.fmean(p["generated_tokens"] for p in points),
            **{m: statistics.fmean(p[m] for p in points) for m in METRICS if m in points[0]},
        }
        for points in zip(*(r["points"] for r in runs.values()), strict=True)
    ]
    return out


def _curve(record: dict, costs: tuple[str, ...], metric: str) -> tuple[list[float], list[float]]:
    """(cost, metric) along a run's evaluations that measured ``metric`` (a suite may evaluate
    sampled EM only at the start and the end)."""
    points = [p for p in record["points"] if metric in p]
    return [sum(p[c] for c in costs) for p in points], [p[metric] for p in points]


def _paired(diffs: list[float]) -> dict[str, Any]:
    return mean_ci(diffs).to_dict() | {
        "detectable": detectable_difference(diffs),
        "differences": diffs,
    }


def _tokens_per_prompt(record: dict) -> float:
    final = record["points"][-1]
    return final["generated_tokens"] / final["prompts"]


def compare(a_runs: dict[int, dict], b_runs: dict[int, dict]) -> dict[str, Any]:
    """``a - b`` paired by seed, per matching and metric: mean, 95% CI, detectable difference
    and, for cost matchings, the mean cost per prompt where the two were compared; the same for
    the per-run signals both recorded (``signals``), and a's generated tokens per prompt over
    b's (``token_ratio``, mean over seeds)."""
    seeds = sorted(set(a_runs) & set(b_runs))
    out: dict[str, Any] = {"seeds": seeds}
    for matching, cost in MATCHINGS.items():
        result: dict[str, Any] = {}
        for metric in METRICS:
            diffs, at = [], []
            for s in seeds:
                a, b = a_runs[s], b_runs[s]
                if cost is None:
                    diffs.append(a["points"][-1][metric] - b["points"][-1][metric])
                    continue
                diff, x = matched_difference(_curve(a, cost, metric), _curve(b, cost, metric))
                diffs.append(diff)
                at.append(x)
            result[metric] = _paired(diffs)
            if at:
                result["at"] = statistics.fmean(at)
        out[matching] = result
    out["wall_ratio"] = statistics.median(
        a_runs[s]["seconds_per_update"] / b_runs[s]["seconds_per_update"] for s in seeds
    )
    out["token_ratio"] = statistics.fmean(
        _tokens_per_prompt(a_runs[s]) / _tokens_per_prompt(b_runs[s]) for s in seeds
    )
    out["signals"] = {
        signal: _paired([a_runs[s][signal] - b_runs[s][signal] for s in seeds])
        for signal in SIGNALS
        if all(signal in r for r in (*a_runs.values(), *b_runs.values()))
    }
    return out


def aggregate(records: list[dict], settings: dict[str, Any]) -> dict[str, Any]:
    """Per start: arm summaries, the tree-vs-chain and the selection comparisons; the headline and
    targets."""
    from treegrpo_ray.experiments.budget_suite import (
        HEADLINE,
        PAIRS,
        SELECTION_PAIRS,
        SELECTION_TARGETS,
        STRETCH,
    )

    by_arm = _by_arm(records)
    starts = sorted({s for s, _ in by_arm}, key=list(settings["starts"]).index)
    result: dict[str, Any] = {"settings": settings, "starts": {}}
    for start in starts:

        def pairs_of(pairs: tuple[tuple[str, str], ...], start: str = start) -> dict[str, Any]:
            return {
                f"{a} vs {b}": compare(by_arm[(start, a)], by_arm[(start, b)])
                for a, b in pairs
                if (start, a) in by_arm and (start, b) in by_arm
            }

        result["starts"][start] = {
            "arms": {arm: arm_summary(runs) for (s, arm), runs in by_arm.items() if s == start},
            PAIRS_KEY: pairs_of((*PAIRS, STRETCH)),
            SELECTION_KEY: pairs_of(SELECTION_PAIRS),
        }
    result["headline"] = headline(result, HEADLINE)
    result["targets"] = targets(result, PAIRS, STRETCH) | selection_targets(
        result, SELECTION_TARGETS
    )
    return result


def headline(result: dict[str, Any], spec: dict[str, str]) -> dict[str, Any] | None:
    """The pre-registered figure: tree minus chain, ``metric`` at matched generated tokens."""
    pairs = result["starts"].get(spec["start"], {}).get(PAIRS_KEY, {})
    pair = pairs.get(f"{spec['tree']} vs {spec['chain']}")
    if pair is None:
        return None
    figure = pair["tokens"][spec["metric"]]
    return {**spec, **figure, "at_tokens_total": pair["tokens"].get("at")}


def targets(result: dict[str, Any], pairs: tuple, stretch: tuple[str, str]) -> dict[str, Any]:
    """Each target of the suite, met or not, with the figure it was judged on."""
    out: dict[str, Any] = {}
    head = result["headline"]
    if head is not None:
        out["headline_ci_above_zero"] = not math.isnan(head["ci95"]) and head["mean"] > head["ci95"]
    for start, data in result["starts"].items():
        for a, b in pairs:
            pair = data[PAIRS_KEY].get(f"{a} vs {b}")
            if pair is None:
                continue
            delta = pair["tokens"]["greedy_em"]["mean"]
            out[f"{start}: {a} >= {b} at equal tokens (greedy)"] = {
                "met": delta >= 0,
                "delta": delta,
            }
            ratio = pair["wall_ratio"]
            out[f"{start}: {a} wall/update <= 1.3x {b}"] = {"met": ratio <= 1.3, "ratio": ratio}
        s = data[PAIRS_KEY].get(f"{stretch[0]} vs {stretch[1]}")
        if s is not None:
            delta = s["updates"]["greedy_em"]["mean"]
            out[f"{start}: stretch {stretch[0]} >= {stretch[1]}"] = {
                "met": delta >= 0,
                "delta": delta,
            }
    return out


def selection_targets(result: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """The pre-registered selection comparison (README), judged on the selection arm with the
    largest mean gain in the share of prompts with reward variance over the uniform tree: the
    primary target (gain >= ``share_gain``, 95% interval above 0, generated tokens per prompt at
    most ``token_slack`` x the uniform tree's), the same with a Bonferroni interval over the arms
    compared, the stretch (the control chain's share at no more tokens than the uniform tree) and
    the cost (planner time <= ``overhead`` of rollout time, every selection arm)."""
    data = result["starts"].get(spec["start"])
    if data is None or spec["uniform"] not in data["arms"]:
        return {}
    arms, pairs, uniform = data["arms"], data[SELECTION_KEY], spec["uniform"]
    gains = {
        a: pairs[f"{a} vs {uniform}"]
        for a in spec["arms"]
        if "groups_with_variance" in pairs.get(f"{a} vs {uniform}", {}).get("signals", {})
    }
    if not gains:
        return {}
    best = max(gains, key=lambda a: gains[a]["signals"]["groups_with_variance"]["mean"])
    gain = gains[best]["signals"]["groups_with_variance"]
    ratio = gains[best]["token_ratio"]
    corrected = mean_ci(gain["differences"], alpha=0.05 / len(gains))
    figure = f"{best}: {_pct(gain)} points, tokens {ratio:.2f}x"
    prefix = f"{spec['start']}: selection"
    share_met = gain["mean"] >= spec["share_gain"] and ratio <= spec["token_slack"]
    out: dict[str, Any] = {
        f"{prefix} primary: best arm − {uniform} share of prompts with reward variance "
        f">= +{100 * spec['share_gain']:.0f} points, 95% CI above 0, tokens <= "
        f"{spec['token_slack']}x": {
            "met": share_met and gain["mean"] - gain["ci95"] > 0,
            "figure": figure,
        },
        f"{prefix} primary, Bonferroni over {len(gains)} arms": {
            "met": share_met and corrected.low > 0,
            "figure": f"{best}: ± {100 * corrected.half_width:.1f} points",
        },
    }
    control = arms.get(spec["control"])
    if control is not None and "groups_with_variance" in control:
        best_arm, uniform_arm = arms[best], arms[uniform]
        share, target = best_arm["groups_with_variance"], control["groups_with_variance"]
        tokens, cap = (
            best_arm["generated_tokens_per_prompt"],
            uniform_arm["generated_tokens_per_prompt"],
        )
        out[
            f"{prefix} stretch: best arm's share >= {spec['control']}'s at tokens <= {uniform}'s"
        ] = {
            "met": share["mean"] >= target["mean"] and tokens <= cap,
            "figure": f"{100 * share['mean']:.1f} vs {100 * target['mean']:.1f}%, "
            f"{tokens:.1f} vs {cap:.1f} tokens",
        }
    for name in gains:
        if "planner_share" in arms[name]:
            overhead = arms[name]["planner_share"]["mean"]
            out[f"{prefix} cost: {name} planner <= {100 * spec['overhead']:.0f}% of rollout"] = {
                "met": overhead <= spec["overhead"],
                "figure": f"{100 * overhead:.2f}%",
            }
    return out


def _pct(estimate: dict[str, float]) -> str:
    ci = "" if math.isnan(estimate["ci95"]) else f" ± {100 * estimate['ci95']:.1f}"
    return f"{100 * estimate['mean']:.1f}{ci}"


def markdown(result: dict[str, Any], seconds: float) -> str:
    """The tables of results.md."""
    s = result["settings"]
    lines = [
        "# Budget efficiency: chain GRPO vs Tree-GRPO",
        "",
        f"Preset `{s['preset']}`, {s['steps']} updates of {s['prompts_per_step']} prompts per run, "
        f"held-out EM on {s['eval_questions']} questions (greedy; sampled x{s['eval_samples']} "
        f"at the end), mean ± 95% CI over seeds; suite wall time {seconds / 60:.1f} min"
        + _run_hours(result)
        + ".",
    ]
    head = result["headline"]
    if head is not None:
        lines += [
            "",
            f"**Headline (pre-registered)**: {head['tree']} − {head['chain']}, greedy held-out EM "
            f"at matched generated tokens, {head['start']} warm start: "
            f"**{_pct(head)} points** over {head['n']} seeds (smallest detectable difference "
            f"{100 * head['detectable']:.1f} points).",
        ]
    for start, data in result["starts"].items():
        lines += ["", f"## Warm start: {start}", ""]
        lines += [
            "| arm | nominal budget | generated tokens / prompt | tool calls / prompt | "
            "prefill tokens / prompt | s / update | greedy EM | sampled EM | seeds | "
            "prompts with reward variance | train reward | planner % of rollout |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        arms = sorted(data["arms"].items(), key=lambda kv: (kv[1]["method"], kv[1]["budget"]))
        warm = next(iter(data["arms"].values()))["curve"][0]
        for name, a in arms:
            signals = " | ".join(_pct(a[s]) if s in a else "–" for s in (*SIGNALS, "planner_share"))
            lines.append(
                f"| {name} | {a['budget']} | {a['generated_tokens_per_prompt']:.1f} | "
                f"{a['tool_calls_per_prompt']:.2f} | {a['prefill_tokens_per_prompt']:.0f} | "
                f"{a['seconds_per_update']:.2f} | {_pct(a['greedy_em'])} | "
                f"{_pct(a['sampled_em'])} | {len(a['seeds'])} | {signals} |"
            )
        lines += [
            "",
            f"Warm start: greedy {100 * warm['greedy_em']:.1f}, sampled "
            f"{100 * warm['sampled_em']:.1f}.",
        ]
        lines += _pairs_table(data[PAIRS_KEY])
        lines += _selection_table(data[SELECTION_KEY])
    if result["targets"]:
        lines += ["", "## Targets", "", "| target | met | figure |", "|---|---|---|"]
    for name, value in result["targets"].items():
        lines.append(f"| {name} | {_target_cells(value)} |")
    return "\n".join(lines) + "\n"


def _run_hours(result: dict[str, Any]) -> str:
    """The runs' own wall times, summed: a resumed suite's wall time counts only its last part."""
    hours = result.get("run_hours")
    return (
        ""
        if hours is None
        else f" (this invocation; the runs' own wall times sum to {hours:.2f} h)"
    )


def _pairs_table(pairs: dict[str, Any]) -> list[str]:
    """Tree − chain at the same budget, per matching."""
    if not pairs:
        return []
    lines = [
        "",
        "| tree − chain | matching | Δ greedy EM | Δ sampled EM | detectable Δ greedy | "
        "tree / chain s per update |",
        "|---|---|---|---|---|---|",
    ]
    for pair, c in pairs.items():
        for matching in MATCHINGS:
            m = c[matching]
            lines.append(
                f"| {pair} | equal {matching} | {_pct(m['greedy_em'])} | "
                f"{_pct(m['sampled_em'])} | {100 * m['greedy_em']['detectable']:.1f} | "
                f"{c['wall_ratio']:.2f} |"
            )
    return lines


def _selection_table(pairs: dict[str, Any]) -> list[str]:
    """Selection arm − reference, paired by seed: share of prompts with reward variance, token
    ratio, greedy and sampled EM at equal generated tokens."""
    if not pairs:
        return []
    lines = [
        "",
        "| selection arm − reference | Δ prompts with reward variance | tokens / prompt ratio | "
        "Δ greedy EM, equal tokens | Δ sampled EM, equal tokens | seeds |",
        "|---|---|---|---|---|---|",
    ]
    for pair, c in pairs.items():
        share = c["signals"].get("groups_with_variance")
        lines.append(
            f"| {pair} | {_pct(share) if share else '–'} | {c['token_ratio']:.2f} | "
            f"{_pct(c['tokens']['greedy_em'])} | {_pct(c['tokens']['sampled_em'])} | "
            f"{len(c['seeds'])} |"
        )
    return lines


def _target_cells(value: bool | dict[str, Any]) -> str:
    """``met | figure`` cells: a difference in EM points, a wall-time ratio or a stated figure."""
    if isinstance(value, bool):
        return f"{'yes' if value else 'no'} | see the headline"
    met = "yes" if value["met"] else "no"
    if "figure" in value:
        return f"{met} | {value['figure']}"
    if "ratio" in value:
        return f"{met} | {value['ratio']:.2f}x"
    return f"{met} | {100 * value['delta']:+.2f} points"


def _family(arm: dict[str, Any]) -> str:
    """The line an arm is drawn on: chain, tree (the paper's uniform choice, fixed budget) or
    the tree's selection variant, e.g. ``tree entropy adaptive``."""
    if arm["method"] == "chain" or (arm["select"], arm["allocate"]) == ("uniform", "fixed"):
        return arm["method"]
    return " ".join(("tree", arm["select"], arm["allocate"])).replace(" fixed", "")


def plot(
    result: dict[str, Any],
    path: Path,
    metrics: tuple[str, ...] = METRICS,
    ylabel: str = "held-out EM (%)",
) -> None:
    """``metrics`` (rows) against measured generated tokens per prompt, a column per start and a
    line per family of arms (``_family``), CI error bars; arms without a metric are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    starts = list(result["starts"])
    fig, axes = plt.subplots(
        len(metrics), len(starts), figsize=(5 * len(starts), 3.5 * len(metrics)), squeeze=False
    )
    markers = "osD^v<>px*"
    for col, start in enumerate(starts):
        arms = result["starts"][start]["arms"]
        families = sorted({_family(a) for a in arms.values()}, key=lambda f: (f != "chain", f))
        for row, metric in enumerate(metrics):
            ax = axes[row][col]
            for family, marker in zip(families, markers, strict=False):
                pts = sorted(
                    (a for a in arms.values() if _family(a) == family and metric in a),
                    key=lambda a: a["generated_tokens_per_prompt"],
                )
                xs = [a["generated_tokens_per_prompt"] for a in pts]
                ys = [100 * a[metric]["mean"] for a in pts]
                errs = [
                    0 if math.isnan(a[metric]["ci95"]) else 100 * a[metric]["ci95"] for a in pts
                ]
                if pts:
                    ax.errorbar(xs, ys, yerr=errs, marker=marker, capsize=3, label=family)
            ax.set_xscale("log", base=2)
            # a log axis within one power of two has no major tick: label plain numbers
            ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=6))
            ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.set_title(f"{start} warm start: {metric.replace('_em', ' EM').replace('_', ' ')}")
            ax.set_ylabel(ylabel)
            ax.set_xlabel("generated tokens per prompt (measured)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    records: list[dict], settings: dict[str, Any], out: Path, seconds: float
) -> dict[str, Any]:
    """Write results.json, results.md, budget_efficiency.png (and signal.png when runs recorded
    the share of prompts with reward variance); returns the result plus a one-line ``line``."""
    result = aggregate(records, settings)
    result["seconds"] = seconds
    if all("wall_seconds" in r for r in records):
        result["run_hours"] = sum(r["wall_seconds"] for r in records) / 3600
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(result, seconds))
    plot(result, out / "budget_efficiency.png")
    with_signal = any(
        "groups_with_variance" in arm
        for data in result["starts"].values()
        for arm in data["arms"].values()
    )
    if with_signal:
        plot(result, out / "signal.png", ("groups_with_variance",), "prompts with variance (%)")
    head = result["headline"]
    figure = "" if head is None else f"; headline {_pct(head)} EM points (n={head['n']})"
    result["line"] = f"budget suite: {len(records)} runs in {seconds / 60:.1f} min{figure}; {out}"
    return result
