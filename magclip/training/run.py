"""The run skeleton shared by the CLIP and text trainers: the run folder, its config, where the
final checkpoint is, and the part of results.json that every run records."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from magclip.config import dump_config
from magclip.io import atomic_write_json, umask_mode
from magclip.training.engine import Engine, LoopState

LOCK_FILE = ".magclip.lock"  # "pid host" of the process that trains into the folder


class RunDirBusyError(FileExistsError):
    """Another live process trains into this run directory."""


def prepare_run_dir(cfg: Any, accelerator: Accelerator) -> Path:
    """The run folder `output_dir/name`, claimed for this run: a folder another live process trains
    into is refused at once, naming it; a finished or started run is never replaced unless
    `overwrite=true`; a resume keeps it. Every process waits until the main one has decided."""
    run_dir = cfg.run_dir
    if accelerator.is_main_process:
        _refuse_if_busy(run_dir)
        if cfg.train.resume is None and run_dir.exists() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
            if not cfg.overwrite:
                finished = (run_dir / "results.json").exists()
                raise FileExistsError(
                    f"run directory {run_dir} already holds a {'finished' if finished else 'started'} run; "
                    "pass overwrite=true to replace it, train.resume=latest to continue it, or another name=")
            shutil.rmtree(run_dir)
        _claim(run_dir)
    accelerator.wait_for_everyone()
    return run_dir


def _holder(run_dir: Path) -> tuple[int, str] | None:
    try:
        pid, host = (run_dir / LOCK_FILE).read_text().split()[:2]
        return int(pid), host
    except (OSError, ValueError):
        return None


def _refuse_if_busy(run_dir: Path) -> None:
    holder = _holder(run_dir)
    if holder is None:
        return
    pid, host = holder
    if host != socket.gethostname():
        raise RunDirBusyError(f"run directory {run_dir} is claimed by process {pid} on host {host} "
                              f"({run_dir / LOCK_FILE}); if no run is going on there, delete that file")
    if pid != os.getpid() and _alive(pid):
        raise RunDirBusyError(f"run directory {run_dir} is in use by process {pid} on this host "
                              f"({run_dir / LOCK_FILE}); wait for it or pick another name=")
    (run_dir / LOCK_FILE).unlink(missing_ok=True)  # left by a run that ended without releasing it (kill -9)


def _claim(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, umask_mode())
    except FileExistsError:  # another process claimed it between the check and now
        _refuse_if_busy(run_dir)
        raise RunDirBusyError(f"run directory {run_dir} was claimed by another process just now") from None
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {socket.gethostname()}\n")


def release_run_dir(run_dir: Path, accelerator: Accelerator) -> None:
    """Drop this process's claim (the end of a run)."""
    if accelerator.is_main_process and _holder(run_dir) == (os.getpid(), socket.gethostname()):
        (run_dir / LOCK_FILE).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_run_config(cfg: Any, run_dir: Path, accelerator: Accelerator) -> None:
    """config.yaml: the resolved config the run trains with."""
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir / "config.yaml")


def latest_checkpoint(engine: Engine) -> Path:
    """The step folder that checkpoints/latest names (the checkpoints folder when none was written)."""
    pointer = engine.ckpt_dir / "latest"
    return engine.ckpt_dir / pointer.read_text().strip() if pointer.is_file() else engine.ckpt_dir


def loop_record(engine: Engine, state: LoopState, skipped: Counter, started: float) -> dict[str, Any]:
    """What every results.json holds about the loop: steps, epochs, samples, skips, recent loss, time."""
    return {"steps": state.step, "epochs_completed": state.epoch, "samples_seen_per_rank": state.samples_seen,
            "world_size": engine.acc.num_processes, "skipped_samples": dict(skipped),
            "train_loss_recent": engine.recent_loss(), "wall_time_s": round(time.perf_counter() - started, 2)}


def write_results(results: dict[str, Any], run_dir: Path, accelerator: Accelerator) -> dict[str, Any]:
    """Stamp the date and write results.json atomically (main process); every process returns it."""
    results["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    if accelerator.is_main_process:
        atomic_write_json(run_dir / "results.json", results)
    release_run_dir(run_dir, accelerator)
    accelerator.wait_for_everyone()
    return results
