"""The CPU a local Ray takes while the job's work waits: the floor under every job (issue 27).

A SmolLM2 job on 2 cores runs its rollout and its learner ~1.2x slower than the same code
in-process (README, "Why the rollout is slower through Ray"). This measures what Ray's own
processes take when nothing runs, in three arms, each in a fresh Ray started by a subprocess:
``bare`` (``ray.init`` only), ``train`` (plus a Ray Train ``TorchTrainer`` whose one worker
sleeps, with Ray Train's health check every 2 s, its default) and ``train-fast-poll`` (the same
with the check every 0.5 s, what ``treegrpo train`` sets). After ``--settle`` seconds it reads
every process's user + system CPU time from ``/proc`` over ``--window`` seconds, sums it by
role, and reports percent of one core (medians over ``--reps`` alternating repetitions)::

    python -m benchmarks.ray_idle_floor [--reps 2] [--settle 30] [--window 40]
        [--out benchmarks/results/ray_idle_floor]

Run it on an otherwise idle machine; Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.rollout_prefix_cache import write_results

ARMS = {"bare": None, "train": "2.0", "train-fast-poll": "0.5"}
# (role, a piece of the process's command line), the first match wins
ROLES = [
    ("Ray Train", "TrainController"),
    ("Ray Train", "RayTrainWorker"),
    ("Ray Train", "PlacementGroupCleaner"),
    ("Ray Train", "PreemptionWatcher"),
    ("Ray Train", "DatasetManager"),
    ("Ray Train", "AutoscalingCoordinator"),
    ("Ray Train", "SynchronizationActor"),
    ("dashboard", "dashboard"),
    ("dashboard", "DashboardAgent"),
    ("dashboard", "RuntimeEnvAgent"),
    ("Ray core", "gcs_server"),
    ("Ray core", "raylet"),
    ("Ray core", "log_monitor"),
    ("Ray core", "monitor.py"),
    ("idle workers", "ray::IDLE"),
    ("driver", "ray_idle_floor"),
    ("other Ray", "ray::"),
    ("other Ray", "/ray/"),
]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> dict[int, tuple[int, str]]:
    """pid -> (user + system clock ticks so far, command line) of every process."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # the process ended while we read
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(pid)] = (int(fields[11]) + int(fields[12]), cmdline)
    return out


def role(cmdline: str) -> str | None:
    return next((name for name, piece in ROLES if piece in cmdline), None)


def percent_by_role(settle: float, window: float) -> dict[str, float]:
    """Percent of one core each role's processes used over ``window`` s, after ``settle`` s."""
    time.sleep(settle)
    before = cpu_ticks()
    time.sleep(window)
    after = cpu_ticks()
    used: dict[str, float] = {}
    for pid, (ticks, cmdline) in after.items():
        name = role(cmdline)
        if name is not None and pid in before:
            spent = (ticks - before[pid][0]) / CLOCK_TICKS
            used[name] = used.get(name, 0.0) + 100 * spent / window
    return used


def sleeping_worker(config: dict) -> None:
    time.sleep(config["seconds"])


def measure_arm(arm: str, settle: float, window: float) -> dict[str, float]:
    """In this process (a fresh one per arm): start Ray as the arm says and measure it."""
    interval = ARMS[arm]
    if interval is not None:
        os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = interval
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=2, logging_level="ERROR")
    result: dict[str, float] = {}
    meter = threading.Thread(target=lambda: result.update(percent_by_role(settle, window)))
    meter.start()
    if interval is not None:
        with tempfile.TemporaryDirectory() as storage:
            TorchTrainer(
                sleeping_worker,
                train_loop_config={"seconds": settle + window + 5},
                scaling_config=ScalingConfig(num_workers=1),
                run_config=RunConfig(storage_path=storage),
            ).fit()
    meter.join()
    ray.shutdown()
    return result


def run_arm(arm: str, settle: float, window: float) -> dict[str, float]:
    """``measure_arm`` in a fresh Python process (each arm needs its own Ray)."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.ray_idle_floor", "--arm", arm,
         "--settle", str(settle), "--window", str(window)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(reps: int, settle: float, window: float) -> dict:
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for rep in range(reps):
        for arm in ARMS:
            runs[arm].append(run_arm(arm, settle, window))
            total = sum(runs[arm][-1].values())
            print(f"rep {rep + 1}, {arm}: {total:.1f}% of a core", flush=True)
    roles = sorted({name for name, _ in ROLES})
    return {
        "reps": reps,
        "window_s": window,
        "cpus": os.cpu_count(),
        "arms": {
            arm: {
                "total": statistics.median(sum(r.values()) for r in runs[arm]),
                "by_role": {
                    name: statistics.median(r.get(name, 0.0) for r in runs[arm]) for name in roles
                },
                "runs": runs[arm],
            }
            for arm in ARMS
        },
    }


def markdown(result: dict) -> str:
    roles = list(next(iter(result["arms"].values()))["by_role"])
    lines = [
        "# A local Ray with nothing to do: percent of one core, by role",
        "",
        f"Medians of {result['reps']} alternating repetitions, {result['window_s']:.0f} s windows, "
        f"{result['cpus']} CPUs.",
        "",
        f"| arm | total | {' | '.join(roles)} |",
        f"|---|---|{'---|' * len(roles)}",
    ]
    for arm, data in result["arms"].items():
        cells = " | ".join(f"{data['by_role'][name]:.1f}" for name in roles)
        lines.append(f"| {arm} | {data['total']:.1f} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--settle", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=40.0)
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/ray_idle_floor")
    args = parser.parse_args()
    if args.arm is not None:  # one arm, in the subprocess run_arm started
        print(json.dumps(measure_arm(args.arm, args.settle, args.window)))
        return
    result = run(args.reps, args.settle, args.window)
    write_results(Path(args.out), result, markdown(result))


if __name__ == "__main__":
    main()
