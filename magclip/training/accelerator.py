"""The run's `Accelerator`: the process group torchrun or `accelerate launch` set up, every collective
bounded in time, and the training precision (`train.precision`, resolved by magclip.training.levers)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from magclip.config import TrainConfig
from magclip.training.host_memory import return_freed_memory
from magclip.training.levers import resolve_precision

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def make_accelerator(cfg: TrainConfig, run_dir: Path) -> Accelerator:
    """accelerate joins the process group that torchrun / `accelerate launch` set up (gloo on CPU, NCCL
    on GPUs). `train.collective_timeout_s` bounds every collective: a rank whose peer is lost (killed,
    frozen, cut off) fails after at most that long instead of waiting forever; see
    magclip.distributed for how the failure names the lost rank. It must exceed the longest time
    one rank may wait for the others legitimately (main-process evaluation and checkpoints)."""
    env = os.environ
    if "ACCELERATE_USE_CPU" in env and "MASTER_ADDR" in env and "WORLD_SIZE" not in env:
        # accelerate's simple launcher (`accelerate launch --cpu`, or a config without a multi-process
        # type) sets MASTER_ADDR only when asked for several processes or machines, and then starts
        # one process per machine that would train alone
        raise ValueError("`accelerate launch` started a single process although several processes or machines "
                         "were asked for: its --cpu launcher starts one process per machine, each training alone. "
                         "On CPUs use `accelerate launch --multi_gpu ...` (it runs torchrun; gloo, see "
                         "configs/accelerate/multi_node_cpu.yaml) or torchrun")
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.collective_timeout_s))
    precision, _ = resolve_precision(cfg.precision, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    _allow_another_precision(MIXED_PRECISION[precision])
    if cfg.sharding == "fsdp" and not torch.cuda.is_available():
        return_freed_memory()   # FSDP's gathered units would otherwise stay resident (training/host_memory.py)
    return Accelerator(mixed_precision=MIXED_PRECISION[precision], project_dir=str(run_dir),
                       cpu=not torch.cuda.is_available(), kwargs_handlers=[timeout])


def _allow_another_precision(mixed_precision: str) -> None:
    """accelerate keeps one AcceleratorState per process and refuses an Accelerator with another mixed
    precision ("restart your runtime"); a second run in one Python process (a notebook, a test session)
    may ask for one, e.g. an fp32 run after one at the default `auto`. The precision part of the state
    is dropped then; the process group (accelerate's PartialState) is kept."""
    from accelerate.state import AcceleratorState

    current = AcceleratorState._shared_state.get("_mixed_precision")
    if current is not None and current != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)
