"""A model's linear layers through oneDNN with prepacked weights, for inference on CPU.

torch's float32 ``F.linear`` on CPU calls MKL's SGEMM, and MKL runs its AVX2 kernels on AMD
CPUs even where AVX-512 is there. oneDNN, which torch also ships, uses AVX-512 and reads a
weight reordered once into its blocked layout. Measured on this project's 2-core AMD (Zen,
AVX-512) machine, SmolLM2-135M's layer shapes, 2 threads: 16 rows 53 -> 87-107 GFLOP/s, 512
rows ~165 -> 350 GFLOP/s, the 49152 x 576 LM head at one row 15 -> 39 GB/s (the copy
bandwidth). Inductor's CPU weight freezing does the same, through a compile; this does it to an
eager model. The packed weights are a second copy of every linear weight (the model keeps its
own, for state dicts and adapters), so ``pack`` again after the weights change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available(device: torch.device) -> bool:
    """Whether ``PackedLinears`` can run on ``device``: a CPU and a torch built with oneDNN."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinears:
    """oneDNN-packed copies of a model's ``nn.Linear`` weights; within ``active()`` the
    layers compute with them.

    model: any module on the CPU; its plain ``nn.Linear`` layers with float32 or bfloat16
    weights are packed (peft's LoRA wrappers call their base layer, which is one; their
    adapter layers are packed too, and unused once merged). batch_hint: the rows a forward
    usually has (oneDNN picks the layout for it; any number of rows still works).
    """

    def __init__(self, model: torch.nn.Module, batch_hint: int = 16):
        self.packed = {
            layer: torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), batch_hint)
            for layer in model.modules()
            if type(layer) is torch.nn.Linear and layer.weight.dtype in PACKABLE_DTYPES
        }

    @property
    def nbytes(self) -> int:
        """Bytes the packed copies take (their dense sizes; oneDNN's padding aside)."""
        return sum(layer.weight.nbytes for layer in self.packed)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, each packed layer's forward is ``packed_linear`` on its copy."""
        for layer, weight in self.packed.items():
            layer.forward = _PackedForward(weight, layer.bias)
        try:
            yield
        finally:
            for layer in self.packed:
                del layer.forward  # back to the class's own forward


class _PackedForward:
    """``x @ W.T + b`` through oneDNN with W prepacked: x (..., in) -> (..., out)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
