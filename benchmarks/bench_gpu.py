"""GPU train-step benchmark on a ViT-B/32 in bf16: magclip vs open_clip_train, and magclip's lever matrix; < 9 minutes.

    python benchmarks/bench_gpu.py                       # on a GPU machine (writes results/gpu_train.json)
    python benchmarks/bench_gpu.py --tiny                # CPU smoke check: tiny-resnet, fp32, few steps, 1 round
    python benchmarks/bench_gpu.py --part floor          # only the floors beside the trainers (CLIP, text)

Part 1, `ab`: the same measurement as `bench_train.py --part ab` (fresh child per run, optimizer-step
timestamps, same window for both, A B A B ...), with:

- model `ViT-B-32` (open_clip's built-in config, random init: no download), batch 256, magclip
  `train.precision=bf16` (accelerate autocast) vs open_clip_train `--precision amp_bf16` (autocast);
- the embedded synthetic shards (generated into $MAGCLIP_CACHE, default /tmp/mc_cache, on first use;
  32 px scenes resized to 224 by open_clip's train transform), 12 shards, `--workers` each;
- `--threads` torch threads in both trainer processes.

Part 2, `matrix` (issue "speed levers"): magclip at each of `--matrix-batches` (256 1024 2048), in
priority order while the budget lasts -- batches already in memory (`--cached-batches`: the step's own
rate) with torch.compile off and on (fused AdamW, the default), then loader-fed magclip and
open_clip_train at the larger batches, then the for-loop optimizer at the first batch (what fused
buys). Every row has its MFU: FLOPs per pair of one training step (forward + backward of both towers
and the loss, `torch.utils.flop_counter`, counted once in a child at batch 4) x samples/s, against a
bf16 (fp32 with --tiny) matmul measured on the same device in the same run.

Part 3, `floor` (run before the matrix; issue 53): the compute floor of each trainer beside it, so that
"trainer / floor" reads how much of the device's time the trainer leaves to its loop and loader. CLIP:
`bench_floor.py`'s bare loop (the same open_clip model, batch and precision, fused AdamW, open_clip's
ClipLoss, batches decoded once and kept on the device) against the A/B row of magclip fed by its loader.
Text (with squad_train, `MAGCLIP_SHARED_DATA` or ../shared/data): `bench_text_trainer.py`'s magclip
text trainer (MiniLM, batch 32, the issue's recipe) against its floor (the same batches tokenized
before the clock, the bare transformers model); the floor also counts the text step's FLOPs (per padded
token x the median step's tokens), from which both text rows get their MFU. `--no-text` leaves the text
rows out.

A time budget (`--budget-s`, default 500 s) is checked before every run: a run is started only if
the slowest run of its kind so far (of any kind, before the first) still fits; a run that fails (out
of memory, cut at the budget) is recorded and the rest go on; the JSON is rewritten after every run,
so a cut-off leaves what was measured. GPU memory: torch.cuda.max_memory_allocated/reserved of each trainer; host
memory: the peak PSS of each trainer's whole process tree (loader workers included), sampled every
0.5 s, and the largest single process's RSS.

open_clip_train needs its [training] extra (pandas, webdataset<=0.2.86). It uses the interpreter
of `--open-clip-python` when that exists (benchmarks/setup_open_clip_train_env.sh makes it), else
the current one with `--shim-missing-deps` (pandas stubbed: only its CSV dataset uses it; webdataset
1.x's end-of-shard marker switched off, the cause of open_clip issue #935); the JSON records which.

On a GPU machine without a package index: install the wheels of open_clip_torch, webdataset,
braceexpand and this checkout (`pip install --no-index --no-deps wheels/*.whl -e .`; torch,
torchvision, timm and accelerate are expected there), then run the command above with a timeout of
~9 minutes; it needs no data (the shards are generated, ~40 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    RESULTS_DIR,
    clip_batch,
    clip_train_module,
    machine_info,
    median,
    peak_matmul_gflops,
    run_child,
    synthetic_urls,
    table,
    write_json,
)

HERE = Path(__file__).resolve().parent
DEFAULT_OC_PY = Path.home() / ".cache" / "magclip-bench" / "open_clip_train_venv" / "bin" / "python"


@dataclass
class Run:
    """One planned child: its row label, the batch it trains at and its command (without --out/--workdir)."""

    label: str
    batch: int
    cmd: list[str]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--batch-size", type=int, default=256, help="the A/B comparison's batch")
    p.add_argument("--matrix-batches", type=int, nargs="*", default=[256, 1024, 2048])
    p.add_argument("--part", choices=["ab", "floor", "matrix", "all"], default="all")
    p.add_argument("--text", action=argparse.BooleanOptionalAction, default=True,
                   help="part floor: also the text trainer against its floor (needs squad_train, see bench_text_trainer.py)")
    p.add_argument("--workers", type=int, default=12, help="loader workers of each trainer (<= 12 shards)")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--measure", type=int, default=50)
    p.add_argument("--reps", type=int, default=2, help="A/B rounds")
    p.add_argument("--budget-s", type=float, default=500)
    p.add_argument("--open-clip-python", default=str(DEFAULT_OC_PY))
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke check: tiny-resnet, fp32, 2+4 steps, 1 round, matrix batches 16 32 without compile "
                        "(a cold CPU compile alone takes minutes; benchmarks/bench_levers.py --part compile times it)")
    p.add_argument("--out", default=None)
    p.add_argument("--child-flops", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child_flops:
        return flops_child(a.model, a.device, Path(a.out))
    t_start = time.perf_counter()

    import torch

    cuda = torch.cuda.is_available()
    if a.tiny:
        a.model, a.batch_size, a.workers, a.threads, a.skip, a.measure, a.reps = "tiny-resnet", 32, 2, 1, 2, 4, 1
        a.matrix_batches = [16, 32]
        precision = ("fp32", "fp32")
    else:
        if not cuda:
            raise SystemExit("SKIP: no CUDA device; this script is for a GPU machine (use --tiny for a CPU smoke check)")
        precision = ("bf16", "amp_bf16")
    device = "cuda" if cuda and not a.tiny else "cpu"
    hide_gpu = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else None  # --tiny: both trainers on the CPU
    urls, _ = synthetic_urls()
    info = machine_info(a.threads)
    if cuda:
        info["gpu"] = torch.cuda.get_device_name()
    oc_py = Path(a.open_clip_python)
    shim = not oc_py.is_file()

    def magclip(batch: int, *extra: str, cached: bool = False) -> list[str]:
        return [sys.executable, str(HERE / "_run_magclip.py"), *_common_args(a, urls, batch), "--precision", precision[0],
                *(["--cached-batches", str(max(1, 2048 // batch))] if cached else []),
                *(["--extra", *extra] if extra else [])]

    def open_clip_train(batch: int) -> list[str]:
        return [sys.executable if shim else str(oc_py), str(HERE / "_run_open_clip.py"), *_common_args(a, urls, batch),
                "--precision", precision[1], "--device", device, *(["--shim-missing-deps"] if shim else [])]

    plan: list[Run] = []
    if a.part in ("ab", "all"):
        for _ in range(a.reps):
            plan += [Run("magclip", a.batch_size, magclip(a.batch_size)),
                     Run("open_clip_train", a.batch_size, open_clip_train(a.batch_size))]
    if a.part in ("floor", "all"):
        if a.part == "floor":  # the loader-fed trainer the CLIP floor is compared with (part ab has it otherwise)
            plan.append(Run("magclip", a.batch_size, magclip(a.batch_size)))
        plan += _floor_plan(a, device, precision[0])
    if a.part in ("matrix", "all"):
        plan += _matrix_plan(a.matrix_batches, magclip, open_clip_train, compiled=not a.tiny)
    out = Path(a.out) if a.out else RESULTS_DIR / f"gpu_train{'_tiny' if a.tiny else ''}.json"
    runs: dict[str, list[dict]] = {}
    record = {"benchmark": "gpu/train_ab_and_levers", "machine": info,
              "settings": {**vars(a), "precision_magclip": precision[0], "precision_open_clip_train": precision[1],
                           "data_urls": urls, "device": device,
                           "open_clip_train_env": "shim (pandas stubbed, current webdataset)" if shim else str(oc_py)},
              "runs": runs}
    print(f"gpu bench: {a.model}, {precision}, {a.workers} workers, {a.threads} threads, device {device}, "
          f"steps {a.skip + 1}..{a.skip + a.measure}; {len(plan)} runs planned; budget {a.budget_s:.0f} s", flush=True)
    record["flops"] = _flops(a.model, device, bf16=precision[0] == "bf16", env=hide_gpu)
    write_json(out, record)
    walls: dict[str, float] = {}  # label -> slowest wall so far (a cold compile is slow, an eager run is not)
    failed = record["failed"] = []
    for run in plan:
        left = a.budget_s - (time.perf_counter() - t_start)
        expected = walls.get(run.label, max(walls.values(), default=0.0)) * 1.1
        if left <= expected:
            print(f"  budget: not starting {run.label} (batch {run.batch}); {left:.0f} s left", flush=True)
            continue
        try:
            res = run_child(run.cmd, a.threads, timeout=left, label=run.label, extra_env=hide_gpu)
        except RuntimeError as e:  # killed at the budget, or out of memory at a large batch: keep the rest
            failed.append({"run": f"{run.label} @ {run.batch}", "error": str(e)[-1500:]})
            print(f"  {run.label} @ {run.batch} failed: {str(e)[-300:]}", flush=True)
            write_json(out, record)
            continue
        walls[run.label] = max(walls.get(run.label, 0.0), res["wall_s"])
        runs.setdefault(f"{run.label} @ {run.batch}", []).append(res)
        print(f"  {run.label:>32} @ {run.batch:<5}: {res['samples_per_s']:9.1f} samples/s "
              f"(step {res['step_ms_median']:.1f} ms, GPU max alloc {res.get('cuda_max_allocated_mb', 0):.0f} MiB, "
              f"tree PSS {res['peak_tree_pss_mb']:.0f} MiB, wall {res['wall_s']:.0f} s)", flush=True)
        write_json(out, record)
    text_floor = runs.get(f"{TEXT_FLOOR} @ {TEXT_BATCH}", [{}])[0].get("flops_per_step")
    record["flops"]["text_flops_per_pair"] = text_floor / TEXT_BATCH if text_floor else None
    record["summary"] = _summary(runs, record["flops"])
    ab = record["summary"]
    key_m, key_o = f"magclip @ {a.batch_size}", f"open_clip_train @ {a.batch_size}"
    if key_m in ab and key_o in ab:
        record["ratio_magclip_over_open_clip_train"] = ab[key_m]["samples_per_s_median"] / ab[key_o]["samples_per_s_median"]
    for name, trainer, floor in (("clip", key_m, f"{CLIP_FLOOR} @ {a.batch_size}"),
                                 ("text", f"{TEXT_TRAINER} @ {TEXT_BATCH}", f"{TEXT_FLOOR} @ {TEXT_BATCH}")):
        if trainer in ab and floor in ab:  # the trainer fed by its loader over the same model fed from memory
            record[f"ratio_{name}_trainer_over_floor"] = (ab[trainer]["samples_per_s_median"]
                                                         / ab[floor]["samples_per_s_median"])
    record["total_s"] = round(time.perf_counter() - t_start, 1)
    write_json(out, record)
    rows = [[k, v["samples_per_s_median"], str(v["samples_per_s_runs"]), v["step_ms_median"], f"{v['mfu_percent']:.1f} %",
             v["cuda_max_allocated_mb"], v["peak_tree_pss_mb"]] for k, v in record["summary"].items()]
    print(table(rows, ["run @ batch", "samples/s (median)", "runs", "step ms", "MFU", "GPU max alloc MiB",
                       "host tree PSS MiB"]))
    print(f"one pair = {record['flops']['flops_per_pair'] / 1e9:.3g} GFLOP (forward + backward); matmul peak "
          f"{record['flops']['peak_gflops']:.0f} GFLOP/s ({record['flops']['peak_dtype']})")
    if "ratio_magclip_over_open_clip_train" in record:
        print(f"ratio magclip / open_clip_train = {record['ratio_magclip_over_open_clip_train']:.3f}")
    for name in ("clip", "text"):
        if f"ratio_{name}_trainer_over_floor" in record:
            print(f"{name}: trainer / its floor = {record[f'ratio_{name}_trainer_over_floor']:.3f}")
    print(f"wrote {out} ({record['total_s']} s)")


def _common_args(a, urls: str, batch: int) -> list[str]:
    n = (a.skip + a.measure + 2) * batch
    return ["--data", urls, "--num-samples", str(n), "--model", a.model, "--batch-size", str(batch),
            "--threads", str(a.threads), "--skip", str(a.skip), "--measure", str(a.measure), "--workers", str(a.workers)]


CLIP_FLOOR = "floor (in memory, bare loop)"
TEXT_TRAINER, TEXT_FLOOR, TEXT_BATCH = "text: magclip trainer", "text: floor (bare model, in memory)", 32


def _floor_plan(a, device: str, precision: str) -> list[Run]:
    """The compute floors beside the trainers: bench_floor.py's bare loop at the A/B batch (the same model,
    precision, fused AdamW, ClipLoss, batches in memory), and bench_text_trainer.py's text trainer and its
    floor (MiniLM on squad_train, batch 32) when squad_train is there."""
    steps = a.skip + a.measure + 1
    common = ["--steps", str(steps), "--skip", str(a.skip), "--threads", str(a.threads), "--device", device]
    plan = [Run(CLIP_FLOOR, a.batch_size, [sys.executable, str(HERE / "bench_floor.py"), "--child", "floor",
                                           "--model", a.model, "--batch-size", str(a.batch_size), *common,
                                           "--extra", f"train.precision={precision}"])]
    from bench_text_trainer import SQUAD

    if not a.text:
        return plan
    if not (SQUAD / "qrels" / "train.tsv").is_file():
        print(f"  text rows left out: no squad_train at {SQUAD} (set MAGCLIP_SHARED_DATA)", flush=True)
        return plan
    if a.tiny:  # a MiniLM step takes seconds on a CPU: 3 steps, 2000 records
        common = ["--steps", "3", "--skip", "1", "--threads", str(a.threads), "--device", device, "--max-records", "2000"]
    text = [sys.executable, str(HERE / "bench_text_trainer.py"), *common, "--precision", precision]
    return plan + [Run(TEXT_FLOOR, TEXT_BATCH, [*text, "--child", "floor", "--flops"]),
                   Run(TEXT_TRAINER, TEXT_BATCH, [*text, "--child", "magclip"])]


def _matrix_plan(batches: list[int], magclip, open_clip_train, compiled: bool = True) -> list[Run]:
    """The lever matrix in priority order: the step's own rate (in memory, compile off/on) at every batch
    first, then both trainers fed by the loader at the larger batches, then the for-loop optimizer."""
    plan = []
    for batch in batches:
        plan.append(Run("magclip in memory, eager", batch, magclip(batch, cached=True)))
        if compiled:
            plan.append(Run("magclip in memory, compiled", batch, magclip(batch, "train.compile=true", cached=True)))
    for batch in batches[1:]:
        plan += [Run("magclip", batch, magclip(batch)), Run("open_clip_train", batch, open_clip_train(batch))]
    plan.append(Run("magclip in memory, eager, for-loop AdamW", batches[0],
                    magclip(batches[0], "train.optimizer_impl=for_loop", cached=True)))
    return plan


def _flops(model: str, device: str, bf16: bool, env: dict | None) -> dict:
    """FLOPs per pair and the matmul peak, from a child (it builds the model on the device once)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "flops.json"
        subprocess.run([sys.executable, __file__, "--child-flops", "--model", model, "--device", device,
                        "--out", str(out)], check=True, env={**os.environ, **(env or {})})
        res = json.loads(out.read_text())
    res["peak_dtype"] = "bf16" if bf16 else "fp32"
    res["peak_gflops"] = res["peak_gflops_bf16" if bf16 else "peak_gflops_fp32"]
    return res


def flops_child(model: str, device: str, out: Path, batch: int = 4) -> None:
    """Count one training step's FLOPs (forward + backward, both towers, the loss) at a small batch, per pair;
    measure fp32 and bf16 matmul peaks on `device`."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    module = clip_train_module(model).to(device)
    clip = module.clip.clip
    size = clip.visual.image_size
    data = clip_batch(batch, image_size=size[0] if isinstance(size, (tuple, list)) else size,
                      text_length=clip.context_length)
    with FlopCounterMode(display=False) as counter:
        image, text = module(data)
        module.compute_loss(image, text)["loss"].backward()
    n, reps = (8192, 20) if device.startswith("cuda") else (1024, 5)
    write_json(out, {"flops_per_pair": counter.get_total_flops() / batch, "flops_batch": batch, "device": device,
                     "peak_gflops_fp32": peak_matmul_gflops(torch.float32, n, reps, device),
                     "peak_gflops_bf16": peak_matmul_gflops(torch.bfloat16, n, reps, device)})


def _summary(runs: dict[str, list[dict]], flops: dict) -> dict:
    summary = {}
    for key, rs in runs.items():
        rate = median([x["samples_per_s"] for x in rs])
        per_pair = flops.get("text_flops_per_pair") if key.startswith("text") else flops["flops_per_pair"]
        summary[key] = {"samples_per_s_median": rate, "samples_per_s_runs": [round(x["samples_per_s"], 1) for x in rs],
                        "step_ms_median": median([x["step_ms_median"] for x in rs]),
                        "mfu_percent": 100 * rate * per_pair / (flops["peak_gflops"] * 1e9) if per_pair else float("nan"),
                        "cuda_max_allocated_mb": max(x.get("cuda_max_allocated_mb", 0) for x in rs),
                        "peak_tree_pss_mb": max(x["peak_tree_pss_mb"] for x in rs),
                        "peak_rss_main_mb": max(x["peak_rss_main_mb"] for x in rs),
                        "wall_s": [x["wall_s"] for x in rs]}
    return summary


if __name__ == "__main__":
    main()
