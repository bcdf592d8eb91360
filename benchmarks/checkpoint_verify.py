"""What verifying a checkpoint adds to a resume: ``check_checkpoint`` against ``load_checkpoint``
(issue 33: verifying must add <= 10% to the time a resume takes to load the checkpoint).

Checkpoints as the learners write them after one optimizer step (so with Adam's state) for:
the tiny preset (full fine-tuning), the SmolLM2 preset (its LoRA adapter, rank 16) and SmolLM2
with full fine-tuning (the largest here); SmolLM2-135M's architecture (a Llama) with random
weights. For each, interleaved for ``--reps`` repetitions (median): the load, the verification
against the manifest (XXH3-64 over memory-mapped pages, format 2), and the CRC-32 of format 1 for
comparison. The files are in the page cache for all three (just written; what a resume on the
node that wrote them meets).

    python benchmarks/checkpoint_verify.py [--reps 5] [--out benchmarks/results/checkpoint_verify]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

import treegrpo_ray.learners.checkpoint as checkpoint
from treegrpo_ray.config import TinyModelConfig, load_config
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.modeling import build_tiny_model, build_word_tokenizer

SMOLLM2 = transformers.LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
CASES = {
    "tiny preset": ("tiny-multihop", lambda: build_tiny_model(TinyModelConfig(), 256, seed=0)),
    "SmolLM2 preset (LoRA)": (
        "smollm2-135m-search-qa",
        lambda: transformers.LlamaForCausalLM(SMOLLM2),
    ),
    "SmolLM2, full fine-tuning": (
        "smollm2-135m-search-qa:full",
        lambda: transformers.LlamaForCausalLM(SMOLLM2),
    ),
}


def write_checkpoint(preset: str, model: torch.nn.Module, folder: Path) -> Path:
    """The checkpoint a learner of ``preset`` writes after one step (``:full``: LoRA off)."""
    name, _, variant = preset.partition(":")
    overrides = ["model.path=" + str(folder / "policy"), "model.pretrained=null"]
    if variant == "full":
        overrides.append("model.lora.enabled=false")
    model.save_pretrained(folder / "policy")
    build_word_tokenizer([f"w{i}" for i in range(200)], folder / "policy")
    learner = Learner.from_config(load_config(name, overrides), str(folder / "policy"))
    for param in learner.model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    learner.optimizer.step()  # Adam's state, as in every checkpoint after the first update
    return checkpoint.save_checkpoint(learner.state_dict(), folder / "checkpoints")


def crc32_all(path: Path) -> None:
    for file in path.iterdir():
        checkpoint._crc32(file)


def measure(path: Path, reps: int) -> dict:
    arms = {
        "load": lambda: checkpoint.load_checkpoint(path),
        "verify": lambda: checkpoint.check_checkpoint(path),
        "crc32": lambda: crc32_all(path),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for fn in arms.values():
        fn()  # warm-up: the pages in the cache, the code paths loaded
    for _ in range(reps):
        for name, fn in arms.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "bytes": sum(f.stat().st_size for f in path.iterdir()),
        **{f"{name}_s": value for name, value in median.items()},
        "verify_over_load": median["verify"] / median["load"],
        "crc32_over_load": median["crc32"] / median["load"],
        "intact": checkpoint.check_checkpoint(path).intact,
        "times": times,
    }


def markdown(rows: dict[str, dict]) -> str:
    lines = [
        "| checkpoint | size | load | verify (XXH3, mmap) | verify / load | CRC-32 / load |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['bytes'] / 1e6:.1f} MB | {r['load_s'] * 1e3:.1f} ms | "
            f"{r['verify_s'] * 1e3:.1f} ms | **{r['verify_over_load']:.3f}** | "
            f"{r['crc32_over_load']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/checkpoint_verify")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, (preset, build) in CASES.items():
        with tempfile.TemporaryDirectory() as folder:
            torch.manual_seed(0)
            path = write_checkpoint(preset, build(), Path(folder))
            rows[name] = measure(path, args.reps)
        print(name, json.dumps({k: v for k, v in rows[name].items() if k != "times"}), flush=True)
        (out / "results.json").write_text(json.dumps({"reps": args.reps, "rows": rows}, indent=2))
        (out / "results.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
