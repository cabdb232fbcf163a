"""How a training process splits its cores between the step and the loader, chosen on purpose and logged:
its intra-op threads and, under `data.workers: auto`, its loader workers.

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


def node_processes() -> int:
    """Training processes on this node (torchrun and accelerate set LOCAL_WORLD_SIZE)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def cores_per_process() -> int:
    """This process's share of the cores it may use, shared among the node's training processes."""
    return max(1, available_cores() // node_processes())


def choose_threads(configured: int | None, loader_workers: int) -> tuple[int, str]:
    """(threads, why) for one training process."""
    if configured is not None:
        return configured, "train.threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    threads = max(1, cores_per_process() - loader_workers)
    return threads, (f"{available_cores()} cores / {node_processes()} process(es) on this node - {loader_workers} "
                     "loader worker(s); set train.threads or OMP_NUM_THREADS to choose")


AUTO_WORKERS = 2  # what `data.workers: auto` keeps where the rule below does not move the loader in


def choose_loader_workers(configured: int | str, device_type: str, loader_cached: bool) -> tuple[int, str]:
    """(loader workers, why) by `data.workers`: a number is taken as it is; `auto` runs the loader in the training
    process where the step computes on the CPU, the decoded-sample cache holds the training set, and AUTO_WORKERS
    workers would hold at least half of this process's cores; else AUTO_WORKERS workers.

    Why: on a CPU the workers and the step share the cores. Reading a batch from the cache is a small part of a
    step (the main job: 17 ms for 128 samples, 13 % of its floor step), so a worker holding a whole core for it
    leaves that core mostly idle, while the step, given the core, runs faster (benchmarks/README.md, "Speed
    against the floor": +38 % samples/s on 2 cores). On a GPU the step does not use the cores; with many cores
    two workers take a small share, and a loader in the training process would add its time to every step."""
    if configured != "auto":
        return int(configured), "data.workers"
    if device_type != "cpu":
        return AUTO_WORKERS, f"auto: the step runs on the {device_type} device, the workers decode beside it"
    if not loader_cached:
        return AUTO_WORKERS, "auto: no decoded-sample cache, the workers read and decode the shards beside the step"
    cores = cores_per_process()
    if 2 * AUTO_WORKERS < cores:
        return AUTO_WORKERS, f"auto: {AUTO_WORKERS} workers hold less than half of this process's {cores} cores"
    return 0, (f"auto: the decoded-sample cache holds the training set and {AUTO_WORKERS} workers would hold at least "
               f"half of this process's {cores} cores: the loader runs in the training process, the cores go to "
               "the step")


DEFAULT_STREAMS = 2  # sample streams per rank under `data.streams: auto` (data/shards.py, _RankStream)


def choose_streams(configured: int | str, configured_workers: int | str) -> int:
    """Sample streams per rank by `data.streams`: a number as it is; `auto` DEFAULT_STREAMS, or the configured
    workers where more (each worker then runs one stream). Decided from the configuration alone, before the
    workers' rule, so that the batches do not depend on where the loader runs: `data.workers: auto` picks 0 or
    AUTO_WORKERS, both of which divide DEFAULT_STREAMS."""
    if configured != "auto":
        return int(configured)
    workers = AUTO_WORKERS if configured_workers == "auto" else int(configured_workers)
    return max(DEFAULT_STREAMS, workers)


def use_threads(configured: int | None, loader_workers: int) -> int:
    """Set torch's intra-op threads for this process by `choose_threads` and log the choice."""
    import torch

    threads, why = choose_threads(configured, loader_workers)
    torch.set_num_threads(threads)
    log.info("using %d intra-op thread(s) (%s)", threads, why)
    return threads
