"""The real-model loop against this machine's limits, measured in one run (issue 27).

First the machine: read bandwidth (a sum over 512 MiB of float32), copy bandwidth and float32
matmul throughput (1024 x 1024; torch's own path and oneDNN's with a prepacked weight, the better
being the roofline), with the run's torch threads, measured again after the workload, the higher
of the two measures standing (``best_limits``). Then a preset's real workload, in this
process through ``LocalRun`` (a job's leases, intake and policy sends): ``--updates`` rollouts of
``train.prompts_per_step`` prompts, starting from the preset's warm-started policy (so update 1
here is the job's update 1, up to the float noise that the job's evaluation before training
leaves in the engine's prefix cache; the embedded engine with its trace on), each followed by
the learner's update on its trees (``Learner.update``, the preset's PPO and LoRA settings),
whose new policy the worker then loads.

Reported, as ratios to the limits:
- rollout: generated tokens/s (the whole ``RolloutWorker.expand``: engine, environment, retrieval);
- decode steps: time against the roofline, the slower of the memory roofline (all weights plus
  the rows' KV read once at the read bandwidth) and the step's matmuls at the matmul throughput
  (per batch-size bucket, median over the steps);
- prefill (rows joining an idle engine): FLOP/s (2 x non-embedding parameters per token, plus
  the LM head at one position a row) against the matmul throughput;
- mixed steps (decoding rows and joining rows' prefixes in one forward): time against the
  roofline, the slower of the memory roofline and the step's matmuls (median over the steps);
- learner: unique tokens/s of the reference pass (forward) and of forward + backward, and their
  FLOP/s against the matmul throughput, counting every matmul a pass needs: the linears (2 x
  non-embedding parameters per token, plus the LM head where an action token is predicted), the
  LoRA adapter's (2 x its parameters per token) and attention's (QK^T and AV, 4 x the query width
  x the layers per (query, key) pair the tree mask keeps; not the pairs a kernel computes and
  throws away, not a split tree's repeated context). A backward costs two forwards of what it
  trains or attends through, one of a frozen linear's (its input gradients only): LoRA's
  forward + backward is 2 x the linears + 3 x the adapter and the attention, full fine-tuning's 3
  x all. Reported too is the linears-only ratio, the count of the figures before 2026-12-07. The
  learner's rates leave out update 1, which pays one-time costs (``ppo.compile_layers``' compiles).

    python benchmarks/realmodel_loop.py [--preset smollm2-135m-search-qa] [--updates 3]
        [--threads 2] [--set KEY=VALUE ...] [--out benchmarks/results/realmodel_loop]

Run it on an otherwise idle machine; the preset's model must be prepared and warm-started (the
first ``treegrpo train`` of the preset does both, or ``treegrpo warmstart PRESET``).
"""

from __future__ import annotations

# Before torch loads: the package sets OMP_WAIT_POLICY=PASSIVE, as in every job's processes (libgomp
# reads it once, when torch loads it). Imported after torch, this benchmark measured with libgomp's
# default spin-waits instead: decode steps ~1.3x and rollouts up to ~2x faster than the jobs run.
# The job's spin count (cluster.omp_spin_count) is known once the config is: ``main`` then starts
# the benchmark again with it (``as_the_jobs_run``).
import treegrpo_ray  # noqa: F401

# isort: split
import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from treegrpo_ray.actors.engines.hf_engine import ForwardTrace, HFEngine
from treegrpo_ray.cluster.local_run import LocalRun
from treegrpo_ray.config import load_config
from treegrpo_ray.learners.policies import resolve_model_path
from treegrpo_ray.onednn_linear import OneDNNLinears, onednn_available
from treegrpo_ray.packing import pack_trees
from treegrpo_ray.tree import Tree

BUCKETS = ((1, 7), (8, 15), (16, 10**6))


def median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_limits() -> dict[str, float]:
    """Read and copy bandwidth (GB/s) and float32 matmul throughput (GFLOP/s): torch's own
    (MKL), oneDNN's with a prepacked weight where torch has it, and the better of the two, the
    roofline every ratio here is taken against."""
    big = torch.rand(2**27)  # 512 MiB
    out = torch.empty_like(big)
    read = big.nbytes / median_seconds(big.sum, 5) / 1e9
    copy = 2 * big.nbytes / median_seconds(lambda: out.copy_(big), 5) / 1e9
    a, layer = torch.rand(1024, 1024), torch.nn.Linear(1024, 1024, bias=False)
    flops = 2 * 1024**3
    with torch.no_grad():
        rates = {"matmul_torch_gflop_s": flops / median_seconds(lambda: layer(a), 20) / 1e9}
        if onednn_available(a.device):
            with OneDNNLinears(layer, batch_hint=1024).active():
                rates["matmul_onednn_gflop_s"] = flops / median_seconds(lambda: layer(a), 20) / 1e9
    return {"read_gb_s": read, "copy_gb_s": copy, "matmul_gflop_s": max(rates.values()), **rates}


def model_sizes(engine: HFEngine) -> dict[str, float]:
    """Bytes of all weights, non-embedding parameters, LM-head parameters, KV bytes per token,
    and attention's FLOPs per visible (query, key) pair over all layers (QK^T and AV)."""
    model = engine.model
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    query_width = config.num_attention_heads * head_dim
    return {
        "weight_bytes": sum(p.nbytes for p in model.parameters()),
        "body_params": params - embedding,
        "head_params": model.get_output_embeddings().weight.numel(),
        "kv_token_bytes": engine.kv.token_bytes(),
        "attention_pair_flops": 4 * query_width * config.num_hidden_layers,
    }


def attention_pairs(trees: list[Tree]) -> int:
    """The (query, key) pairs of every tree's own mask, each tree whole (``visible_pairs``)."""
    widest = max(t.token_count for t in trees)
    return pack_trees(trees, widest, pad_token_id=0, one_tree_per_row=True).visible_pairs()


def step_roofline(step: ForwardTrace, sizes: dict, limits: dict) -> tuple[float, float]:
    """Seconds a forward takes at the limits: all weights plus the rows' KV read once at the
    read bandwidth, and its matmul FLOPs at the matmul throughput (the body for every token fed,
    the LM head once a row)."""
    memory = (sizes["weight_bytes"] + step.context * sizes["kv_token_bytes"]) / limits["read_gb_s"]
    flops = 2 * sizes["body_params"] * step.tokens + 2 * sizes["head_params"] * step.rows
    return memory / 1e9, flops / limits["matmul_gflop_s"] / 1e9


def against_roofline(steps: list[ForwardTrace], sizes: dict, limits: dict) -> dict[str, float]:
    """Of some forwards: how many, their median rows, tokens, KV tokens and ms, their median
    ratio to the roofline (the slower of memory and matmul, ``step_roofline``) and to the memory
    roofline alone, and the share of them the matmuls bound."""
    bounds = [step_roofline(t, sizes, limits) for t in steps]
    return {
        "steps": len(steps),
        "median_rows": statistics.median(t.rows for t in steps),
        "median_tokens": statistics.median(t.tokens for t in steps),
        "median_context": statistics.median(t.context for t in steps),
        "median_ms": 1e3 * statistics.median(t.seconds for t in steps),
        "roofline_ratio": statistics.median(
            t.seconds / max(b) for t, b in zip(steps, bounds, strict=True)
        ),
        "memory_roofline_ratio": statistics.median(
            t.seconds / b[0] for t, b in zip(steps, bounds, strict=True)
        ),
        "matmul_bound_share": sum(b[1] > b[0] for b in bounds) / len(bounds),
    }


def decode_ratios(trace: list[ForwardTrace], sizes: dict, limits: dict) -> dict[str, dict]:
    """``against_roofline`` of the decode steps, per batch-size bucket."""
    out = {}
    for low, high in BUCKETS:
        steps = [t for t in trace if t.kind == "decode" and low <= t.rows <= high]
        if steps:
            out[f"{low}-{high if high < 10**6 else ''}"] = against_roofline(steps, sizes, limits)
    return out


def mixed_ratio(trace: list[ForwardTrace], sizes: dict, limits: dict) -> dict[str, float]:
    """``against_roofline`` of the forwards that decode some rows and prefill others; empty if
    none."""
    steps = [t for t in trace if t.kind == "mixed"]
    return against_roofline(steps, sizes, limits) if steps else {}


def prefill_rate(trace: list[ForwardTrace], sizes: dict, limits: dict) -> dict[str, float]:
    steps = [t for t in trace if t.kind == "prefill"]
    tokens = sum(t.tokens for t in steps)
    seconds = sum(t.seconds for t in steps)
    flops = sum(
        2 * sizes["body_params"] * t.tokens + 2 * sizes["head_params"] * t.rows for t in steps
    )
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "matmul_ratio": flops / seconds / (limits["matmul_gflop_s"] * 1e9),
    }


def learner_rates(
    updates: list[dict], sizes: dict, limits: dict, reference: bool
) -> dict[str, float]:
    """Unique tokens/s and FLOP/s against the matmul roofline of the learner's passes over
    ``updates`` (their metrics, with ``actions``, ``attention_pairs`` and ``adapter_params``; see
    the module's docstring for the count); the reference pass's only if the learner has one."""
    tokens = sum(u["learner/tokens"] for u in updates)
    actions = sum(u["actions"] for u in updates)
    linears = 2 * sizes["body_params"] * tokens + 2 * sizes["head_params"] * actions
    attention = sizes["attention_pair_flops"] * sum(u["attention_pairs"] for u in updates)
    adapter = 2 * sum(u["adapter_params"] * u["learner/tokens"] for u in updates)
    # passes over the linears in forward + backward: under LoRA they are frozen, and a frozen
    # linear's backward computes its input gradients only
    linear_passes = 2 if adapter else 3
    train = linear_passes * linears + 3 * (adapter + attention)
    ref_s = sum(u["timing/ref_logprobs"] for u in updates)
    opt_s = sum(u["timing/optimize"] for u in updates)
    matmul = limits["matmul_gflop_s"] * 1e9
    rates = {
        "unique_tokens": tokens,
        "attention_share_of_forward": attention / (linears + adapter + attention),
        "train_tokens_per_s": tokens / opt_s,
        "train_matmul_ratio": train / opt_s / matmul,
        "train_linears_ratio": linear_passes * linears / opt_s / matmul,
    }
    if reference:  # none without a KL term (ppo.kl_coef 0): its timing is of an empty loop
        rates["reference_tokens_per_s"] = tokens / ref_s
        rates["reference_matmul_ratio"] = (linears + attention) / ref_s / matmul
        rates["reference_linears_ratio"] = linears / ref_s / matmul
    return rates


def best_limits(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The higher of each limit measured before and after the workload: what the machine showed
    it can do in this run. On the shared VM the same matmul measured 291-379 GFLOP/s from run to
    run, so one measurement could set a roofline the run's own work then beat or missed by far;
    the higher one keeps every ratio conservative."""
    return {key: max(before[key], after[key]) for key in before}


def run(preset: str, updates: int, threads: int, overrides: list[str]) -> dict:
    torch.set_num_threads(threads)
    before = machine_limits()
    cfg = load_config(preset, [*overrides, f"cluster.torch_threads={threads}"])
    path = resolve_model_path(cfg, progress=False)
    loop = LocalRun(cfg, path)  # the job's leases, intake and policy sends, in this process
    learner = loop.learner
    engine = loop.worker.engine
    assert isinstance(engine, HFEngine), "this benchmark reads the embedded engine's trace"
    engine.trace = []
    adapter_params = (
        sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
        if cfg.model.lora.enabled
        else 0
    )
    rollouts, learned = [], []
    for step in range(updates):
        start = time.perf_counter()
        intake = loop.next_batch(learner.version)
        seconds = time.perf_counter() - start
        generated = intake.budget.generated_tokens
        rollouts.append({"seconds": seconds, "generated_tokens": generated})
        trees = intake.trees
        metrics = learner.update(trees)
        metrics["actions"] = sum(len(n.action_ids) for t in trees for n in t.nodes)
        metrics["attention_pairs"] = attention_pairs(trees)
        metrics["adapter_params"] = adapter_params
        loop.publish(learner, trees, metrics)
        learned.append(metrics)
        print(
            f"update {step + 1}: rollout {seconds:.1f} s, {generated} tokens; "
            f"learner {metrics['timing/ref_logprobs'] + metrics['timing/optimize']:.1f} s"
        )
    limits = best_limits(before, machine_limits())
    sizes = model_sizes(engine)
    generated = sum(r["generated_tokens"] for r in rollouts)
    return {
        "preset": preset,
        "overrides": overrides,
        "threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "updates": updates,
        "prompts_per_update": cfg.train.prompts_per_step,
        "machine": limits,
        "machine_before": before,
        "model": sizes,
        "rollout": {
            "generated_tokens": generated,
            "seconds": sum(r["seconds"] for r in rollouts),
            "tokens_per_s": generated / sum(r["seconds"] for r in rollouts),
            "per_update": rollouts,
        },
        "decode": decode_ratios(engine.trace, sizes, limits),
        "prefill": prefill_rate(engine.trace, sizes, limits),
        "mixed": mixed_ratio(engine.trace, sizes, limits),
        # update 1 pays the one-time costs (ppo.compile_layers' compiles), so rates are of the rest
        "learner": learner_rates(learned[1:], sizes, limits, learner.reference),
        "learner_first_update_s": learned[0]["timing/ref_logprobs"] + learned[0]["timing/optimize"],
    }


def markdown(r: dict) -> str:
    m, ro, pf, le = r["machine"], r["rollout"], r["prefill"], r["learner"]
    lines = [
        f"# {r['preset']}: the real-model loop against the machine's limits",
        "",
        f"{r['updates']} updates of {r['prompts_per_update']} prompts, {r['threads']} torch threads"
        f"{', ' + ' '.join(r['overrides']) if r['overrides'] else ''}, OpenMP "
        f"{r['omp_wait_policy']} with spin count {r.get('gomp_spincount')} (as the job's). "
        f"Machine, measured in the same run, before and after the workload, the higher of the "
        f"two: read {m['read_gb_s']:.1f} GB/s, copy {m['copy_gb_s']:.1f} GB/s, float32 matmul "
        f"{m['matmul_gflop_s']:.0f} GFLOP/s (torch's own {m['matmul_torch_gflop_s']:.0f}, oneDNN "
        f"prepacked {m.get('matmul_onednn_gflop_s', float('nan')):.0f}; the better is the "
        f"roofline; before the workload: {r['machine_before']['matmul_gflop_s']:.0f}).",
        "A decode step's roofline is the slower of reading all weights and the rows' KV once "
        "and its matmuls at the matmul roofline.",
        "",
        "| figure | measured | against the limit |",
        "|---|---|---|",
        f"| rollout, generated tokens/s | {ro['tokens_per_s']:.1f} | — |",
        f"| prefill tokens/s | {pf['tokens_per_s']:.0f} | {pf['matmul_ratio']:.2f} of the matmul roofline |",
    ]
    for bucket, d in r["decode"].items():
        lines.append(
            f"| decode step, batch {bucket} (median {d['median_rows']:.0f} rows, "
            f"{d['median_context']:.0f} KV tokens; {d['steps']} steps) | {d['median_ms']:.1f} ms "
            f"| {d['roofline_ratio']:.2f}x the roofline ({d['memory_roofline_ratio']:.2f}x the "
            f"memory roofline; matmuls bind {d['matmul_bound_share']:.0%} of steps) |"
        )
    if mx := r.get("mixed"):
        lines.append(
            f"| mixed step: decoding rows and joining prefixes (median {mx['median_rows']:.0f} "
            f"rows, {mx['median_tokens']:.0f} tokens; {mx['steps']} steps) | "
            f"{mx['median_ms']:.1f} ms | {mx['roofline_ratio']:.2f}x the roofline |"
        )
    if "reference_tokens_per_s" in le:
        lines.append(
            f"| learner reference pass, unique tokens/s | {le['reference_tokens_per_s']:.0f} "
            f"| {le['reference_matmul_ratio']:.2f} of the matmul roofline "
            f"({le['reference_linears_ratio']:.2f} counting the linears only) |"
        )
    lines += [
        f"| learner forward + backward, unique tokens/s | {le['train_tokens_per_s']:.0f} "
        f"| {le['train_matmul_ratio']:.2f} of the matmul roofline "
        f"({le['train_linears_ratio']:.2f} counting the linears only) |",
        "",
        f"Learner rates over updates 2-{r['updates']}, every matmul a pass needs counted "
        f"(attention's visible pairs {le['attention_share_of_forward']:.1%} of a forward's "
        f"FLOPs); update 1's learner took {r['learner_first_update_s']:.1f} s (one-time costs "
        "included).",
        "",
    ]
    return "\n".join(lines)


def as_the_jobs_run(preset: str, overrides: list[str]) -> None:
    """Run again in a new process whose OpenMP environment is the one the job's rollout worker
    and learner get (``JobConfig.omp_env``), unless this one has it already."""
    env = load_config(preset, overrides).omp_env()
    if any(os.environ.get(key) != value for key, value in env.items()):
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **env})


def write_results(out: Path, result: dict, markdown: Callable[[dict], str]) -> None:
    """``result`` as ``out/results.json`` and its table as ``out/results.md``, which is printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(markdown(result))
    print(markdown(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m-search-qa")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default="benchmarks/results/realmodel_loop")
    args = parser.parse_args()
    if args.updates < 2:
        parser.error("--updates must be at least 2: the learner's rates leave out update 1")
    as_the_jobs_run(args.preset, args.set)
    write_results(Path(args.out), run(args.preset, args.updates, args.threads, args.set), markdown)


if __name__ == "__main__":
    main()
