"""The package keeps freed memory for reuse (``treegrpo_ray.keep_freed_memory``): large tensors come
from glibc's heap, not from fresh ``mmap`` pages faulted in on every allocation."""

import subprocess
import sys

import pytest

import treegrpo_ray

# Prints the mapping (/proc/self/maps) holding a new 4 MiB tensor's data.
WHERE_IS_A_TENSOR = """
import sys
if sys.argv[1] == "import":
    import treegrpo_ray
import torch
tensor = torch.empty(1 << 20)
ptr = tensor.data_ptr()
for line in open("/proc/self/maps"):
    fields = line.split()
    low, high = (int(v, 16) for v in fields[0].split("-"))
    if low <= ptr < high:
        print(fields[5] if len(fields) > 5 else "anonymous mapping")
"""


def _mapping(import_package: bool, env: dict[str, str] | None = None) -> str:
    argv = [sys.executable, "-c", WHERE_IS_A_TENSOR, "import" if import_package else "torch-only"]
    return subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux)")
def test_large_tensors_come_from_the_heap_once_the_package_is_imported():
    assert _mapping(import_package=False) == "anonymous mapping"  # glibc's default: mmap
    assert _mapping(import_package=True) == "[heap]"


@pytest.mark.parametrize(
    "name, value", [("MALLOC_MMAP_THRESHOLD_", "131072"), ("TREEGRPO_KEEP_FREED_MEMORY", "0")]
)
def test_the_users_own_setting_wins(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert treegrpo_ray.keep_freed_memory() is False
