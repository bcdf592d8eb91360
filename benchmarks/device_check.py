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
- ``plan_vs_peak`` and ``plan_vs_peak_1b`` (CUDA): ``Learner.update``'s peak CUDA memory, in
  steady state, against ``memory_plan.gpu_learner_plan``, over full / LoRA x activation
  checkpointing at 8k-token rows, bfloat16-mixed, for the 0.5B shape (which the plan's constants
  were fitted on) and Llama-3.2-1B's (which they were not).

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
from treegrpo_ray.config import TinyModelConfig
from treegrpo_ray.learners.forward import packed_logprobs
from treegrpo_ray.modeling import build_tiny_model, build_word_tokenizer
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
# the GPU presets' precision; the float32 and 2048-token cases of the first run agreed as well
PLAN_GRID = [
    ("bfloat16-mixed", lora, checkpointing, 8192)
    for lora in (False, True)
    for checkpointing in (False, True)
]
# a second shape, Llama-3.2-1B's (1.24B parameters), that the plan's constants were not fitted on
ONE_B = TinyModelConfig(
    hidden_size=2048,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    intermediate_size=8192,
    max_positions=32768,
)
ONE_B_VOCAB = 128256


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_row(size: int, device: torch.device) -> PackedBatch:
    """A packed batch of one row: as many whole trees as fit in ``size`` tokens."""
    kept, total = [], 0
    for tree in synthetic_trees(SHAPES["standard"], prompts=size // 100, seed=0):
        tokens = tree.token_count
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


def largest_row(trees: list, budget: int) -> tuple[int, float]:
    """Tokens of the largest packed row of ``trees`` and its share of action tokens."""
    batch = pack_trees(trees, budget, pad_token_id=0)
    row = max(range(batch.num_rows), key=batch.row_length)
    return batch.row_length(row), float(batch.loss_mask[row].sum()) / batch.row_length(row)


def plan_vs_peak(model, device: torch.device, grid: list[tuple]) -> dict:
    """Peak CUDA memory of ``Learner.update`` against ``memory_plan.gpu_learner_plan``, over
    ``grid`` (precision, LoRA, activation checkpointing, row budget): two updates from a fresh
    learner on trees of about four rows; the second is the steady state the plan describes
    (Adam's state exists while the rows run their backward). The plan is taken at the largest
    row's real length and action share (the formula's accuracy) and at the budget with the
    plan's default share (what ``treegrpo plan`` would say)."""
    from treegrpo_ray.config import load_config
    from treegrpo_ray.learners.learner import Learner
    from treegrpo_ray.memory_plan import ModelSizes, gpu_learner_plan

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        build_word_tokenizer([f"w{i}" for i in range(VOCAB - 3)], folder)
        for precision, lora, checkpointing, budget in grid:
            settings = [
                f"ppo.precision={precision}",
                f"ppo.activation_checkpointing={checkpointing}",
                f"model.lora.enabled={lora}",
            ]
            cfg = load_config("tiny-multihop", [*settings, f"ppo.micro_batch_tokens={budget}"])
            trees = synthetic_trees(SHAPES["standard"], prompts=4 * budget // 650, seed=2)
            tokens, share = largest_row(trees, budget)
            sizes = ModelSizes.of(model.config, cfg.model.lora)
            at_row = load_config("tiny-multihop", [*settings, f"ppo.micro_batch_tokens={tokens}"])
            plan = gpu_learner_plan(at_row, sizes, action_share=share)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()  # this benchmark's own copy of the model
            learner = Learner.from_config(cfg, folder, device=device)
            peaks = []
            for _ in range(2):
                torch.cuda.reset_peak_memory_stats()
                metrics = learner.update(trees)
                peaks.append(torch.cuda.max_memory_allocated() - before)
            del learner
            rows.append(
                {
                    "precision": precision,
                    "lora": lora,
                    "checkpointing": checkpointing,
                    "micro_batch_tokens": budget,
                    "largest_row_tokens": tokens,
                    "action_share": share,
                    "first_update_peak_bytes": peaks[0],
                    "peak_bytes": peaks[1],
                    "plan_bytes": plan.nbytes,
                    "plan_terms": {t.what: t.nbytes for t in plan.terms},
                    "plan_over_peak": plan.nbytes / peaks[1],
                    "plan_at_budget_bytes": gpu_learner_plan(cfg, sizes).nbytes,
                    "loss": metrics["learner/loss"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)  # a cut run still shows the rows it made
    return {"grid": rows, "target": "plan_over_peak within 0.8-1.2"}


def half_b_model(device: torch.device):
    """Qwen2.5-0.5B's shape, random weights, float32, training mode."""
    return _model(HALF_B, HALF_B_VOCAB, device)


def one_b_model(device: torch.device):
    """Llama-3.2-1B's shape (as a Qwen2), random weights, float32, training mode."""
    return _model(ONE_B, ONE_B_VOCAB, device)


def _model(shape: TinyModelConfig, vocab: int, device: torch.device):
    model = build_tiny_model(shape, vocab, seed=0).to(device)
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
            ("plan_vs_peak_1b", lambda: skipped),
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
        ("plan_vs_peak", lambda: plan_vs_peak(model, gpu, PLAN_GRID)),
        ("plan_vs_peak_1b", lambda: plan_vs_peak(one_b_model(gpu), gpu, PLAN_GRID)),
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
