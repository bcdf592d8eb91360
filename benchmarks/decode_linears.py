"""A decode step's linear layers alone, on each GEMM path this machine has, against its limits.

The embedded engine's decode step is bound below by its linears: every weight read once (the
memory roofline) or their matmuls at the machine's matmul throughput, whichever is slower. This
measures how close the GEMM libraries themselves come at the row counts a decode batch has, with
the preset's real weights: per decoder layer the four matrices the engine multiplies (q/k/v and
gate/up packed as one matrix each, as ``OneDNNLinears`` packs them, o and down), all layers
distinct as in the model, and the LM head. Paths:

- ``torch``: ``F.linear`` (MKL's SGEMM on x86);
- ``onednn``: oneDNN with weights prepacked for the row count (``torch.ops.mkldnn``), the
  engine's path;
- ``inductor``: ``torch.compile(mode="max-autotune")`` with weight freezing, inductor's C++ GEMM
  template (weights prepacked at compile time) against ATen, autotuned per shape;
- ``small_rows``: the project's kernel (``treegrpo_ray.kernels.small_rows_linear``), which the engine
  takes at most 16 rows.

Per row count: milliseconds for all the linears (median), the weights' bytes per second, GFLOP/s,
and the ratio to the linears' own roofline, the machine measured in the same run (read bandwidth
and matmul throughput, as ``realmodel_loop.py``). A decode step cannot come closer to its roofline
than its linears come to theirs.

    python -m benchmarks.decode_linears [--rows 1 3 8 16 32]
        [--paths torch onednn inductor small_rows] [--threads 2]
        [--out benchmarks/results/decode_linears]

Run it on an otherwise idle machine, with the preset's model prepared.
"""

from __future__ import annotations

from benchmarks.realmodel_loop import (
    as_the_jobs_run,
    machine_limits,
    median_seconds,
    write_results,
)

# isort: split
import argparse
from pathlib import Path

import torch

from treegrpo_ray.config import load_config
from treegrpo_ray.kernels.small_rows_linear import load_kernel
from treegrpo_ray.learners.policies import resolve_model_path
from treegrpo_ray.onednn_linear import _linear as packed_linear
from treegrpo_ray.onednn_linear import _pack as pack_weight

PATHS = ("torch", "onednn", "inductor", "small_rows")


def decode_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The matrices a decode step multiplies, (out, in) each: per layer q/k/v and gate/up packed,
    o and down, then the LM head."""
    weights = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights.append(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        weights.append(attn.o_proj.weight)
        weights.append(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        weights.append(mlp.down_proj.weight)
    weights.append(model.get_output_embeddings().weight)
    return [w.detach().contiguous() for w in weights]


class Linears(torch.nn.Module):
    """Each weight applied to an input of its own width: ``forward(inputs)`` -> outputs."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(w, requires_grad=False) for w in weights
        )

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.nn.functional.linear(x, w) for x, w in zip(inputs, self.weights, strict=True)]


def path_call(path: str, weights: list[torch.Tensor], rows: int):
    """A function computing every linear once at ``rows`` rows on ``path``."""
    inputs = [torch.randn(rows, w.shape[1]) for w in weights]
    if path == "torch":
        module = Linears(weights)
        return lambda: module(inputs)
    if path == "onednn":
        packed = [pack_weight(w, rows) for w in weights]
        return lambda: [packed_linear(x, w, None) for x, w in zip(inputs, packed, strict=True)]
    if path == "small_rows":
        kernel = load_kernel()
        if kernel is None:
            raise SystemExit("the small-rows kernel does not build here (its warning says why)")
        blocked = [kernel.block(w) for w in weights]
        return lambda: [kernel.linear(x, w, None) for x, w in zip(inputs, blocked, strict=True)]
    import torch._inductor.config as inductor

    inductor.freezing = True
    inductor.max_autotune_gemm_backends = "CPP,ATEN"
    compiled = torch.compile(Linears(weights).eval(), mode="max-autotune", dynamic=False)
    compiled(inputs)
    return lambda: compiled(inputs)


def measure(
    weights: list[torch.Tensor], rows: list[int], paths: list[str], limits: dict
) -> list[dict]:
    weight_bytes = sum(w.nbytes for w in weights)
    params = sum(w.numel() for w in weights)
    results = []
    for count in rows:
        flops = 2 * params * count
        roofline = max(
            weight_bytes / (limits["read_gb_s"] * 1e9), flops / (limits["matmul_gflop_s"] * 1e9)
        )
        for path in paths:
            with torch.no_grad():
                seconds = median_seconds(path_call(path, weights, count), 15)
            results.append(
                {
                    "rows": count,
                    "path": path,
                    "ms": seconds * 1e3,
                    "weight_gb_s": weight_bytes / seconds / 1e9,
                    "gflop_s": flops / seconds / 1e9,
                    "roofline_ms": roofline * 1e3,
                    "ratio": seconds / roofline,
                }
            )
            print(
                f"{count} rows, {path}: {seconds * 1e3:.1f} ms, {seconds / roofline:.2f}x",
                flush=True,
            )
    return results


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# A decode step's linear layers alone, against the machine's limits",
        "",
        f"{result['preset']}'s weights ({result['weight_bytes'] / 1e6:.0f} MB: per layer q/k/v and "
        f"gate/up packed, o, down; the LM head), {result['threads']} torch threads. Machine, same "
        f"run: read {m['read_gb_s']:.1f} GB/s, float32 matmul {m['matmul_gflop_s']:.0f} GFLOP/s.",
        "",
        "| rows | path | ms | weights GB/s | GFLOP/s | against the linears' roofline |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['rows']} | {r['path']} | {r['ms']:.1f} | {r['weight_gb_s']:.1f} | {r['gflop_s']:.0f} "
        f"| {r['ratio']:.2f}x (roofline {r['roofline_ms']:.1f} ms) |"
        for r in result["results"]
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m-search-qa")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 8, 16, 32])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/decode_linears")
    args = parser.parse_args()
    as_the_jobs_run(args.preset, [])
    torch.set_num_threads(args.threads)
    cfg = load_config(args.preset, [])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(cfg, progress=False), dtype=torch.float32
    )
    weights = decode_weights(model)
    limits = machine_limits()
    result = {
        "preset": args.preset,
        "threads": args.threads,
        "machine": limits,
        "weight_bytes": sum(w.nbytes for w in weights),
        "results": measure(weights, args.rows, args.paths, limits),
    }
    write_results(Path(args.out), result, markdown)


if __name__ == "__main__":
    main()
