"""A run's metrics: one JSON line per record in metrics.jsonl, and the same numbers in the trackers
of `train.report_to` (tensorboard scalars in RUN/tensorboard by default; wandb, mlflow, ... through
accelerate, training/trackers.py), written by the main process only.

metrics.jsonl is appended to and flushed per record, so a killed run keeps every line it logged; it
is the record, and a tracker that fails mid-run is only warned about. A resume continues it from its
checkpoint: the lines logged after that checkpoint (steps the resumed run takes again) are moved,
atomically, to metrics.superseded.jsonl, so that metrics.jsonl holds each step once; tensorboard's
events from the resumed step on are purged (SummaryWriter's purge_step), and the trackers continue
the same run where they can (training/trackers.py).
tensorboard's writer flushes on a background thread that can hang on a slow or full disk: `close`
waits for it a bounded time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from magclip.config import flatten
from magclip.io import atomic_write_text
from magclip.training.checkpoints import CHECKPOINTS_DIR, RunWriteError, resume_hint, run_write_error
from magclip.training.trackers import Trackers, check_installed, numeric_fields

log = logging.getLogger("magclip.training.metrics_log")

METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"  # records a resume took back: logged after the checkpoint it continued
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
        self.lines = 0  # of metrics.jsonl, kept in each checkpoint: what a resume from it keeps
        self._file = None
        self._tb = None
        self._trackers = Trackers()

    @property
    def path(self) -> Path:
        return self.run_dir / METRICS_FILE

    def open(self, resumed: ResumePoint | None = None) -> None:
        """Start writing; a resumed run first takes back what was logged after its checkpoint."""
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lines = self._rewind(resumed) if resumed is not None else _count_lines(self.path)
        self._file = open(self.path, "a")
        if "tensorboard" in self.report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
                purge = {"purge_step": resumed.step + 1} if resumed is not None else {}
                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), **purge)
                quiet_tensorboard_thread_errors()
            except ImportError:  # tensorboard is a dependency; a broken install only loses the event files
                log.warning("tensorboard is not importable; no tensorboard events")
        self._trackers = Trackers.start(self.report_to, self.run_dir, flatten(self.config), resume=resumed is not None)

    def _rewind(self, resumed: ResumePoint) -> int:
        """metrics.jsonl as it was when the checkpoint was written (its first `resumed.lines` lines; a
        checkpoint that does not record them: the records up to its step), the rest appended to
        metrics.superseded.jsonl first, then the file replaced atomically. Returns the lines kept."""
        if not self.path.is_file():
            return 0
        lines = self.path.read_text().splitlines(keepends=True)
        n = resumed.lines if resumed.lines is not None else _lines_up_to(lines, resumed.step)
        later = lines[n:]
        if later:
            try:
                with open(self.run_dir / SUPERSEDED_FILE, "a") as f:
                    f.write(json.dumps({"superseded_at_resume_from_step": resumed.step, "lines": len(later)}) + "\n")
                    f.writelines(x if x.endswith("\n") else x + "\n" for x in later)
                    f.flush()
                    os.fsync(f.fileno())
                atomic_write_text(self.path, "".join(lines[:n]))
            except OSError as exn:
                raise self._write_failed(self.path, exn) from exn
            log.info("resumed at step %d: %d metrics.jsonl records logged after its checkpoint moved to %s",
                     resumed.step, len(later), SUPERSEDED_FILE)
        return n

    def write(self, record: dict[str, Any]) -> None:
        """One record (it must hold "step"): a JSON line, and every number in it (`numeric_fields`) at
        that step in each tracker."""
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            self.lines += 1
        except OSError as exn:
            raise self._write_failed(self.path, exn) from exn
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


@dataclass
class ResumePoint:
    """Where a resumed run continues: its checkpoint's step and the metrics.jsonl lines written by then
    (None in a checkpoint from before they were counted)."""

    step: int
    lines: int | None = None


def _count_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _lines_up_to(lines: list[str], step: int) -> int:
    """The lines before the first record of a step after `step` (an unreadable line counts as later)."""
    for i, line in enumerate(lines):
        try:
            if json.loads(line).get("step", 0) > step:
                return i
        except ValueError:
            return i
    return len(lines)


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
