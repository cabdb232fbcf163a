"""Where a training step's time goes: py-spy on the trainer process of magclip and of open_clip_train.

    pip install py-spy
    python benchmarks/profile_train.py                    # both trainers, the bench_train.py --part ab setup
    python benchmarks/profile_train.py --i2t learnable --t2i learnable    # a magclip mode
    python benchmarks/profile_train.py --tiny

Each trainer runs once under `py-spy record --format raw` (main process only: loader workers are
separate processes, their cost shows here as time waiting for the next batch). The collapsed
stacks are bucketed by the first matching rule (`BUCKETS`, checked in order against the whole
stack), giving the share of the trainer's wall time per phase; the raw collapsed stacks are kept, gzipped, under
benchmarks/results/profiles/ for flame graphs (`zcat X.txt.gz | flamegraph.pl > X.svg`).
Sampling at 100 Hz slows the process a little; compare shares, not absolute speed.
"""

from __future__ import annotations

import argparse
import gzip
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, RESULTS_DIR, child_env, machine_info, synthetic_urls, table, write_json

HERE = Path(__file__).resolve().parent
DEFAULT_OC_PY = Path.home() / ".cache" / "magclip-bench" / "open_clip_train_venv" / "bin" / "python"

OUTSIDE = "outside the training loop (imports, model build, data setup, exit)"
LOOP = r"fit \(.*engine\.py|train_one_epoch"  # a stack inside the trainer's step loop has one of these frames
# (bucket, regex on the ';'-joined stack); first match wins, for stacks inside the loop
BUCKETS = [
    ("final checkpoint", r"save_checkpoint|torch/serialization\.py|atomic_torch_save|publish_dir"),
    ("backward", r"_engine_run_backward|run_backward|\bbackward \("),
    ("optimizer step", r"optim/adamw\.py|optim/optimizer\.py|_multi_tensor_adamw|_single_tensor_adamw"),
    ("grad clipping / norm", r"clip_grad_norm|_clip_gradients|get_total_norm"),
    ("waiting for data", r"dataloader\.py|_next_data|ShardLoader|__next__ \(.*webdataset|_steps_of_epoch"),
    ("loss", r"magclip/losses\.py|open_clip/loss\.py|similarity\.py|temperature\.py"),
    ("forward (encoders)", r"encode_image|encode_text|modified_resnet|transformer\.py|model\.py"),
    ("logging / metrics", r"tensorboard|_log \(|_write_metrics|logging/__init__|tqdm|\.item \(|reduce_counts"),
    ("step bookkeeping (other engine/trainer code)", r"engine\.py|open_clip_train/train\.py"),
]


def bucket_stacks(raw: Path) -> Counter:
    counts: Counter = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        if not re.search(LOOP, stack):
            counts[OUTSIDE] += int(n)
            continue
        for name, pattern in BUCKETS:
            if re.search(pattern, stack):
                counts[name] += int(n)
                break
        else:
            counts["other"] += int(n)
    return counts


def gzip_file(path: Path) -> Path:
    """path -> path.gz (the raw stacks are megabytes of text; gzip keeps a few hundred kB)."""
    gz = path.with_name(path.name + ".gz")
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return gz


def profile(cmd: list[str], raw: Path, threads: int, rate: int) -> None:
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("SKIP: py-spy is not installed (pip install py-spy)")
    with tempfile.TemporaryDirectory(prefix="magclip_prof_") as tmp:
        full = [spy, "record", "--rate", str(rate), "--format", "raw", "--output", str(raw), "--", *cmd,
                "--out", f"{tmp}/r.json", "--workdir", tmp]
        proc = subprocess.run(full, check=False, cwd=REPO, env=child_env(threads), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"py-spy run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-resnet")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--i2t", default="cosine")
    p.add_argument("--t2i", default="cosine")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--open-clip-python", default=str(DEFAULT_OC_PY))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    urls, n = synthetic_urls()
    if a.tiny:
        n = 8 * a.batch_size
    common = ["--data", urls, "--num-samples", str(n), "--model", a.model, "--batch-size", str(a.batch_size),
              "--threads", str(a.threads), "--workers", str(a.workers), "--skip", "1", "--measure", "4"]
    cmds = {"magclip": [sys.executable, str(HERE / "_run_magclip.py"), *common, "--i2t", a.i2t, "--t2i", a.t2i]}
    if Path(a.open_clip_python).is_file() and a.i2t == a.t2i == "cosine":
        cmds["open_clip_train"] = [a.open_clip_python, str(HERE / "_run_open_clip.py"), *common]
    prof_dir = RESULTS_DIR / "profiles"
    prof_dir.mkdir(parents=True, exist_ok=True)
    shares = {}
    for name, cmd in cmds.items():
        tag = name if name != "magclip" or a.i2t == a.t2i == "cosine" else f"magclip_{a.i2t}_{a.t2i}"
        raw = prof_dir / f"{tag}{'_tiny' if a.tiny else ''}.txt"
        profile(cmd, raw, a.threads, a.rate)
        counts = bucket_stacks(raw)
        raw = gzip_file(raw)
        total = sum(counts.values())
        train = total - counts[OUTSIDE] - counts["final checkpoint"]
        shares[tag] = {"samples": total, "training_samples": train,
                       "share_of_training_pct": {k: 100 * v / max(train, 1) for k, v in counts.items()
                                                 if k not in (OUTSIDE, "final checkpoint")},
                       "seconds": {k: v / a.rate for k, v in counts.items()}, "raw_stacks": str(raw.relative_to(REPO))}
        print(f"{tag}: {total} samples ({total / a.rate:.1f} s), stacks in {raw}", flush=True)
    names = [b for b, _ in BUCKETS if b != "final checkpoint"] + ["other"]
    rows = [[b, *[f"{shares[t]['share_of_training_pct'].get(b, 0.0):.1f} %" for t in shares],
             *[shares[t]["seconds"].get(b, 0.0) for t in shares]] for b in names]
    print(table(rows, ["phase (trainer process)", *[f"{t} share" for t in shares], *[f"{t} s" for t in shares]]))
    out = Path(a.out) if a.out else RESULTS_DIR / f"profile_train{'_tiny' if a.tiny else ''}.json"
    write_json(out, {"benchmark": "profile/train", "machine": machine_info(a.threads), "settings": vars(a),
                     "buckets": [OUTSIDE, *[b for b, _ in BUCKETS]], "profiles": shares})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
