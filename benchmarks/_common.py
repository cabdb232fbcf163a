"""Shared helpers of the benchmark scripts: paths, data, child processes, step timing, tables.

Every contender runs in its own child process (`python benchmarks/_run_*.py ...`), so that each
one pays its own imports and start-up, cannot warm a cache for the other, and reports its own
peak memory. A child writes one JSON file; the parent alternates the contenders (A B A B ...)
and reports medians, because the machines these run on are shared and noisy: the ratio of
interleaved medians is the figure, not any single absolute number.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
# the real data (../shared/data beside a checkout; MAGCLIP_SHARED_DATA elsewhere, e.g. in a git worktree)
SHARED_DATA = Path(os.environ.get("MAGCLIP_SHARED_DATA", REPO / ".." / "shared" / "data")).resolve()
EMOJI_DIR = SHARED_DATA / "emoji"
SCIFACT_DIR = SHARED_DATA / "text" / "scifact"
# the interpreter of open_clip_train's own venv (made by setup_open_clip_train_env.sh)
DEFAULT_OC_PY = Path.home() / ".cache" / "magclip-bench" / "open_clip_train_venv" / "bin" / "python"

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ----------------------------------------------------------------------------- environment


def child_env(threads: int | None) -> dict[str, str]:
    """The environment of every contender: the same thread count for OpenMP/MKL and torch; None leaves the
    count to the contender (no thread variable set, as a user runs it)."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        if threads is None:
            env.pop(var, None)
        else:
            env[var] = str(threads)
    env.setdefault("MAGCLIP_CACHE", "/tmp/mc_cache")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def machine_info(threads: int) -> dict[str, Any]:
    import torch

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "host_cpus": os.cpu_count(), "threads": threads, "loadavg_at_start": load,
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(),
            "note": "shared machine: other jobs ran during the measurement; compare interleaved medians"}


# ----------------------------------------------------------------------------- data


def synthetic_urls(num_train: int = 6000) -> tuple[str, int]:
    """The embedded synthetic shards (generated into $MAGCLIP_CACHE on first use) and their size."""
    os.environ.setdefault("MAGCLIP_CACHE", "/tmp/mc_cache")
    from magclip.data.synthetic import ensure_synthetic

    synth = ensure_synthetic(None, num_train=num_train, num_val=500, image_size=32)
    from magclip.data.shards import count_samples

    return synth.train_urls, count_samples(synth.train_urls)


def emoji_urls() -> tuple[str, int] | None:
    """The real emoji train shards under ../shared/data/emoji, or None when missing."""
    shards = sorted(EMOJI_DIR.glob("train-*.tar"))
    if not shards:
        return None
    from magclip.data.shards import count_samples

    urls = str(EMOJI_DIR / f"train-{{000000..{len(shards) - 1:06d}}}.tar")
    return urls, count_samples(urls)


def jpeg224_urls(count: int = 12000, per_shard: int = 1000) -> tuple[str, int] | None:
    """224-px JPEG shards the size of web photos, made once into ~/.cache/magclip-bench/jpeg224 from the
    emoji train images: each upscaled to 224 x 224 (bicubic) with mild noise (sigma 8) so that it
    encodes like a photo rather than flat art (~23 kB at quality 95, img2dataset's default); the
    captions are the emoji's. 12 shards of 1,000: 6,000 samples per worker with 2 workers, so a 5,000
    sample buffer really fills. None when the emoji shards are missing."""
    import io
    import tarfile

    folder = Path.home() / ".cache" / "magclip-bench" / "jpeg224"
    n_shards = count // per_shard
    urls = str(folder / f"jpeg224-{{000000..{n_shards - 1:06d}}}.tar")
    if (folder / "done").is_file() and (folder / "done").read_text().strip() == str(count):
        return urls, count
    found = sorted(EMOJI_DIR.glob("train-*.tar"))
    if not found:
        return None
    import numpy as np
    from PIL import Image

    from magclip.data.shard_reader import iter_tar_samples

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    samples = (s for _ in range(count) for s in iter_tar_samples([str(f) for f in found], {}))
    written = 0
    while written < count:
        with tarfile.open(folder / f"jpeg224-{written // per_shard:06d}.tar", "w") as tar:
            for _ in range(per_shard):
                _, key, sample = next(samples)
                image = Image.open(io.BytesIO(sample["png"])).convert("RGB").resize((224, 224), Image.BICUBIC)
                noisy = np.clip(np.asarray(image, dtype=np.float32) + rng.normal(0, 8, (224, 224, 3)), 0, 255)
                buf = io.BytesIO()
                Image.fromarray(noisy.astype(np.uint8)).save(buf, format="JPEG", quality=95)
                for ext, data in (("jpg", buf.getvalue()), ("txt", sample["txt"])):
                    info = tarfile.TarInfo(f"j{written:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                written += 1
    (folder / "done").write_text(f"{count}\n")
    return urls, count


def resolve_data(which: str) -> tuple[str, int]:
    """`--data synthetic|emoji|jpeg224` -> (shard URLs, sample count); SKIP (exit) when the emoji shards
    (which jpeg224 is made from) are missing."""
    if which == "synthetic":
        return synthetic_urls()
    found = jpeg224_urls() if which == "jpeg224" else emoji_urls()
    if found is None:
        raise SystemExit(f"SKIP: emoji shards not found under {EMOJI_DIR} (see {BENCH_DIR / 'README.md'})")
    return found


# ----------------------------------------------------------------------------- step timing (children)


def train_child_parser() -> argparse.ArgumentParser:
    """The arguments both training children (`_run_magclip.py`, `_run_open_clip.py`) start with."""
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--num-samples", type=int, required=True)
    p.add_argument("--model", default="tiny-resnet")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--epochs", type=int, default=1)
    return p


class StepClock:
    """Timestamps at the end of every optimizer step, for any torch optimizer in the process.

    Uses torch's global optimizer step post-hook, so the trainer under test is not modified and
    both trainers are timed by exactly the same code: the time between the end of step i and the
    end of step j covers everything the trainer does per step (waiting for data, forward,
    backward, clipping, optimizer, logging).
    """

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.times: list[float] = []
        self.optimizer: str | None = None  # what stepped first: class and kernel (fused / foreach / for-loop)
        self._handle = register_optimizer_step_post_hook(self._hook)

    def _hook(self, optimizer, args, kwargs) -> None:
        self.times.append(time.perf_counter())
        if self.optimizer is None:
            d = optimizer.defaults
            kernel = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "default (foreach where supported)" \
                if d.get("foreach") is None else "for-loop"
            self.optimizer = f"{type(optimizer).__name__}, {kernel}"

    def close(self) -> None:
        self._handle.remove()


def steady_rate(times: Sequence[float], samples_per_step: int, skip: int, measure: int | None) -> dict[str, Any]:
    """samples/s over steps skip+1 .. skip+measure (intervals after the first `skip` steps)."""
    end = len(times) if measure is None else min(len(times), skip + 1 + measure)
    window = list(times[skip:end])
    if len(window) < 2:
        raise RuntimeError(f"only {len(times)} steps timed; need more than skip={skip}")
    span = window[-1] - window[0]
    steps = len(window) - 1
    deltas = [b - a for a, b in itertools.pairwise(window)]
    return {"samples_per_s": samples_per_step * steps / span, "steps_measured": steps, "seconds": span,
            "step_ms_median": 1000 * statistics.median(deltas), "steps_total": len(times)}


def peak_rss_mb() -> dict[str, float]:
    """ru_maxrss of this process and of the largest of its finished children (loader workers), MiB."""
    import gc

    gc.collect()
    return {"peak_rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_rss_largest_child_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def gpu_peak_mb() -> dict[str, float]:
    """torch.cuda.max_memory_allocated / reserved of this process in MiB (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"cuda_max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
            "cuda_max_reserved_mb": torch.cuda.max_memory_reserved() / 2**20,
            "cuda_device": torch.cuda.get_device_name()}


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


# ----------------------------------------------------------------------------- parent side


def run_child(cmd: list[str], threads: int | None, timeout: float = 900, label: str = "",
              extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one contender; returns its JSON plus wall time and the tree's peak RSS (wait4)."""
    with tempfile.TemporaryDirectory(prefix="magclip_bench_") as tmp:
        out = Path(tmp) / "result.json"
        log_path = Path(tmp) / "log.txt"
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen([*cmd, "--out", str(out), "--workdir", tmp], cwd=REPO,
                                    env={**child_env(threads), **(extra_env or {})}, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.time() + timeout
            peak_pss, next_sample = 0.0, 0.0
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.time() > deadline:
                    proc.kill()
                    pid, status, usage = os.wait4(proc.pid, 0)
                    break
                if time.time() >= next_sample:
                    peak_pss = max(peak_pss, tree_pss_mb(proc.pid))
                    next_sample = time.time() + 0.5
                time.sleep(0.05)
            proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.is_file():
            tail = log_path.read_text()[-3000:]
            raise RuntimeError(f"{label or cmd[1]} failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(out.read_text())
    result["wall_s"] = round(wall, 2)
    result["peak_rss_tree_max_mb"] = usage.ru_maxrss / 1024  # the largest single process of the tree
    result["peak_tree_pss_mb"] = peak_pss  # sampled every 0.5 s: the whole tree, shared pages split fairly
    return result


def clip_train_module(model: str):
    """The CLIP training module the engine steps (the model's towers, the default loss and scale), random init."""
    from magclip.config import LossConfig
    from magclip.models.clip import create_clip
    from magclip.training.clip import CLIPTrainModule, build_logit_scale, build_loss

    loss = LossConfig()
    return CLIPTrainModule(create_clip(model).model, build_loss(loss), build_logit_scale(loss))


def engine_in_memory(cfg, module):
    """The training engine around `module` with no loader, evaluation or model saving: for timing its
    `_train_step` on batches already in memory (the step's own work, without the loop around it)."""
    from magclip.training.accelerator import make_accelerator
    from magclip.training.engine import Engine

    run_dir = Path(tempfile.mkdtemp(prefix="engine_"))
    return Engine(cfg, make_accelerator(cfg, run_dir), module, run_dir, lambda e: [], 10 ** 6,
                  save_model=lambda m, d: None)


def clip_batch(batch: int, seed: int = 0, image_size: int = 32, text_length: int = 32) -> dict:
    """One loader-shaped batch of random uint8 images and token ids (the engine normalizes on its device)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"images": torch.randint(0, 255, (batch, 3, image_size, image_size), dtype=torch.uint8, generator=g),
            "texts": torch.randint(1, 400, (batch, text_length), generator=g), "keys": [], "skipped": {}}


def peak_matmul_gflops(dtype, n: int = 1024, reps: int = 5, device: str = "cpu") -> float:
    """GFLOP/s of an n^3 matmul in `dtype` on `device`: the peak an MFU is quoted against, measured in the same run."""
    import torch

    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e9


def tree_pss_mb(pid: int) -> float:
    """Sum of PSS (proportional set size) over a process and its descendants, MiB; 0 if unreadable.

    ru_maxrss of a forked loader worker counts the pages it shares with its parent, so it says
    little about what a worker adds; PSS splits shared pages between the processes that map them,
    so the sum over the tree is the tree's real footprint."""
    try:
        import psutil
    except ImportError:
        return 0.0
    total = 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except (psutil.Error, AttributeError):
            pass
    return total / 2**20


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def table(rows: list[list[Any]], header: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)

    cells = [header] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
