"""A rollout beside processes that wake every 10 ms, as a Ray job's idle actors do (issue 27).

Ray's core worker checks for signals every 10 ms in every worker process
(``CoreWorker::RunTaskExecutionLoop``, not configurable), so each idle actor of a job wakes 100
times a second; a SmolLM2 job has ten of them during its rollout (the controller, the queue, the
retriever, the learner worker and Ray Train's six). On 2 cores each wakeup preempts one of the
rollout's two compute threads, and the other waits for it at the next OpenMP barrier.

This runs the preset's first lease (the job's own: same prompts and seeds) in this process, with
no sleepers and with ``--sleepers`` processes that sleep 10 ms in a loop, alternating, and
reports the median seconds, the ratio, and the involuntary context switches a second (repeats
of one lease find its prompts in the engine's prefix cache, as every arm does)::

    python -m benchmarks.rollout_wakeups [--sleepers 10 25] [--reps 3]
        [--out benchmarks/results/rollout_wakeups]

Run it on an otherwise idle machine, the preset prepared and warm-started.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.realmodel_loop import as_the_jobs_run
from benchmarks.rollout_prefix_cache import write_results
from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import leases_of_step, load_task
from treegrpo_ray.config import load_config
from treegrpo_ray.learners.policies import resolve_model_path

PRESET = "smollm2-135m-search-qa"
SLEEPER = "import time\nwhile True:\n    time.sleep(0.01)"


def timed_rollout(worker: RolloutWorker, lease, sleepers: int) -> dict[str, float]:
    """Seconds of ``worker.expand(lease)`` with ``sleepers`` 100 Hz processes beside it, and
    this process's involuntary context switches a second."""
    procs = [subprocess.Popen([sys.executable, "-c", SLEEPER]) for _ in range(sleepers)]
    try:
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        worker.expand(lease)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return {"seconds": seconds, "preemptions_per_s": (after.ru_nivcsw - before.ru_nivcsw) / seconds}


def run(sleeper_counts: list[int], reps: int) -> dict:
    cfg = load_config(PRESET, [])
    torch.set_num_threads(cfg.cluster.torch_threads)
    worker = RolloutWorker.from_config(cfg, resolve_model_path(cfg, progress=False))
    (lease,) = leases_of_step(cfg, load_task(cfg.task).train_samples())(0)
    worker.expand(lease)  # one-time costs out of the timings
    arms = [0, *sleeper_counts]
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in arms}
    for rep in range(reps):
        for n in arms:
            runs[n].append(timed_rollout(worker, lease, n))
            print(f"rep {rep + 1}, {n} sleepers: {runs[n][-1]['seconds']:.2f} s", flush=True)
    medians = {n: statistics.median(r["seconds"] for r in runs[n]) for n in arms}
    return {
        "preset": PRESET,
        "reps": reps,
        "arms": {
            str(n): {
                "median_s": medians[n],
                "slowdown": medians[n] / medians[0],
                "preemptions_per_s": statistics.median(r["preemptions_per_s"] for r in runs[n]),
                "runs": runs[n],
            }
            for n in arms
        },
    }


def markdown(result: dict) -> str:
    lines = [
        f"# {result['preset']}: the first lease's rollout beside 100 Hz sleepers",
        "",
        f"In process, medians of {result['reps']} alternating repetitions.",
        "",
        "| sleepers | rollout | against none | involuntary switches/s |",
        "|---|---|---|---|",
    ]
    for n, arm in result["arms"].items():
        lines.append(
            f"| {n} | {arm['median_s']:.2f} s | {arm['slowdown']:.3f}x "
            f"| {arm['preemptions_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleepers", type=int, nargs="+", default=[10, 25])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/rollout_wakeups")
    args = parser.parse_args()
    as_the_jobs_run(PRESET, [])
    result = run(args.sleepers, args.reps)
    write_results(Path(args.out), result, markdown(result))


if __name__ == "__main__":
    main()
