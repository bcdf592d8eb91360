"""A model's linear layers through oneDNN with prepacked weights, on CPU.

torch's float32 ``F.linear`` on CPU calls MKL's SGEMM, and MKL runs its AVX2 kernels on AMD
CPUs even where AVX-512 is there. oneDNN, which torch also ships, uses AVX-512 and reads a
weight reordered once into its blocked layout. Measured on this project's 2-core AMD (Zen,
AVX-512) machine, SmolLM2-135M's layer shapes, 2 threads: 16 rows 53 -> 87-107 GFLOP/s, 512
rows ~165 -> 350 GFLOP/s, the 49152 x 576 LM head at one row 15 -> 39 GB/s (the read
bandwidth). Inductor's CPU weight freezing does the same through a compile; this does it to an
eager model, for the embedded engine (inference) and for the learner's frozen layers (a LoRA
policy's base weights, whose input gradient goes through a packed transpose).

A oneDNN call costs ~0.1 ms beyond its arithmetic here, which at decode batches of a few rows
is as much as streaming a 576 x 1536 weight; so for inference the layers that read the same
input (an attention layer's q, k and v projections, an MLP's gate and up projections: Llama and
Qwen2 call them one after another on the same tensor) are packed as one matrix, computed once
by the first call and handed out in slices (``_Fused``): 4 calls a decoder layer instead of 7.

For inference, a forward of at most ``MOST_ROWS`` rows (a decode step) can go through
``treegrpo_ray.kernels.small_rows_linear`` instead, from a third copy of each weight in that
kernel's blocks: on AVX2-only CPUs oneDNN streams the weights at about half the memory's rate
at those rows.

The packed weights are copies (the model keeps its own, for state dicts and adapters): one per
layer for inference (two with the small-rows kernel), two with gradients. Pack again after the
weights change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from treegrpo_ray.kernels.small_rows_linear import MOST_ROWS, SmallRowsKernel

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Sibling projections that read their parent's same input tensor (Llama / Qwen2 names).
FUSED_ROLES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def onednn_available(device: torch.device) -> bool:
    """Whether ``OneDNNLinears`` can run on ``device``: a CPU and a torch built with oneDNN."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` with W packed: x (..., in) -> (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _frozen(layer: torch.nn.Linear) -> bool:
    return not layer.weight.requires_grad and (layer.bias is None or not layer.bias.requires_grad)


def _callers(model: torch.nn.Module) -> dict[torch.nn.Linear, torch.nn.Module]:
    """The merged LoRA wrappers of ``model``'s linear layers, by layer: peft's wrapper of a
    merged adapter computes its base layer alone, through a Python forward of its own (210
    calls a decode step of the SmolLM2 preset's policy), so inference overrides the wrapper's
    forward instead of the layer's."""
    callers: dict[torch.nn.Linear, torch.nn.Module] = {}
    for module in model.modules():
        layer = getattr(module, "base_layer", None)
        if type(layer) is torch.nn.Linear and getattr(module, "merged", False):
            callers[layer] = module
    return callers


class OneDNNLinears:
    """oneDNN-packed copies of a model's ``nn.Linear`` weights; within ``active()`` the layers
    compute with them.

    model: any module on the CPU; its plain ``nn.Linear`` layers with float32 or bfloat16
    weights are packed (peft's LoRA wrappers call their base layer, which is one).
    batch_hint: the rows a forward usually has (oneDNN picks the layout for it; any number of
    rows works). gradients: whether inputs need gradients through the layers (training); then
    only frozen layers are packed (weights and bias without ``requires_grad``), each with its
    transpose for the backward, and the others keep torch's path. small_rows: without
    gradients, the kernel that computes forwards of at most ``MOST_ROWS`` rows (None: oneDNN
    computes them all).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        batch_hint: int = 16,
        gradients: bool = False,
        small_rows: SmallRowsKernel | None = None,
    ):
        self.small_rows = small_rows
        self.forwards: dict[torch.nn.Linear, Any] = {}
        self.frozen: dict[torch.nn.Linear, tuple[torch.Tensor, torch.Tensor]] = {}
        self.groups: dict[tuple[torch.nn.Linear, ...], _Fused] = {}
        self.callers: dict[torch.nn.Linear, torch.nn.Module] = {}
        layers = {
            name: layer
            for name, layer in model.named_modules()
            if type(layer) is torch.nn.Linear and layer.weight.dtype in PACKABLE_DTYPES
        }
        if not gradients:
            self._fuse(layers, batch_hint)
            self.callers = _callers(model)
        for layer in layers.values():
            if layer in self.forwards:  # a fused group's member
                continue
            bias = None if layer.bias is None else layer.bias.detach()
            if not gradients:
                self.forwards[layer] = _Inference(layer.weight, bias, batch_hint, small_rows)
            elif _frozen(layer):
                self.frozen[layer] = (
                    _pack(layer.weight, batch_hint),
                    _pack(layer.weight.t(), batch_hint),
                )

    def _fuse(self, layers: dict[str, torch.nn.Linear], batch_hint: int) -> None:
        """Pack each group of ``FUSED_ROLES`` siblings as one matrix (``_Fused``)."""
        by_role: dict[tuple[str, str], torch.nn.Linear] = {}
        for name, layer in layers.items():
            parent, _, role = name.removesuffix(".base_layer").rpartition(".")
            by_role[parent, role] = layer
        for parent in {parent for parent, _ in by_role}:
            for roles in FUSED_ROLES:
                members = [by_role[parent, r] for r in roles if (parent, r) in by_role]
                if len(members) < len(roles):
                    continue
                group = _Fused(members, batch_hint, self.small_rows)
                self.groups[tuple(members)] = group
                for i, member in enumerate(members):
                    self.forwards[member] = group.member(i)

    def computing(self, *layers: torch.nn.Linear) -> _Inference | None:
        """Without gradients, the forward that computes ``layers`` at once, their outputs side by
        side in this order: one packed layer's, or a packed sibling group's (``FUSED_ROLES``);
        None where they are not packed so. x (..., in) -> (..., sum of outs)."""
        if len(layers) > 1:
            group = self.groups.get(layers)
            return None if group is None else group.linear
        forward = self.forwards.get(layers[0])
        return forward if isinstance(forward, _Inference) else None

    @staticmethod
    def active_if(linears: OneDNNLinears | None) -> contextlib.AbstractContextManager[None]:
        """``linears.active()``, or nothing to do where a model keeps torch's path (None)."""
        return linears.active() if linears is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, each packed layer computes through its packed copy."""
        for layer, forward in self.forwards.items():
            # an instance override, on the module its parent calls
            self.callers.get(layer, layer).forward = forward  # type: ignore[method-assign]
        for layer, packs in self.frozen.items():
            layer.__class__ = _FrozenPackedLinear
            _FROZEN[_key(layer.weight)] = packs
        try:
            yield
        finally:
            for layer in self.forwards:
                del self.callers.get(layer, layer).forward  # back to the class's own forward
            for layer in self.frozen:
                layer.__class__ = torch.nn.Linear
                del _FROZEN[_key(layer.weight)]
            for group in self.groups.values():
                group.forget()


class _Inference:
    """A layer's forward without gradients: oneDNN's packed copy of ``weight`` (out, in), and
    where ``small_rows`` is given and can take it, the kernel's blocked copy for forwards of at
    most ``MOST_ROWS`` rows."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        batch_hint: int,
        small_rows: SmallRowsKernel | None,
    ):
        self.packed, self.bias = _pack(weight, batch_hint), bias
        self.small_rows = small_rows if small_rows and small_rows.blockable(weight) else None
        self.blocked = self.small_rows.block(weight) if self.small_rows else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        few_rows = x.numel() <= MOST_ROWS * x.shape[-1] and x.dtype == torch.float32
        if few_rows and self.small_rows and self.blocked is not None:
            return self.small_rows.linear(x, self.blocked, self.bias)
        return _linear(x, self.packed, self.bias)


class _Fused:
    """Sibling layers that read the same input, packed as one matrix: a member's call on the
    input the group last computed returns its slice of that output (``(..., out_i)``, a view);
    on any other input the group computes the whole output first. The last member's call drops
    the output, so nothing is held between one parent's calls and the next's."""

    def __init__(
        self,
        layers: list[torch.nn.Linear],
        batch_hint: int,
        small_rows: SmallRowsKernel | None,
    ):
        weight = torch.cat([layer.weight.detach() for layer in layers])
        bias = None
        if any(layer.bias is not None for layer in layers):
            bias = torch.cat(
                [
                    layer.bias.detach()
                    if layer.bias is not None
                    else weight.new_zeros(len(layer.weight))
                    for layer in layers
                ]
            )
        self.linear = _Inference(weight, bias, batch_hint, small_rows)
        ends = torch.tensor([len(layer.weight) for layer in layers]).cumsum(0).tolist()
        self.bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def member(self, index: int) -> Any:
        """The forward of the group's ``index``-th layer."""
        return lambda x: self._slice(x, index)

    def _slice(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._input or self._output is None:
            self._input, self._output = x, self.linear(x)
        start, stop = self.bounds[index]
        out = self._output[..., start:stop]
        if index == len(self.bounds) - 1:
            self.forget()
        return out

    def forget(self) -> None:
        self._input = self._output = None


class _FrozenPackedLinear(torch.nn.Linear):
    """A frozen layer within ``active()``: its forward reads the packed copies, its input gradient
    flows (``grad_x = grad_y @ W``, from the packed transpose). The matmuls are opaque ops
    (``treegrpo::frozen_linear``) that find the copies by the weight's storage, so
    ``torch.compile`` traces a layer of this class as a weight input and one op: a compiled
    decoder layer's graph serves every layer (``ppo.compile_layers``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = frozen_linear(x, self.weight)
        return out if self.bias is None else out + self.bias


# The packed copies (weight, transpose) of the frozen layers of the active ``OneDNNLinears``, by
# their weight's storage address.
_FROZEN: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _key(weight: torch.Tensor) -> int:
    return (
        weight.untyped_storage().data_ptr() + int(weight.storage_offset()) * weight.element_size()
    )


@torch.library.custom_op("treegrpo::frozen_linear", mutates_args=())
def frozen_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` from the packed copy of a frozen ``weight``: x (..., in) -> (..., out)."""
    return _linear(x, _FROZEN[_key(weight)][0], None)


@torch.library.custom_op("treegrpo::frozen_linear_input_grad", mutates_args=())
def frozen_linear_input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad @ weight`` from the packed transpose: grad (..., out) -> (..., in)."""
    return _linear(grad.contiguous(), _FROZEN[_key(weight)][1], None)


@frozen_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@frozen_linear_input_grad.register_fake
def _(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad.new_empty((*grad.shape[:-1], weight.shape[1]))


def _save_weight(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: Any) -> None:
    ctx.weight = inputs[1]


def _input_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return frozen_linear_input_grad(grad, ctx.weight), None


frozen_linear.register_autograd(_input_grad, setup_context=_save_weight)
