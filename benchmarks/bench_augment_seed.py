"""What seeding each sample's augmentation costs (data/sample_augment.py): the main job's train transform on its
decoded images, called plainly (draws from the global RNGs, as the loader did before) and through
`SeededAugment`, in alternating blocks in one process (drift in the machine's speed falls on both).

    python benchmarks/bench_augment_seed.py                 # -> results/augment_seed.json
    python benchmarks/bench_augment_seed.py --blocks 4 --per-block 256

Reported: microseconds per sample of each, their difference, and that difference for a batch of 128 against
the main job's floor step (results/floor.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, synthetic_urls, write_json  # noqa: E402


def images(n: int) -> list:
    """The first `n` decoded images of the main job's training shards (RGB, before augmentation)."""
    from collections import Counter

    from magclip.data.shard_reader import DEFAULT_MAX_IMAGE_PIXELS, check_sample, iter_tar_samples
    from magclip.data.urls import expand_sources

    urls, _ = synthetic_urls()
    out = []
    for _, key, sample in iter_tar_samples([u for source in expand_sources(urls) for u in source], Counter()):
        good, _, _ = check_sample({**sample, "__key__": key}, DEFAULT_MAX_IMAGE_PIXELS)
        if good is not None:
            out.append(good["image"])
        if len(out) == n:
            return out
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--per-block", type=int, default=512)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "augment_seed.json")
    a = p.parse_args()
    import torch

    from magclip.data.sample_augment import SeededAugment, sample_seed
    from magclip.models.clip import create_clip, uint8_transform

    torch.set_num_threads(1)
    transform = uint8_transform(create_clip("tiny-resnet").preprocess_train)
    seeded = SeededAugment(transform)
    imgs = images(a.per_block)
    plain, seeded_us = [], []
    for block in range(a.blocks):
        for name, times in (("plain", plain), ("seeded", seeded_us)) if block % 2 == 0 else (("seeded", seeded_us),
                                                                                          ("plain", plain)):
            t0 = time.perf_counter()
            for i, img in enumerate(imgs):
                if name == "plain":
                    transform(img)
                else:
                    seeded(img, sample_seed(0, block, 0, str(i)))
            times.append(1e6 * (time.perf_counter() - t0) / len(imgs))
    floor = json.loads((RESULTS_DIR / "floor.json").read_text()) if (RESULTS_DIR / "floor.json").is_file() else {}
    floor_ms = _floor_step_ms(floor)
    extra_us = statistics.median(seeded_us) - statistics.median(plain)
    report = {"plain_us_per_sample": statistics.median(plain), "seeded_us_per_sample": statistics.median(seeded_us),
              "extra_us_per_sample": extra_us, "extra_ms_per_batch_128": extra_us * 128 / 1000,
              "floor_step_ms": floor_ms,
              "share_of_floor_step": (extra_us * 128 / 1000 / floor_ms) if floor_ms else None,
              "blocks": {"plain": plain, "seeded": seeded_us}}
    write_json(a.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "blocks"}, indent=1))


def _floor_step_ms(floor: dict) -> float | None:
    """ms of one floor step of 128 samples (results/floor.json's summary), if it is there."""
    return (floor.get("summary") or {}).get("floor", {}).get("ms_per_step")


if __name__ == "__main__":
    main()
