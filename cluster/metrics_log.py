"""A job's step records: ``metrics.jsonl`` plus a TensorBoard log in the run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from torch.utils.tensorboard import SummaryWriter


class MetricsLog:
    """``metrics.jsonl`` plus a TensorBoard log in the run directory.

    ``rewind(step)`` (a resumed run, a restarted learner) drops the records of later steps, which
    are about to be redone, from both; ``records`` holds the ones kept. A record can be held back
    (``add(..., ready=False)``) until its evaluation ``complete``s it; the records after it wait
    with it, so the files stay in step order."""

    def __init__(self, run_dir: Path, resume_after: int | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        self.pending: dict[int, tuple[dict[str, Any], bool]] = {}  # step -> (record, ready)
        self.tensorboard: SummaryWriter | None = None
        self.jsonl: TextIO | None = None
        if resume_after is None:
            self._open([], None)
        else:
            self.rewind(resume_after)

    def rewind(self, step: int) -> None:
        self.close()
        self.pending = {s: entry for s, entry in self.pending.items() if s <= step}
        self._open(_records_upto(self.path, step), step + 1)

    def add(self, step: int, record: dict[str, Any], ready: bool = True) -> None:
        """Write ``record`` once it and every earlier pending one are ready."""
        self.pending[step] = (record, ready)
        self._flush()

    def complete(self, step: int, record: dict[str, Any], extra: dict[str, Any]) -> None:
        """The evaluation that held ``record`` back finished: add ``extra`` to it and write what
        is ready. Nothing happens if a rewind dropped that record meanwhile (even if the step
        has been published again since: that is another record)."""
        held, _ = self.pending.get(step, (None, False))
        if held is record:
            self.pending[step] = ({**record, **extra}, True)
            self._flush()

    def _flush(self) -> None:
        while self.pending:
            step = min(self.pending)
            record, ready = self.pending[step]
            if not ready:
                return
            del self.pending[step]
            self.write(step, record)

    def _open(self, records: list[dict[str, Any]], purge_step: int | None) -> None:
        self.records[:] = records
        self.path.write_text("".join(json.dumps(r) + "\n" for r in records))
        self.jsonl = self.path.open("a")
        self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)

    def write(self, step: int, record: dict[str, Any]) -> None:
        jsonl, tensorboard = self.jsonl, self.tensorboard
        assert jsonl is not None and tensorboard is not None  # open from __init__ on
        full = {"step": step, **record}
        self.records.append(full)
        jsonl.write(json.dumps(full) + "\n")
        jsonl.flush()
        for key, value in record.items():
            if isinstance(value, (int, float)):
                tensorboard.add_scalar(key, value, step)
        tensorboard.flush()

    def close(self) -> None:
        if self.jsonl is not None and self.tensorboard is not None:
            self.jsonl.close()
            self.tensorboard.close()
            self.jsonl = None


def _records_upto(path: Path, last_step: int) -> list[dict[str, Any]]:
    """The step records in ``path`` up to and including ``last_step``."""
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] <= last_step]
