"""The README main job against its compute floor, and where the difference goes.

    python benchmarks/bench_floor.py                          # ratio + breakdown, 3 rounds: results/floor.json
    python benchmarks/bench_floor.py --part ratio --rounds 5  # floor vs main job only (A B A B ...)
    python benchmarks/bench_floor.py --part ratio --also 'data.workers=1'   # + the main job with other settings
    python benchmarks/bench_floor.py --part blocks              # floor step, engine step, cached batch in one process
    python benchmarks/bench_floor.py --steps 3 --skip 1 --rounds 1 --out /tmp/floor_smoke.json   # smoke check

The floor: the main job's model (configs/clip/default.yaml: tiny-resnet), batch (128), precision
(`train.precision: auto`, resolved by magclip.training.levers.resolve_precision: bf16 autocast where
the CPU has AVX512-BF16 or AMX, fp32 elsewhere), AdamW as the engine builds it (lr, betas, eps, weight
decay on >= 2-D weights only, the kernel `optimizer_kwargs('auto')` picks: fused), channels_last where
the engine uses it, the cosine schedule with warm-up, gradient clipping at train.grad_clip, and
open_clip's own `ClipLoss` on the plain open_clip model -- fed K batches drawn once from the synthetic
shards by the main job's loader (decoded, augmented, tokenized) and normalized once, cycled. No
loader, no logging, no per-step host sync: the step's irreducible compute on this CPU, with every core
this process may use as intra-op threads (`--threads` chooses another count). The main-job rows run as a
user runs them: no thread variable set, so the trainer's own rule picks its threads and loader workers
(magclip/training/threads.py), and each row records what it picked.

Rows (each a fresh child process, every row once per round, rows alternating, medians over rounds;
all timed by the same optimizer-step clock, _common.StepClock: samples/s between the end of step
`--skip` and the end of the last step):

| row | what |
|---|---|
| floor | the loop above |
| engine step | `Engine._train_step` (magclip/training/engine.py) on the same batches as the loader gives them (uint8 images, normalized on the device), the main job's TrainConfig: + magclip's Scorer loss and logit scale, the BatchNorm buffer snapshot, the non-finite check, the scale projection |
| main job, batches in memory | `train/clip.py` with its defaults, its loader replaced by the same K batches (`_run_magclip._use_cached_batches`): + the loop around the step (logging every 10 steps, tqdm, the settling host syncs, epochs) |
| main job | `train/clip.py` with its defaults (`magclip.cli.train_clip.main`): the decoded-sample cache on, `data.workers: auto` (on 2 cores: the loader in the training process, 2 threads) |
| main job, data.workers=2 | the loader in 2 workers, the step on the cores left (1 of 2): the default before `data.workers: auto` |
| main job, data.cache=false | the decoded-sample cache off as well (every epoch reads and decodes the shards in 2 workers) |
| loader, W workers | the main job's shard pipeline alone (`bench_loader.py`'s child, the trainer's uint8 transform and shuffle buffer), drained; with 0 workers the time inside the collation (stack + tokenizer) is measured too; ", decoded cache": reading from the trainer's decoded-sample cache (filled before the clock), as the main job's epochs after the first do |

The ratio main job / floor is the issue's figure (target >= 0.9). The breakdown turns the rows into
ms per step: (engine step - floor) is the step's own extra work, (in memory - engine step) the loop's,
(main job - in memory) what the loader costs the step on this machine (in the training process, or in
workers sharing the cores); the three add up to (main job - floor). The loader rows say what decoding + transform and collation
cost per batch of 128 when nothing else runs.

`--steps` defaults to the whole main job (5 epochs of 46 steps); the floor and the engine step run as
many steps. Nothing in magclip is modified: the children hook torch's global optimizer-step hook.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    RESULTS_DIR,
    StepClock,
    engine_in_memory,
    gpu_peak_mb,
    machine_info,
    median,
    peak_rss_mb,
    run_child,
    steady_rate,
    synthetic_urls,
    table,
    write_json,
)

HERE = Path(__file__).resolve().parent
CACHE_OFF = "main job, data.cache=false"  # the cache off: every epoch reads and decodes the shards (2 workers, 1 thread)
WORKERS_BEFORE = "main job, data.workers=2"  # the cache on, the loader in 2 workers (1 thread): the default before auto
CACHED_BATCHES = 8  # as bench_loader.py's consumption row: enough distinct batches that no cache stays warm


# ----------------------------------------------------------------------------- children


def main_job_config(overrides: list[str]):
    """The README main job's config (no config file: the built-in defaults are the main job)."""
    from magclip.config import load_config

    return load_config(None, overrides)


def main_job_steps(batch: int | None = None) -> int:
    """Optimizer steps of the whole main job: epochs x (synthetic train samples // batch)."""
    cfg = main_job_config([])
    return cfg.train.epochs * (cfg.data.synthetic.num_train // (batch or cfg.train.batch_size))


def real_batches(model: str, batch: int, k: int, device: str) -> list[dict]:
    """k training batches of the synthetic shards as the main job's loader makes them (uint8 images,
    token ids), drawn once with 0 workers, moved to `device`."""
    from magclip.data.shards import build_clip_loader
    from magclip.models.clip import create_clip, uint8_transform

    cfg = main_job_config([])
    urls, n = synthetic_urls(cfg.data.synthetic.num_train)
    bundle = create_clip(model)
    loader = build_clip_loader(urls, preprocess=uint8_transform(bundle.preprocess_train) or bundle.preprocess_train,
                               tokenizer=bundle.tokenizer, batch_size=batch, num_samples=n, shuffle=True,
                               shuffle_buffer=cfg.data.shuffle_buffer, workers=0, seed=0)
    it = iter(loader)
    return [{"images": b["images"].to(device), "texts": b["texts"].to(device), "keys": [], "skipped": {}}
            for b in (next(it) for _ in range(min(k, loader.num_batches)))]


def floor_stepper(a, steps: int):
    """The bare loop's step: open_clip model + ClipLoss + AdamW (+ schedule, clipping) on normalized batches in
    memory. Returns (step(i) -> loss tensor, what it runs)."""
    import torch
    from open_clip.loss import ClipLoss

    from magclip.models.clip import create_clip
    from magclip.training.engine import cosine_with_warmup
    from magclip.training.levers import optimizer_kwargs, resolve_precision, use_channels_last

    device = torch.device(a.device)
    cfg = main_job_config([f"train.batch_size={a.batch_size}", *a.extra]).train
    precision, why = resolve_precision(cfg.precision, device)
    raw = create_clip(a.model).model.to(device)  # magclip's wrapper: only for its normalisation of uint8 images
    model = raw.clip
    model.logit_scale.requires_grad_(True)  # the plain open_clip model trains its own scale
    channels_last = use_channels_last(model, cfg.channels_last)
    batches = []
    for b in real_batches(a.model, a.batch_size, CACHED_BATCHES, a.device):
        images = raw.normalize_images(b["images"])
        batches.append((images.contiguous(memory_format=torch.channels_last) if channels_last else images, b["texts"]))
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    impl, impl_why = optimizer_kwargs(cfg.optimizer_impl, params)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(cfg.warmup_steps, steps))
    loss_fn = ClipLoss()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    model.train()

    def step(i: int):
        images, texts = batches[i % len(batches)]
        with autocast:
            image_features, text_features, scale = model(images, texts)[:3]
            loss = loss_fn(image_features, text_features, scale)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step, {"precision": f"{precision} ({why})", "optimizer": impl_why, "channels_last": channels_last}


def engine_stepper(a, steps: int):
    """Engine._train_step, the main job's TrainConfig, on the same batches as the loader gives them."""
    from _common import clip_train_module

    cfg = main_job_config([f"train.batch_size={a.batch_size}", f"train.max_steps={steps}", *a.extra]).train
    engine = engine_in_memory(cfg, clip_train_module(a.model))
    batches = real_batches(a.model, a.batch_size, CACHED_BATCHES, str(engine.acc.device))
    return (lambda i: engine._train_step([batches[i % len(batches)]])["loss"]), {"levers": engine.levers}


def timed_steps_child(a, row: str, make_stepper) -> None:
    """`a.steps` calls of the step `make_stepper(a, steps)` builds, timed by the step clock: the floor's and the
    engine's rows."""
    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    step, info = make_stepper(a, a.steps)
    clock = StepClock()
    for i in range(a.steps):
        loss = step(i)
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()  # the last step's kernels are done before the clock is read
        clock.times[-1] = time.perf_counter()
    loss = float(loss)  # one host sync, after the clock's last stamp
    clock.close()
    write_json(a.out, {"row": row, "threads": torch.get_num_threads(), **info, "batch_size": a.batch_size,
                       "model": a.model, "final_loss": loss, **steady_rate(clock.times, a.batch_size, a.skip, None),
                       **peak_rss_mb(), **gpu_peak_mb()})


def cached_loader_stepper(a, memo: bool):
    """One batch per call from the main job's loader in this process (0 workers), reading the decoded-sample cache
    as the epochs after the first do, epoch after epoch; `memo=False` keeps the cache's token memo out."""
    import copy

    from magclip.data import decoded_cache
    from magclip.data.captions import CaptionKey
    from magclip.data.shards import DEFAULT_MAX_IMAGE_PIXELS, build_clip_loader
    from magclip.models.clip import create_clip, uint8_transform

    cfg = main_job_config([])
    urls, n = synthetic_urls(cfg.data.synthetic.num_train)
    bundle = create_clip(a.model)
    cache = decoded_cache.fill(urls, max_pixels=DEFAULT_MAX_IMAGE_PIXELS, caption_key=CaptionKey(cfg.data.caption_key),
                               budget_mb=decoded_cache.default_budget_mb())
    if not memo:
        cache = copy.copy(cache)
        cache.tokenizer = lambda tokenizer: tokenizer
    state = {"batches": iter(()), "epoch": 0}

    def step(i: int):
        for _ in range(2):
            batch = next(state["batches"], None)
            if batch is not None:
                return batch
            state["batches"] = iter(build_clip_loader(
                urls, preprocess=uint8_transform(bundle.preprocess_train), tokenizer=bundle.tokenizer,
                batch_size=a.batch_size, num_samples=n, shuffle=True, shuffle_buffer=cfg.data.shuffle_buffer, workers=0,
                seed=0, epoch=state["epoch"], decoded_cache=cache))
            state["epoch"] += 1
        raise RuntimeError("the loader gave no batch")

    return step


BLOCK_ROWS = ("floor step", "engine step", "cached batch, in process", "cached batch, no token memo")


def blocks_child(a) -> None:
    """The floor's step, the engine's step and a cached batch of the in-process loader (with and without the token
    memo), built in one process and timed in alternating blocks of `--block` calls: machine drift cancels out of
    each block-to-block ratio."""
    import statistics

    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    steps = a.blocks * a.block + 2
    contenders = dict(zip(BLOCK_ROWS, (floor_stepper(a, steps)[0], engine_stepper(a, steps)[0],
                                       cached_loader_stepper(a, memo=True), cached_loader_stepper(a, memo=False))))
    for call in contenders.values():  # warm-up: first batches, allocator
        call(0), call(1)
    ms: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(a.blocks):
        for name, call in contenders.items():
            t0 = time.perf_counter()
            for i in range(a.block):
                call(i)
            ms[name].append(1000 * (time.perf_counter() - t0) / a.block)
    floor = ms["floor step"]
    write_json(a.out, {"threads": torch.get_num_threads(), "block": a.block, "blocks": a.blocks, "ms_per_call": ms,
                       "median_ms": {k: statistics.median(v) for k, v in ms.items()},
                       "median_ratio_to_floor_step": {k: statistics.median(x / f for x, f in zip(v, floor))
                                                      for k, v in ms.items()},
                       "token_memo_ratio": statistics.median(
                           x / y for x, y in zip(ms["cached batch, in process"], ms["cached batch, no token memo"]))})


def main_job_child(a) -> None:
    """`train/clip.py` as a user runs it (its defaults), timed by the step clock; `--cached` feeds it
    K batches in memory instead of its loader (and skips the final validation, outside the clock)."""
    import torch
    from _run_magclip import _use_cached_batches

    overrides = ["name=mainjob", f"output_dir={a.workdir}", f"train.batch_size={a.batch_size}", *a.extra]
    if a.steps:
        overrides.append(f"train.max_steps={a.steps}")
    if a.cached:  # the validation loader would be served the cached training batches too: no validation
        overrides += [f"data.train={synthetic_urls()[0]}", "data.val=null"]
        _use_cached_batches(None, CACHED_BATCHES)
    from magclip.cli.train_clip import main

    clock = StepClock()
    main(overrides)
    clock.close()
    results = json.loads((Path(a.workdir) / "mainjob" / "results.json").read_text())
    write_json(a.out, {"row": "main job" + (", batches in memory" if a.cached else ""), "overrides": overrides,
                       "levers": results.get("speed_levers"), "wall_time_s": results.get("wall_time_s"),
                       "batch_size": a.batch_size, "threads": torch.get_num_threads(),
                       **steady_rate(clock.times, a.batch_size, a.skip, None), **peak_rss_mb()})


# ----------------------------------------------------------------------------- parent


def plan(a, steps: int) -> dict[str, tuple[list[str], int | None]]:
    """row name -> (the child's command, its thread count; None: the child's own rule, as a user runs it);
    run_child adds --out and --workdir."""
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--steps", str(steps), "--skip", str(a.skip), "--batch-size", str(a.batch_size),
              "--threads", str(a.threads), "--model", a.model]
    rows = {"floor": ([*me, "--child", "floor", *common], a.threads),
            "main job": ([*me, "--child", "mainjob", *common], None),
            WORKERS_BEFORE: ([*me, "--child", "mainjob", *common, "--extra", "data.workers=2"], None),
            CACHE_OFF: ([*me, "--child", "mainjob", *common, "--extra", "data.cache=false"], None)}
    for overrides in a.also:  # more main-job rows, each with its overrides (space-separated)
        rows[f"main job, {overrides}"] = ([*me, "--child", "mainjob", *common, "--extra", *overrides.split()], None)
    if a.part == "ratio":
        return rows
    rows["engine step"] = ([*me, "--child", "engine_step", *common], a.threads)
    rows["main job, batches in memory"] = ([*me, "--child", "mainjob", "--cached", *common], a.threads)
    cfg = main_job_config([])
    urls, n = synthetic_urls(cfg.data.synthetic.num_train)
    loader_n = min(n, max(6, steps + a.skip + 2) * a.batch_size)
    for cached in (False, True):
        for w in a.loader_workers:
            rows[f"loader, {w} workers" + (", decoded cache" if cached else "")] = ([
                sys.executable, str(HERE / "bench_loader.py"), "--child", "--data", urls, "--model", a.model,
                "--batch-size", str(a.batch_size), "--threads", "1", "--num-samples", str(loader_n),
                "--skip", str(min(a.skip, 3)), "--workers", str(w), "--shuffle-buffer", str(cfg.data.shuffle_buffer),
                "--trainer-transform", *(["--time-collate"] if w == 0 else []),
                *(["--decoded-cache"] if cached else [])], 1)
    return rows


def breakdown(summary: dict[str, dict[str, Any]], batch: int) -> list[list[Any]]:
    """ms per step added at each stage from the floor to the main job; loader costs per batch."""
    ms = {k: v["ms_per_step"] for k, v in summary.items()}
    rows = []
    stages = [("the step's own work (Scorer loss, on-device normalize, buffer snapshot, non-finite check, projection)",
               "floor", "engine step"),
              ("the loop around it (logging every 10 steps, tqdm, host syncs, epochs)", "engine step",
               "main job, batches in memory"),
              ("the loader feeding it", "main job, batches in memory", "main job"),
              (("data.workers auto: the loader in the training process, the cores to the step (main job - "
                "data.workers=2)"), WORKERS_BEFORE, "main job"),
              ("the decoded-sample cache, both with 2 workers (data.workers=2 - data.cache=false)", CACHE_OFF,
               WORKERS_BEFORE)]
    for what, before, after in stages:
        if before in ms and after in ms:
            d = ms[after] - ms[before]
            rows.append([what, f"{d:+.1f}", f"{100 * d / ms['floor']:+.1f} %"])
    if "floor" in ms and "main job" in ms:
        d = ms["main job"] - ms["floor"]
        rows.append(["total: main job - floor", f"{d:+.1f}", f"{100 * d / ms['floor']:+.1f} %"])
    for k, v in summary.items():
        if k.startswith("loader"):
            per_batch = 1000 * batch / v["samples_per_s_median"]
            rows.append([f"{k}: one batch of {batch} (decode + transform + collation), alone", f"{per_batch:.1f}",
                         f"{100 * per_batch / ms['floor']:.1f} % of a floor step"])
            if v.get("collate_ms_per_batch") is not None:
                c = v["collate_ms_per_batch"]
                rows.append([f"  of which collation (stack + tokenizer), {k}", f"{c:.1f}",
                             f"{100 * c / per_batch:.1f} % of the batch"])
    return rows


def run_blocks(a) -> None:
    """`--part blocks`: one child, its table, results/floor_blocks.json."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "blocks", "--blocks", str(a.blocks), "--block",
           str(a.block), "--batch-size", str(a.batch_size), "--threads", str(a.threads), "--model", a.model]
    res = run_child(cmd, a.threads, timeout=3600, label="blocks")
    floor = res["median_ms"]["floor step"]
    print(table([[k, f"{v:.1f}", f"{100 * v / floor:.1f} %", f"{res['median_ratio_to_floor_step'][k]:.3f}"]
                 for k, v in res["median_ms"].items()],
                ["contender (one process, alternating blocks)", "ms per call (median)", "of a floor step",
                 "median block ratio to the floor step"]))
    print(f"token memo: a cached batch takes {res['token_memo_ratio']:.3f} of its time without it (median block ratio)")
    out = Path(a.out) if a.out else RESULTS_DIR / "floor_blocks.json"
    write_json(out, {"benchmark": "floor blocks", "machine": machine_info(a.threads), "settings": vars(a), **res})
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "ratio", "blocks"), default="all",
                   help="ratio: the floor and the main job only; all: + the breakdown rows; blocks: the floor's step, "
                        "the engine's and a cached batch, alternating in one process (results/floor_blocks.json)")
    p.add_argument("--blocks", type=int, default=16, help="--part blocks: blocks per contender")
    p.add_argument("--block", type=int, default=10, help="--part blocks: calls per block")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per child (default: the whole main job)")
    p.add_argument("--skip", type=int, default=5, help="steps left out of the window (start-up, first batches)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the main job's (128)")
    p.add_argument("--threads", type=int, default=None,
                   help="the floor's intra-op threads (default: every core this process may use)")
    p.add_argument("--model", default=None, help="default: the main job's (tiny-resnet)")
    p.add_argument("--loader-workers", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--also", nargs="*", default=[],
                   help="more main-job rows, each a string of overrides, e.g. 'data.workers=1' 'train.threads=2'")
    p.add_argument("--out", default=None)
    # child mode
    p.add_argument("--child", choices=("floor", "engine_step", "mainjob", "blocks"), help=argparse.SUPPRESS)
    p.add_argument("--cached", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--extra", nargs="*", default=[], help=argparse.SUPPRESS)  # overrides of the main job's config
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    cfg = main_job_config([])
    a.batch_size = a.batch_size or cfg.train.batch_size
    a.model = a.model or cfg.model.name
    from magclip.training.threads import available_cores

    a.threads = a.threads or available_cores()
    if a.child:
        if a.child in ("floor", "engine_step"):
            return timed_steps_child(a, a.child.replace("_", " "), floor_stepper if a.child == "floor" else engine_stepper)
        return {"mainjob": main_job_child, "blocks": blocks_child}[a.child](a)
    if a.part == "blocks":
        return run_blocks(a)

    steps = a.steps or main_job_steps(a.batch_size)
    rows = plan(a, steps)
    info = machine_info(a.threads)
    print(f"floor vs main job: {a.model}, batch {a.batch_size}, {steps} steps (window from step {a.skip}), "
          f"{a.threads} thread(s), {a.rounds} rounds, rows: {', '.join(rows)}", flush=True)
    runs: dict[str, list[dict]] = {k: [] for k in rows}
    for r in range(a.rounds):
        for name, (cmd, threads) in rows.items():
            res = run_child(cmd, threads, timeout=1800, label=name)
            runs[name].append(res)
            print(f"  round {r + 1}/{a.rounds} {name:>28}: {res['samples_per_s']:8.1f} samples/s", flush=True)
    summary = {}
    for k, v in runs.items():
        rate = median([x["samples_per_s"] for x in v])
        summary[k] = {"samples_per_s_median": rate, "samples_per_s_runs": [round(x["samples_per_s"], 1) for x in v],
                      "ms_per_step": 1000 * a.batch_size / rate,
                      "peak_tree_pss_mb": max(x["peak_tree_pss_mb"] for x in v)}
        walls = [x["wall_time_s"] for x in v if x.get("wall_time_s") is not None]
        summary[k]["run_wall_time_s_median"] = median(walls) if walls else None  # results.json: start to end
        collate = [x["collate_s"] / x["batches"] for x in v if x.get("collate_s") is not None]
        summary[k]["collate_ms_per_batch"] = 1000 * median(collate) if collate else None
    floor = summary["floor"]["samples_per_s_median"]
    ratio = summary["main job"]["samples_per_s_median"] / floor
    paired = [m["samples_per_s"] / f["samples_per_s"] for m, f in zip(runs["main job"], runs["floor"])]
    print(table([[k, v["samples_per_s_median"], str(v["samples_per_s_runs"]), f"{v['ms_per_step']:.1f}",
                  f"{v['samples_per_s_median'] / floor:.2f}"] for k, v in summary.items()],
                ["row", "samples/s (median)", "runs", "ms per step of 128", "× floor"]))
    print(f"main job / floor = {ratio:.3f} (paired per round: {', '.join(f'{x:.2f}' for x in paired)}, their median "
          f"{median(paired):.3f}); target >= 0.9")
    parts = breakdown(summary, a.batch_size)
    print(table(parts, ["where the rest goes", "ms per step", "share of a floor step"]))
    first = {k: {f: v[0].get(f) for f in ("precision", "optimizer", "channels_last", "levers", "threads")} for k, v in runs.items()}
    out = Path(a.out) if a.out else RESULTS_DIR / "floor.json"
    write_json(out, {"benchmark": "floor", "machine": info, "settings": {**vars(a), "steps": steps},
                     "as_run": first, "summary": summary, "ratio_main_job_over_floor": ratio,
                     "ratio_paired_per_round": paired, "ratio_paired_median": median(paired), "breakdown": parts, "runs": runs})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
