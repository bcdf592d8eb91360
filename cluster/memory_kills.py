"""Ray's memory-monitor kills, told in one line.

When a node's memory use passes ``RAY_memory_usage_threshold`` (0.95 by default), Ray kills
workers on it and the calls in flight on them raise ``ray.exceptions.OutOfMemoryError`` with a
report of 20-50 lines (the node's figures, object-store statistics, every worker considered). A
user needs three facts from it: that memory was the cause, how full the node was, how much the
killed worker held; and which settings to lower.
"""

from __future__ import annotations

import re

KILLED = re.compile(r"(\d+) worker\(s\) were killed due to the node running low on memory")
OLD_KILLED = re.compile(r"[Tt]ask was killed due to the node running low on memory")
# Ray 2.60: "was 22.90GB used / 24.00GB limit (0.954...)"; before 2.56 "was 22.90GB / 24.00GB"
NODE = re.compile(r"was ([\d.]+) ?GB(?: used)? / ([\d.]+) ?GB(?: limit)? \(([\d.]+)\)")
# Ray 2.60: "exceeded threshold of 22800000000B (95.0% of 24000000000B limit)"; before: "0.95"
THRESHOLD = re.compile(
    r"exceeded threshold of \d+B \(([\d.]+)% of|usage threshold of (\d+(?:\.\d+)?)"
)
WORKER = re.compile(r"pid=(\d+), (?:actual )?memory used=([\d.]+) ?GB")
SETTINGS = (
    "lower train.prompts_per_step, engine.max_kv_bytes or engine.cache_bytes (rollout), "
    "ppo.micro_batch_tokens (learner); `treegrpo plan CONFIG` shows what each process holds"
)


def memory_kill_line(text: str) -> str | None:
    """One line for Ray's out-of-memory report in ``text``; None when ``text`` holds none."""
    killed = KILLED.search(text)
    if killed is None and OLD_KILLED.search(text) is None:
        return None
    count = int(killed.group(1)) if killed else 1
    parts = [f"Ray's memory monitor killed {count} worker(s): the node was running out of memory"]
    node = NODE.search(text)
    if node is not None:
        used, total, share = node.groups()
        parts[0] += f" ({float(used):.1f} of {float(total):.1f} GB, {float(share):.0%}"
        threshold = THRESHOLD.search(text)
        if threshold is not None:
            percent, fraction = threshold.groups()
            limit = float(percent) / 100 if percent else float(fraction)
            parts[0] += f", its kill threshold {limit:.0%}"
        parts[0] += ")"
    killed_part = text.split("Selected to kill:", 1)[-1]  # not the workers only considered
    workers = [(float(gb), pid) for pid, gb in WORKER.findall(killed_part)]
    if workers:
        gb, pid = max(workers)
        parts.append(f"the largest killed worker (pid {pid}) held {gb:g} GB")
    parts.append(SETTINGS)
    return "; ".join(parts)


def short_failure(text: str) -> str:
    """``text``, with Ray's out-of-memory report (and what followed it) cut to one line."""
    line = memory_kill_line(text)
    if line is None:
        return text
    start = min(m.start() for m in (KILLED.search(text), OLD_KILLED.search(text)) if m)
    before = re.sub(r"(ray\.exceptions\.)?OutOfMemoryError:\s*$", "", text[:start]).rstrip()
    return f"{before} {line}" if before else line
