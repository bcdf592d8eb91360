"""A decoder layer's small operations, one kernel call each.

Between its linear layers and its attention, a Llama decoder layer runs ~40 torch operations on
a few KB per token at a decode step (two RMS norms, the rotary embedding of q and k, the KV
write, SiLU, the residual adds, the views and copies between them), each costing more to
dispatch than to compute: ~16 ms of a 47 ms SmolLM2 decode step at 3 rows here (README, "A lean
forward"). ``decoder_ops.c`` computes them in three calls a layer half: ``add_rms_norm``,
``rotary_store``, ``silu_mul``. Built at first use (``treegrpo_ray.kernels``); where it cannot
be, ``load_kernel`` returns None and the engine keeps the model's own forward.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from treegrpo_ray.kernels import load_library

_POINTER, _INT, _FLOAT, _THREADS = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class DecoderOpsKernel:
    """The compiled kernel. Every tensor contiguous, on the CPU; the floating ones float32."""

    def __init__(self, library: ctypes.CDLL):
        self._norm = library.add_rms_norm
        # residual, x or NULL, weight, eps, rows, hidden, out, threads
        self._norm.argtypes = [_POINTER, _POINTER, _POINTER, _FLOAT, _INT, _INT, _POINTER, _THREADS]
        self._rotary = library.rotary_store
        # qkv, cos, sin, columns, slots or NULL, rows, heads, kv heads, head dim, capacity,
        # query, keys, values, threads
        self._rotary.argtypes = [_POINTER] * 5 + [_INT] * 5 + [_POINTER] * 3 + [_THREADS]
        self._silu = library.silu_mul
        self._silu.argtypes = [
            _POINTER,
            _INT,
            _INT,
            _POINTER,
            _THREADS,
        ]  # gate_up, rows, width, out
        for call in (self._norm, self._rotary, self._silu):
            call.restype = None

    def add_rms_norm(
        self,
        residual: torch.Tensor,
        added: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """``residual += added`` in place (None: nothing added), then returns Llama's RMS norm
        of it, ``weight * residual / sqrt(mean(residual ** 2) + eps)``.

        residual, added: (rows, hidden); weight: (hidden,). Returns (rows, hidden)."""
        rows, hidden = residual.shape
        out = torch.empty_like(residual)
        self._norm(
            residual.data_ptr(),
            None if added is None else added.data_ptr(),
            weight.data_ptr(),
            eps,
            rows,
            hidden,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def rotary_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        columns: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotate each row's query and key heads (``q * cos + rotate_half(q) * sin``, as Llama's
        rotary embedding), write its key and value heads into its slot at its column, and
        return the rotated queries.

        qkv: (rows, (H + 2 Hkv) D), each row's q, k and v projections; cos, sin: (rows, D) at
        each row's position; columns: (rows,) int64, below the capacity, no two rows at the
        same slot and column; keys, values: a layer's slot buffers (slots, Hkv, capacity, D);
        slots: (rows,) int64, each row's slot (None: row r in slot r). Returns
        (rows, Hkv, G, D), H = G * Hkv (the layout ``DecodeAttentionKernel.attend`` takes)."""
        _, kv_heads, capacity, dim = keys.shape
        rows, heads = len(qkv), qkv.shape[1] // dim - 2 * kv_heads
        query = qkv.new_empty(rows, kv_heads, heads // kv_heads, dim)
        self._rotary(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            columns.data_ptr(),
            None if slots is None else slots.data_ptr(),
            rows,
            heads,
            kv_heads,
            dim,
            capacity,
            query.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            torch.get_num_threads(),
        )
        return query

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up``: gate_up (rows, 2 I), each row's gate then up -> (rows, I)."""
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, width)
        self._silu(gate_up.data_ptr(), rows, width, out.data_ptr(), torch.get_num_threads())
        return out


@functools.cache
def load_kernel() -> DecoderOpsKernel | None:
    """The compiled kernel (None where it cannot run here: ``load_library`` says why)."""
    library = load_library("decoder_ops")
    return None if library is None else DecoderOpsKernel(library)
