"""Child process: one magclip training run (train_clip, the path `train/clip.py` takes), timed per step.

Not meant to be run by hand; `bench_train.py` starts it. Also works under
`torchrun --nproc_per_node 2` (every rank times its own steps; rank 0 writes the JSON, with the
other ranks' rates gathered beside it).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import StepClock, gpu_peak_mb, peak_rss_mb, steady_rate, train_child_parser, write_json


def main() -> None:
    p = train_child_parser()
    p.add_argument("--i2t", default="cosine")
    p.add_argument("--t2i", default="cosine")
    p.add_argument("--extra", nargs="*", default=[], help="more dotted overrides")
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--measure", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--expect-world-size", type=int, default=1)
    p.add_argument("--cached-batches", type=int, default=0,
                   help="train on K batches decoded before the run, cycled (no loader): the step's own consumption rate")
    p.add_argument("--defaults", action="store_true",
                   help="the trainer's own threads, loader workers, precision and epoch length (--threads, --workers, "
                        "--precision and --num-samples are not applied)")
    p.add_argument("--out", required=True)
    p.add_argument("--workdir", required=True)
    a = p.parse_args()

    import torch

    if not a.defaults:
        torch.set_num_threads(a.threads)
    import torch.distributed as dist

    from magclip.training.clip import train_clip
    from magclip.config import load_config

    host = [] if a.defaults else [f"data.num_samples={a.num_samples}", f"data.workers={a.workers}",
                                  f"train.precision={a.precision}"]
    overrides = [
        "name=bench", f"output_dir={a.workdir}/runs", "overwrite=true",
        f"model.name={a.model}", f"data.train={a.data}", "data.val=null", *host,
        f"train.batch_size={a.batch_size}", f"train.epochs={a.epochs}",
        "train.lr=0.001", "train.warmup_steps=10", "train.log_every=10",
        f"loss.i2t={a.i2t}", f"loss.t2i={a.t2i}", *a.extra,
    ]
    if a.max_steps:
        overrides.append(f"train.max_steps={a.max_steps}")
    cfg = load_config(None, overrides)
    if a.cached_batches:
        _use_cached_batches(cfg, a.cached_batches)
    clock = StepClock()
    results = train_clip(cfg)
    clock.close()
    world = results["world_size"]
    if world != a.expect_world_size:
        raise SystemExit(f"expected world size {a.expect_world_size}, got {world}")
    rate = steady_rate(clock.times, a.batch_size * world, a.skip, a.measure)
    mem = {**peak_rss_mb(), **gpu_peak_mb()}
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    record = {"contender": "magclip", "mode": f"i2t={a.i2t},t2i={a.t2i}", "world_size": world, "rank": rank,
              "threads": torch.get_num_threads(), "workers": a.workers, "batch_size": a.batch_size,
              "precision": a.precision, "levers": results.get("speed_levers"), "defaults": a.defaults,
              "model": a.model, "cached_batches": a.cached_batches, **rate, **mem,
              "skipped_samples": results.get("skipped_samples")}
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, {"samples_per_s": rate["samples_per_s"], **mem})
        record["per_rank"] = gathered
    if rank == 0:
        write_json(a.out, record)


class _CachedLoader:
    """Stands in for ShardLoader: `num_batches` batches cycled from a fixed list already in memory."""

    def __init__(self, batches, num_batches):
        self.batches, self.num_batches = batches, num_batches

    def __len__(self):
        return self.num_batches

    def __iter__(self):
        for i in range(self.num_batches):
            yield dict(self.batches[i % len(self.batches)])


def _use_cached_batches(cfg, k: int) -> None:
    """Patch train_clip's loader factory: decode k real batches once (0 workers), then serve them from memory."""
    import magclip.training.clip as ct

    real = ct.build_clip_loader
    cache = {}

    def build(urls, **kw):
        if "batches" not in cache:
            loader = real(urls, **{**kw, "workers": 0})
            it = iter(loader)
            cache["batches"] = [next(it) for _ in range(min(k, loader.num_batches))]
            cache["num_batches"] = loader.num_batches
        return _CachedLoader(cache["batches"], cache["num_batches"])

    ct.build_clip_loader = build


if __name__ == "__main__":
    main()
