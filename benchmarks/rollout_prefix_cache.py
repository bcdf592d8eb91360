"""Tree rollouts with the embedded engine's prefix KV cache on vs off (issue 3, DESIGN §7).

Standard shape: (M, N, L) = (2, 2, 1) trees on 3-hop ``multihop`` questions, observations of ~30-60
tokens (``--distractors`` extra facts per search result). Two model sizes:

- ``tiny``: the warm-started tiny policy, running the real rollout (``RolloutWorker.expand``) with
  the cache on and off, same leases and seeds.
- ``large``: a randomly initialised ~25M-parameter Qwen2 (a random model cannot follow the action
  format, so its own rollouts would end after one action). It replays the request trace of the
  tiny policy's tree search: same waves, same batch composition, same branching, same observation
  tokens and the same number of generated tokens per request (no stop sequences), but the prefixes
  are rebuilt from the large model's *own* outputs, so the cache sees exactly what a real tree
  search with that model would give it.

Arms alternate within each repetition (on, off, then off, on), ``--reps`` times; medians. Writes
``results.json`` and ``results.md`` under ``--out``.

    python benchmarks/rollout_prefix_cache.py [--reps 5] [--prompts 8] [--threads 2] [--out DIR]

Run it on an otherwise idle machine: with more torch threads than free cores, every small forward
pass waits on busy cores (a one-token decode step went from 0.04 s to 0.9 s here).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from treegrpo_ray.actors.engines.hf_engine import HFEngine
from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.config import (
    EngineConfig,
    JobConfig,
    TaskConfig,
    TinyModelConfig,
    TreeConfig,
    load_config,
)
from treegrpo_ray.engine import Engine, GenerationRequest, GenerationResult, SamplingParams
from treegrpo_ray.envs.base import Sample
from treegrpo_ray.envs.multihop import MultihopConfig, MultihopTask
from treegrpo_ray.learners.warmstart import warm_start
from treegrpo_ray.modeling import build_tiny_model, load_tokenizer
from treegrpo_ray.tree import batch_info

LARGE = TinyModelConfig(
    hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536,
    max_positions=1024,
)  # fmt: skip
CACHE_BYTES = 2**30


@dataclass
class TracedRequest:
    """One request of the recorded tree search: it extends request ``parent``'s prefix and output
    (or, when ``parent`` is None, starts from ``head``) with ``tail`` tokens; ``new_tokens`` were
    generated."""

    parent: int | None
    head: tuple[int, ...]
    tail: tuple[int, ...]
    new_tokens: int
    seed: int


class TraceRecorder:
    """Wraps an engine and records each ``generate`` call as a wave of ``TracedRequest``s."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.version = engine.version
        self.waves: list[list[TracedRequest]] = []
        self._seen: list[tuple[int, ...]] = []  # prefix + output of every request so far

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results = self.engine.generate(requests)
        wave = [self._trace(r, res) for r, res in zip(requests, results, strict=True)]
        for request, result in zip(requests, results, strict=True):
            self._seen.append(request.prefix_ids + tuple(result.token_ids))
        self.waves.append(wave)
        return results

    def _trace(self, request: GenerationRequest, result: GenerationResult) -> TracedRequest:
        prefix, seed = request.prefix_ids, request.params.seed or 0
        for index in reversed(range(len(self._seen))):
            seen = self._seen[index]
            if len(seen) <= len(prefix) and prefix[: len(seen)] == seen:
                return TracedRequest(index, (), prefix[len(seen) :], len(result.token_ids), seed)
        return TracedRequest(None, prefix, (), len(result.token_ids), seed)


def replay(engine: Engine, waves: list[list[TracedRequest]]) -> dict[str, float]:
    """Run the traced tree search on ``engine``; prefixes are built from its own outputs."""
    sequences: list[tuple[int, ...]] = []
    prefill = cached = generated = 0
    start = time.perf_counter()
    for wave in waves:
        requests = [
            GenerationRequest(
                (sequences[t.parent] if t.parent is not None else t.head) + t.tail,
                SamplingParams(temperature=1.0, max_new_tokens=max(t.new_tokens, 1), seed=t.seed),
            )
            for t in wave
        ]
        results = engine.generate(requests)
        for request, result in zip(requests, results, strict=True):
            sequences.append(request.prefix_ids + tuple(result.token_ids))
            prefill += result.prefill_tokens
            cached += result.cached_tokens
            generated += len(result.token_ids)
    return _arm(time.perf_counter() - start, prefill, cached, generated)


def _arm(seconds: float, prefill: int, cached: int, generated: int) -> dict[str, float]:
    return {
        "seconds": seconds,
        "prefill_tokens": prefill,
        "cached_tokens": cached,
        "prefix_tokens": prefill + cached,
        "generated_tokens": generated,
    }


def three_hop_samples(task: MultihopTask, count: int, offset: int) -> list[Sample]:
    samples = [s for s in task.train_samples() if dict(s.meta)["hops"] == 3]
    return samples[offset : offset + count]


def tiny_rollouts(cfg: JobConfig, policy: str, args: argparse.Namespace) -> tuple[dict, list]:
    """Real tree rollouts of the tiny policy, cache on vs off; returns the per-rep arms and the
    traces recorded with the cache off (the reference request stream)."""
    task_cfg = TaskConfig(multihop=MultihopConfig(distractors=args.distractors))
    task = MultihopTask(task_cfg.multihop)
    workers = {
        on: RolloutWorker(
            policy,
            task_cfg,
            TreeConfig(m=2, n=2, l=1),
            cfg.sampling,
            EngineConfig(prefix_cache=on, cache_bytes=CACHE_BYTES),
            seed=0,
            torch_threads=args.threads,
        )  # fmt: skip
        for on in (True, False)
    }
    reps: list[dict] = []
    traces = []
    for rep in range(args.reps):
        samples = three_hop_samples(task, args.prompts, rep * args.prompts)
        lease = Lease(rep, tuple(enumerate(samples)), seed=rep)
        arms = {}
        for on in (True, False) if rep % 2 == 0 else (False, True):
            worker = workers[on]
            recorder = TraceRecorder(worker.engine)
            worker.engine = recorder  # type: ignore[assignment]
            start = time.perf_counter()
            table = worker.expand(lease)
            seconds = time.perf_counter() - start
            worker.engine = recorder.engine
            budgets = batch_info(table).budgets.values()
            arms["on" if on else "off"] = _arm(
                seconds,
                sum(b.prefill_tokens for b in budgets),
                sum(b.cached_tokens for b in budgets),
                sum(b.generated_tokens for b in budgets),
            )
            if not on:
                traces.append(recorder.waves)
        reps.append(arms)
    params = sum(p.numel() for p in workers[True].engine.model.parameters())
    summary = {
        "reps": reps,
        "parameters": params,
        "observation_tokens": _observation_lengths(traces),
    }
    return summary, traces


def _observation_lengths(traces: list) -> dict[str, float]:
    tails = [len(t.tail) for waves in traces for wave in waves for t in wave if t.tail]
    return {"median": statistics.median(tails), "min": min(tails), "max": max(tails)}


def large_replays(vocab_size: int, traces: list, pad_token_id: int) -> dict:
    model = build_tiny_model(LARGE, vocab_size=vocab_size, seed=0)
    engines = {
        "on": HFEngine(model, pad_token_id, cache_bytes=CACHE_BYTES),
        "off": HFEngine(model, pad_token_id, cache_bytes=0),
    }
    reps = []
    for rep, waves in enumerate(traces):
        order = ("on", "off") if rep % 2 == 0 else ("off", "on")
        reps.append({arm: replay(engines[arm], waves) for arm in order})
        engines["on"].cache.reset(version=rep + 1)  # each repetition starts cold, like a new policy
    params = sum(p.numel() for p in model.parameters())
    return {"reps": reps, "parameters": params}


def summarise(reps: list[dict]) -> dict[str, float]:
    """Medians over repetitions of each arm, and the on/off ratios."""

    def median(arm: str, key: str) -> float:
        return statistics.median(r[arm][key] for r in reps)

    return {
        "seconds_on": median("on", "seconds"),
        "seconds_off": median("off", "seconds"),
        "speedup": statistics.median(r["off"]["seconds"] / r["on"]["seconds"] for r in reps),
        "prefill_on": median("on", "prefill_tokens"),
        "prefill_off": median("off", "prefill_tokens"),
        "prefill_ratio": statistics.median(
            r["on"]["prefill_tokens"] / r["off"]["prefill_tokens"] for r in reps
        ),
        "generated_on": median("on", "generated_tokens"),
        "generated_off": median("off", "generated_tokens"),
    }


def markdown(results: dict) -> str:
    lines = [
        "| model | params | prefill tokens on / off | ratio | wall s on / off | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("tiny", "large"):
        s, params = results[name]["summary"], results[name]["parameters"]
        lines.append(
            f"| {name} | {params / 1e6:.1f}M | {s['prefill_on']:.0f} / {s['prefill_off']:.0f} | "
            f"{s['prefill_ratio']:.3f} | {s['seconds_on']:.2f} / {s['seconds_off']:.2f} | "
            f"{s['speedup']:.2f}x |"
        )
    obs = results["tiny"]["observation_tokens"]
    lines.append(
        f"\nShape (M, N, L) = (2, 2, 1), {results['prompts']} three-hop questions per rollout, "
        f"observation + next-turn tokens median {obs['median']} (min {obs['min']}, max "
        f"{obs['max']}); medians of {results['reps']} repetitions; {results['machine']}."
    )
    return "\n".join(lines) + "\n"


def rollout_arguments(doc: str, out: str) -> argparse.ArgumentParser:
    """The options of a tree-rollout benchmark (``out``: the default output folder)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8, help="questions per rollout")
    parser.add_argument("--distractors", type=int, default=8, help="extra facts per observation")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per engine")
    parser.add_argument("--out", default=out)
    return parser


def write_results(out: Path, results: dict, table: str) -> None:
    """``results.json`` and ``results.md`` (``table``) under ``out``; prints the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(table)
    print(table)


def main() -> None:
    args = rollout_arguments(__doc__, "benchmarks/results/rollout_prefix_cache").parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config("tiny-multihop", [])
    policy = str(warm_start(cfg.task.multihop, cfg.model.tiny, cfg.warmstart))
    tokenizer = load_tokenizer(policy)
    tiny, traces = tiny_rollouts(cfg, policy, args)
    large = large_replays(len(tokenizer), traces, tokenizer.pad_token_id)
    results = {
        "reps": args.reps,
        "prompts": args.prompts,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "tiny": {**tiny, "summary": summarise(tiny["reps"])},
        "large": {**large, "summary": summarise(large["reps"])},
    }
    write_results(Path(args.out), results, markdown(results))


if __name__ == "__main__":
    main()
