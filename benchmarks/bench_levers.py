"""The speed levers (magclip/training/levers.py), each alone and combined, on the engine's own step.

    python benchmarks/bench_levers.py --part step               # in-memory steps: tiny-resnet, tiny-vit, MiniLM
    python benchmarks/bench_levers.py --part compile            # cold and warm torch.compile, and its break-even
    python benchmarks/bench_levers.py --part mainjob            # the README's main job, this checkout vs --before
    python benchmarks/bench_levers.py --part precision --side-by-side   # the main job, fp32 vs train.precision=auto
    python benchmarks/bench_levers.py --part encode             # MiniLM BEIR encoding fp32 vs bf16 (SciFact)
    python benchmarks/bench_levers.py --part step --tiny        # smoke check: few steps, 1 round

step: per workload and round, one child process per precision (accelerate's precision is one per
process) builds one engine per variant (`magclip.training.engine.Engine` with the lever set in its
TrainConfig, on fixed batches already in memory) and times `Engine._train_step` -- forward, backward,
clipping, the optimizer, the non-finite check -- variant after variant; the figure is each variant's
median ms/step over the rounds and its ratio to the first variant (the default before the levers:
for-loop AdamW, fp32). The child's peak RSS is reported per variant group. MFU:
FLOPs of one step (forward + backward, `torch.utils.flop_counter`) / time, against the peak of a
1024^3 matmul measured in the same child, fp32 and bf16.

compile: a child with an empty inductor cache (cold) and one reusing it (warm) each time their first
step (the compile) and the steady steps after it; break-even = compile time / (eager - compiled ms).

mainjob: `train/clip.py` with the README's defaults (tiny ResNet, synthetic shards, the real loader),
seeds 0..N-1, alternating this checkout and a `git worktree` of --before (the commit before the
levers): samples/s (the run's own training time) and final val R@1 per seed. --side-by-side runs the
two checkouts of a seed at once (both under the same load, so their ratio stays fair) for recipes
too long to run one after the other, e.g. the emoji recipe (the buffer pinned: its default changed):
    python benchmarks/bench_levers.py --part mainjob --side-by-side --recipe configs/clip/emoji.yaml \
        --extra data.shuffle_buffer=1000 --out benchmarks/results/levers_emoji.json

precision: the same, this checkout on both sides, `train.precision=fp32` against `auto` (R@1 and
samples/s per seed; --recipe for the emoji recipe).

encode: eval/beir.py's encoding of a SciFact subset by MiniLM, --precision fp32 vs bf16, alternating:
documents/s and nDCG@10.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO,
    RESULTS_DIR,
    SCIFACT_DIR,
    child_env,
    clip_batch,
    clip_train_module,
    engine_in_memory,
    machine_info,
    peak_matmul_gflops,
    table,
    write_json,
)

VARIANTS = {  # name -> TrainConfig lever keys
    "for_loop fp32 (before)": {"optimizer_impl": "for_loop", "channels_last": False},
    "foreach": {"optimizer_impl": "foreach", "channels_last": False},
    "fused": {"optimizer_impl": "fused", "channels_last": False},
    "channels_last": {"optimizer_impl": "for_loop", "channels_last": True},
    "bf16 autocast": {"optimizer_impl": "for_loop", "channels_last": False, "precision": "bf16"},
    "fused + channels_last (default)": {"optimizer_impl": "fused", "channels_last": True},
    "fused + channels_last + bf16": {"optimizer_impl": "fused", "channels_last": True, "precision": "bf16"},
}
WORKLOADS = ("tiny-resnet", "tiny-vit", "minilm")


# ----------------------------------------------------------------------------- the step, in a child


def _text_module():
    from magclip.config import TextLossConfig, TextModelConfig
    from magclip.losses import RetrievalLoss
    from magclip.similarity import make_scorer
    from magclip.training.text import TextTrainModule, build_logit_scale, load_encoder

    enc = load_encoder(TextModelConfig(name="minilm", query_max_length=32, passage_max_length=128))
    return TextTrainModule(enc, RetrievalLoss(make_scorer("cosine"), 1), build_logit_scale(TextLossConfig())), enc


def _text_batch(encoder, batch: int) -> dict:
    import random

    from magclip.data.pairs import PairBatches, records_from_dicts

    rng = random.Random(0)
    words = "the protein of cell results in human brain study with white matter data large model".split()
    rows = [{"query": " ".join(rng.choices(words, k=12)), "positive": " ".join(rng.choices(words, k=110))}
            for _ in range(batch)]
    records, skipped = records_from_dicts(rows)
    return next(iter(PairBatches(records, encoder.tokenize, batch, 1, epoch=0, seed=0, rank=0, world_size=1,
                                 skipped=skipped)))


def step_child(workload: str, variants: list[str], steps: int, batch: int, out: Path) -> None:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from magclip.config import TrainConfig

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    engines, batches = {}, {}
    for name in variants:
        levers = VARIANTS[name]
        torch.manual_seed(0)
        module, encoder = (_text_module() if workload == "minilm" else (clip_train_module(workload), None))
        engines[name] = engine_in_memory(TrainConfig(epochs=1, batch_size=batch, warmup_steps=0, **levers), module)
        batches[name] = _text_batch(encoder, batch) if encoder is not None else clip_batch(batch)
    first = variants[0]
    with FlopCounterMode(display=False) as counter:
        engines[first]._train_step([batches[first]])
    flops = counter.get_total_flops()
    times: dict[str, float] = {}
    for name, engine in engines.items():
        engine._train_step([batches[name]])  # warm: first-touch allocations, lazy optimizer state
        t0 = time.perf_counter()
        for _ in range(steps):
            engine._train_step([batches[name]])
        times[name] = (time.perf_counter() - t0) / steps * 1000
    peaks = {"fp32": peak_matmul_gflops(torch.float32), "bf16": peak_matmul_gflops(torch.bfloat16)}
    write_json(out, {"workload": workload, "batch": batch, "flops_per_step": flops, "ms": times,
                     "peak_gflops": peaks, "levers": {n: e.levers for n, e in engines.items()},
                     "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def part_step(a) -> dict[str, Any]:
    """accelerate's precision is one per process: each round runs one child per precision (fp32 variants,
    bf16 variants), alternating, and each child times its variants in turn."""
    groups = [[n for n, v in VARIANTS.items() if v.get("precision", "fp32") == p] for p in ("fp32", "bf16")]
    results: dict[str, dict[str, Any]] = {}
    for workload in a.workloads:
        batch = a.text_batch if workload == "minilm" else a.batch
        merged: dict[str, Any] = {"workload": workload, "batch": batch, "ms": {n: [] for n in VARIANTS}, "max_rss_mb": {}}
        for _ in range(a.rounds):
            for variants in groups:
                out = Path(tempfile.mkdtemp()) / "step.json"
                cmd = [sys.executable, __file__, "--child-step", workload, "--variants", *variants, "--steps",
                       str(a.steps), "--batch", str(batch), "--out", str(out)]
                subprocess.run(cmd, env=child_env(a.threads), check=True)
                r = json.loads(out.read_text())
                for name, ms in r["ms"].items():
                    merged["ms"][name].append(ms)
                merged.update({k: r[k] for k in ("flops_per_step", "peak_gflops")})
                merged["max_rss_mb"].update({n: r["max_rss_mb"] for n in variants})
                merged.setdefault("levers", {}).update(r["levers"])
        results[workload] = merged
    rows = []
    for workload, r in results.items():
        base = statistics.median(r["ms"][next(iter(VARIANTS))])
        for name, ms in r["ms"].items():
            med = statistics.median(ms)
            gflops = r["flops_per_step"] / (med / 1000) / 1e9
            rows.append([workload, str(r["batch"]), name, f"{med:.1f}", f"{base / med:.2f}",
                         f"{gflops:.1f}", f"{100 * gflops / r['peak_gflops']['fp32']:.0f} %",
                         f"{100 * gflops / r['peak_gflops']['bf16']:.0f} %", f"{r['max_rss_mb'][name]:.0f}"])
    print(table(rows, ["workload", "batch", "variant", "ms/step", "× first", "GFLOP/s", "MFU fp32 peak",
                       "MFU bf16 peak", "child peak RSS MB"]))
    for workload, r in results.items():
        print(f"{workload}: {r['flops_per_step'] / 1e9:.2f} GFLOP/step; matmul peak fp32 "
              f"{r['peak_gflops']['fp32']:.0f} GFLOP/s, bf16 {r['peak_gflops']['bf16']:.0f} GFLOP/s")
    return results


# ----------------------------------------------------------------------------- compile


def compile_child(compiled: bool, steps: int, batch: int, out: Path) -> None:
    import torch

    from magclip.config import TrainConfig

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    engine = engine_in_memory(TrainConfig(epochs=1, batch_size=batch, warmup_steps=0, compile=compiled),
                              clip_train_module("tiny-resnet"))
    data = clip_batch(batch)
    t0 = time.perf_counter()
    engine._train_step([data])
    first = time.perf_counter() - t0
    engine._train_step([data])
    t0 = time.perf_counter()
    for _ in range(steps):
        engine._train_step([data])
    write_json(out, {"first_step_s": first, "ms": (time.perf_counter() - t0) / steps * 1000})


def part_compile(a) -> dict[str, Any]:
    cache = tempfile.mkdtemp(prefix="inductor_")
    env = {**child_env(a.threads), "TORCHINDUCTOR_CACHE_DIR": cache}
    res = {}
    for name, compiled in (("eager", False), ("compiled, cold cache", True), ("compiled, warm cache", True)):
        out = Path(tempfile.mkdtemp()) / "c.json"
        subprocess.run([sys.executable, __file__, "--child-compile", str(int(compiled)), "--steps", str(a.steps),
                        "--batch", str(a.batch), "--out", str(out)], env=env, check=True)
        res[name] = json.loads(out.read_text())
    eager = res["eager"]["ms"]
    rows = []
    for name, r in res.items():
        gain = eager - r["ms"]
        even = f"{(r['first_step_s'] - res['eager']['first_step_s']) * 1000 / gain:.0f}" if gain > 0 and name != "eager" else "never"
        rows.append([name, f"{r['first_step_s']:.1f}", f"{r['ms']:.1f}", f"{eager / r['ms']:.2f}",
                     even if name != "eager" else "–"])
    print(table(rows, ["tiny-resnet train step", "first step s", "ms/step after", "× eager", "break-even steps"]))
    return res


# ----------------------------------------------------------------------------- the main job, before vs after


def _main_job(checkout: Path, name: str, seed: int, out_dir: Path, threads: int, recipe: str | None,
              extra: list[str]) -> dict[str, Any]:
    env = {**child_env(threads), "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, str(checkout / "train" / "clip.py"), *(["--config", recipe] if recipe else []),
           f"name={name}", f"output_dir={out_dir}", f"train.seed={seed}", *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=checkout, env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    results = json.loads((out_dir / name / "results.json").read_text())
    records = [json.loads(x) for x in (out_dir / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r]
    rates = rates[1:] or rates  # the first window holds start-up; a --tiny run may have only that one
    return {"wall_s": wall, "train_s": results["wall_time_s"],
            "samples_per_s": statistics.median(rates) if rates else float("nan"),
            "r1_i2t": results["metrics"]["image_to_text_R@1"], "r1_t2i": results["metrics"]["text_to_image_R@1"]}


def part_mainjob(a) -> dict[str, Any]:
    before = Path(tempfile.mkdtemp(prefix="before_")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(before), a.before], check=True,
                   capture_output=True)
    if (REPO.parent / "shared").is_dir():  # so that a recipe's ../shared/data paths mean the same data
        (before.parent / "shared").symlink_to(REPO.parent / "shared")
    try:
        return {**_main_job_sides(a, [("before", before, []), ("after", REPO, [])]), "before": a.before}
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)], capture_output=True)


def part_precision(a) -> dict[str, Any]:
    """This checkout's main job (or --recipe) in fp32 against `train.precision=auto`, seed by seed: the
    measurement behind the precision default (auto's R@1 must stay within the seed spread)."""
    return _main_job_sides(a, [(p, REPO, [f"train.precision={p}"]) for p in ("fp32", "auto")])


def _main_job_sides(a, sides: list[tuple[str, Path, list[str]]]) -> dict[str, Any]:
    """Seeds 0..N-1 of the main job on each (label, checkout, overrides) side, alternating or --side-by-side;
    the table, and the second side's samples/s over the first's."""
    out = Path(tempfile.mkdtemp(prefix="mainjob_"))
    res: dict[str, list[dict]] = {label: [] for label, _, _ in sides}
    for seed in range(a.seeds):
        with ThreadPoolExecutor(len(sides) if a.side_by_side else 1) as pool:
            runs = [pool.submit(_main_job, tree, f"{label}_{seed}", seed, out, a.threads, a.recipe, [*a.extra, *extra])
                    for label, tree, extra in sides]
            for (label, _, _), run in zip(sides, runs):
                res[label].append(run.result())
                print(label, seed, {k: round(v, 4) for k, v in res[label][-1].items()}, flush=True)
    rows = []
    for label, runs in res.items():
        rows.append([label, f"{statistics.median(r['samples_per_s'] for r in runs):.0f}",
                     f"{statistics.median(r['train_s'] for r in runs):.1f}",
                     ", ".join(f"{100 * r['r1_i2t']:.1f}" for r in runs),
                     ", ".join(f"{100 * r['r1_t2i']:.1f}" for r in runs)])
    first, second = (label for label, _, _ in sides)
    ratio = statistics.median(r["samples_per_s"] for r in res[second]) / statistics.median(
        r["samples_per_s"] for r in res[first])
    print(table(rows, ["main job", "samples/s (median)", "train s (median)", "val i→t R@1 per seed",
                       "val t→i R@1 per seed"]))
    print(f"{second} / {first} samples/s: {ratio:.2f}")
    return {"runs": res, "ratio": ratio}


# ----------------------------------------------------------------------------- MiniLM BEIR encoding


def part_encode(a) -> dict[str, Any]:
    if not SCIFACT_DIR.is_dir():
        print(f"SKIP encode: no SciFact at {SCIFACT_DIR}")
        return {}
    res: dict[str, list[dict]] = {"fp32": [], "bf16": []}
    for _ in range(a.rounds):
        for precision in res:
            out = Path(tempfile.mkdtemp()) / "beir.json"
            cmd = [sys.executable, str(REPO / "eval" / "beir.py"), "--model", "minilm", "--data", str(SCIFACT_DIR),
                   "--max-docs", str(a.max_docs), "--precision", precision, "--out", str(out), "--no-progress"]
            subprocess.run(cmd, env=child_env(a.threads), check=True, capture_output=True)
            entry = json.loads(out.read_text())["scifact"]
            res[precision].append({"docs_per_s": entry["docs"] / entry["encode_docs_s"], "ndcg@10": entry["ndcg@10"]})
    rows = [[p, f"{statistics.median(r['docs_per_s'] for r in runs):.1f}",
             f"{100 * statistics.median(r['ndcg@10'] for r in runs):.2f}"] for p, runs in res.items()]
    print(table(rows, ["MiniLM SciFact encoding", "docs/s (median)", "nDCG@10"]))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("step", "compile", "mainjob", "precision", "encode"), default="step")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=128, help="CLIP batch (tiny-resnet, tiny-vit)")
    p.add_argument("--text-batch", type=int, default=16, help="MiniLM batch (queries 32, passages 128 tokens)")
    p.add_argument("--seeds", type=int, default=3, help="mainjob: seeds per checkout")
    p.add_argument("--before", default="4fd47cd", help="mainjob: the commit before the levers")
    p.add_argument("--extra", nargs="*", default=[], help="mainjob: overrides for both checkouts")
    p.add_argument("--recipe", default=None, help="mainjob: a config file (relative to the repository) for both checkouts")
    p.add_argument("--side-by-side", action="store_true",
                   help="mainjob: run before and after of one seed at the same time (one core each), for long recipes")
    p.add_argument("--max-docs", type=int, default=2000, help="encode: SciFact subset size")
    p.add_argument("--tiny", action="store_true", help="smoke check: 1 round, 1 step, small batches")
    p.add_argument("--out", default=None)
    p.add_argument("--child-step", choices=WORKLOADS, help=argparse.SUPPRESS)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--child-compile", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child_step:
        return step_child(a.child_step, a.variants, a.steps, a.batch, Path(a.out))
    if a.child_compile is not None:
        return compile_child(bool(a.child_compile), a.steps, a.batch, Path(a.out))
    if a.tiny:
        a.rounds, a.steps, a.batch, a.text_batch, a.seeds = 1, 1, 16, 4, 1
        a.extra = [*a.extra, "train.max_steps=3", "data.synthetic.num_train=256", "data.synthetic.num_val=64"]
    result = {"step": part_step, "compile": part_compile, "mainjob": part_mainjob, "precision": part_precision,
              "encode": part_encode}[a.part](a)
    out = Path(a.out) if a.out else RESULTS_DIR / f"levers_{a.part}{'_tiny' if a.tiny else ''}.json"
    write_json(out, {"machine": machine_info(a.threads), "args": vars(a), "result": result})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
