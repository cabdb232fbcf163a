"""`train.sharding=fsdp` on every GPU of one machine: memory per GPU and samples/s, bf16; < 9 minutes.

    bash tools/gpu_sharding.sh                            # there: installs the carried wheels, runs this under torchrun
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_gpu_sharding.py --tiny   # CPU smoke check (gloo)

Why: bench_sharding_memory.py shows on CPUs that fsdp divides the parameters, gradients and AdamW state by the
world size; this is the same engine step at the sizes fsdp is for, on the hardware it is for. Every rank (one
per GPU, started by torchrun; NCCL) trains, one after the other, in this order while the budget lasts:

1. CLIP `--clip-model` (default open_clip ViT-L-14, 427.6 M parameters), randomly initialised on the GPU, 224 px,
   `--clip-batch` pairs per GPU (default 64), loss cosine/cosine, under fsdp;
2. a ~1.1 B decoder embedder: a Qwen3 built here (hidden 2048, 16 layers, 16 heads / 8 kv heads, intermediate 6144,
   vocab 151,936), one shared tower pooled at its last token (magclip BiEncoder), `--text-batch` query-passage
   pairs per GPU (default 32) of `--seq` tokens (default 128), RetrievalLoss cosine, under fsdp;
3. and 4. the same two under ddp, the reference (skipped when the budget is short).

Each run: `train.precision=bf16` (accelerate autocast; under fsdp the gathered parameters and the compute are
bf16, the shards, the master weights and the gradient reduction fp32), fused AdamW, grad clipping 1.0,
channels_last off; `--warmup` steps of the real `Engine._train_step` on a fixed batch, then `--steps` timed ones
(torch.cuda.synchronize around the window): samples/s = world x per-GPU batch x steps / seconds. Memory per
GPU: torch.cuda.max_memory_allocated / max_memory_reserved over the whole run (build + warm-up + timed) and over
the timed steps alone (peak stats reset after the warm-up), memory_allocated at the start of the timed steps,
and `engine.sharding.memory_record` (parameters, gradients, AdamW state of this rank; in AdamW's step pre-hook,
so the gradients are still there). With one GPU, fsdp does not shard (FSDPSharding.sharded is False: the run
is a single replica in fsdp's code path) and the JSON says so. The JSON (every rank's record, rank 0 writes) is
rewritten after every run, so a cut-off keeps what was measured. A run is started only while the elapsed time
plus the slowest run so far stays inside `--budget-s`.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]
from _common import machine_info, table, write_json
from bench_sharding_memory import (
    TINY_DECODER,
    StateProbe,
    clip_batch,
    decoder_module,
    make_engine,
    parameter_count,
    text_batch,
    train_config,
)

GIB = 2 ** 30
# ~1.1 B parameters (Qwen3-1.7B's width with 16 of its 28 layers): 311 M of embeddings + 16 x 50.3 M
DECODER_1B = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 16,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 2048}


def build(model: str, args: argparse.Namespace, device: Any, seed: int) -> tuple[Any, dict[str, Any]]:
    """The module, initialised on `device` (no host-side init of a billion parameters), and this rank's batch
    (on the host: the module moves it, as a loader's batch)."""
    import torch

    from magclip.config import LossConfig
    from magclip.models.clip import create_clip
    from magclip.training.clip import CLIPTrainModule, build_logit_scale, build_loss

    torch.manual_seed(0)
    if model == "clip":
        name = "tiny-vit" if args.tiny else args.clip_model
        with torch.device(device):
            loss = LossConfig()
            module = CLIPTrainModule(create_clip(name, None, device=device).model, build_loss(loss),
                                     build_logit_scale(loss))
        inner = module.clip.clip
        size = getattr(inner.visual, "image_size", 224)
        size = int(size[0] if isinstance(size, (tuple, list)) else size)
        return module, clip_batch(args.clip_batch, size, int(getattr(inner, "context_length", 77)), seed)
    decoder = TINY_DECODER if args.tiny else DECODER_1B
    seq = min(args.seq, decoder["max_position_embeddings"])
    with torch.device(device):
        module = decoder_module(decoder, seq)
    return module, text_batch(args.text_batch, seq, decoder["vocab_size"], seed)


def one_run(model: str, sharding: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, warm up, time `--steps` steps; this rank's record. Frees everything before returning."""
    import torch

    from magclip.training.accelerator import make_accelerator

    cuda = torch.cuda.is_available()
    cfg = train_config(sharding, args.precision, args.clip_batch if model == "clip" else args.text_batch)
    run_dir = Path(args.work) / f"{model}_{sharding}"
    acc = make_accelerator(cfg, run_dir)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    module, batch = build(model, args, acc.device, seed=acc.process_index)
    engine = make_engine(module, cfg, acc, run_dir)
    del module
    probe = StateProbe(engine)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        engine._train_step([batch])
    sync()
    build_s = time.perf_counter() - t_build
    at_start = torch.cuda.memory_allocated() if cuda else 0
    whole = _cuda_peaks()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    acc.wait_for_everyone()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = engine._train_step([batch])
    sync()
    seconds = time.perf_counter() - t0
    record = {"model": model, "sharding": sharding, "rank": acc.process_index, "world": acc.num_processes,
              "sharded": engine.sharding.sharded, "parameters": parameter_count(engine.unwrapped),
              "batch_per_gpu": cfg.batch_size, "precision": args.precision, "loss": float(out["loss"].detach()),
              "samples_per_s": acc.num_processes * cfg.batch_size * args.steps / seconds,
              "step_ms": 1000 * seconds / args.steps, "build_and_warmup_s": build_s,
              **probe.records[-1], "allocated_at_timed_start_bytes": at_start,
              **{f"run_{k}": v for k, v in whole.items()}, **{f"timed_{k}": v for k, v in _cuda_peaks().items()},
              "levers": engine.levers}
    probe.close()
    acc.free_memory(engine.model, engine.optimizer)
    del engine, batch, out
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return record


def _cuda_peaks() -> dict[str, int]:
    import torch

    if not torch.cuda.is_available():
        return {"max_allocated_bytes": 0, "max_reserved_bytes": 0}
    return {"max_allocated_bytes": torch.cuda.max_memory_allocated(), "max_reserved_bytes": torch.cuda.max_memory_reserved()}


def gather(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's record, in rank order (a collective)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [record]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, record)
    return out


def rows(runs: list[list[dict[str, Any]]]) -> list[list[Any]]:
    """One row per run: the largest rank's memory (GiB per GPU) and the global samples/s."""
    out = []
    for ranks in runs:
        r0 = ranks[0]
        state = max(r["parameter_bytes"] + r["gradient_bytes"] + r["optimizer_state_bytes"] for r in ranks)
        out.append([r0["model"], f"{r0['parameters'] / 1e6:,.0f} M", r0["sharding"], r0["world"],
                    "yes" if r0["sharded"] else "no", r0["batch_per_gpu"], state / GIB,
                    max(r["timed_max_allocated_bytes"] for r in ranks) / GIB,
                    max(r["timed_max_reserved_bytes"] for r in ranks) / GIB,
                    max(r["run_max_allocated_bytes"] for r in ranks) / GIB, r0["samples_per_s"]])
    return out


HEADER = ["model", "parameters", "sharding", "GPUs", "sharded", "batch/GPU", "params+grads+AdamW GiB/GPU",
          "peak allocated (timed) GiB", "peak reserved (timed) GiB", "peak allocated (whole run) GiB", "samples/s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clip-model", default="ViT-L-14", help="open_clip name, random init (ViT-H-14: 986 M)")
    p.add_argument("--clip-batch", type=int, default=64, help="pairs per GPU")
    p.add_argument("--text-batch", type=int, default=32, help="query-passage pairs per GPU")
    p.add_argument("--seq", type=int, default=128, help="tokens per query and per passage")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--runs", default="clip:fsdp,text:fsdp,clip:ddp,text:ddp")
    p.add_argument("--budget-s", type=float, default=400, help="no run starts past this (elapsed + slowest run)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke check: tiny-vit, a 2-layer decoder, batch 2, 1+2 steps")
    p.add_argument("--out", default=None, help="JSON (default results/gpu_sharding.json; --tiny: gpu_sharding_tiny.json)")
    p.add_argument("--work", default="/tmp/magclip_gpu_sharding", help="run folders (nothing is written there)")
    args = p.parse_args()
    if args.tiny:
        args.clip_batch, args.text_batch, args.seq, args.warmup, args.steps = 2, 2, 16, 1, 2
    started = time.perf_counter()
    out = Path(args.out or BENCH / "results" / ("gpu_sharding_tiny.json" if args.tiny else "gpu_sharding.json"))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    import torch

    doc: dict[str, Any] = {"machine": {**machine_info(torch.get_num_threads()), **_devices()}, "world": world,
                           "setup": {k: v for k, v in vars(args).items() if k not in ("out", "work")},
                           "decoder": TINY_DECODER if args.tiny else DECODER_1B, "runs": [], "skipped": []}
    if world == 1:
        doc["note"] = ("one process: train.sharding=fsdp does not shard (FSDPSharding.sharded is False), so its rows "
                       "are a single replica in fsdp's code path; run on a machine with several GPUs to see the 1/N")
        if rank == 0:
            print(doc["note"], flush=True)
    slowest = 0.0
    for item in args.runs.split(","):
        model, sharding = item.split(":")
        if time.perf_counter() - started + slowest > args.budget_s:
            doc["skipped"].append({"run": item, "why": f"budget {args.budget_s:.0f} s"})
            continue
        t0 = time.perf_counter()
        try:
            records = gather(one_run(model, sharding, args))
        except torch.OutOfMemoryError as exn:  # a rank out of memory: recorded, the next run goes on
            doc["skipped"].append({"run": item, "why": f"out of memory on rank {rank}: {str(exn)[:300]}"})
            gc.collect()
            torch.cuda.empty_cache()
            continue
        slowest = max(slowest, time.perf_counter() - t0)
        doc["runs"].append(records)
        if rank == 0:
            print(f"{item}: {records[0]['samples_per_s']:.1f} samples/s, "
                  f"{max(r['timed_max_allocated_bytes'] for r in records) / GIB:.2f} GiB peak allocated per GPU, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            doc["elapsed_s"] = time.perf_counter() - started
            write_json(out, doc)
    if rank == 0:
        text = table(rows(doc["runs"]), HEADER)
        doc["table_markdown"] = text
        write_json(out, doc)
        print(f"\n{world} process(es); GiB per GPU (the largest rank)\n{text}\nwrote {out}", flush=True)


def _devices() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu (smoke check)"}
    return {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory, "cuda": torch.version.cuda}


if __name__ == "__main__":
    main()
