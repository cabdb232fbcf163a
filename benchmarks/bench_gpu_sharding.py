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
3. and 4. the same two under ddp, the reference (skipped when the budget is short);
5. `text7b:fsdp_lora` (in --runs to ask for it): a ~7.1 B decoder embedder (the Qwen2-7B layout: hidden 3584,
   28 layers, 28 heads / 4 kv heads, intermediate 18944, vocab 152,064) built on the meta device
   (magclip.models.build), LoRA adapters r=16 on its attention projections (peft's `inject_adapter_in_model`, the
   base frozen), sharded by the engine's own meta-device start (training/meta_start.py) and filled shard by shard
   from a random source (no 28 GB weights file to read on the GPU machine: `RandomWeights` hands each rank its rows
   of a seeded random tensor, lora_B zero), so no GPU and no host process ever holds the whole model.
   `--dry-run` builds it on the meta device only and prints its parameter count and each rank's bytes at 1-8
   GPUs, allocating nothing (runs on a CPU: `python benchmarks/bench_gpu_sharding.py --dry-run`).
   After its timed steps it takes the path a LoRA run takes at the defaults (issue 62): a checkpoint that holds the
   adapters and their optimizer state alone (`Engine(frozen_base=..., save_trained=...)`: the DCP shards without
   the frozen base, the adapters gathered whole on rank 0 and written as safetensors; no merged model) and a
   sharded evaluation (`Engine.evaluate_model`: every rank encodes its own batch with the sharded model), each
   timed, with the GPU peak over it and the checkpoint folder's size. It runs first (the default `--runs`).

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
import zlib
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

from magclip.training.meta_start import start_sharded

GIB = 2 ** 30
# ~1.1 B parameters (Qwen3-1.7B's width with 16 of its 28 layers): 311 M of embeddings + 16 x 50.3 M
DECODER_1B = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 16,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 2048}

# ~7.1 B parameters: the Qwen2-7B layout (AutoModel: no LM head), the size of the paper's retriever condition
DECODER_7B = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
              "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 4096}
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


class RandomWeights:
    """A weights source (magclip.models.build.WeightsSource's reading side) of seeded random tensors: each rank
    reads the rows it owns of the same tensor (normal std 0.02, ones for norms, zeros for LoRA's B, as their
    initialisations), so the engine's meta-device start fills a model that has no weights file."""

    def __init__(self, module: Any):
        self.keys = {k: (None, k) for k, t in module.state_dict(keep_vars=True).items() if t.is_meta}
        self.shapes = {k: tuple(t.shape) for k, t in module.state_dict(keep_vars=True).items() if t.is_meta}

    def read(self, key: str, rows: tuple[int, int] | None = None) -> Any:
        import torch

        shape = self.shapes[key]
        start, stop = rows if rows is not None else (0, shape[0] if shape else 0)
        part = (stop - start, *shape[1:]) if shape else ()
        if "lora_B" in key:
            return torch.zeros(part)
        if key.endswith("norm.weight"):
            return torch.ones(part)
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()) + start)   # the same on every rank
        return torch.randn(part, generator=g) * 0.02

    def close(self) -> None:
        pass


def lora_decoder_module(config: dict[str, Any], max_length: int) -> Any:
    """A TextTrainModule around a decoder built on the meta device with LoRA adapters (the base frozen) and a
    RandomWeights source: nothing of it is allocated until the engine shards and fills it."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import Qwen2Config, Qwen2Model

    from magclip.config import TextLossConfig
    from magclip.losses import RetrievalLoss
    from magclip.models.build import attach, parameters_on_meta
    from magclip.models.text import BiEncoder, TextEncoderSettings
    from magclip.similarity import make_scorer
    from magclip.training.text import TextTrainModule, build_logit_scale

    with parameters_on_meta():
        decoder = Qwen2Model(Qwen2Config(**config))
        decoder = inject_adapter_in_model(LoraConfig(**LORA), decoder)
    for name, p in decoder.named_parameters():
        p.requires_grad_("lora_" in name)
    attach(decoder, RandomWeights(decoder))
    settings = TextEncoderSettings(pooling="last", query_max_length=max_length, passage_max_length=max_length)
    encoder = BiEncoder(decoder, None, settings, source="random Qwen2 7B + LoRA")
    loss_cfg = TextLossConfig()
    return TextTrainModule(encoder, RetrievalLoss(make_scorer(loss_cfg.mode), 1, False), build_logit_scale(loss_cfg))


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """The 7 B LoRA module on the meta device: parameter counts and each rank's bytes under fsdp, nothing allocated."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    module = lora_decoder_module(DECODER_7B, args.seq)
    params = list(module.named_parameters())
    total = sum(p.numel() for _, p in params)
    trained = sum(p.numel() for _, p in params if p.requires_grad)
    meta = all(p.is_meta for n, p in params if n.startswith("encoder."))
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    per_rank = {}
    for world in (1, 2, 4, 8):
        # fp32 shards of every parameter; AdamW's two moments and the gradients of the trained ones only (LoRA and
        # the loss parameters: replicated or sharded, at most whole); bf16 gathered units come and go per block
        shards = 4 * total / world
        per_rank[world] = {"parameter_shard_bytes": shards, "trained_state_bytes": 12 * trained,
                           "sum_gib": (shards + 12 * trained) / GIB}
    out = {"parameters": total, "trained_parameters": trained, "fp32_bytes": 4 * total,
           "encoder_on_meta": meta, "host_memory_grown_bytes": grown, "per_rank": per_rank}
    print(f"7B decoder + LoRA r={LORA['r']}: {total / 1e9:.3f} B parameters ({4 * total / GIB:.1f} GiB in fp32), "
          f"{trained / 1e6:.1f} M trained; built on the meta device: {meta}; host memory grown by "
          f"{grown / 2**20:.0f} MiB while building")
    for world, r in per_rank.items():
        print(f"  fsdp on {world} GPU(s): {r['parameter_shard_bytes'] / GIB:.2f} GiB of parameter shards + "
              f"{r['trained_state_bytes'] / GIB:.3f} GiB of LoRA gradients and AdamW state = {r['sum_gib']:.2f} GiB "
              f"per GPU before activations")
    return out


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
    if model == "text7b":   # on the meta device: the engine's meta-device start shards and fills it
        decoder = TINY_DECODER if args.tiny else DECODER_7B
        seq = min(args.seq, decoder["max_position_embeddings"])
        return lora_decoder_module(decoder, seq), text_batch(args.text_batch, seq, decoder["vocab_size"], seed)
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
    cfg = train_config(sharding.removesuffix("_lora"), args.precision,
                       args.clip_batch if model == "clip" else args.text_batch)
    run_dir = Path(args.work) / f"{model}_{sharding}"
    acc = make_accelerator(cfg, run_dir)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    module, batch = build(model, args, acc.device, seed=acc.process_index)
    lora = sharding.endswith("_lora")
    engine = make_engine(module, cfg, acc, run_dir, sharding=start_sharded(module, acc, cfg),
                         **({"frozen_base": {"path": None, "fingerprint": None, "dtype": "float32", "seed": 0},
                             "save_trained": save_adapters} if lora else {}))
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
    if lora:   # the checkpoint (adapters and their optimizer state only) and a sharded evaluation, each timed
        record.update(lora_checkpoint_and_evaluation(engine, batch, sync))
    probe.close()
    acc.free_memory(engine.model, engine.optimizer)
    del engine, batch, out
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return record


def save_adapters(module: Any, trained: dict[str, Any], folder: Path) -> None:
    """The checkpoint's adapter file (the 7 B module has peft's layers without a PeftModel: the tensors alone)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in trained.items() if "lora_" in k}, str(folder / "adapter_model.safetensors"))


def lora_checkpoint_and_evaluation(engine: Any, batch: dict[str, Any], sync: Any) -> dict[str, Any]:
    """engine.save_checkpoint() (the LoRA path: no base, no merged model) and one sharded encoding of this rank's batch
    (engine.evaluate_model), timed, with the GPU peaks over each and the step folder's bytes."""
    import torch

    out: dict[str, Any] = {}
    cuda = torch.cuda.is_available()
    for name, run in (("checkpoint", engine.save_checkpoint),
                      ("evaluation", lambda: engine.evaluate_model(lambda m: m(batch)))):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        done = run()
        sync()
        out[f"{name}_s"] = time.perf_counter() - t0
        out.update({f"{name}_{k}": v for k, v in _cuda_peaks().items()})
        if name == "checkpoint":
            out["checkpoint_folder_bytes"] = sum(f.stat().st_size for f in Path(done).rglob("*") if f.is_file())
    engine.model.train()
    return out


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
    p.add_argument("--runs", default="text7b:fsdp_lora,clip:fsdp,text:fsdp,clip:ddp,text:ddp")
    p.add_argument("--budget-s", type=float, default=400, help="no run starts past this (elapsed + slowest run)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke check: tiny-vit, a 2-layer decoder, batch 2, 1+2 steps")
    p.add_argument("--out", default=None, help="JSON (default results/gpu_sharding.json; --tiny: gpu_sharding_tiny.json)")
    p.add_argument("--work", default="/tmp/magclip_gpu_sharding", help="run folders (nothing is written there)")
    p.add_argument("--dry-run", action="store_true", help="the 7 B LoRA decoder's sizes on the meta device; no run")
    args = p.parse_args()
    if args.dry_run:
        out = Path(args.out or BENCH / "results" / "gpu_sharding_7b_dry_run.json")
        write_json(out, {"decoder": DECODER_7B, "lora": LORA, **dry_run(args)})
        print(f"wrote {out}")
        return
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
