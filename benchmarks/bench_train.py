"""Training throughput: magclip's trainer vs open_clip_train, the cost of the scoring modes, 2 processes.

    bash benchmarks/setup_open_clip_train_env.sh          # once: open_clip_train's own env (pandas, webdataset<=0.2.86)
    python benchmarks/bench_train.py --part ab            # magclip vs open_clip_train, A B A B ...
    python benchmarks/bench_train.py --part ab --magclip-precision auto   # each at its default precision
    python benchmarks/bench_train.py --part ab --magclip-defaults --epochs 5 --measure 0   # the main job's 5 epochs:
                                                    # magclip at all its defaults, open_clip_train at its precision's
    python benchmarks/bench_train.py --part modes         # cosine vs qnorm/dnorm/learnable/asymmetric, rotated
    python benchmarks/bench_train.py --part modes --cached-batches 8 --workers 0   # the same, batches in memory
    python benchmarks/bench_train.py --part ddp           # 1 process vs torchrun --nproc_per_node 2 (gloo)
    python benchmarks/bench_train.py --part loss          # the loss alone per mode, fwd+bwd on fixed features
    python benchmarks/bench_train.py --part ab --data emoji   # the real emoji shards (../shared/data/emoji)
    python benchmarks/bench_train.py --part ab --tiny     # smoke check: few steps, 1 repetition

Every run is a fresh child process (imports, model build, loader start-up are its own) with the
same model config, shards, batch, precision, loader workers, learning-rate settings and torch/OpenMP
thread count. Both trainers are timed by the same code: torch's global optimizer step post-hook
records a timestamp after every optimizer step (`_common.StepClock`), and samples/s is
`batch x steps / time` between the end of step `--skip` and the end of step `--skip + --measure`
(the same window for both; start-up, shuffle-buffer fill and the final checkpoint are outside it).
Runs alternate A B A B ...; the figure is the median of each contender and their ratio.

Peak memory: ru_maxrss of the trainer process (RUSAGE_SELF, reported by the child itself) and the
peak PSS summed over the whole process tree (trainer + loader workers), sampled every 0.5 s by the
parent (`_common.tree_pss_mb`). The RSS of a forked worker is mostly pages shared with the trainer,
so the tree PSS, not a per-worker RSS, is the footprint figure.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    DEFAULT_OC_PY,
    RESULTS_DIR,
    machine_info,
    median,
    resolve_data,
    run_child,
    table,
    write_json,
)

HERE = Path(__file__).resolve().parent

# name -> (i2t, t2i); "asym_mixed" = different modes per direction, "asym_i2t" = one direction only
MODES = {
    "cosine": ("cosine", "cosine"),
    "qnorm": ("qnorm", "qnorm"),
    "dnorm": ("dnorm", "dnorm"),
    "learnable": ("learnable", "learnable"),
    "asym_mixed": ("qnorm", "dnorm"),
    "asym_i2t": ("qnorm", "null"),
}


def common_args(a, urls: str, n: int) -> list[str]:
    return ["--data", urls, "--num-samples", str(n), "--model", a.model, "--batch-size", str(a.batch_size),
            "--threads", str(a.threads), "--precision", a.precision, "--skip", str(a.skip),
            *(["--measure", str(a.measure)] if a.measure else []), "--epochs", str(a.epochs)]


def magclip_cmd(a, urls, n, i2t="cosine", t2i="cosine", workers=None) -> list[str]:
    cached = ["--cached-batches", str(a.cached_batches)] if a.cached_batches else []
    own = ["--precision", a.magclip_precision] if a.magclip_precision else []  # the last --precision wins
    defaults = ["--defaults"] if a.magclip_defaults else []
    return [sys.executable, str(HERE / "_run_magclip.py"), *common_args(a, urls, n),
            "--workers", str(a.workers if workers is None else workers), "--i2t", i2t, "--t2i", t2i, *cached, *own,
            *defaults]


def open_clip_cmd(a, urls, n) -> list[str]:
    py = Path(a.open_clip_python)
    if not py.is_file():
        raise SystemExit(f"SKIP: no open_clip_train environment at {py}; run bash benchmarks/setup_open_clip_train_env.sh "
                         "(or pass --open-clip-python)")
    return [str(py), str(HERE / "_run_open_clip.py"), *common_args(a, urls, n), "--workers", str(a.workers)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alternate(contenders: dict[str, callable], reps: int, threads: int, rotate: bool = False,
              own_threads: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """Run each contender `reps` times, interleaved: A B C A B C ... (rotated per round if asked); the contenders
    named in `own_threads` run with no thread variable set (their own rule decides, as a user runs them)."""
    names = list(contenders)
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)] if rotate else names
        for name in order:
            res = run_child(contenders[name](), None if name in own_threads else threads, label=name)
            runs[name].append(res)
            print(f"  round {r + 1}/{reps} {name:>16}: {res['samples_per_s']:8.1f} samples/s  "
                  f"(step {res['step_ms_median']:.0f} ms, main RSS {res['peak_rss_main_mb']:.0f} MiB, wall {res['wall_s']:.0f} s)",
                  flush=True)
    return runs


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for name, rs in runs.items():
        out[name] = {"samples_per_s_median": median([r["samples_per_s"] for r in rs]),
                     "samples_per_s_runs": [round(r["samples_per_s"], 1) for r in rs],
                     "step_ms_median": median([r["step_ms_median"] for r in rs]),
                     "peak_rss_main_mb": max(r["peak_rss_main_mb"] for r in rs),
                     "peak_rss_largest_worker_mb": max(r["peak_rss_largest_child_mb"] for r in rs),
                     "peak_tree_pss_mb": max(r["peak_tree_pss_mb"] for r in rs),
                     "wall_s_median": median([r["wall_s"] for r in rs])}
    return out


def part_ab(a, urls, n) -> dict:
    runs = alternate({"magclip": lambda: magclip_cmd(a, urls, n), "open_clip_train": lambda: open_clip_cmd(a, urls, n)},
                     a.reps, a.threads, own_threads=("magclip",) if a.magclip_defaults else ())
    s = summarize(runs)
    ratio = s["magclip"]["samples_per_s_median"] / s["open_clip_train"]["samples_per_s_median"]
    paired = [m["samples_per_s"] / o["samples_per_s"] for m, o in zip(runs["magclip"], runs["open_clip_train"])]
    rows = [[k, v["samples_per_s_median"], str(v["samples_per_s_runs"]), v["step_ms_median"], v["peak_rss_main_mb"],
             v["peak_tree_pss_mb"]] for k, v in s.items()]
    print(table(rows, ["trainer", "samples/s (median)", "runs", "step ms", "peak RSS main MiB", "peak tree PSS MiB"]))
    print(f"ratio magclip / open_clip_train = {ratio:.3f} (paired per round: {', '.join(f'{x:.2f}' for x in paired)}); "
          "target >= 1.0")
    return {"summary": s, "ratio_magclip_over_open_clip_train": ratio, "paired_ratios": paired,
            "target": ">= 1.0", "met": ratio >= 1.0, "runs": runs}


def part_modes(a, urls, n) -> dict:
    modes = {k: MODES[k] for k in a.modes}
    runs = alternate({k: (lambda i2t=i2t, t2i=t2i: magclip_cmd(a, urls, n, i2t, t2i)) for k, (i2t, t2i) in modes.items()},
                     a.reps, a.threads, rotate=True)
    s = summarize(runs)
    base = s["cosine"]["samples_per_s_median"]
    rows = []
    for k, v in s.items():
        v["overhead_vs_cosine_pct"] = 100 * (base / v["samples_per_s_median"] - 1)
        rows.append([k, f"{modes[k][0]}/{modes[k][1]}", v["samples_per_s_median"], v["step_ms_median"],
                     f"{v['overhead_vs_cosine_pct']:+.1f} %", v["peak_rss_main_mb"], v["peak_tree_pss_mb"]])
    print(table(rows, ["mode", "i2t/t2i", "samples/s (median)", "step ms", "time/step vs cosine", "peak RSS MiB",
                       "peak tree PSS MiB"]))
    return {"summary": s, "modes": modes, "target": "asymmetric or learnable <= +5 % time per step over cosine",
            "runs": runs}


def part_ddp(a, urls, n) -> dict:
    def two_procs():
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                str(HERE / "_run_magclip.py"), *common_args(a, urls, n), "--workers", str(a.ddp_workers),
                "--expect-world-size", "2"]

    runs = alternate({"magclip_1proc": lambda: magclip_cmd(a, urls, n), "magclip_2proc": two_procs}, a.reps, a.threads)
    s = summarize(runs)
    for r in runs["magclip_2proc"]:
        assert r["world_size"] == 2, r
    ratio = s["magclip_2proc"]["samples_per_s_median"] / s["magclip_1proc"]["samples_per_s_median"]
    rows = [[k, v["samples_per_s_median"], str(v["samples_per_s_runs"]), v["peak_rss_main_mb"], v["peak_tree_pss_mb"]]
            for k, v in s.items()]
    print(table(rows, ["setup", "global samples/s (median)", "runs", "peak RSS rank 0 MiB", "peak tree PSS MiB"]))
    print(f"2 processes / 1 process = {ratio:.3f} (global batch {2 * a.batch_size} vs {a.batch_size}; "
          f"{a.ddp_workers} loader worker(s) per process vs {a.workers})")
    return {"summary": s, "ratio_2proc_over_1proc": ratio, "runs": runs,
            "note": "open_clip_train cannot run DDP on CPU (it passes device_ids=[cpu] to DistributedDataParallel)"}


def part_loss(a) -> dict:
    """The loss alone: forward + backward of CLIPLoss per mode on fixed random features, in-process,
    rotated rounds; isolates the extra cost of the modes from encoder and loader noise."""
    import time

    import torch

    from magclip.training.clip import build_logit_scale, build_loss
    from magclip.config import LossConfig

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    B, D = a.batch_size, 64
    img = torch.randn(B, D) * 3
    txt = torch.randn(B, D) * 3
    per_mode: dict[str, list[float]] = {k: [] for k in a.modes}
    objs = {}
    for k in a.modes:
        i2t, t2i = MODES[k]
        cfg = LossConfig(i2t=i2t, t2i=None if t2i == "null" else t2i)
        objs[k] = (build_loss(cfg), build_logit_scale(cfg))
    iters = 20 if a.tiny else 300
    for r in range(a.reps * 2):
        for k in a.modes[r % len(a.modes):] + a.modes[:r % len(a.modes)]:
            loss, scale = objs[k]
            t0 = time.perf_counter()
            for _ in range(iters):
                fi, ft = img.clone().requires_grad_(), txt.clone().requires_grad_()
                out = loss(fi, ft, scale())
                out["loss"].backward()
            per_mode[k].append(1e6 * (time.perf_counter() - t0) / iters)
    base = median(per_mode["cosine"])
    s = {k: {"us_per_call_median": median(v), "extra_us_vs_cosine": median(v) - base} for k, v in per_mode.items()}
    rows = [[k, v["us_per_call_median"], v["extra_us_vs_cosine"]] for k, v in s.items()]
    print(table(rows, [f"mode (B={B}, D={D})", "loss fwd+bwd us", "extra us vs cosine"]))
    return {"summary": s, "batch": B, "dim": D, "iters_per_round": iters}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("ab", "modes", "ddp", "loss"), required=True)
    p.add_argument("--data", choices=("synthetic", "emoji"), default="synthetic")
    p.add_argument("--model", default="tiny-resnet")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2, help="loader workers of each contender")
    p.add_argument("--ddp-workers", type=int, default=1, help="loader workers per process with 2 processes")
    p.add_argument("--threads", type=int, default=1, help="torch + OpenMP threads of each contender")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--magclip-precision", default=None,
                   help="magclip's own precision (e.g. auto: both trainers at their defaults, open_clip_train fp32)")
    p.add_argument("--num-samples", type=int, default=None, help="epoch length; default: all training samples")
    p.add_argument("--epochs", type=int, default=1, help="epochs of each contender (the main job: 5)")
    p.add_argument("--magclip-defaults", action="store_true",
                   help="magclip at all its defaults: its own threads, loader workers, precision and decoded-sample "
                        "cache (no data.num_samples: it counts the shards); open_clip_train as set by the other options")
    p.add_argument("--skip", type=int, default=5, help="steps excluded as warm-up")
    p.add_argument("--measure", type=int, default=40, help="steps in the timed window (0: every step after --skip)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cached-batches", type=int, default=0,
                   help="--part modes only: feed K batches decoded before the run (no loader in the timed steps)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--open-clip-python", default=str(DEFAULT_OC_PY),
                   help="interpreter of open_clip_train's environment (setup_open_clip_train_env.sh)")
    p.add_argument("--tiny", action="store_true", help="smoke check: 1 repetition, 2+4 steps")
    p.add_argument("--out", default=None, help="default: benchmarks/results/train_<part>[_<data>].json")
    a = p.parse_args()
    if a.tiny:
        a.reps, a.skip, a.measure = 1, 2, 4
    if a.cached_batches and a.part != "modes":
        raise SystemExit("--cached-batches is for --part modes (the A/B comparison runs both trainers' own loaders)")
    if "cosine" not in a.modes:
        a.modes.insert(0, "cosine")
    info = machine_info(a.threads)
    settings = {k: v for k, v in vars(a).items() if k not in ("out",)}
    if a.part == "loss":
        result = part_loss(a)
    else:
        urls, n = resolve_data(a.data)
        if a.num_samples:
            n = a.num_samples
        elif a.tiny:
            n = (a.skip + a.measure + 2) * a.batch_size * (2 if a.part == "ddp" else 1)
        needed = (a.skip + a.measure + 1) * a.batch_size * (2 if a.part == "ddp" else 1)
        if n < needed:
            raise SystemExit(f"{n} samples give too few steps for skip {a.skip} + measure {a.measure}; pass --num-samples")
        settings.update(data_urls=urls, num_samples=n)
        print(f"{a.part}: {a.model}, batch {a.batch_size}, {a.precision}, {a.threads} thread(s), {a.workers} worker(s), "
              f"{n} samples from {urls}; timed steps {a.skip + 1}..{a.skip + a.measure if a.measure else 'the last'}, "
              f"{a.reps} rounds", flush=True)
        result = {"ab": part_ab, "modes": part_modes, "ddp": part_ddp}[a.part](a, urls, n)
    suffix = ("" if a.data == "synthetic" or a.part == "loss" else f"_{a.data}") + ("_cached" if a.cached_batches else "")
    out = Path(a.out) if a.out else RESULTS_DIR / f"train_{a.part}{suffix}{'_tiny' if a.tiny else ''}.json"
    write_json(out, {"benchmark": f"train/{a.part}", "machine": info, "settings": settings, **result})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
