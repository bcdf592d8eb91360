"""The record of one training run as a table: every update's time, tokens, reward and evaluation.

Not an A-versus-B benchmark: it reads a run directory (``metrics.jsonl``, ``evaluations.json``) and
writes ``results.md`` beside them, for the README's record of a preset's full run.

    python benchmarks/run_record.py RUN_DIR [--title TEXT]

Columns per update: wall (time since the previous record, evaluations that ran meanwhile
included), rollout (the rollout worker's expansion of the update's prompts), learner (the update:
reference log-probs, forward + backward, optimiser), generated tokens and their rate, the learner's
unique tokens, the train reward mean, the share of format-valid actions and of prompts with reward
variance, and the held-out EM measured after the update. Below the table: medians over the updates
without an evaluation, and the before / after evaluation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

COLUMNS = (
    "update",
    "wall s",
    "rollout s",
    "learner s",
    "generated tokens",
    "tokens/s",
    "learner tokens",
    "reward mean",
    "format-valid actions",
    "prompts with variance",
    "EM sampled / greedy",
)


def read_records(run_dir: Path) -> list[dict]:
    """Every update's record of ``metrics.jsonl``, in step order (the last record of a step wins:
    a resumed run rewrites the steps it redid)."""
    by_step: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[int(record["step"])] = record
    return [by_step[step] for step in sorted(by_step)]


def _em(record: dict) -> str:
    sampled, greedy = record.get("eval/sampled_em"), record.get("eval/greedy_em")
    if sampled is None and greedy is None:
        return ""
    fmt = lambda v: "–" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    return f"{fmt(sampled)} / {fmt(greedy)}"


def rows(records: list[dict]) -> list[list[str]]:
    out, previous = [], 0.0
    for r in records:
        elapsed = r["timing/elapsed_s"]
        out.append(
            [
                str(r["step"]),
                f"{elapsed - previous:.0f}",
                f"{r['rollout/seconds']:.0f}",
                f"{r['timing/update']:.0f}",
                f"{r['budget/generated_tokens']:.0f}",
                f"{r['rollout/tokens_per_s']:.1f}",
                f"{r['learner/tokens']:.0f}",
                f"{r['tree/reward_mean']:.3f}",
                f"{100 * r['tree/format_valid_actions']:.0f}%",
                f"{100 * r['tree/groups_with_variance']:.0f}%",
                _em(r),
            ]
        )
        previous = elapsed
    return out


def summary(records: list[dict], evaluations: dict) -> list[str]:
    plain = [r for r in records[1:] if not any(k.startswith("eval/") for k in r)]
    elapsed = [r["timing/elapsed_s"] for r in records]
    walls = [b - a for a, b in itertools.pairwise(elapsed)]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in plain)

    lines = [
        f"Run wall time (the controller's start to the last update's record): "
        f"{records[-1]['timing/elapsed_s'] / 60:.1f} min over {len(records)} updates; median "
        f"wall per update {statistics.median(walls):.0f} s.",
        f"Updates 2-{len(records)} without an evaluation ({len(plain)}): median rollout "
        f"{med('rollout/seconds'):.0f} s at {med('rollout/tokens_per_s'):.1f} generated tokens/s, "
        f"learner {med('timing/update'):.0f} s (reference log-probs {med('timing/ref_logprobs'):.0f}"
        f" s, forward + backward {med('timing/optimize'):.0f} s) for "
        f"{med('learner/tokens'):.0f} unique tokens.",
    ]
    if evaluations:
        ev = {k: f"{100 * v:.1f}%" for k, v in evaluations.items()}
        lines.append(
            f"Held-out EM before training {ev.get('before/eval/sampled_em', '–')} / "
            f"{ev.get('before/eval/greedy_em', '–')} (sampled / greedy), after "
            f"{ev.get('after/eval/sampled_em', '–')} / {ev.get('after/eval/greedy_em', '–')} "
            "(`evaluations.json`)."
        )
    return lines


def markdown(run_dir: Path, title: str) -> str:
    records = read_records(run_dir)
    evaluations_file = run_dir / "evaluations.json"
    evaluations = json.loads(evaluations_file.read_text()) if evaluations_file.exists() else {}
    table = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(row) + " |" for row in rows(records)),
    ]
    return "\n".join([f"# {title}", "", *table, "", *summary(records, evaluations), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    title = args.title or f"The run in {args.run_dir.name}"
    out = args.run_dir / "results.md"
    out.write_text(markdown(args.run_dir, title))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
