"""Freed host memory goes back to the system at once in a sharded CPU run (glibc's `mallopt`).

Why: glibc serves a large allocation with its own `mmap` and unmaps it on free, but raises that size threshold
to the size of every such block freed (up to 32 MiB): after the first few, FSDP's gathered units and reduce
buffers (tens of MB each, a new one per unit per forward and backward) come from the heap, whose freed middle
pieces stay resident. Measured on a 0.6 B decoder + LoRA under fsdp at 2 gloo processes (bf16, 2 steps, a
checkpoint, two sharded evaluations; benchmarks/bench_phase_memory.py): every rank's peak resident memory 4.96 GiB
with glibc's defaults, 2.35 GiB with a fixed 1 MiB threshold, the live tensors being the same. Fixing the
threshold (`M_MMAP_THRESHOLD`, which also turns the adjustment off) and the trim threshold (`M_TRIM_THRESHOLD`)
costs a page fault per fresh large buffer; it is applied where memory is the point, `train.sharding=fsdp` on a
CPU, said once in the log, and left alone elsewhere (another C library: nothing to do). The environment variables
`MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` set before the process starts take precedence.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("magclip.training.host_memory")

M_TRIM_THRESHOLD = -1   # glibc's malloc.h
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 20


def return_freed_memory(threshold: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap and trim thresholds at `threshold` bytes (see the module docstring); False where the C library
    is not glibc or the environment sets them already."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(mallopt(M_TRIM_THRESHOLD, threshold))
    if done:
        log.info("train.sharding=fsdp on a CPU: freed blocks of %d KiB and more go back to the system at once (glibc "
                 "mallopt), so FSDP's gathered units do not stay resident", threshold // 1024)
    return done
