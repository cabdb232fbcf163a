"""Stopping a run cleanly before the scheduler kills it: a signal (preemption, `scancel`, SLURM's
`--signal=B:USR1@90` warning) or the job's time limit saves the step the run reached, and the process
exits with STOPPED_EXIT, so that a requeued job continues with `train.resume=auto` and loses nothing.

The engine consults a `StopGuard` at every step boundary (`should_stop`); the guard itself only
listens:

- a signal of `train.save_on_signal` (default SIGTERM and SIGUSR1) is noted, and the optimizer step in
  progress finishes. At the next step boundary the ranks agree through one small all-reduce of a
  flag (a signal can reach the ranks at different steps, or only some of them), so every rank stops
  after the same step; the engine then writes one complete checkpoint, logs one line and raises
  `TrainingStopped`, which the commands turn into exit code 75.
- a repeat of the signal within SIGNAL_REPEAT_S of the first is the same request (one preemption
  often reaches a process twice: from the scheduler, and from a parent that forwards it, such as
  torchrun or eval/compare.py). A later one exits at once (128 + the signal's number) without
  waiting for the save in progress: checkpoints are written under a temporary name and published
  by a rename, so the last complete one stays intact and the next resume removes the partial one.
- `train.time_limit` ("3h50m", "90m", "45s", "1:30:00" or seconds, from the process's start: imports
  and start-up count)
  and, where it is set, SLURM's job end time (SLURM_JOB_END_TIME) are deadlines: the run stops
  like on a signal when the time left is less than the margin: twice the slowest step plus the
  slowest checkpoint measured so far (before the first checkpoint, its size at CHECKPOINT_BYTES_PER_S),
  and EXIT_S for the process to end (trackers, tensorboard, the interpreter: ~3 s measured on a CPU).
- outside the training loop there is no step to finish: a signal during the start-up (building the
  model, reading data, the evaluation of the start) or after the final checkpoint (the final
  evaluation) raises `TrainingStopped` at once. Nothing is lost: before the loop the run has trained
  nothing that is not in the checkpoint it resumed from; after it, the final checkpoint holds every
  step and a resume only evaluates again. A rank that did not receive such a signal stops at its
  next collective (train.collective_timeout_s).

Why 75: EX_TEMPFAIL of sysexits.h ("a temporary failure; the user is invited to retry"). A batch
script tells it from a failure (1, 2) and from a kill by signal (128 + N): the recipes in
configs/slurm/ requeue the job on 75 with `scontrol requeue`, and a preemption that SLURM requeues
itself (PreemptMode=REQUEUE) restarts the script, which resumes the same way.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from magclip.config import parse_duration, signal_numbers

log = logging.getLogger("magclip.training.preemption")
# torch is imported where it is used: the grid runner reads STOPPED_EXIT without loading it

STOPPED_EXIT = 75                 # EX_TEMPFAIL: saved, stopped; requeue and resume
SIGNAL_REPEAT_S = 1.0             # a repeat within this many seconds is the same request
MARGIN_FACTOR = 2.0               # the time-limit margin: this many times (slowest step + slowest checkpoint) ...
EXIT_S = 10.0                     # ... + the process's way out (trackers, tensorboard's close, the interpreter)
CHECKPOINT_BYTES_PER_S = 100e6    # the write rate assumed for a checkpoint not yet measured
SLURM_END = "SLURM_JOB_END_TIME"  # epoch seconds at which SLURM ends the job


class TrainingStopped(BaseException):
    """The run stopped on a signal or its time limit; `checkpoint` (None outside the loop) holds its state.

    A BaseException, as KeyboardInterrupt is, for the same reason: outside the loop the signal handler raises it
    wherever the interpreter is, and code that catches `Exception` there (a reader that counts a damaged tar and goes
    on, a library's fallback) would take it for its own error: the stop vanished, and the run went on with what that
    code made of it (an epoch counted short: a resume that ended as finished, a step saved with the wrong length)."""

    def __init__(self, reason: str, step: int | None = None, checkpoint: str | None = None):
        self.reason, self.step, self.checkpoint = reason, step, checkpoint
        where = f" after step {step}, saved in {checkpoint}" if checkpoint else " (nothing new to save)"
        super().__init__(f"stopped on {reason}{where}; exit {STOPPED_EXIT}: continue with train.resume=auto")


TIME_LIMIT = "time limit"
TIME_LIMIT_CODE = 255


def _reason_code(reason: str | None) -> int:
    if reason is None:
        return 0
    return TIME_LIMIT_CODE if reason == TIME_LIMIT else int(signal.Signals[reason.split()[0]])


def _reason_name(code: int) -> str:
    return TIME_LIMIT if code == TIME_LIMIT_CODE else signal.Signals(code).name


def process_start() -> float:
    """When this process started (epoch seconds): a time limit counts the imports and the start-up too.
    Linux's /proc; elsewhere, when this module was imported."""
    try:
        ticks = float(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()
_ACTIVE: list[StopGuard | None] = [None]   # the installed guard (one per process: signals are)


def slurm_deadline(env: dict[str, str] | None = None) -> float | None:
    """SLURM's end time of this job (epoch seconds) where the variable is set and is a number."""
    value = (os.environ if env is None else env).get(SLURM_END, "")
    try:
        return float(value) if value.strip() else None
    except ValueError:
        log.warning("%s=%r is not a time in seconds; ignored", SLURM_END, value)
        return None


class StopGuard:
    """Listens for the run's stop signals and watches its deadline; `should_stop` (every rank, at each
    step boundary) says when to save and stop. `phase` is "startup" until the loop's first step,
    "training" in the loop, "final" after the final checkpoint (see the module docstring)."""

    def __init__(self, signals: list[str], time_limit: str | float | None = None, env: dict[str, str] | None = None):
        self.signals = signal_numbers(signals)
        self.phase = "startup"
        limit = parse_duration(time_limit)
        deadlines = [d for d in (process_start() + limit if limit is not None else None, slurm_deadline(env))
                     if d is not None]
        self.deadline = min(deadlines) if deadlines else None
        self.requested: str | None = None     # the first signal's name, or the deadline
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}
        self._slowest_step = 0.0
        self._slowest_checkpoint: float | None = None
        self._checkpoint_estimate = 0.0
        self._last_boundary: float | None = None
        self._group = None
        self._outer: StopGuard | None = None

    # ------------------------------------------------------------------ signals
    @staticmethod
    def active() -> StopGuard | None:
        """The guard that listens in this process (a command installs one before torch loads; the run
        it starts uses that one), None when none does."""
        return _ACTIVE[0]

    def install(self) -> StopGuard:
        """Take over the signals (main thread only: where Python runs signal handlers)."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._outer, _ACTIVE[0] = _ACTIVE[0], self
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if _ACTIVE[0] is self:
            _ACTIVE[0] = self._outer

    def __enter__(self) -> StopGuard:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.requested is not None and self.requested != TIME_LIMIT:
            if now - self._first_at < SIGNAL_REPEAT_S:
                return                                      # the same request, delivered twice
            log.warning("second %s while stopping: exiting at once (the last complete checkpoint stays)", name)
            os._exit(128 + signum)
        self.requested, self._first_at = name, now
        if self.phase != "training":
            raise TrainingStopped(name)
        log.info("%s received: the run saves after the step in progress and stops", name)

    # ------------------------------------------------------------------ the step boundary
    def set_checkpoint_size(self, n_bytes: int) -> None:
        """What a checkpoint writes (model + optimizer state), for the margin before one was timed."""
        self._checkpoint_estimate = n_bytes / CHECKPOINT_BYTES_PER_S

    def checkpoint_took(self, seconds: float) -> None:
        self._slowest_checkpoint = max(self._slowest_checkpoint or 0.0, seconds)

    @property
    def margin_s(self) -> float:
        """How long before the deadline the run stops: room for the step in progress and a checkpoint."""
        checkpoint = self._slowest_checkpoint if self._slowest_checkpoint is not None else self._checkpoint_estimate
        return MARGIN_FACTOR * (self._slowest_step + checkpoint) + EXIT_S

    def start_loop(self, world_size: int) -> None:
        """The loop begins: a signal from now on waits for the step boundary. Several ranks agree over a
        CPU (gloo) group, so that reading the flag never waits on an accelerator's queue."""
        self.phase = "training"
        self._last_boundary = time.perf_counter()
        if world_size > 1 and self._group is None:
            import torch.distributed as dist

            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        if self.requested is not None:   # arrived between the start-up and now
            log.warning("%s received during the start-up: the run stops at the first step boundary", self.requested)

    def end_loop(self) -> None:
        """The final checkpoint is written: a signal from now on stops the run at once."""
        self.phase = "final"

    def should_stop(self, world_size: int) -> bool:
        """Whether every rank stops after this step (a collective when world_size > 1): this rank's
        signal or deadline, or any other rank's."""
        if not self.signals and self.deadline is None:   # alike on every rank: the same config and job
            return False
        now = time.perf_counter()
        if self._last_boundary is not None:
            self._slowest_step = max(self._slowest_step, now - self._last_boundary)
        self._last_boundary = now
        if self.requested is None and self.deadline is not None and time.time() + self.margin_s >= self.deadline:
            self.requested = TIME_LIMIT
            log.warning("time limit: %.0f s left, less than the margin of %.0f s (a step and a checkpoint x%g, and "
                        "%.0f s to exit): saving and stopping", self.deadline - time.time(), self.margin_s,
                        MARGIN_FACTOR, EXIT_S)
        if world_size == 1:
            return self.requested is not None
        import torch
        import torch.distributed as dist

        # the reason travels as a number (a signal's, TIME_LIMIT_CODE), so that every rank names it
        flag = torch.tensor([_reason_code(self.requested)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        code = int(flag.item())
        if code and self.requested is None:
            self.requested = f"{_reason_name(code)} (received by another rank)"
        return code > 0

    def stop(self, step: int, checkpoint: str) -> TrainingStopped:
        """The exception that ends a run stopped at a boundary (its message is the one line the command
        prints, once the progress bar is closed)."""
        return TrainingStopped(self.requested or "request", step, checkpoint)


def state_bytes(state: Any) -> int:
    """Bytes of every tensor in a (nested) state dict: what a checkpoint of it writes."""
    import torch

    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return total


__all__ = ["STOPPED_EXIT", "StopGuard", "TrainingStopped", "slurm_deadline", "state_bytes"]
