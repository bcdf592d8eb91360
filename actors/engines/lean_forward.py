"""The engine's forwards of a Llama-family model without the model's own forward.

At a decode step of a few rows, the SmolLM2 preset's forward spent as long in ~1,300 small torch
operations and transformers' Python (views, copies, norms, the rotary embedding, the cache's
bookkeeping) as in streaming the weights (README, "A lean forward"). ``LeanForward`` runs the
same arithmetic from the engine's own pieces: the packed linears (``OneDNNLinears``, q/k/v and
gate/up as one matrix each), the slot KV buffers (``SlotKV``) with the slot attention kernel,
and ``decoder_ops`` for the norms, the rotary embedding with the KV write and SiLU. Per layer:
4 linears, the attention, 3 small ops.

A forward's tokens are packed as ``SlotKV.begin`` places them (a decoding row's one token, a
joining row's uncached prefix): every token is a query row of the attention kernel over its own
slot's columns up to its own, so decode, mixed and prefill steps are one path. It takes Llama
and Qwen2 models (``LeanForward.build`` says why not, and the engine keeps the model's forward):
the model's rotary embedding module computes cos and sin, so its RoPE scaling is the model's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from treegrpo_ray.actors.engines.slot_kv import SlotKV, token_places
from treegrpo_ray.kernels.decode_attention import DecodeAttentionKernel
from treegrpo_ray.kernels.decoder_ops import DecoderOpsKernel
from treegrpo_ray.onednn_linear import OneDNNLinears

logger = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "qwen2")  # decoder layers as LlamaDecoderLayer computes them
Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights as the lean forward reads them; eps: its norms' epsilon."""

    input_norm: torch.Tensor
    qkv: Linear
    output: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    eps: float


def _base(layer: Any) -> torch.nn.Linear:
    """The linear layer itself under a (merged) LoRA wrapper."""
    return getattr(layer, "base_layer", layer)


def _refusal(model: Any, linears: OneDNNLinears | None, kv: SlotKV) -> str | None:
    """Why the lean forward cannot run ``model`` (None: it can)."""
    config = model.config
    if config.model_type not in MODEL_TYPES:
        return f"model type {config.model_type!r} (it takes {', '.join(MODEL_TYPES)})"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r} (it takes silu)"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return "sliding-window layers"
    if model.dtype != torch.float32 or model.device.type != "cpu":
        return f"{model.dtype} on {model.device} (it takes float32 on the CPU)"
    if kv.decode_kernel is None:
        return "no slot attention kernel (engine.decode_attention_kernel)"
    if linears is None:
        return "linear layers not packed (engine.onednn_linears)"
    return None


class LeanForward:
    """Packed forwards of ``model`` over ``kv``'s slots. Build with ``build``; build again after
    the weights or the linears change."""

    def __init__(
        self,
        model: Any,
        layers: list[_Layer],
        head: Linear,
        kv: SlotKV,
        ops: DecoderOpsKernel,
        attention: DecodeAttentionKernel,
    ):
        decoder = model.model
        self.embedding = decoder.embed_tokens.weight
        self.rotary = decoder.rotary_emb
        self.norm, self.norm_eps = decoder.norm.weight, decoder.norm.variance_epsilon
        self.scale = decoder.layers[0].self_attn.scaling
        self.layers, self.head = layers, head
        self.kv, self.ops, self.attention = kv, ops, attention

    @classmethod
    def build(
        cls,
        model: Any,
        linears: OneDNNLinears | None,
        kv: SlotKV,
        ops: DecoderOpsKernel | None,
    ) -> LeanForward | None:
        """The lean forward of ``model`` (a causal LM, or peft's model of one with its adapter
        merged), or None, with the reason logged, where it cannot run it."""
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        refusal = "no decoder_ops kernel" if ops is None else _refusal(model, linears, kv)
        if refusal is None:
            assert ops is not None and linears is not None and kv.decode_kernel is not None
            layers = [_layer(block, linears) for block in model.model.layers]
            head = linears.computing(_base(model.lm_head))
            if head is not None and all(layers):
                return cls(model, layers, head, kv, ops, kv.decode_kernel)  # type: ignore[arg-type]
            refusal = "a layer's linears not packed as Llama's"
        logger.info("the lean forward is off: %s", refusal)
        return None

    def forward(
        self, token_ids: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One packed forward of the rows in slots 0..k-1: the row in slot r feeds ``counts[r]``
        tokens at columns ``starts[r]..`` (None: one each, a decode step), their KV written
        there, each token attending its row's columns up to its own.

        token_ids: (T,) int64 packed in slot order, T = counts.sum(); starts, counts: (k,)
        int64 on the CPU. Returns the logits (k, V) of each row's last token."""
        if counts is None:  # a decode step: token r is row r's, in slot r
            positions, slots, last = starts, None, None
        else:
            slots, positions = token_places(starts, counts)
            last = torch.cumsum(counts, 0) - 1
        if int(positions.max()) >= self.kv.capacity:
            raise RuntimeError(f"a position past the KV slots' {self.kv.capacity} columns")
        residual = torch.nn.functional.embedding(token_ids, self.embedding)  # (T, hidden)
        cos, sin = (t[0] for t in self.rotary(residual, positions[None]))  # (T, D) each
        added = self._layers(residual, cos, sin, positions, slots)
        final = self.ops.add_rms_norm(residual, added, self.norm, self.norm_eps)
        return self.head(final if last is None else final[last])

    def _layers(
        self,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decoder layers over the tokens' residual stream (T, hidden), updated in place;
        returns the last layer's MLP output (T, hidden), which the final norm adds."""
        ops, kv = self.ops, self.kv
        counts = positions + 1  # each token attends its row's columns up to its own
        added = None  # the last layer's MLP output, added to the residual by the next norm
        for index, layer in enumerate(self.layers):
            keys, values = kv.keys[index], kv.values[index]
            x = ops.add_rms_norm(residual, added, layer.input_norm, layer.eps)
            query = ops.rotary_store(layer.qkv(x), cos, sin, positions, keys, values, slots)
            attended = self.attention.attend(query, keys, values, counts, self.scale, slots)
            attended = layer.output(attended.view(len(residual), -1))
            x = ops.add_rms_norm(residual, attended, layer.post_norm, layer.eps)
            added = layer.down(ops.silu_mul(layer.gate_up(x)))
        assert added is not None, "a model without decoder layers"
        return added


def _layer(block: Any, linears: OneDNNLinears) -> _Layer | None:
    """A decoder layer's pieces (None where its linears are not packed as Llama's)."""
    attention, mlp = block.self_attn, block.mlp
    qkv = linears.computing(
        _base(attention.q_proj), _base(attention.k_proj), _base(attention.v_proj)
    )
    gate_up = linears.computing(_base(mlp.gate_proj), _base(mlp.up_proj))
    output = linears.computing(_base(attention.o_proj))
    down = linears.computing(_base(mlp.down_proj))
    if qkv is None or gate_up is None or output is None or down is None:
        return None
    return _Layer(
        block.input_layernorm.weight.detach(),
        qkv,
        output,
        block.post_attention_layernorm.weight.detach(),
        gate_up,
        down,
        block.input_layernorm.variance_epsilon,
    )
