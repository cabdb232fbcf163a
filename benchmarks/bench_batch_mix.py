"""What a training run's batches hold under each loader layout: the emoji recipe's 390 batches per seed, read by the
training loader itself (no model, no augmentation), for every `data.streams` of `--streams`.

    python benchmarks/bench_batch_mix.py                      # streams 1 and 2, seeds 0-5 -> results/batch_mix.json
    python benchmarks/bench_batch_mix.py --streams 1 2 4 --seeds 3

Why: contrastive learning takes its negatives from the batch, so what a batch holds is part of the recipe. Per
batch: captions that occur twice (in the emoji set each caption has two drawings, google and twitter: a
repeated caption is a false negative of the other drawing), how unequal the two styles are, from how many
shards it comes, and how far apart in the epoch's reading order its samples were read (a batch drawn while the
shuffle buffer is still filling holds samples read close together). Per run: how unevenly the samples are seen
(coefficient of variation of each sample's count over the run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import EMOJI_DIR, RESULTS_DIR, write_json  # noqa: E402

STEPS, BATCH = 390, 128
ZERO = None  # the stand-in image (a zero-size tensor): the batches' images are not looked at


def read_order(urls: list[str]) -> dict[str, tuple[int, int]]:
    """key -> (shard index, position in its shard)."""
    from magclip.data.shard_reader import iter_tar_samples

    where: dict[str, tuple[int, int]] = {}
    for i, url in enumerate(urls):
        for pos, (_, key, _) in enumerate(iter_tar_samples([url], Counter())):
            where[key] = (i, pos)
    return where


def run_batches(urls: list[str], cache, streams: int, seed: int) -> list[dict]:
    """The first STEPS batches of a run (epochs as the trainer makes them), keys and captions only."""
    import torch

    from magclip.data.shards import build_clip_loader, count_samples

    global ZERO
    ZERO = torch.zeros(0)
    n = count_samples(urls)
    out: list[dict] = []
    epoch = 0
    while len(out) < STEPS:
        loader = build_clip_loader(urls, preprocess=lambda img: ZERO, tokenizer=lambda texts: None, batch_size=BATCH,
                                   num_samples=n, shuffle=True, shuffle_buffer=5000, workers=0, streams=streams,
                                   seed=seed, epoch=epoch, decoded_cache=cache)
        out += [{"keys": b["keys"], "captions": b["captions"], "epoch": epoch}
                for b in loader._stream]  # noqa: SLF001 (the rank's stream in this process: no DataLoader needed)
        epoch += 1
    return [b for b in out if b.get("keys")][:STEPS]


def batch_stats(batch: dict, where: dict[str, tuple[int, int]], shard_sizes: list[int]) -> dict[str, float]:
    counts = Counter(batch["captions"])
    styles = Counter(k.split("_")[0] for k in batch["keys"])
    offsets = [sum(shard_sizes[:where[k][0]]) + where[k][1] for k in batch["keys"]]
    return {"repeated_caption_pairs": sum(c * (c - 1) // 2 for c in counts.values()),
            "style_imbalance": abs(styles["google"] - styles["twitter"]) / len(batch["keys"]),
            "shards": len({where[k][0] for k in batch["keys"]}),
            "read_offset_std": statistics.pstdev(offsets)}


def layout_stats(batches: list[dict], where, shard_sizes) -> dict[str, float]:
    per_batch = [batch_stats(b, where, shard_sizes) for b in batches]
    seen = Counter(k for b in batches for k in b["keys"])
    counts = [seen.get(k, 0) for k in where]
    out = {name: statistics.mean(s[name] for s in per_batch) for name in per_batch[0]}
    out["exposure_cv"] = statistics.pstdev(counts) / statistics.mean(counts)
    out["never_seen"] = sum(1 for c in counts if c == 0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "batch_mix.json")
    a = p.parse_args()
    from magclip.data.captions import CaptionKey
    from magclip.data.decoded_cache import fill
    from magclip.data.shard_reader import DEFAULT_MAX_IMAGE_PIXELS

    urls = sorted(str(u) for u in EMOJI_DIR.glob("train-*.tar"))
    if not urls:
        raise SystemExit(f"SKIP: no emoji shards in {EMOJI_DIR}")
    where = read_order(urls)
    shard_sizes = [sum(1 for v in where.values() if v[0] == i) for i in range(len(urls))]
    cache = fill(urls, max_pixels=DEFAULT_MAX_IMAGE_PIXELS, caption_key=CaptionKey("txt"), budget_mb=512)
    report: dict = {"steps": STEPS, "batch": BATCH, "shards": shard_sizes, "layouts": {}}
    for streams in a.streams:
        per_seed = [layout_stats(run_batches(urls, cache, streams, seed), where, shard_sizes) for seed in range(a.seeds)]
        report["layouts"][f"streams={streams}"] = {
            name: {"mean": statistics.mean(s[name] for s in per_seed), "per_seed": [s[name] for s in per_seed]}
            for name in per_seed[0]}
    write_json(a.out, report)
    names = list(next(iter(report["layouts"].values())))
    print("| layout | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for layout, stats in report["layouts"].items():
        print(f"| {layout} | " + " | ".join(f"{stats[n]['mean']:.3f}" for n in names) + " |")
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
