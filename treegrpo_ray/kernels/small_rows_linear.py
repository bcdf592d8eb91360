"""Linear layers at a few rows (a decode step's), streaming the weights at the memory's rate.

A decode step of a few rows reads every weight once for little arithmetic, so its linear layers
are bound by memory traffic. On a CPU with AVX2 but no AVX-512, oneDNN's and MKL's GEMMs stream
the weights at half the read bandwidth or less at 1-16 rows, and reach fewer GFLOP/s than this
kernel up to 64 rows (measured on the SmolLM2 preset's shapes: README, "Linears at a few rows";
with AVX-512, oneDNN streamed them at the read bandwidth from one row). ``small_rows_linear.c``
is a kernel for that case alone: the weight stored in blocks of 16 outputs (one contiguous
stream per block), up to 6 rows sharing each load, AVX2 and FMA, the threads of torch's OpenMP
pool. It is compiled at first use (``treegrpo_ray.kernels``); where it cannot be,
``load_kernel`` returns None and the layers keep oneDNN's path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from treegrpo_ray.kernels import load_library

BLOCK = 16  # outputs per weight block (the kernel's BLOCK)
MOST_ROWS = 32  # the kernel's rows at most: measured faster than oneDNN up to 64 (README)


class SmallRowsKernel:
    """The compiled kernel: ``block`` a weight once, then ``linear`` at up to ``MOST_ROWS`` rows."""

    def __init__(self, library: ctypes.CDLL):
        self._call = library.small_rows_linear
        self._call.argtypes = [
            ctypes.c_void_p,  # x
            ctypes.c_int64,  # rows
            ctypes.c_int64,  # in features
            ctypes.c_void_p,  # blocked weight
            ctypes.c_int64,  # out features
            ctypes.c_void_p,  # bias or NULL
            ctypes.c_void_p,  # y
            ctypes.c_int,  # threads
        ]
        self._call.restype = None

    @staticmethod
    def blockable(weight: torch.Tensor) -> bool:
        """Whether ``weight`` (out, in) can be blocked: float32 on the CPU, out a multiple of 16."""
        return (
            weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.shape[0] % BLOCK == 0
        )

    @staticmethod
    def block(weight: torch.Tensor) -> torch.Tensor:
        """(out, in) -> (out / 16, in, 16): each block's 16 outputs' weights, input by input."""
        out_features, in_features = weight.shape
        blocks = weight.detach().reshape(out_features // BLOCK, BLOCK, in_features)
        return blocks.transpose(1, 2).contiguous()

    def linear(
        self, x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` with W blocked by ``block``: x (..., in) float32, at most
        ``MOST_ROWS`` rows in all -> (..., out)."""
        blocks, in_features, _ = blocked.shape
        rows = x.reshape(-1, in_features).contiguous()
        y = x.new_empty((*x.shape[:-1], blocks * BLOCK))
        self._call(
            rows.data_ptr(),
            len(rows),
            in_features,
            blocked.data_ptr(),
            blocks * BLOCK,
            None if bias is None else bias.contiguous().data_ptr(),
            y.data_ptr(),
            torch.get_num_threads(),
        )
        return y


def pays_off() -> bool:
    """Whether the kernel beats oneDNN here: on CPUs with AVX2 and without AVX-512."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


@functools.cache
def load_kernel() -> SmallRowsKernel | None:
    """The compiled kernel (None where it cannot run here: ``load_library`` says why)."""
    library = load_library("small_rows_linear")
    return None if library is None else SmallRowsKernel(library)
