"""C kernels for the CPU paths torch's own kernels leave slow, compiled at first use.

Each kernel ships as a C source beside this file (with the shared headers, ``*.h``) and is built
with the machine's C compiler (``cc`` or ``$CC``, flags ``FLAGS``: AVX2, FMA, OpenMP) into
``~/.cache/treegrpo/kernels``, once per source, headers and flags (a fraction of a second), then
loaded with ``ctypes``. Its OpenMP loops run on torch's own OpenMP runtime (the same
``libgomp.so.1``, already loaded by torch) with torch's thread count, passed at each call. ``load_library`` returns None and says why where a kernel
cannot run (no AVX2, no compiler, a failed build); its callers then keep torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNEL_DIR = Path("~/.cache/treegrpo/kernels").expanduser()
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """The kernel ``name`` (``name.c`` beside this module), built unless cached (None, with the
    reason logged, where it cannot run here)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("kernel %s off: the CPU has no AVX2 and FMA", name)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("kernel %s off: no C compiler (cc or $CC) on PATH", name)
        return None
    try:
        return ctypes.CDLL(str(_build(name, compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        log.warning("kernel %s off: its build failed: %s", name, detail)
        return None


def _build(name: str, compiler: str) -> Path:
    """The shared library of the shipped source ``name.c`` (with the headers beside it), built
    unless a build is cached."""
    package = resources.files(__package__)
    sources = {f"{name}.c": (package / f"{name}.c").read_bytes()}
    sources |= {h.name: h.read_bytes() for h in package.iterdir() if h.name.endswith(".h")}
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for file_name in sorted(sources):  # the headers a source may include are part of its build
        digest.update(file_name.encode() + sources[file_name])
    library = KERNEL_DIR / f"{name}-{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    KERNEL_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=KERNEL_DIR) as scratch:
        source, built = Path(scratch) / f"{name}.c", Path(scratch) / f"{name}.so"
        for file_name, text in sources.items():
            (Path(scratch) / file_name).write_bytes(text)
        subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(built)],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(built, library)  # atomic: processes building at once each install a whole file
    return library
