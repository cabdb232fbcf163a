"""How many intra-op threads a training process uses, chosen on purpose and logged.

torch starts one intra-op thread per core it sees. Loader workers are processes of their own (each
runs single-threaded), so with the default a 2-core machine running 2 workers has 4 busy threads on 2
cores, and anything else on the machine makes it worse: the main job measured 12 samples/s with
torch's default against 46 with one thread (benchmarks/bench_threads.py has the side-by-side numbers).
The rule: `train.threads` if set, else OMP_NUM_THREADS if set (the variable every launcher knows),
else the cores this process may use, shared among the processes of this node, minus its loader workers.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("magclip.training.threads")


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which a scheduler or `taskset` may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def choose_threads(configured: int | None, loader_workers: int) -> tuple[int, str]:
    """(threads, why) for one training process."""
    if configured is not None:
        return configured, "train.threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cores = available_cores()
    processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))  # torchrun / accelerate set it
    share = max(1, cores // processes)
    threads = max(1, share - loader_workers)
    return threads, (f"{cores} cores / {processes} process(es) on this node - {loader_workers} loader worker(s); "
                     "set train.threads or OMP_NUM_THREADS to choose")


def use_threads(configured: int | None, loader_workers: int) -> int:
    """Set torch's intra-op threads for this process by `choose_threads` and log the choice."""
    import torch

    threads, why = choose_threads(configured, loader_workers)
    torch.set_num_threads(threads)
    log.info("using %d intra-op thread(s) (%s)", threads, why)
    return threads
