"""The run skeleton shared by the CLIP and text trainers: the run folder, its config, where the
final checkpoint is, and the part of results.json that every run records.

In a multi-process run (several GPUs, several nodes) the ranks first agree on the config: the
run's first collective exchanges every rank's resolved config, and a rank started with another
value (a batch size, a run folder, a data path) stops the run on every node before anything is
written, with an error that names the key, its values and the ranks and hosts that hold them."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from magclip import distributed
from magclip.config import ConfigError, dump_config, flatten, to_dict
from magclip.io import umask_mode
from magclip.metrics.ranks import write_results_with_outcomes
from magclip.training.checkpoints import (
    CHECKPOINTS_DIR,
    check_resume_config,
    latest_step,
    resolve_resume,
    resume_hint,
    run_write_error,
    tidy_interrupted_writes,
)
from magclip.training.engine import Engine, LoopState
from magclip.training.preemption import StopGuard, TrainingStopped

LOCK_FILE = ".magclip.lock"  # "pid host" of the process that trains into the folder
HOST_KEYS = ("train.threads",)  # may differ between ranks: each host's own cores

log = logging.getLogger("magclip.run")


class RunDirBusyError(FileExistsError):
    """Another live process trains into this run directory."""


def prepare_run_dir(cfg: Any, accelerator: Accelerator) -> Path:
    """The run folder `output_dir/name`, claimed for this run: a folder another live process trains
    into is refused at once, naming it; a finished or started run is never replaced unless
    `overwrite=true`; a resume keeps it, and is refused when its config would change the experiment
    of the checkpoint it continues (`checkpoints.check_resume_config`). Every process waits until the
    main one has decided, then `cfg.train.resume` holds the step folder the run starts from (None: a
    fresh start, also where `auto` found no checkpoint). Before any of it, every rank must have the
    same config (`check_same_config`). Nothing is written before every check has passed."""
    check_same_config(cfg, accelerator)
    run_dir = cfg.run_dir
    ckpt_dir = run_dir / CHECKPOINTS_DIR
    if accelerator.is_main_process:
        _refuse_if_busy(run_dir)
        if cfg.train.resume is not None:
            tidy_interrupted_writes(ckpt_dir)
        start = resolve_resume(cfg.train.resume, ckpt_dir)
        if start is not None:
            check_resume_config(to_dict(cfg), start, accelerator.num_processes)
        elif run_dir.exists() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
            _replace_earlier_run(cfg, run_dir)
        _claim(run_dir)
    with distributed.naming_lost_ranks("the run folder set-up (the main process's log says why it stopped)"):
        accelerator.wait_for_everyone()
    start = resolve_resume(cfg.train.resume, ckpt_dir)
    cfg.train.resume = None if start is None else str(start)
    return run_dir


def _replace_earlier_run(cfg: Any, run_dir: Path) -> None:
    """A fresh start in a folder that holds files: only with `overwrite=true`, or with `train.resume=auto`
    when an earlier attempt stopped before its first checkpoint (nothing of it can be continued)."""
    finished = (run_dir / "results.json").exists()
    if cfg.train.resume == "auto" and not finished and not cfg.overwrite:
        log.warning("train.resume=auto: %s holds no checkpoint (an earlier attempt stopped before its first one); "
                    "starting afresh", run_dir)
    elif not cfg.overwrite:
        raise FileExistsError(
            f"run directory {run_dir} already holds a {'finished' if finished else 'started'} run; "
            "pass overwrite=true to replace it, train.resume=latest to continue it, or another name=")
    shutil.rmtree(run_dir)


def check_same_config(cfg: Any, accelerator: Accelerator) -> None:
    """Every rank must train with the same resolved config (HOST_KEYS excepted). The run's first
    collective; it also introduces the ranks to each other (hosts, addresses: a lost rank is named
    by them later). Logs "rank R of W on HOST" on every rank. A difference is a ConfigError on
    every rank, naming each differing key with its value per rank, before anything is written."""
    flat = {k: v for k, v in flatten(to_dict(cfg)).items() if k not in HOST_KEYS}
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:12]
    ranks = distributed.introduce({"digest": digest, "config": flat}) if accelerator.num_processes > 1 else []
    if not ranks:
        return
    me = ranks[accelerator.process_index][0]
    log.info("rank %d of %d on %s (%s): config %s", me.rank, len(ranks), me.host,
             me.addresses[0] if me.addresses else "no address", digest)
    if len({p["digest"] for _, p in ranks}) == 1:
        return
    missing = "<absent>"
    keys = sorted({k for _, p in ranks for k in p["config"]})
    differing = [k for k in keys if len({repr(p["config"].get(k, missing)) for _, p in ranks}) > 1]
    parts = []
    for key in differing[:5]:
        holders: dict[str, list[str]] = {}
        for peer, p in ranks:
            holders.setdefault(repr(p["config"].get(key, missing)), []).append(f"{peer.rank} ({peer.host})")
        parts.append(f"{key} = " + "; ".join(f"{value} on rank {', '.join(where)}" for value, where in holders.items()))
    more = f" (and {len(differing) - 5} more keys)" if len(differing) > 5 else ""
    raise ConfigError(f"the ranks of this run were started with different configs: {' | '.join(parts)}{more}; "
                      "start every node with the same config file and overrides")


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


@contextmanager
def stoppable(cfg: Any) -> Iterator[StopGuard]:
    """The run's StopGuard (train.save_on_signal, train.time_limit: training/preemption.py), listening from
    the task's first line to its last; a run it stops leaves its folder unclaimed. Signal handlers exist
    in the main thread only: a run started in another thread keeps only the time limit."""
    guard = StopGuard.active()   # the command's, listening since before torch loaded
    own = guard is None
    if own:
        guard = StopGuard(cfg.train.save_on_signal, cfg.train.time_limit)
        if threading.current_thread() is threading.main_thread():
            guard.install()
        elif guard.signals:
            log.info("train.save_on_signal: not in the main thread, the signals keep their default action")
    try:
        yield guard
    except TrainingStopped:
        if _holder(cfg.run_dir) == (os.getpid(), socket.gethostname()):
            (cfg.run_dir / LOCK_FILE).unlink(missing_ok=True)
        raise
    finally:
        if own:
            guard.restore()


def write_run_config(cfg: Any, run_dir: Path, accelerator: Accelerator) -> None:
    """config.yaml: the resolved config the run trains with."""
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir / "config.yaml")


def latest_checkpoint(engine: Engine) -> Path:
    """The step folder that checkpoints/latest names (the checkpoints folder when none was written)."""
    return latest_step(engine.ckpt_dir) or engine.ckpt_dir


def loop_record(engine: Engine, state: LoopState, skipped: Counter) -> dict[str, Any]:
    """What every results.json holds about the loop: steps, epochs, samples, skips, recent loss, wall
    time (across resumes; `wall_time_earlier_s`: the part spent by the processes before the last resume),
    and a digest of the final parameters (`sharding.weights_record`: every replica's under ddp, equal on all
    ranks; the consolidated weights' under fsdp, with every rank's digest of the replicated loss parameters).
    Every rank must call it."""
    weights = engine.sharding.weights_record(engine.unwrapped)
    return {"steps": state.step, "epochs_completed": state.epoch, "samples_seen_per_rank": state.samples_seen,
            "world_size": engine.acc.num_processes, "sharding": engine.sharding.name, **weights,
            "skipped_samples": dict(skipped),
            "train_loss_recent": engine.recent_loss(), "speed_levers": dict(engine.levers),
            "wall_time_s": round(engine.wall_time_s(), 2), "wall_time_earlier_s": round(state.wall_before_s, 2)}


def write_results(results: dict[str, Any], run_dir: Path, accelerator: Accelerator) -> dict[str, Any]:
    """Stamp the date and write results.json atomically (main process); every process returns it."""
    results["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    if accelerator.is_main_process:
        try:
            write_results_with_outcomes(run_dir / "results.json", results)  # + results.ranks.npz / .queries.npz
        except OSError as exn:
            release_run_dir(run_dir, accelerator)
            raise run_write_error(run_dir / "results.json", exn, "training finished; " + resume_hint(
                run_dir / CHECKPOINTS_DIR, then="run the same command with train.resume=latest: it evaluates that "
                "checkpoint again and writes the results")) from exn
    release_run_dir(run_dir, accelerator)
    with distributed.naming_lost_ranks("the end of the run"):
        accelerator.wait_for_everyone()
    distributed.stop_heartbeat()
    return results
