"""A loader worker dies with its trainer: a trainer SIGKILLed mid-epoch (the OOM killer, a soak) leaves
no worker behind, although the workers ignore the stop signals (they are the trainer's to handle). The
kernel kills them at once (PR_SET_PDEATHSIG); torch's own watchdog would notice only after up to 5 s,
and never while a worker is blocked (the soak once left one behind, holding the trainer's stdout)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

CHILD = textwrap.dedent("""
    import os, sys, time
    import torch
    from magclip.data.shards import build_clip_loader
    from magclip.data.synthetic import ensure_synthetic
    data = ensure_synthetic(sys.argv[1], num_train=64, num_val=8, image_size=16, shard_size=16)
    loader = build_clip_loader(data.train_urls, preprocess=lambda im: torch.zeros(3, 16, 16),
                               tokenizer=lambda caps: torch.zeros(len(caps), 4, dtype=torch.long), batch_size=4,
                               num_samples=64, shuffle=False, workers=2, rank=0, world_size=1, drop_last=False)
    batches = iter(loader)
    next(batches), next(batches)   # one from each worker: both have run their init
    print(" ".join(str(c.pid) for c in __import__("multiprocessing").active_children()), flush=True)
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_killed_trainer(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2 and all(alive(p) for p in workers)
        for pid in workers:               # the stop signals do not reach them ...
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        assert all(alive(p) for p in workers)
        proc.kill()                       # ... but their trainer's death does
        proc.wait(timeout=30)
        deadline = time.monotonic() + 2.5    # torch's watchdog polls every 5 s
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in workers), [p for p in workers if alive(p)]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
