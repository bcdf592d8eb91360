"""The device check's measurements (issue 30): what a GPU machine confirms, in one run.

``scripts/device-check.sh`` runs this after the gpu-marked tests; it writes ``device_check.json``
under ``--out`` after every section (a cut run keeps what it measured; a section that fails is
recorded with its error, and the next one runs).
Needs neither Ray nor vLLM. Trees are ``learner_packing``'s synthetic multi-hop trees; the loss is
its paper-mode PPO loss (``packed_step``).

- ``flex_vs_dense``: one packed row of about ``size`` tokens through the same model with the dense
  additive tree mask (``sdpa``) and with the flex block mask (``tree_flex``). On CUDA: a Qwen2 of
  Qwen2.5-0.5B's shape built from a config (random weights), bfloat16 autocast over float32
  weights (``ppo.precision: bfloat16-mixed``); loss, gradients (cosine, largest difference
  relative to the largest gradient), the memory forward + backward add above the weights and the
  median time of 3 (after a warm-up that compiles flex); then the attention alone (queries, keys
  and values of the model's head shape, mask creation included). On CPU: the tiny model's forward
  log-probs in float32 (flex has no backward on CPU).
- ``packed_vs_paths``: ``learner_packing``'s packed step against its path-expanded step on the
  same trees and model (CUDA: flex for the packed rows, sdpa for the padded paths), interleaved;
  the speedup against its limit, the ratio of the tokens the two arms forward.
- ``plan_vs_peak`` (CUDA): ``Learner.update`` of the 0.5B model (full fine-tuning,
  bfloat16-mixed, flex), with and without activation checkpointing: the peak CUDA memory against
  ``memory_plan.learner_plan``'s terms that live on the GPU (weights, trained state, reference,
  activations of one row; not the CPU runtime or oneDNN copies).

    python -m benchmarks.device_check [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from benchmarks.learner_packing import (
    SHAPES,
    VOCAB,
    interleaved_times,
    packed_step,
    path_step,
    synthetic_trees,
)
from treegrpo_ray.advantage import tree_grpo_advantages
from treegrpo_ray.learners.learner import packed_logprobs
from treegrpo_ray.modeling import TinyModelConfig, build_tiny_model, build_word_tokenizer
from treegrpo_ray.packing import PackedBatch, expand_paths, pack_trees
from treegrpo_ray.tree_attention import TREE_FLEX, tree_flex_attention

# Qwen2.5-0.5B's shape (494M parameters with its 151,936-token vocabulary)
HALF_B = TinyModelConfig(
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    max_positions=32768,
)
HALF_B_VOCAB = 151936
GPU_SIZES = (4096, 16384)
CPU_SIZES = (1024, 2048)
PLAN_GRID = [
    (precision, lora, checkpointing, tokens)
    for precision in ("bfloat16-mixed", "float32")
    for lora in (False, True)
    for checkpointing in (False, True)
    for tokens in (2048, 8192)
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_row(size: int, device: torch.device) -> PackedBatch:
    """A packed batch of one row: as many whole trees as fit in ``size`` tokens."""
    kept, total = [], 0
    for tree in synthetic_trees(SHAPES["standard"], prompts=size // 100, seed=0):
        tokens = len(tree.prompt_ids) + sum(node.token_count for node in tree.nodes)
        if total + tokens > size:
            break
        kept.append(tree)
        total += tokens
    return pack_trees(kept, size, pad_token_id=0).to(device)


def _forward_backward(model, batch: PackedBatch, mixed: bool) -> float:
    """The packed paper-mode step on ``batch`` (bfloat16 autocast if ``mixed``); the loss."""
    advantages = tree_grpo_advantages(batch.rewards, batch.tree_ids, batch.group_ids)
    mask_dtype = torch.bfloat16 if mixed else None
    with torch.autocast(batch.input_ids.device.type, torch.bfloat16, enabled=mixed):
        return packed_step(model, batch, advantages, mask_dtype)


def _added_peak(device: torch.device, fn: Callable[[], object]) -> tuple[object, int]:
    """``fn()`` and the most CUDA memory it held above what was allocated before it."""
    _sync(device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    _sync(device)
    return out, torch.cuda.max_memory_allocated() - base


def _median_time(device: torch.device, fn: Callable[[], object], reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def flex_vs_dense_cpu(size: int) -> dict:
    """Forward log-probs of the tiny model, dense mask against block mask, float32."""
    model = build_tiny_model(TinyModelConfig(), VOCAB, seed=0).eval()
    batch = one_row(size, torch.device("cpu"))
    out = {}
    for attention in ("sdpa", TREE_FLEX):
        model.set_attn_implementation(attention)
        with torch.no_grad():
            out[attention] = packed_logprobs(model, batch, 0)[0]
    return {
        "tokens": batch.row_length(0),
        "logprob_max_abs_diff": float((out["sdpa"] - out[TREE_FLEX]).abs().max()),
        "target": "<= 1e-5",
    }


def _gradients(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def flex_vs_dense_cuda(model, size: int, device: torch.device) -> dict:
    batch = one_row(size, device)
    arms = {}
    for attention in ("sdpa", TREE_FLEX):
        model.set_attn_implementation(attention)
        model.zero_grad(set_to_none=True)
        _forward_backward(model, batch, mixed=True)  # warm-up (flex compiles here)
        model.zero_grad(set_to_none=True)
        loss, added = _added_peak(device, lambda: _forward_backward(model, batch, mixed=True))
        grads = _gradients(model)
        seconds = _median_time(device, lambda: _forward_backward(model, batch, mixed=True))
        arms[attention] = {"loss": loss, "added_peak_bytes": added, "seconds": seconds}
        arms[attention]["grads"] = grads
    dense, flex = arms["sdpa"], arms[TREE_FLEX]
    cosine = torch.nn.functional.cosine_similarity(dense["grads"], flex["grads"], dim=0)
    largest = float(dense["grads"].abs().max())
    worst = float((dense["grads"] - flex["grads"]).abs().max())
    for arm in arms.values():
        del arm["grads"]
    model.zero_grad(set_to_none=True)
    return {
        "tokens": batch.row_length(0),
        "dense": dense,
        "flex": flex,
        "loss_abs_diff": abs(dense["loss"] - flex["loss"]),
        "grad_cosine": float(cosine),
        "grad_max_diff_over_max_grad": worst / largest,
        "model_memory_ratio": dense["added_peak_bytes"] / max(flex["added_peak_bytes"], 1),
        "speedup": dense["seconds"] / flex["seconds"],
        "attention_alone": attention_alone(model.config, batch, device),
    }


def attention_alone(config, batch: PackedBatch, device: torch.device) -> dict:
    """The memory and time one attention call adds, forward + backward, bfloat16, mask made
    inside; the dense arm repeats keys and values per query head, as transformers' sdpa path
    does under a mask."""
    n = batch.row_length(0)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads

    def tensor(h: int) -> torch.Tensor:
        return torch.randn(1, h, n, dim, device=device, dtype=torch.bfloat16, requires_grad=True)

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)

    def dense():
        bias = batch.attention_bias(0, torch.bfloat16)
        kk, vv = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=bias)
        out.float().sum().backward()

    def flex():
        out, _ = tree_flex_attention(None, q, k, v, batch.flex_block_mask(0))
        out.float().sum().backward()

    result = {}
    for name, fn in (("dense", dense), ("flex", flex)):
        fn()  # warm-up
        _, added = _added_peak(device, fn)
        result[name] = {"added_peak_bytes": added, "seconds": _median_time(device, fn)}
    result["memory_ratio"] = (
        result["dense"]["added_peak_bytes"] / result["flex"]["added_peak_bytes"]
    )
    result["target"] = "memory_ratio >= 3 at 16k tokens"
    return result


def packed_vs_paths(model, device: torch.device, budget: int, reps: int) -> dict:
    trees = synthetic_trees(SHAPES["standard"], prompts=max(2, budget // 300), seed=1)
    packed = pack_trees(trees, budget, pad_token_id=0).to(device)
    paths = expand_paths(trees, pad_token_id=0).to(device)
    advantages = tree_grpo_advantages(paths.rewards, paths.tree_ids, paths.group_ids)
    mixed = device.type == "cuda"
    flex = TREE_FLEX if mixed else "sdpa"

    def packed_arm():
        model.set_attn_implementation(flex)
        with torch.autocast(device.type, torch.bfloat16, enabled=mixed):
            packed_step(model, packed, advantages, torch.bfloat16 if mixed else None)
        _sync(device)

    def path_arm():
        model.set_attn_implementation("sdpa")
        with torch.autocast(device.type, torch.bfloat16, enabled=mixed):
            forwarded = path_step(model, paths, advantages, budget)[1]
        _sync(device)
        return forwarded

    packed_arm()
    path_forwarded = path_arm()  # warm-ups
    packed_times, path_times = interleaved_times([packed_arm, path_arm], reps)
    model.zero_grad(set_to_none=True)
    packed_forwarded = sum(packed.row_length(r) for r in range(packed.num_rows))
    speedup = statistics.median(path_times) / statistics.median(packed_times)
    limit = path_forwarded / packed_forwarded
    return {
        "budget": budget,
        "trees": len(trees),
        "packed_forwarded": packed_forwarded,
        "path_forwarded": path_forwarded,
        "packed_s": statistics.median(packed_times),
        "path_s": statistics.median(path_times),
        "speedup": speedup,
        "token_ratio_limit": limit,
        "share_of_limit": speedup / limit,
    }


def plan_vs_peak(model, device: torch.device) -> dict:
    """Peak CUDA memory of ``Learner.update`` against the plan's GPU-side terms, over the grid
    ``PLAN_GRID`` (precision x LoRA x activation checkpointing x row tokens): one update each on
    trees of twice the row budget (two rows), from a fresh learner."""
    from treegrpo_ray.config import load_config
    from treegrpo_ray.learners.learner import Learner
    from treegrpo_ray.memory_plan import ModelSizes, learner_plan

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        build_word_tokenizer([f"w{i}" for i in range(VOCAB - 3)], folder)
        for precision, lora, checkpointing, tokens in PLAN_GRID:
            cfg = load_config(
                "tiny-multihop",
                [
                    f"ppo.micro_batch_tokens={tokens}",
                    f"ppo.precision={precision}",
                    f"ppo.activation_checkpointing={checkpointing}",
                    f"model.lora.enabled={lora}",
                ],
            )
            trees = synthetic_trees(SHAPES["standard"], prompts=2 * tokens // 330, seed=2)
            plan = learner_plan(cfg, ModelSizes.of(model.config, cfg.model.lora), 1)
            skip = ("runtime", "oneDNN")
            on_gpu = {t.what: t.nbytes for t in plan.terms if not t.what.startswith(skip)}
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()  # this benchmark's own copy of the model
            learner = Learner.from_config(cfg, folder, device=device)
            static = torch.cuda.memory_allocated() - before
            torch.cuda.reset_peak_memory_stats()
            metrics = learner.update(trees)
            peak = torch.cuda.max_memory_allocated() - before
            after = torch.cuda.memory_allocated() - before
            del learner
            rows.append(
                {
                    "precision": precision,
                    "lora": lora,
                    "checkpointing": checkpointing,
                    "micro_batch_tokens": tokens,
                    "tokens": metrics["learner/tokens"],
                    "tokens_forwarded": metrics["learner/tokens_forwarded"],
                    "static_bytes": static,
                    "after_update_bytes": after,
                    "peak_bytes": peak,
                    "plan_bytes": sum(on_gpu.values()),
                    "plan_terms": on_gpu,
                    "plan_over_peak": sum(on_gpu.values()) / peak,
                    "loss": metrics["learner/loss"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)  # a cut run still shows the rows it made
    return {"grid": rows, "target": "plan_over_peak within 0.8-1.2"}


def half_b_model(device: torch.device):
    """Qwen2.5-0.5B's shape, random weights, float32, training mode."""
    model = build_tiny_model(HALF_B, HALF_B_VOCAB, seed=0).to(device)
    model.config.use_cache = False
    return model.train()


def sections(cuda: bool) -> list[tuple[str, Callable[[], object]]]:
    """(name, measurement) in the order they run; without CUDA the CUDA ones say why not."""
    if not cuda:
        skipped = {"skipped": "no CUDA device: this part needs a GPU (run the check on one)"}
        tiny = build_tiny_model(TinyModelConfig(), VOCAB, seed=0).train()
        cpu = torch.device("cpu")
        return [
            ("flex_vs_dense", lambda: {str(s): flex_vs_dense_cpu(s) for s in CPU_SIZES}),
            ("packed_vs_paths", lambda: packed_vs_paths(tiny, cpu, budget=1024, reps=3)),
            ("flex_vs_dense_cuda", lambda: skipped),
            ("plan_vs_peak", lambda: skipped),
        ]
    gpu = torch.device("cuda")
    model = half_b_model(gpu)
    return [
        ("flex_vs_dense", lambda: flex_vs_dense_cpu(CPU_SIZES[-1])),
        (
            "flex_vs_dense_cuda",
            lambda: {str(s): flex_vs_dense_cuda(model, s, gpu) for s in GPU_SIZES},
        ),
        ("packed_vs_paths", lambda: packed_vs_paths(model, gpu, budget=4096, reps=3)),
        ("plan_vs_peak", lambda: plan_vs_peak(model, gpu)),
    ]


def run(out: Path, only: list[str] | None = None) -> bool:
    """Every section (or those named in ``only``), each written as soon as it ends; a failing one
    is recorded with its error and the next runs. True when none failed."""
    cuda = torch.cuda.is_available()
    report: dict = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    passed = True
    for name, measure in sections(cuda):
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            report[name] = measure()
        except Exception as error:  # recorded; the other sections still run
            report[name] = {"error": "".join(traceback.format_exception(error)[-8:])}
            passed = False
        report[name + "_seconds"] = time.perf_counter() - start
        print(json.dumps({name: report[name]}, default=str), flush=True)
        (out / "device_check.json").write_text(json.dumps(report, indent=2, default=str))
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/device-check")
    parser.add_argument("--only", nargs="+", help="Run only these sections (default: all).")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not run(out, args.only):
        raise SystemExit(f"device check: a section failed, see {out / 'device_check.json'}")


if __name__ == "__main__":
    main()
