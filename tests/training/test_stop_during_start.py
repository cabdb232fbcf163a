"""A stop signal during the start raises TrainingStopped wherever the interpreter is (training/preemption.py), so code
there that catches `Exception` must not be able to take it for its own error. The start's shard count did: it counts a
damaged tar as far as it reads and goes on (data/shards.py), so a SIGTERM inside it vanished, the epoch came out short,
and the resume it began ended as a finished run (exit 0 after a SIGTERM) or a step was saved with the wrong length."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from builders import good, write_tar

from magclip.data.shards import shard_sizes
from magclip.training.preemption import StopGuard, TrainingStopped


def test_a_sigterm_while_the_start_counts_a_shard_ends_the_count(tmp_path: Path) -> None:
    """The shard is a named pipe fed by a thread that sends SIGTERM to this process half-way through it: the signal
    lands while the real count reads the tar, and the stop must come out of it, not a short count."""
    data = write_tar(tmp_path / "shard.tar", [m for i in range(16) for m in good(f"{i:04d}")]).read_bytes()
    fifo = tmp_path / "fed.tar"
    os.mkfifo(fifo)

    def feed() -> None:
        try:
            with open(fifo, "wb") as pipe:
                pipe.write(data[: len(data) // 2])
                pipe.flush()
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.3)          # the count waits on the pipe meanwhile: the handler runs inside it
                pipe.write(data[len(data) // 2:])
        except BrokenPipeError:          # the count stopped reading: what is expected
            pass

    with StopGuard(["SIGTERM"]):
        feeder = threading.Thread(target=feed)
        feeder.start()
        try:
            with pytest.raises(TrainingStopped, match="stopped on SIGTERM"):
                shard_sizes([str(fifo)])   # what the start's count_samples reads each local shard with
        finally:
            if feeder.is_alive():          # the count never opened the pipe: release the feeder
                os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
            feeder.join(5)
    assert shard_sizes([str(tmp_path / "shard.tar")]) == [16]   # the same shard, unsignalled


def test_code_that_catches_exception_cannot_swallow_a_stop() -> None:
    """Every broad `except Exception` of the start (readers, decoders, libraries' fallbacks) at once."""
    with StopGuard(["SIGTERM"]), pytest.raises(TrainingStopped):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)   # the handler runs here at the latest
        except Exception:   # noqa: BLE001 (the broad catch under test)
            pytest.fail("a stop was caught as an Exception")
