"""A run's metrics: one JSON line per record in metrics.jsonl, and the same numbers in the trackers
of `train.report_to` (tensorboard scalars in RUN/tensorboard by default; wandb, mlflow, ... through
accelerate, training/trackers.py), written by the main process only.

metrics.jsonl is appended to (a resume continues it) and flushed per record, so a killed run keeps
every line it logged; it is the record, and a tracker that fails mid-run is only warned about.
tensorboard's writer flushes on a background thread that can hang on a slow or full disk: `close`
waits for it a bounded time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from magclip.config import flatten
from magclip.training.checkpoints import CHECKPOINTS_DIR, RunWriteError, resume_hint, run_write_error
from magclip.training.trackers import Trackers, check_installed, numeric_fields

log = logging.getLogger("magclip.training.metrics_log")

TB_CLOSE_TIMEOUT_S = 5.0  # an interrupt must not wait on tensorboard's flush thread (it could hang for minutes)


class MetricsLog:
    """metrics.jsonl in `run_dir` + the trackers of `report_to` (`train.report_to`), with the run's
    `config` (nested, as in config.yaml) as their parameters; does nothing where `enabled` is false
    (other ranks). A tracker whose package is missing is a ConfigError here, on every rank."""

    def __init__(self, run_dir: Path, enabled: bool = True, report_to: Iterable[str] = ("tensorboard",),
                 config: dict[str, Any] | None = None):
        self.run_dir = run_dir
        self.enabled = enabled
        self.report_to = list(report_to)
        check_installed(self.report_to)
        self.config = config or {}
        self._file = None
        self._tb = None
        self._trackers = Trackers()

    def open(self) -> None:
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a")
        if "tensorboard" in self.report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
                quiet_tensorboard_thread_errors()
            except ImportError:  # tensorboard is a dependency; a broken install only loses the event files
                log.warning("tensorboard is not importable; no tensorboard events")
        self._trackers = Trackers.start(self.report_to, self.run_dir, flatten(self.config))

    def write(self, record: dict[str, Any]) -> None:
        """One record (it must hold "step"): a JSON line, and every number in it (`numeric_fields`) at
        that step in each tracker."""
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as exn:
            raise self._write_failed(self.run_dir / "metrics.jsonl", exn) from exn
        values = numeric_fields(record)
        if self._tb is not None:
            try:
                for k, v in values.items():
                    self._tb.add_scalar(k, v, record["step"])
                self._tb.flush()
            except OSError as exn:  # its background writer's failure surfaces here
                raise self._write_failed(self.run_dir / "tensorboard", exn) from exn
        self._trackers.log(values, record["step"])

    def _write_failed(self, path: Path, exn: OSError) -> RunWriteError:
        """Stop writing (the lines already written stay intact) and say which file failed and what the
        run can be continued from."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # its unwritten line cannot be flushed either
                self._file.close()
            self._file = None
        tb, self._tb = self._tb, None
        if tb is not None:
            close_within(tb.close, TB_CLOSE_TIMEOUT_S, "tensorboard writer")
        return run_write_error(path, exn, resume_hint(self.run_dir / CHECKPOINTS_DIR))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            close_within(self._tb.close, TB_CLOSE_TIMEOUT_S, "tensorboard writer")
            self._tb = None
        self._trackers.finish()


def quiet_tensorboard_thread_errors() -> None:
    """tensorboard's writer thread re-raises a failed write (a full disk) after storing it, so Python
    prints its traceback; the next `flush` raises the same error and the run reports it in one line
    (`MetricsLog.write`). Other threads' errors are printed as before."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            log.debug("tensorboard's writer thread stopped: %s", args.exc_value)
            return
        previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


def close_within(close: Callable[[], None], seconds: float, what: str) -> None:
    """Run `close` in a daemon thread and wait at most `seconds`; log if it did not finish (its
    buffered events may be lost, the run's own files are not)."""
    def quietly() -> None:  # a failure here (a full disk) is the run's to report, not a thread traceback's
        try:
            close()
        except Exception as exn:
            log.warning("%s did not close: %s: %s", what, type(exn).__name__, exn)

    worker = threading.Thread(target=quietly, name=f"close {what}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        log.warning("%s did not close within %.0f s; not waiting for it", what, seconds)
