"""Intra-op threads of the trainer: the chosen default against the alternatives, idle and under load.

    python benchmarks/bench_threads.py                    # main job settings, 40 steps per run, 3 rounds
    python benchmarks/bench_threads.py --steps 12 --rounds 1   # smoke check

Contenders (each a fresh `python train/clip.py` child with the main job's settings, 2 loader workers,
OMP_NUM_THREADS unset so the trainer's own rule decides):
- `auto`: no setting; magclip chooses (cores this process may use - loader workers; magclip/training/threads.py)
- `threads=N` for N = 1 .. cores: torch's old default is N = cores (one thread per core it sees)
Each runs idle and under load (one busy process per core running beside the trainer, as on a
shared machine), in rotated order A B C, B C A, ... The figure is samples/s, the median over the
steps after the first 5 of each run (metrics.jsonl), then the median over rounds, and each
contender's ratio to `auto` within the same condition.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def spin(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


def run_once(out: Path, name: str, threads: int | None, steps: int, workers: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.setdefault("MAGCLIP_CACHE", "/tmp/mc_cache")
    args = [sys.executable, str(REPO / "train" / "clip.py"), f"output_dir={out}", f"name={name}",
            f"train.max_steps={steps}", "train.log_every=1", f"data.workers={workers}", "overwrite=true"]
    if threads is not None:
        args.append(f"train.threads={threads}")
    subprocess.run(args, env=env, check=True, capture_output=True, timeout=1800)
    rates = [r["samples_per_s"] for r in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines())
             if "samples_per_s" in r and r.get("step", 0) > 5]
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    contenders: list[tuple[str, int | None]] = [("auto", None)] + [(f"threads={n}", n) for n in range(1, cores + 1)]
    rates: dict[str, dict[str, list[float]]] = {"idle": {}, "loaded": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = contenders[rnd % len(contenders):] + contenders[:rnd % len(contenders)]
            for condition in ("idle", "loaded"):
                for label, threads in order:
                    hogs = []
                    if condition == "loaded":
                        hogs = [mp.Process(target=spin, args=(time.time() + 3600,)) for _ in range(cores)]
                        for h in hogs:
                            h.start()
                    try:
                        rate = run_once(Path(tmp), "t", threads, args.steps, args.workers)
                    finally:
                        for h in hogs:
                            h.terminate()
                    rates[condition].setdefault(label, []).append(rate)
                    print(f"round {rnd} {condition:6s} {label:10s} {rate:7.1f} samples/s", flush=True)
    table = {}
    for condition, by_label in rates.items():
        auto = statistics.median(by_label["auto"])
        table[condition] = {label: {"samples_per_s": round(statistics.median(v), 1),
                                    "ratio_to_auto": round(statistics.median(v) / auto, 3), "runs": v}
                            for label, v in by_label.items()}
    print(json.dumps(table, indent=1))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "threads.json"
    out.write_text(json.dumps({"cores": cores, "workers": args.workers, "steps": args.steps, "table": table,
                               "date": time.strftime("%Y-%m-%d")}, indent=1) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
