"""Data loading alone vs what a train step consumes.

    python benchmarks/bench_loader.py                     # synthetic shards, 0/1/2 workers vs the step, 3 rounds
    python benchmarks/bench_loader.py --data emoji        # the real emoji shards (64 px PNG)
    python benchmarks/bench_loader.py --tiny              # smoke check
    python benchmarks/bench_loader.py --data jpeg224 --workers-list 2 --shuffle-buffer 1000 5000   # buffer memory

Loader: magclip's shard pipeline (`magclip.data.shards.build_clip_loader`: shard split, tar read,
group, shuffle buffer, PNG decode, open_clip's train transform, tokenizer in the collation),
drained by a process that does nothing else; samples/s between batch `--skip` and the last batch.
With `--with-open-clip`, open_clip_train's own webdataset pipeline (`get_wds_dataset`) on the
same shards, in its environment, for reference.

Consumption: the same magclip trainer as `bench_train.py` (`train_clip`, same model, batch,
threads), fed from K batches decoded before the run (`_run_magclip.py --cached-batches`), so a
step never waits for data: the samples/s a train step consumes. Target: loader >= 3x that.

Every measurement is a fresh child process; rounds are interleaved (loader 0/1/2 workers, step,
...), medians reported. Memory: ru_maxrss of the draining process and the peak PSS of the whole
process tree (with its workers), sampled every 0.5 s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    DEFAULT_OC_PY,
    RESULTS_DIR,
    machine_info,
    median,
    peak_rss_mb,
    resolve_data,
    run_child,
    table,
    write_json,
)

HERE = Path(__file__).resolve().parent


def child_loader(a) -> None:
    """Drain magclip's loader (or open_clip_train's with --impl open_clip) and time it."""
    import torch

    torch.set_num_threads(a.threads)
    from magclip.models.clip import create_clip

    bundle = create_clip(a.model)
    collate_s = _time_collation() if a.time_collate else None
    if a.impl == "magclip":
        from magclip.data.shards import build_clip_loader
        from magclip.models.clip import uint8_transform

        preprocess = (uint8_transform(bundle.preprocess_train) or bundle.preprocess_train if a.trainer_transform
                      else bundle.preprocess_train)
        cache = _decoded_cache(a.data) if a.decoded_cache else None  # filled before the clock: the later epochs' loader
        loader = build_clip_loader(a.data, preprocess=preprocess, tokenizer=bundle.tokenizer,
                                   batch_size=a.batch_size, num_samples=a.num_samples, shuffle=True, workers=a.workers,
                                   seed=0, shuffle_buffer=a.shuffle_buffer[0], decoded_cache=cache)
    else:
        from types import SimpleNamespace

        from open_clip_train.data import get_wds_dataset

        args = SimpleNamespace(train_data=a.data, val_data=None, dataset_resampled=False, train_num_samples=a.num_samples,
                               train_data_upsampling_factors=None, seed=0, batch_size=a.batch_size, workers=a.workers,
                               world_size=1)
        loader = get_wds_dataset(args, bundle.preprocess_train, is_train=True, tokenizer=bundle.tokenizer).dataloader
    times, n = [], 0
    t_start = time.perf_counter()
    for batch in loader:
        images = batch["images"] if isinstance(batch, dict) else batch[0]
        n += images.shape[0]
        times.append(time.perf_counter())
    skip = min(a.skip, len(times) - 2)
    span = times[-1] - times[skip]
    rate = a.batch_size * (len(times) - 1 - skip) / span
    from _common import write_json as wj

    wj(a.out, {"impl": a.impl, "workers": a.workers, "batches": len(times), "samples": n, "samples_per_s": rate,
               "first_batch_s": times[0] - t_start, "drain_s": times[-1] - t_start,
               "collate_s": collate_s[0] if collate_s else None, "threads": torch.get_num_threads(), **peak_rss_mb()})


def _decoded_cache(urls: str):
    """The trainer's decoded-sample cache of these shards (magclip.data.decoded_cache), as data.cache fills it."""
    from magclip.data import decoded_cache
    from magclip.data.captions import CaptionKey
    from magclip.data.shard_reader import DEFAULT_MAX_IMAGE_PIXELS

    return decoded_cache.fill(urls, max_pixels=DEFAULT_MAX_IMAGE_PIXELS, caption_key=CaptionKey("txt"),
                              budget_mb=decoded_cache.default_budget_mb())


def _time_collation() -> list[float]:
    """Time spent in the loader's collation (stack + tokenizer), summed into the returned one-element list.
    In-process only: with workers the collation runs in other processes (use 0 workers)."""
    from magclip.data import shards

    inner = getattr(shards, "_collate", None)
    if inner is None:
        raise SystemExit("--time-collate: magclip.data.shards._collate not found (the loader changed): "
                         "update bench_loader.py's _time_collation")
    total = [0.0]

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        total[0] += time.perf_counter() - t0
        return out

    shards._collate = timed
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="synthetic", help="synthetic, emoji (parent) or shard URLs (child)")
    p.add_argument("--model", default="tiny-resnet")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workers-list", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--num-samples", type=int, default=None)
    p.add_argument("--skip", type=int, default=3, help="batches excluded as warm-up (worker start, shuffle fill)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--with-open-clip", action="store_true", help="also open_clip_train's pipeline (its env)")
    p.add_argument("--shuffle-buffer", type=int, nargs="+", default=[1000],
                   help="magclip's data.shuffle_buffer; several values: each loader contender at each (memory)")
    p.add_argument("--open-clip-python", default=str(DEFAULT_OC_PY))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    # child mode
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="magclip", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--trainer-transform", action="store_true", help=argparse.SUPPRESS)  # uint8, as train_clip
    p.add_argument("--time-collate", action="store_true", help=argparse.SUPPRESS)  # 0 workers: time in _collate
    p.add_argument("--decoded-cache", action="store_true", help=argparse.SUPPRESS)  # read from the trainer's cache
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child_loader(a)
        return

    if a.tiny:
        a.reps, a.skip = 1, 1
    urls, n = resolve_data(a.data)
    n = a.num_samples or (6 * a.batch_size if a.tiny else n)
    steps = n // a.batch_size
    info = machine_info(a.threads)
    base = ["--data", urls, "--model", a.model, "--batch-size", str(a.batch_size), "--threads", str(a.threads),
            "--num-samples", str(n), "--skip", str(a.skip)]
    contenders = {}
    for w in a.workers_list:
        for buffer in a.shuffle_buffer:
            name = f"loader_{w}w" + (f"_buffer{buffer}" if len(a.shuffle_buffer) > 1 else "")
            contenders[name] = (lambda w=w, buffer=buffer: [sys.executable, str(HERE / "bench_loader.py"), "--child",
                                                            *base, "--workers", str(w), "--shuffle-buffer", str(buffer)])
    if a.with_open_clip:
        if not Path(a.open_clip_python).is_file():
            raise SystemExit("SKIP --with-open-clip: run bash benchmarks/setup_open_clip_train_env.sh first")
        for w in [w for w in a.workers_list if w > 0]:
            contenders[f"open_clip_loader_{w}w"] = (
                lambda w=w: [a.open_clip_python, str(HERE / "bench_loader.py"), "--child", *base, "--workers", str(w),
                             "--impl", "open_clip"])
    skip_steps = min(5, steps // 4)
    contenders["train_step_consumes"] = lambda: [
        sys.executable, str(HERE / "_run_magclip.py"), "--data", urls, "--num-samples", str(n), "--model", a.model,
        "--batch-size", str(a.batch_size), "--threads", str(a.threads), "--workers", "0", "--cached-batches", "8",
        "--skip", str(skip_steps), "--measure", str(steps - skip_steps - 1)]
    print(f"loader: {urls} ({n} samples), batch {a.batch_size}, {a.threads} thread(s), {a.reps} rounds", flush=True)
    runs: dict[str, list[dict]] = {k: [] for k in contenders}
    for r in range(a.reps):
        for name, cmd in contenders.items():
            res = run_child(cmd(), a.threads, label=name)
            runs[name].append(res)
            print(f"  round {r + 1}/{a.reps} {name:>22}: {res['samples_per_s']:8.1f} samples/s "
                  f"(main RSS {res['peak_rss_main_mb']:.0f} MiB, tree PSS {res['peak_tree_pss_mb']:.0f} MiB)",
                  flush=True)
    summary = {k: {"samples_per_s_median": median([r["samples_per_s"] for r in v]),
                   "samples_per_s_runs": [round(r["samples_per_s"], 1) for r in v],
                   "peak_rss_main_mb": max(r["peak_rss_main_mb"] for r in v),
                   "peak_rss_largest_worker_mb": max(r["peak_rss_largest_child_mb"] for r in v),
                   "peak_tree_pss_mb": max(r["peak_tree_pss_mb"] for r in v)} for k, v in runs.items()}
    consume = summary["train_step_consumes"]["samples_per_s_median"]
    rows = []
    for k, v in summary.items():
        v["ratio_to_step"] = v["samples_per_s_median"] / consume
        rows.append([k, v["samples_per_s_median"], str(v["samples_per_s_runs"]), f"{v['ratio_to_step']:.2f}x",
                     v["peak_rss_main_mb"], v["peak_tree_pss_mb"]])
    print(table(rows, ["what", "samples/s (median)", "runs", "vs step", "peak RSS main MiB", "peak tree PSS MiB"]))
    best = max(v["ratio_to_step"] for k, v in summary.items() if k.startswith("loader_"))
    two = next((v["ratio_to_step"] for k, v in summary.items() if k.startswith("loader_2w")), None)
    print(f"loader / train-step consumption: 2 workers {two if two is None else f'{two:.2f}'}x, best {best:.2f}x; target >= 3x")
    buffers = "_buffers" + "_".join(map(str, a.shuffle_buffer)) if len(a.shuffle_buffer) > 1 else ""
    out = Path(a.out) if a.out else RESULTS_DIR / (f"loader{'' if a.data == 'synthetic' else '_' + a.data}{buffers}"
                                                   f"{'_tiny' if a.tiny else ''}.json")
    write_json(out, {"benchmark": "loader", "machine": info,
                     "settings": {**{k: v for k, v in vars(a).items() if k not in ('out', 'child', 'impl', 'workers', 'workdir')},
                                  "data_urls": urls, "num_samples": n},
                     "summary": summary, "ratio_2_workers_to_step": two, "target": ">= 3x", "runs": runs})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
