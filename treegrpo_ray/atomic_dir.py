"""Directories that appear whole: written under a temporary name, then renamed."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def new_directory(final: Path, marker: str) -> Iterator[Path]:
    """A temporary directory beside ``final`` to fill; renamed to ``final`` when the block ends
    without error, so a reader never sees half of it. ``final / marker`` marks a complete one:
    when another process finished ``final`` first (an ``OSError`` here), its directory is kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        yield tmp
        os.rename(tmp, final)
    except OSError:
        if not (final / marker).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
