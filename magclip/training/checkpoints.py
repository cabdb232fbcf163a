"""A run's checkpoints: step folders written atomically, the `latest` pointer, which checkpoint a resume
starts from, and the check that it continues the same experiment.

    checkpoints/step_N/   the task's model files + state.pt (optimizer, scheduler, loop, RNG) + config.yaml
    checkpoints/latest    the name of the newest complete step folder

A step folder is written under a temporary name and renamed into place, then `latest` is rewritten
atomically: a reader (or a resume) sees the previous checkpoint or the new one, never half of one.
`config.yaml` is the resolved config the checkpoint was trained with: a resume whose config differs
from it in a key that changes the experiment is refused (`magclip.config.RESUMABLE_KEYS`).
"""

from __future__ import annotations

import errno
import json
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

from magclip.config import RESUMABLE_KEYS, RESUME_CAVEATS, ConfigError, experiment_differences
from magclip.io import atomic_torch_save, atomic_write_text, publish_dir, recover_dir, safe_torch_load
from magclip.training.frozen_base import write_base

log = logging.getLogger("magclip.training.checkpoints")

CHECKPOINTS_DIR = "checkpoints"  # RUN/checkpoints
STATE_FILE = "state.pt"
CONFIG_FILE = "config.yaml"
WORLD_FILE = "world.json"  # the world size, per-process batch and sharding that wrote the checkpoint (the resume check)
STATE_KEYS = ("module", "optimizer", "scheduler", "scaler", "loop", "rng")  # what state.pt holds


class RunWriteError(OSError):
    """A file of the run (metrics.jsonl, tensorboard events, results.json, a checkpoint) could not be
    written: disk full, I/O error. The message names the file and what the run can be continued from."""

    def __str__(self) -> str:  # the message alone, not "[Errno 28] ...": the errno stays in .errno
        return self.strerror if self.errno else super().__str__()


class CheckpointWriteError(RunWriteError):
    """A checkpoint could not be written (disk full, I/O error); the previous one is untouched."""


def run_write_error(path: Path | str, exn: BaseException, after: str,
                    kind: type[RunWriteError] = RunWriteError) -> RunWriteError:
    """One error naming `path`, the cause (disk full when ENOSPC), the OS's own words (torch.save on a
    full disk says only "unexpected pos N vs M") and `after` (what is intact, what to run next); an
    OSError's errno stays visible to callers."""
    code = exn.errno if isinstance(exn, OSError) else None
    reason = "disk full" if code == errno.ENOSPC else "disk full or not writable?"
    msg = f"could not write {path} ({reason}): {type(exn).__name__}: {exn}; {after}"
    return kind(code, msg) if code else kind(msg)


def resume_hint(ckpt_dir: Path, then: str = "continue with train.resume=latest") -> str:
    """What a run that stopped on a failed write can be continued from, and how."""
    step = latest_step(ckpt_dir)
    return (f"the last checkpoint {step} is complete: free space and {then}"
            if step else f"no checkpoint was written in {ckpt_dir}")


class ResumeConfigError(ConfigError):
    """A resume whose config would change the experiment its checkpoint belongs to."""


def latest_step(ckpt_dir: Path) -> Path | None:
    """The step folder `ckpt_dir/latest` names, None when no checkpoint was written."""
    pointer = ckpt_dir / "latest"
    return ckpt_dir / pointer.read_text().strip() if pointer.is_file() else None


def resolve_resume(resume: str | None, ckpt_dir: Path) -> Path | None:
    """The step folder a run starts from: None (a fresh start), `latest` (which must exist), `auto`
    (latest if there is one, else a fresh start) or a step folder's path."""
    if resume is None:
        return None
    if resume not in ("latest", "auto"):
        return Path(resume)
    step = latest_step(ckpt_dir)
    if step is None and resume == "latest":
        raise FileNotFoundError(f"train.resume=latest but {ckpt_dir / 'latest'} does not exist: no checkpoint to "
                                "resume from (train.resume=auto starts afresh when there is none)")
    return step


def tidy_interrupted_writes(ckpt_dir: Path) -> None:
    """Before a resume: undo or remove what checkpoint writes killed mid-way left behind (a step folder
    moved aside while being replaced, temp folders and files; nothing reads them)."""
    if not ckpt_dir.is_dir():
        return
    for old in ckpt_dir.glob(".step_*.old"):
        final = ckpt_dir / old.name[1:-len(".old")]
        if recover_dir(final):
            log.warning("restored %s, left aside by a checkpoint write that was interrupted", final)
    for junk in [*ckpt_dir.glob(".tmp_step_*"), *ckpt_dir.glob(".latest.*.tmp")]:
        log.info("removing %s, left by an interrupted checkpoint write", junk)
        if junk.is_dir():
            shutil.rmtree(junk, ignore_errors=True)
        else:
            junk.unlink(missing_ok=True)


def saved_config(step: Path) -> tuple[dict[str, Any], Path] | None:
    """The config a checkpoint was trained with and the file it came from: the step folder's own
    config.yaml, else (a checkpoint written before step folders held one) its run folder's."""
    candidates = [step / CONFIG_FILE]
    if step.parent.name == "checkpoints":
        candidates.append(step.parent.parent / CONFIG_FILE)
    for path in candidates:
        if path.is_file():
            try:
                return yaml.safe_load(path.read_text()) or {}, path
            except yaml.YAMLError as exn:
                raise ConfigError(f"{path}: not valid YAML ({exn}); cannot tell what the checkpoint was trained with")
    return None


def check_resume_config(current: dict[str, Any], step: Path, world_size: int | None = None) -> None:
    """Refuse (ResumeConfigError, naming every differing key with both values) a resume of `step` whose
    config changes the experiment; log the changes a resume may make. Reads only YAML and JSON.

    On another number of processes (`world_size`) the global batch is what must stay: train.batch_size (per
    process) may change so that batch size x processes equals the checkpoint's, and must where it would not."""
    found = saved_config(step)
    if found is None:
        log.warning("train.resume: %s records no config (no %s there or in its run folder); "
                    "cannot check that the resume continues the same experiment", step, CONFIG_FILE)
        return
    saved, source = found
    refused, allowed = experiment_differences(saved, current)
    _check_global_batch(step, current, world_size, refused, allowed)
    for key, (old, new) in allowed.items():
        caveat = RESUME_CAVEATS.get(key)
        log.info("train.resume: %s %r -> %r%s", key, old, new, f" ({caveat})" if caveat else "")
    if refused:
        parts = "; ".join(f"{key} = {old!r} in the checkpoint, {new!r} now" for key, (old, new) in refused.items())
        raise ResumeConfigError(
            f"train.resume: {step} was trained with another experiment ({source}): {parts}. Resume with the "
            f"checkpoint's values, or start a new run (another name=); a resume may change only "
            f"{', '.join(RESUMABLE_KEYS)}")


def _check_global_batch(step: Path, current: dict[str, Any], world_size: int | None, refused: dict, allowed: dict) -> None:
    """The world-size rule of `check_resume_config`, on the refused/allowed differences (changed in place)."""
    world_file = step / WORLD_FILE
    if world_size is None or not world_file.is_file():
        return
    written = json.loads(world_file.read_text())
    old_world, old_batch = written.get("world_size"), written.get("batch_size")
    new_batch = current.get("train", {}).get("batch_size")
    if not old_world or not old_batch or old_world == world_size:
        return
    refused.pop("train.batch_size", None)
    if old_world * old_batch == world_size * new_batch:
        allowed["train.batch_size"] = (old_batch, new_batch)
        log.info("train.resume: %d processes where the checkpoint had %d; the global batch stays %d", world_size,
                 old_world, world_size * new_batch)
        return
    keep = old_world * old_batch
    hint = (f"train.batch_size={keep // world_size}" if keep % world_size == 0
            else f"a number of processes that divides {keep}")
    refused["global batch (train.batch_size x processes)"] = (
        f"{old_batch} x {old_world} = {keep}", f"{new_batch} x {world_size} = {new_batch * world_size}; keep it with {hint}")


class Checkpointer:
    """Writes and reads the step folders of one run; the main process writes, every process reads.

    `save_model(module, folder)` writes the task's model files (open_clip's layout, a text model folder);
    `run_config` is the resolved config, saved beside them for the resume check."""

    def __init__(self, ckpt_dir: Path, save_model: Callable[[nn.Module, Path], None],
                 run_config: dict[str, Any] | None = None):
        self.dir = ckpt_dir
        self.save_model = save_model
        self.run_config = run_config

    def save(self, module: nn.Module, state: dict[str, Any], step: int) -> Path:
        """checkpoints/step_N/{model files, state.pt, config.yaml}, written in a temp folder and renamed;
        then `latest` points at it. A failed write raises CheckpointWriteError naming the intact previous one."""
        self.begin(step)
        return self.finish(module, state, step)

    def tmp_dir(self, step: int) -> Path:
        return self.dir / f".tmp_step_{step:08d}"

    def begin(self, step: int) -> Path:
        """A fresh temporary folder for step N's checkpoint (the main process; a sharded checkpoint's ranks then
        write their shards into it before `finish`)."""
        tmp = self.tmp_dir(step)
        self.write_or_fail(step, lambda: (shutil.rmtree(tmp, ignore_errors=True), tmp.mkdir(parents=True)))
        return tmp

    def finish(self, module: nn.Module | None, state: dict[str, Any], step: int,
               write_model: Callable[[Path], None] | None = None) -> Path:
        """The model files (none for `module` None: a sharded checkpoint without them, train.save_full_model; or
        `write_model(folder)`'s: a LoRA run's adapters under fsdp), state.pt, config.yaml and a LoRA run's base.json
        into the temporary folder, renamed into place; `latest` then points at it."""
        final, tmp = self.dir / f"step_{step:08d}", self.tmp_dir(step)

        def write() -> None:
            if write_model is not None:
                write_model(tmp)
            elif module is not None:
                self.save_model(module, tmp)
            if state.get("base") is not None:
                write_base(tmp, state["base"])
            atomic_torch_save(state, tmp / STATE_FILE)
            if self.run_config is not None:
                atomic_write_text(tmp / CONFIG_FILE, yaml.safe_dump(self.run_config, sort_keys=False))
            loop = state.get("loop", {})
            atomic_write_text(tmp / WORLD_FILE, json.dumps({k: loop.get(k) for k in ("world_size", "batch_size",
                                                                                   "sharding")}) + "\n")
            publish_dir(tmp, final)
            atomic_write_text(self.dir / "latest", final.name + "\n")

        self.write_or_fail(step, write)
        return final

    def write_or_fail(self, step: int, write: Callable[[], object]) -> None:
        """Run one write of step N's checkpoint; a failure removes the temporary folder and raises
        CheckpointWriteError naming the intact previous checkpoint."""
        try:
            write()
        except BaseException as exn:
            shutil.rmtree(self.tmp_dir(step), ignore_errors=True)
            if not isinstance(exn, (OSError, RuntimeError)):
                raise
            raise self._write_error(self.dir / f"step_{step:08d}", exn) from exn

    def _write_error(self, final: Path, exn: BaseException) -> RunWriteError:
        previous = latest_step(self.dir)
        after = (f"the previous checkpoint {previous} is intact and {self.dir / 'latest'} still points at it: free "
                 "space and continue with train.resume=latest" if previous else "no earlier checkpoint exists")
        return run_write_error(f"checkpoint {final}", exn, after, kind=CheckpointWriteError)

    @staticmethod
    def load_state(step: Path) -> dict[str, Any]:
        """state.pt of a step folder, loaded without running code from it and checked for every STATE_KEYS entry."""
        state_file = step / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"checkpoint {step} has no {STATE_FILE}")
        state = safe_torch_load(state_file)  # a checkpoint folder is user input: nothing in it may run code
        missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
        if missing:
            raise ValueError(f"{state_file} is not a magclip training state: no {', '.join(missing)}")
        return state


def get_rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain values, so that state.pt loads with weights_only=True."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    n = rng["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
