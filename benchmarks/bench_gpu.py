"""GPU train-step comparison: magclip vs open_clip_train on a ViT-B/32 in bf16, one prepared run < 8 minutes.

    python benchmarks/bench_gpu.py                       # on a GPU machine (writes results/gpu_train.json)
    python benchmarks/bench_gpu.py --tiny                # CPU smoke check: tiny-resnet, fp32, few steps, 1 round

The same measurement as `bench_train.py --part ab` (fresh child per run, optimizer-step timestamps,
same window for both, A B A B ...), with:

- model `ViT-B-32` (open_clip's built-in config, random init: no download), batch 256, magclip
  `train.precision=bf16` (accelerate autocast) vs open_clip_train `--precision amp_bf16` (autocast);
- the embedded synthetic shards (generated into $MAGCLIP_CACHE, default /tmp/mc_cache, on first use;
  32 px scenes resized to 224 by open_clip's train transform), 12 shards, `--workers` each;
- `--threads` torch threads in both trainer processes;
- then, if time is left, magclip fed from batches already in memory (`--cached-batches`): the step's
  own rate, i.e. how far the loader holds the end-to-end figure down.

A time budget (`--budget-s`, default 420 s) is checked before every run: a run is started only if
the slowest run so far still fits, and the JSON is rewritten after every run, so a cut-off leaves
what was measured. GPU memory: torch.cuda.max_memory_allocated/reserved of each trainer.

open_clip_train needs its [training] extra (pandas, webdataset<=0.2.86). It uses the interpreter
of `--open-clip-python` when that exists (benchmarks/setup_open_clip_train_env.sh makes it), else
the current one with `--shim-missing-deps` (pandas stubbed: only its CSV dataset uses it; webdataset
1.x's end-of-shard marker switched off, the cause of open_clip issue #935); the JSON records which.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, machine_info, median, run_child, synthetic_urls, table, write_json

HERE = Path(__file__).resolve().parent
DEFAULT_OC_PY = Path.home() / ".cache" / "magclip-bench" / "open_clip_train_venv" / "bin" / "python"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=12, help="loader workers of each trainer (<= 12 shards)")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--measure", type=int, default=50)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--open-clip-python", default=str(DEFAULT_OC_PY))
    p.add_argument("--tiny", action="store_true", help="CPU smoke check: tiny-resnet, fp32, 2+4 steps, 1 round")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    t_start = time.perf_counter()

    import torch

    cuda = torch.cuda.is_available()
    if a.tiny:
        a.model, a.batch_size, a.workers, a.threads, a.skip, a.measure, a.reps = "tiny-resnet", 32, 2, 1, 2, 4, 1
        precision = ("fp32", "fp32")
    else:
        if not cuda:
            raise SystemExit("SKIP: no CUDA device; this script is for a GPU machine (use --tiny for a CPU smoke check)")
        precision = ("bf16", "amp_bf16")
    device = "cuda" if cuda and not a.tiny else "cpu"
    hide_gpu = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else None  # --tiny: both trainers on the CPU
    urls, _ = synthetic_urls()
    n = (a.skip + a.measure + 2) * a.batch_size
    info = machine_info(a.threads)
    if cuda:
        info["gpu"] = torch.cuda.get_device_name()
    oc_py = Path(a.open_clip_python)
    shim = not oc_py.is_file()
    common = ["--data", urls, "--num-samples", str(n), "--model", a.model, "--batch-size", str(a.batch_size),
              "--threads", str(a.threads), "--skip", str(a.skip), "--measure", str(a.measure), "--workers", str(a.workers)]
    contenders = {
        "magclip": [sys.executable, str(HERE / "_run_magclip.py"), *common, "--precision", precision[0]],
        "open_clip_train": [sys.executable if shim else str(oc_py), str(HERE / "_run_open_clip.py"), *common,
                            "--precision", precision[1], "--device", device, *(["--shim-missing-deps"] if shim else [])],
    }
    cached = [sys.executable, str(HERE / "_run_magclip.py"), *common, "--precision", precision[0],
              "--cached-batches", "8"]
    out = Path(a.out) if a.out else RESULTS_DIR / f"gpu_train{'_tiny' if a.tiny else ''}.json"
    runs: dict[str, list[dict]] = {"magclip": [], "open_clip_train": [], "magclip_cached_batches": []}
    record = {"benchmark": "gpu/train_ab", "machine": info,
              "settings": {**vars(a), "precision_magclip": precision[0], "precision_open_clip_train": precision[1],
                           "data_urls": urls, "num_samples": n, "device": device,
                           "open_clip_train_env": "shim (pandas stubbed, current webdataset)" if shim else str(oc_py)},
              "runs": runs}
    slowest = 0.0

    def fits() -> bool:
        left = a.budget_s - (time.perf_counter() - t_start)
        return left > slowest * 1.1

    print(f"gpu bench: {a.model}, batch {a.batch_size}, {precision}, {a.workers} workers, {a.threads} threads, "
          f"device {device}, steps {a.skip + 1}..{a.skip + a.measure}; budget {a.budget_s:.0f} s", flush=True)
    for r in range(a.reps):
        for name, cmd in contenders.items():
            if not fits():
                print(f"  budget: not starting {name} round {r + 1}", flush=True)
                continue
            res = run_child(cmd, a.threads, timeout=max(60.0, a.budget_s - (time.perf_counter() - t_start)), label=name, extra_env=hide_gpu)
            slowest = max(slowest, res["wall_s"])
            runs[name].append(res)
            print(f"  round {r + 1} {name:>16}: {res['samples_per_s']:9.1f} samples/s (step {res['step_ms_median']:.1f} ms, "
                  f"GPU max alloc {res.get('cuda_max_allocated_mb', 0):.0f} MiB, wall {res['wall_s']:.0f} s)", flush=True)
            write_json(out, record)
    if fits():
        res = run_child(cached, a.threads, timeout=max(60.0, a.budget_s - (time.perf_counter() - t_start)),
                        label="magclip cached", extra_env=hide_gpu)
        runs["magclip_cached_batches"].append(res)
        print(f"  magclip, batches in memory: {res['samples_per_s']:9.1f} samples/s", flush=True)
    summary = {k: {"samples_per_s_median": median([x["samples_per_s"] for x in v]),
                   "samples_per_s_runs": [round(x["samples_per_s"], 1) for x in v],
                   "step_ms_median": median([x["step_ms_median"] for x in v]),
                   "cuda_max_allocated_mb": max(x.get("cuda_max_allocated_mb", 0) for x in v),
                   "peak_rss_main_mb": max(x["peak_rss_main_mb"] for x in v)} for k, v in runs.items() if v}
    record["summary"] = summary
    if runs["magclip"] and runs["open_clip_train"]:
        record["ratio_magclip_over_open_clip_train"] = (summary["magclip"]["samples_per_s_median"]
                                                        / summary["open_clip_train"]["samples_per_s_median"])
    record["total_s"] = round(time.perf_counter() - t_start, 1)
    write_json(out, record)
    rows = [[k, v["samples_per_s_median"], str(v["samples_per_s_runs"]), v["step_ms_median"], v["cuda_max_allocated_mb"],
             v["peak_rss_main_mb"]] for k, v in summary.items()]
    print(table(rows, ["trainer", "samples/s (median)", "runs", "step ms", "GPU max alloc MiB", "peak RSS MiB"]))
    if "ratio_magclip_over_open_clip_train" in record:
        print(f"ratio magclip / open_clip_train = {record['ratio_magclip_over_open_clip_train']:.3f}")
    print(f"wrote {out} ({record['total_s']} s)")


if __name__ == "__main__":
    main()
