"""Attention over the embedded engine's KV slots, reading each row's own columns once.

torch's CPU attention (the flash kernel behind ``scaled_dot_product_attention``) took ~0.4 ms a
layer for 3 decode rows of ~350 KV tokens (1 MB of KV: ~2.5 GB/s) and read 7-9 GB/s at 26 rows,
and a batch's rows all attend up to the longest row's length, masked (README, "Decode attention
over the slots"). ``decode_attention.c`` takes one task per (row, KV head): that row's columns
only, its G query heads together, an exact softmax. The engine's lean forward also hands it the
tokens of rows that join, one query row each over its slot's columns up to its own (``slots``).
Built at first use
(``treegrpo_ray.kernels``); where it cannot be, ``load_kernel`` returns None and the engine keeps
torch's attention.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from treegrpo_ray.kernels import load_library


class DecodeAttentionKernel:
    """The compiled kernel: ``attend`` the decoding rows over their slots."""

    def __init__(self, library: ctypes.CDLL):
        self._call = library.decode_attention
        self._call.argtypes = [
            ctypes.c_void_p,  # q
            ctypes.c_void_p,  # k
            ctypes.c_void_p,  # v
            ctypes.c_void_p,  # counts
            ctypes.c_void_p,  # slots or NULL
            ctypes.c_int64,  # rows
            ctypes.c_int64,  # kv heads
            ctypes.c_int64,  # query heads per KV head
            ctypes.c_int64,  # capacity
            ctypes.c_int64,  # head dim
            ctypes.c_float,  # scale
            ctypes.c_void_p,  # out
            ctypes.c_int,  # threads
        ]
        self._call.restype = None

    @staticmethod
    def takes(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        """Whether the kernel reads slot buffers of ``dtype`` on ``device``: float32 on the CPU,
        a head dim that is a multiple of 8."""
        return dtype == torch.float32 and device.type == "cpu" and head_dim % 8 == 0

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        counts: torch.Tensor,
        scale: float,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Query row r's heads attend the first ``counts[r]`` columns of slot ``slots[r]``.

        query: (rows, Hkv, G, D), the G query heads of each KV head; key, value: a layer's slot
        buffers (slots, Hkv, capacity, D), contiguous, as ``takes``; counts: (rows,) int64 on
        the CPU, each at least 1; slots: (rows,) int64 (None: row r reads slot r). Returns
        (rows, Hkv, G, D)."""
        rows, kv_heads, group, dim = query.shape
        query = query.contiguous()
        counts = counts.contiguous()
        out = torch.empty_like(query)
        self._call(
            query.data_ptr(),
            key.data_ptr(),
            value.data_ptr(),
            counts.data_ptr(),
            None if slots is None else slots.contiguous().data_ptr(),
            rows,
            kv_heads,
            group,
            key.shape[2],
            dim,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out


@functools.cache
def load_kernel() -> DecodeAttentionKernel | None:
    """The compiled kernel (None where it cannot run here: ``load_library`` says why)."""
    library = load_library("decode_attention")
    return None if library is None else DecodeAttentionKernel(library)
