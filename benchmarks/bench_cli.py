"""How fast a command answers `--help` and bad input, against the cost of the imports it avoids.

    python benchmarks/bench_cli.py             # 5 rounds
    python benchmarks/bench_cli.py --rounds 1  # smoke check

Every command checks its arguments, config and input paths before it imports torch, open_clip or a
model (tests/cli/test_errors.py asserts the modules loaded; this measures the time). Each case is a
fresh `python` process, rotated per round; the reference is `python -c "import torch, open_clip"`,
what each of these paid before. Figures: median wall seconds per case and its ratio to the reference.
Every case runs offline (HF_HUB_OFFLINE=1, an empty HF_HOME), so the hub cases answer from the cache
check alone: their figure is what the one-line "not in the local hub cache" error costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = {
    "reference: import torch, open_clip": ["-c", "import torch, open_clip"],
    "train/clip.py --help": ["train/clip.py", "--help"],
    "train/clip.py loss.i2t=qnrom (bad value)": ["train/clip.py", "loss.i2t=qnrom"],
    "train/clip.py data.train=<missing shards>": ["train/clip.py", "data.train=/no/such/shard-{000000..000009}.tar"],
    "eval/beir.py --data <missing folder>": ["eval/beir.py", "--data", "/no/such/dir", "--out", "/tmp/x.json"],
    "eval/zeroshot.py --checkpoint <missing>": ["eval/zeroshot.py", "--checkpoint", "/no/such/run", "--data", "x.tar",
                                                "--out", "/tmp/x.json"],
    "eval/compare.py --help": ["eval/compare.py", "--help"],
    # offline (HF_HUB_OFFLINE=1, an empty HF_HOME): a hub model / pretrained tag answers in one line
    "train/clip.py model.name=hf-hub:<not cached>": ["train/clip.py", "model.name=hf-hub:timm/ViT-B-16-SigLIP",
                                                     "output_dir=/tmp/bench_cli_runs"],
    "train/clip.py ViT-B-32 pretrained=<tag not cached>": ["train/clip.py", "model.name=ViT-B-32",
                                                          "model.pretrained=laion2b_s34b_b79k",
                                                          "output_dir=/tmp/bench_cli_runs"],
}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HOME": "/tmp/bench_cli_empty_hf_home"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    names = list(CASES)
    times: dict[str, list[float]] = {n: [] for n in names}
    codes: dict[str, int] = {}
    for rnd in range(args.rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            t0 = time.perf_counter()
            env = {**os.environ, **OFFLINE}
            proc = subprocess.run([sys.executable, *CASES[name]], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=600)
            times[name].append(time.perf_counter() - t0)
            codes[name] = proc.returncode
    ref = statistics.median(times[names[0]])
    table = {n: {"median_s": round(statistics.median(t), 3), "ratio_to_reference": round(statistics.median(t) / ref, 3),
                 "exit_code": codes[n]} for n, t in times.items()}
    for n, row in table.items():
        print(f"{n:45s} {row['median_s']:7.3f} s  x{row['ratio_to_reference']:.2f}  exit {row['exit_code']}")
    out = REPO / "benchmarks" / "results" / "cli.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rounds": args.rounds, "table": table, "date": time.strftime("%Y-%m-%d")}, indent=1) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
