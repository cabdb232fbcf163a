"""A run's metrics on disk: one JSON line per record in metrics.jsonl and the same numbers as
tensorboard scalars, written by the main process only.

metrics.jsonl is appended to (a resume continues it) and flushed per record, so a killed run keeps
every line it logged. tensorboard's writer flushes on a background thread that can hang on a slow
or full disk: `close` waits for it a bounded time.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("magclip.training.metrics_log")

TB_CLOSE_TIMEOUT_S = 5.0  # an interrupt must not wait on tensorboard's flush thread (it could hang for minutes)


class MetricsLog:
    """metrics.jsonl + tensorboard/ in `run_dir`; does nothing where `enabled` is false (other ranks)."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.run_dir = run_dir
        self.enabled = enabled
        self._file = None
        self._tb = None

    def open(self) -> None:
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        except ImportError:  # tensorboard is a dependency; a broken install only loses the event files
            log.warning("tensorboard is not importable; metrics.jsonl only")

    def write(self, record: dict[str, Any]) -> None:
        """One record (it must hold "step"): a JSON line, and every number in it as a tensorboard scalar."""
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, record["step"])
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            close_within(self._tb.close, TB_CLOSE_TIMEOUT_S, "tensorboard writer")
            self._tb = None


def close_within(close: Callable[[], None], seconds: float, what: str) -> None:
    """Run `close` in a daemon thread and wait at most `seconds`; log if it did not finish (its
    buffered events may be lost, the run's own files are not)."""
    worker = threading.Thread(target=close, name=f"close {what}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        log.warning("%s did not close within %.0f s; not waiting for it", what, seconds)
