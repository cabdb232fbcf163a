"""The run skeleton shared by the CLIP and text trainers: the run folder, its config, where the
final checkpoint is, and the part of results.json that every run records."""

from __future__ import annotations

import datetime as dt
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from magclip.config import dump_config
from magclip.io import atomic_write_json
from magclip.training.engine import Engine, LoopState


def prepare_run_dir(cfg: Any, accelerator: Accelerator) -> Path:
    """The run folder `output_dir/name`: a finished or started run is never replaced unless
    `overwrite=true`; a resume keeps it. Every process waits until the main one has decided."""
    run_dir = cfg.run_dir
    if cfg.train.resume is None and run_dir.exists() and any(run_dir.iterdir()):
        if not cfg.overwrite:
            finished = (run_dir / "results.json").exists()
            raise FileExistsError(f"run directory {run_dir} already holds a {'finished' if finished else 'started'} run; "
                                  "pass overwrite=true to replace it, train.resume=latest to continue it, or another name=")
        if accelerator.is_main_process:
            shutil.rmtree(run_dir)
    accelerator.wait_for_everyone()
    return run_dir


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
    accelerator.wait_for_everyone()
    return results
