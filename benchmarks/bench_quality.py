"""Learning quality: what magclip's trainer and open_clip_train learn from the same recipe, the same
step count and the same seeds, scored by one evaluator that belongs to neither.

    bash benchmarks/setup_open_clip_train_env.sh                       # once: open_clip_train's own env
    python benchmarks/bench_quality.py                                 # emoji recipe, 6 seeds each, alternating
    python benchmarks/bench_quality.py --tag buffer5000 --magclip-override data.shuffle_buffer=5000   # an ablation
    python benchmarks/bench_quality.py --data synthetic                # the main job's recipe
    python benchmarks/bench_quality.py --tiny                          # smoke check: 2 seeds, a few steps
    python benchmarks/bench_quality.py --seeds 9 --reuse-runs          # 3 more seeds; finished runs are kept
    python benchmarks/bench_quality.py --tag streams1 --magclip-override data.streams=1 --train-only   # magclip's side
    python benchmarks/bench_quality.py --tag streams1 --magclip-override data.streams=1 --reuse-runs --reuse-open-clip
                                       # ... then scored against the untagged run's open_clip_train checkpoints

The recipe (emoji): tiny-resnet on the emoji train shards, batch 128, lr 2e-3 with 50 warm-up steps
and a cosine schedule, weight decay 0.1, AdamW (0.9, 0.98, 1e-6), gradient clip 1.0, fp32, 2 loader
workers, 1 thread. Step count: open_clip_train's, which `open_clip_steps` computes from its rule
(each of its W workers yields ceil(ceil(N / B) / W) batches an epoch); magclip runs the same number
with `train.max_steps` (and one more epoch, so the step limit is what ends it). Runs alternate
(seed 0: magclip first, seed 1: open_clip_train first, ...), so drift in the machine's speed falls
on both.

The evaluator: each final checkpoint loads into the same open_clip model (open_clip_train's
`epoch_N.pt` and magclip's `model.safetensors` through `magclip.evaluation.checkpoint`), encodes
every split of `--eval-splits` with the model's validation transform, one art style at a time
(the key's prefix: google, twitter, openmoji), and ranks by cosine with caption identity as
relevance. Per cell (split, style, direction): R@1 per query. The comparison, magclip −
open_clip_train per seed, goes through `magclip.experiments.stats`: a t interval over seeds per cell,
and a pooled difference weighted by queries (all cells' queries of a seed together) with its t
interval over seeds; per cell also the query-level bootstrap stratified by seed. Written to
benchmarks/results/quality_<data>[_<tag>].json; the table goes to benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DEFAULT_OC_PY, EMOJI_DIR, REPO, RESULTS_DIR, child_env, machine_info, resolve_data, write_json

HERE = Path(__file__).resolve().parent
EVAL_SPLITS = ("id_novel", "id_heldcat", "ood_seen", "ood_novel", "ood_heldcat")
RECIPES = {  # magclip config + the same hyper-parameters spelled for open_clip_train
    "emoji": {"config": "configs/clip/emoji.yaml", "batch": 128, "lr": 2e-3, "warmup": 50, "epochs": 15},
    "synthetic": {"config": None, "batch": 64, "lr": 1e-3, "warmup": 20, "epochs": 3},
}


def open_clip_steps(num_samples: int, batch: int, workers: int, epochs: int) -> int:
    """open_clip_train's optimizer steps for a webdataset of `num_samples` (its get_wds_dataset rule)."""
    batches = math.ceil(num_samples / batch)
    per_worker = math.ceil(batches / max(1, workers))
    return per_worker * max(1, workers) * epochs


# ----------------------------------------------------------------------------- the two trainers


def magclip_command(a, recipe: dict, urls: str, steps: int, seed: int, work: Path) -> list[str]:
    run = work / "magclip" / f"seed{seed}"
    return [sys.executable, str(REPO / "train" / "clip.py"), *(["--config", recipe["config"]] if recipe["config"] else []),
            f"output_dir={run.parent}", f"name={run.name}", "overwrite=true", f"data.train={urls}", "data.val=null",
            "data.eval_sets={}", f"data.workers={a.workers}", f"train.threads={a.threads}", f"train.seed={seed}",
            f"train.batch_size={recipe['batch']}", f"train.lr={recipe['lr']}", f"train.warmup_steps={recipe['warmup']}",
            f"train.epochs={recipe['epochs'] + 1}", f"train.max_steps={steps}", "train.checkpoint_every=0",
            "train.log_every=10", "train.weight_decay=0.1", *a.magclip_override]


def run_magclip(a, cmd: list[str], steps: int, seed: int, work: Path) -> dict[str, Any]:
    run = work / "magclip" / f"seed{seed}"
    wall = _run(cmd, a.threads, work / f"magclip_seed{seed}.log")
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r and r["step"] > 20]
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == steps, (results["steps"], steps)
    return {"weights": str(run / "checkpoints" / "latest"), "wall_s": wall, "steps": results["steps"],
            "samples_per_s": statistics.median(rates) if rates else None}


def open_clip_command(a, recipe: dict, urls: str, n: int, seed: int, work: Path) -> list[str]:
    extra = (f"--epochs {recipe['epochs']} --lr {recipe['lr']} --warmup {recipe['warmup']} --seed {seed} "
             f"--logs {work / 'open_clip_train'} --name seed{seed}")
    return [str(a.open_clip_python), str(HERE / "_run_open_clip.py"), "--data", urls, "--num-samples", str(n),
            "--model", a.model, "--batch-size", str(recipe["batch"]), "--threads", str(a.threads), "--precision", "fp32",
            "--workers", str(a.workers), "--skip", "20", "--open-clip-args", extra, "--out",
            str(work / f"open_clip_seed{seed}.json"), "--workdir", str(work)]


def run_open_clip(a, cmd: list[str], recipe: dict, seed: int, work: Path) -> dict[str, Any]:
    logs = work / "open_clip_train"
    shutil.rmtree(logs / f"seed{seed}", ignore_errors=True)  # open_clip_train refuses an existing experiment name
    wall = _run(cmd, a.threads, work / f"open_clip_seed{seed}.log")
    child = json.loads((work / f"open_clip_seed{seed}.json").read_text())
    ckpt = logs / f"seed{seed}" / "checkpoints" / f"epoch_{recipe['epochs']}.pt"
    return {"weights": str(ckpt), "wall_s": wall, "steps": child.get("steps"),
            "samples_per_s": child.get("samples_per_s")}


def trained_once(record: Path, cmd: list[str], reuse: bool, train) -> dict[str, Any]:
    """train() unless `reuse` and `record` says the same command already finished (its weights still
    there): a benchmark stopped half-way, or one extended to more seeds, trains only what is missing."""
    if reuse and record.is_file():
        done = json.loads(record.read_text())
        if done["command"] == cmd and Path(done["result"]["weights"]).exists():
            return {**done["result"], "reused_run": str(record)}
    result = train()
    record.write_text(json.dumps({"command": cmd, "result": result}, indent=1))
    return result


def reused_open_clip(recipe: dict, seed: int, work: Path) -> dict[str, Any]:
    """The open_clip_train run of `seed` that an earlier untagged benchmark left in `work`."""
    ckpt = work / "open_clip_train" / f"seed{seed}" / "checkpoints" / f"epoch_{recipe['epochs']}.pt"
    child = work / f"open_clip_seed{seed}.json"
    if not ckpt.is_file() or not child.is_file():
        raise SystemExit(f"--reuse-open-clip: no open_clip_train run of seed {seed} in {work} ({ckpt}); run the "
                         "benchmark without --tag first")
    timing = json.loads(child.read_text())
    return {"weights": str(ckpt), "wall_s": None, "steps": timing.get("steps"),
            "samples_per_s": timing.get("samples_per_s"), "reused_from": str(work)}


def _run(cmd: list[str], threads: int, log_path: Path) -> float:
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=child_env(threads), stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd[:3])} ... failed (exit {proc.returncode}); log {log_path}:\n"
                           f"{log_path.read_text()[-3000:]}")
    return round(time.perf_counter() - t0, 1)


# ----------------------------------------------------------------------------- the evaluator


def eval_cells(a, data: str) -> dict[str, dict[str, Any]]:
    """cell name ("id_novel/google") -> its samples: preprocessed images, captions, keys (decoded once)."""
    import torch
    from PIL import Image

    from collections import Counter

    from magclip.data.shard_reader import iter_tar_samples
    from magclip.data.urls import check_sources_exist
    from magclip.models.clip import create_clip

    preprocess = create_clip(a.model).preprocess_val
    if data == "synthetic":
        from magclip.data.synthetic import ensure_synthetic

        sources = {"synthetic_val": ensure_synthetic(None, num_train=6000, num_val=500, image_size=32).val_urls}
    else:
        sources = {s: sorted(str(p) for p in EMOJI_DIR.glob(f"{s}-*.tar")) for s in a.eval_splits}
    cells: dict[str, dict[str, Any]] = {}
    skipped: Counter = Counter()
    for split, urls in sources.items():
        for _, key, sample in iter_tar_samples(check_sources_exist(urls), skipped):
            image_bytes = next((sample[e] for e in ("png", "jpg", "jpeg", "webp") if e in sample), None)
            if image_bytes is None or "txt" not in sample:
                continue
            style = key.split("_")[0] if data == "emoji" else "all"
            cell = cells.setdefault(f"{split}/{style}", {"images": [], "captions": [], "keys": []})
            cell["images"].append(preprocess(Image.open(io.BytesIO(image_bytes)).convert("RGB")))
            cell["captions"].append(sample["txt"].decode("utf-8").strip())
            cell["keys"].append(key)
    for cell in cells.values():
        cell["images"] = torch.stack(cell["images"])
    return cells


def score(weights: str, a, cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
    """cell/direction -> R@1 hit (0/1) per query, cosine, caption identity."""
    import torch

    from magclip.evaluation.checkpoint import pretrained_weights
    from magclip.evaluation.clip import retrieval_from_features
    from magclip.models.clip import create_clip
    from magclip.similarity import make_scorer

    bundle = create_clip(a.model, pretrained_weights(weights))
    model = bundle.model.eval()
    cosine = make_scorer("cosine").requires_grad_(False)
    out = {}
    with torch.no_grad():
        for name, cell in cells.items():
            img = torch.cat([model.encode_image(chunk).float() for chunk in cell["images"].split(256)])
            txt = torch.cat([model.encode_text(bundle.tokenizer(cell["captions"][i:i + 256])).float()
                             for i in range(0, len(cell["captions"]), 256)])
            metrics = retrieval_from_features(img, txt, cell["captions"], {"i2t": cosine, "t2i": cosine})
            for direction, ranks in metrics.ranks.items():
                out[f"{name}/{direction}"] = [int(r == 0) for r in ranks]
    return out


# ----------------------------------------------------------------------------- statistics


def paired(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """magclip − open_clip_train: per cell (seed t interval + query bootstrap) and pooled over queries."""
    import numpy as np

    from magclip.experiments.stats import compare, t_interval

    cells = sorted(runs[0]["magclip"]["hits"])
    per_cell = {}
    for cell in cells:
        m = np.array([r["magclip"]["hits"][cell] for r in runs], dtype=float)
        o = np.array([r["open_clip_train"]["hits"][cell] for r in runs], dtype=float)
        c = compare(100 * (m.mean(1) - o.mean(1)), 100 * (m - o))
        per_cell[cell] = {"queries": int(m.shape[1]), "magclip_R@1": float(100 * m.mean()),
                          "open_clip_train_R@1": float(100 * o.mean()), **c.to_dict()}
    pooled_seed = [100 * (np.mean(np.concatenate([r["magclip"]["hits"][c] for c in cells])) -
                          np.mean(np.concatenate([r["open_clip_train"]["hits"][c] for c in cells]))) for r in runs]
    unweighted = [float(np.mean([100 * (np.mean(r["magclip"]["hits"][c]) - np.mean(r["open_clip_train"]["hits"][c]))
                                 for c in cells])) for r in runs]
    below = sum(1 for v in per_cell.values() if v["diff"] < 0)
    return {"cells": per_cell, "pooled_query_weighted": {"per_seed": pooled_seed, **t_interval(pooled_seed)},
            "unweighted_over_cells": {"per_seed": unweighted, **t_interval(unweighted)},
            "cells_magclip_below": below, "cells_total": len(per_cell)}


def table(report: dict[str, Any]) -> str:
    s = report["stats"]
    rows = ["| cell | queries | magclip R@1 | open_clip_train R@1 | diff [95 % seed t] | query bootstrap | verdict |",
            "|---|---|---|---|---|---|---|"]
    for cell, v in s["cells"].items():
        rows.append(f"| {cell} | {v['queries']} | {v['magclip_R@1']:.2f} | {v['open_clip_train_R@1']:.2f} | "
                    f"{v['diff']:+.2f} [{v['seed_low']:+.2f}, {v['seed_high']:+.2f}] | "
                    f"[{v['item_low']:+.2f}, {v['item_high']:+.2f}] | {v['verdict']} |")
    p, u = s["pooled_query_weighted"], s["unweighted_over_cells"]
    rows.append(f"| **pooled, query-weighted** | | | | **{p['mean']:+.2f} [{p['low']:+.2f}, {p['high']:+.2f}]** | | |")
    rows.append(f"| unweighted over {s['cells_total']} cells | | | | {u['mean']:+.2f} [{u['low']:+.2f}, {u['high']:+.2f}] | | |")
    speed = report["speed"]
    rows.append(f"\n{report['seeds']} seeds, {report['steps']} steps each; magclip below open_clip_train in "
                f"{s['cells_magclip_below']} of {s['cells_total']} cells; steady samples/s magclip / open_clip_train "
                f"= {speed['ratio_samples_per_s']:.2f} (median per seed), wall time ratio {speed['ratio_wall']:.2f}.")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=sorted(RECIPES), default="emoji")
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--first-seed", type=int, default=0,
                   help="train from this seed on (a second copy of the benchmark taking the last seeds on a machine "
                        "with cores to spare; the scoring pass then takes every seed with --reuse-runs)")
    p.add_argument("--model", default="tiny-resnet")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-splits", nargs="+", default=list(EVAL_SPLITS))
    p.add_argument("--magclip-override", action="append", default=[], help="one magclip key=value (an ablation)")
    p.add_argument("--tag", default="", help="results file suffix (e.g. the ablation's name)")
    p.add_argument("--open-clip-python", type=Path, default=DEFAULT_OC_PY)
    p.add_argument("--work", type=Path, default=Path("/tmp/magclip_bench_quality"))
    p.add_argument("--tiny", action="store_true", help="2 seeds, 1 epoch: checks the pipeline, not the gap")
    p.add_argument("--reuse-open-clip", action="store_true",
                   help="an ablation of magclip only: take open_clip_train's checkpoints of the same seeds from the "
                        "untagged run's work folder instead of training them again (its recipe is unchanged)")
    p.add_argument("--reuse-runs", action="store_true",
                   help="take a run of this work folder that finished with the same command instead of training it "
                        "again (more seeds after a first reading, or a benchmark stopped half-way)")
    p.add_argument("--train-only", action="store_true",
                   help="train magclip's runs of every seed and stop (no open_clip_train, no scoring): an ablation's "
                        "side trained while the untagged benchmark is still running; score it later with --reuse-runs "
                        "--reuse-open-clip")
    a = p.parse_args()
    if not a.open_clip_python.is_file():
        raise SystemExit(f"SKIP: no open_clip_train environment at {a.open_clip_python}; run bash "
                         "benchmarks/setup_open_clip_train_env.sh")
    recipe = dict(RECIPES[a.data])
    if a.tiny:
        a.seeds, recipe["epochs"], recipe["warmup"] = 2, 1, 5
    urls, n = resolve_data(a.data)
    steps = open_clip_steps(n, recipe["batch"], a.workers, recipe["epochs"])
    work = a.work / (a.data + (f"_{a.tag}" if a.tag else "") + ("_tiny" if a.tiny else ""))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{a.data}: {n} samples, {steps} steps per run, {a.seeds} seeds; overrides {a.magclip_override}", flush=True)
    if a.train_only:
        for seed in range(a.first_seed, a.seeds):
            cmd = magclip_command(a, recipe, urls, steps, seed, work)
            trained = trained_once(work / f"magclip_seed{seed}.run.json", cmd, True,
                                   lambda: run_magclip(a, cmd, steps, seed, work))
            print(f"seed {seed} magclip: {trained['wall_s']} s, samples/s {trained['samples_per_s']}", flush=True)
        return
    cells = eval_cells(a, a.data)
    runs = []
    for seed in range(a.first_seed, a.seeds):
        order = ("magclip", "open_clip_train") if seed % 2 == 0 else ("open_clip_train", "magclip")
        run: dict[str, Any] = {"seed": seed}
        for who in order:
            if who == "magclip":
                cmd = magclip_command(a, recipe, urls, steps, seed, work)
                trained = trained_once(work / f"magclip_seed{seed}.run.json", cmd, a.reuse_runs,
                                       lambda: run_magclip(a, cmd, steps, seed, work))
            elif a.reuse_open_clip:
                trained = reused_open_clip(recipe, seed, a.work / a.data)
            else:
                cmd = open_clip_command(a, recipe, urls, n, seed, work)
                trained = trained_once(work / f"open_clip_seed{seed}.run.json", cmd, a.reuse_runs,
                                       lambda: run_open_clip(a, cmd, recipe, seed, work))
            trained["hits"] = score(trained["weights"], a, cells)
            run[who] = trained
            print(f"seed {seed} {who}: {trained['wall_s']} s, samples/s {trained['samples_per_s']}", flush=True)
        runs.append(run)
    ratio_rate = statistics.median(r["magclip"]["samples_per_s"] / r["open_clip_train"]["samples_per_s"] for r in runs)
    report = {"data": a.data, "recipe": recipe, "steps": steps, "seeds": a.seeds, "tag": a.tag,
              "magclip_overrides": a.magclip_override, "machine": machine_info(a.threads),
              "speed": {"ratio_samples_per_s": ratio_rate,
                        "ratio_wall": statistics.median(r["open_clip_train"]["wall_s"] / r["magclip"]["wall_s"]
                                                        for r in runs) if not a.reuse_open_clip else math.nan},
              "stats": paired(runs),
              "runs": [{"seed": r["seed"], **{w: {k: v for k, v in r[w].items() if k != "hits"}
                                              for w in ("magclip", "open_clip_train")}} for r in runs]}
    name = f"quality_{a.data}" + (f"_{a.tag}" if a.tag else "") + ("_tiny" if a.tiny else "")
    write_json(RESULTS_DIR / f"{name}.json", report)
    print(table(report))
    print(f"written: {RESULTS_DIR / (name + '.json')}")


if __name__ == "__main__":
    main()
