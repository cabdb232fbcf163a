"""Memory per process against the world size, `train.sharding` ddp vs fsdp (issue 50, part 2).

    OMP_NUM_THREADS=1 python benchmarks/bench_sharding_memory.py                 # ViT-B-16 + 134M decoder, W = 1, 2, 4
    OMP_NUM_THREADS=1 python benchmarks/bench_sharding_memory.py --tiny --worlds 1,2   # smoke check, ~2 min

Why: fsdp exists so that the parameters, gradients and AdamW state of a model stop being whole on every
process; this script shows whether they really fall as 1/W on the engine's own step, and what that does to
a process's whole footprint. One torchrun launch per (model, sharding, world size), run one after the other
(the parent re-launches this file with `python -m torch.distributed.run --standalone --nproc_per_node W
... --worker`: gloo, one CPU process per rank, the world size asserted inside). Each rank builds the module
(seeded; fsdp broadcasts rank 0's start anyway), the real `Engine` (fp32, fused AdamW, channels_last off on
both sides, grad clipping 1.0), takes one warm-up `Engine._train_step` (AdamW's state is allocated lazily in
the first step) and then the measured step, on a fixed in-memory batch:

- CLIP: open_clip `ViT-B-16` randomly initialised (149.6 M parameters), 2 images of 224 px (uint8, RawCLIP
  normalises) and 2 texts of 77 tokens per process, loss cosine/cosine;
- text: a Qwen3 decoder built here with transformers (hidden 1024, 8 layers, 16 heads / 8 kv heads,
  intermediate 3072, vocab 32,000: 133.4 M parameters; no folder written, no tokenizer needed for token ids),
  one shared tower pooled at its last token by `magclip.models.text.BiEncoder`, 2 queries + 2 passages of 32
  tokens per process, RetrievalLoss cosine.

What is measured, per process (the JSON keeps every rank; the table shows the largest rank):
- `parameter_bytes`, `gradient_bytes`, `optimizer_state_bytes`: `engine.sharding.memory_record(...)` taken in
  AdamW's step pre-hook of the measured step (after backward, the loss parameters' all-reduce and gradient
  clipping; before the update and before `zero_grad(set_to_none=True)` frees the gradients), i.e. the local
  shards of DTensors under fsdp and the whole tensors under ddp. The optimizer state there is the one the
  warm-up step allocated. After the step the same record is taken again (`after_step`: gradients 0).
- `tensor_start_bytes`, `tensor_peak_bytes`: every tensor torch allocated on this process's main thread since
  before the module was built and still alive, at the start of the measured step and at its peak (torch's
  CPU allocator accounting through the profiler's allocation events, which run for the whole worker). This
  counts what memory_record does not see: DDP's gradient buckets, buffers, the batch, activations, FSDP's
  all-gathered blocks and reduce-scatter buffers, AdamW's temporaries. Not counted: gloo's internal buffers,
  Python objects, malloc overhead.
- `rss_start_bytes`, `rss_peak_bytes`: the process's resident set at the start of the measured step and its
  kernel-tracked peak during it (VmHWM, reset through /proc/self/clear_refs just before the step). RSS
  includes the Python/torch runtime (`rss_runtime_bytes`: after imports and the process group, before the
  module is built) and what glibc keeps of freed memory (the warm-up step's transients), so it is an upper
  bound of what the step needs, not the step alone. `rss_lifetime_peak_bytes`: the larger of VmHWM before the
  reset and the step's (the process's peak, which includes building the whole module on every rank before fsdp
  shards it, and the warm-up step).

The two kinds of reading come from two launches of each configuration (their memory_record must agree to the
byte): a plain one for RSS, and a profiled one for the tensor accounting (the profiler's own records and the heap
fragmentation they cause add ~1 GiB of RSS a process, so its RSS is not used). Under fsdp the tensor accounting
reads up to ~0.1 GiB above the tensors Python can reach: a tensor allocated on the main thread and freed on a
gloo or autograd thread stays counted (a check on CLIP W=2: 905-959 MiB counted at the step's start against
856 MiB reachable, which is memory_record's parameters + AdamW state exactly); under ddp the accounting equals
parameters + AdamW state + DDP's gradient buckets to the byte.
Writes benchmarks/results/sharding_memory.json and prints a Markdown table. Read the numbers as ratios;
timings from a shared 2-core machine are recorded (`step_s`) but are no figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(BENCH), str(REPO)]
from _common import RESULTS_DIR, machine_info, write_json

MIB = 2 ** 20
STATE_KEYS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")
TENSOR_KEYS = ("tensor_start_bytes", "tensor_peak_bytes")
MARKER = "measured_step"
# the profiled launch only: glibc returns every freed block >= 1 MiB at once. Under the profiler the kept free
# memory grows by ~1 GiB a process (its small records fragment the heap); its RSS is not reported, and this keeps
# four profiled ddp processes inside a 24 GiB machine shared with other work. Tensor accounting is unaffected.
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2 ** 20), "MALLOC_TRIM_THRESHOLD_": str(2 ** 20)}
# a ~134 M parameter decoder embedder (Qwen3 layout); the GPU script's ~1 B one is in bench_gpu_sharding.py
TEXT_DECODER = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
                "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 512}
TINY_DECODER = {"vocab_size": 400, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64}


# ============================================================================ what a rank trains (shared with the GPU script)


def clip_module(name: str):
    """A CLIPTrainModule around open_clip `name`, randomly initialised (no download), cosine loss both ways."""
    from magclip.config import LossConfig
    from magclip.models.clip import create_clip
    from magclip.training.clip import CLIPTrainModule, build_logit_scale, build_loss

    loss = LossConfig()
    return CLIPTrainModule(create_clip(name, None).model, build_loss(loss), build_logit_scale(loss))


def decoder_module(config: dict[str, Any], max_length: int):
    """A TextTrainModule around a randomly initialised Qwen3 decoder (one shared tower, last-token pooling): the
    decoder-only embedder's layout, built in memory (the token ids are given, so no tokenizer is needed)."""
    from transformers import Qwen3Config, Qwen3Model

    from magclip.config import TextLossConfig
    from magclip.losses import RetrievalLoss
    from magclip.models.text import BiEncoder, TextEncoderSettings
    from magclip.similarity import make_scorer
    from magclip.training.text import TextTrainModule, build_logit_scale

    settings = TextEncoderSettings(pooling="last", query_max_length=max_length, passage_max_length=max_length)
    encoder = BiEncoder(Qwen3Model(Qwen3Config(**config)), None, settings, source="random Qwen3")
    loss_cfg = TextLossConfig()
    return TextTrainModule(encoder, RetrievalLoss(make_scorer(loss_cfg.mode), 1, False), build_logit_scale(loss_cfg))


def clip_batch(batch: int, image_size: int, context: int, seed: int) -> dict[str, Any]:
    """Loader-shaped CLIP batch: uint8 images (RawCLIP normalises on the device) and token ids."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"images": torch.randint(0, 255, (batch, 3, image_size, image_size), dtype=torch.uint8, generator=g),
            "texts": torch.randint(1, 400, (batch, context), generator=g), "keys": [], "skipped": {}}


def text_batch(batch: int, length: int, vocab: int, seed: int) -> dict[str, Any]:
    """Query and passage token ids of `length` tokens (random lengths from half to full, right-padded)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {"keys": [], "skipped": {}}
    for side in ("query", "passage"):
        lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        out[f"{side}_input_ids"] = torch.randint(5, vocab, (batch, length), generator=g) * mask
        out[f"{side}_attention_mask"] = mask
    return out


def model_and_batch(model: str, tiny: bool, batch: int, seq: int, seed: int, *, clip_name: str | None = None,
                    decoder: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """The module (seeded) and this rank's batch for `model` ('clip' or 'text'); `tiny`: tiny-vit, a 2-layer decoder."""
    import torch

    torch.manual_seed(0)
    if model == "clip":
        module = clip_module(clip_name or ("tiny-vit" if tiny else "ViT-B-16"))
        inner = module.clip.clip
        size = getattr(inner.visual, "image_size", 224)
        size = int(size[0] if isinstance(size, (tuple, list)) else size)
        return module, clip_batch(batch, size, int(getattr(inner, "context_length", 77)), seed)
    cfg = decoder or (TINY_DECODER if tiny else TEXT_DECODER)
    return decoder_module(cfg, seq), text_batch(batch, seq, cfg["vocab_size"], seed)


def train_config(sharding: str, precision: str, batch: int):
    """The run's TrainConfig: fused AdamW (auto), grad clipping, channels_last off on both sides (fsdp turns it off)."""
    from magclip.config import TrainConfig

    return TrainConfig(epochs=1, batch_size=batch, lr=1e-4, warmup_steps=0, log_every=10_000, grad_clip=1.0,
                       precision=precision, sharding=sharding, channels_last=False, max_steps=1000)


def make_engine(module: Any, cfg: Any, acc: Any, run_dir: Path, sharding: Any = None, **engine_kwargs: Any):
    """The real Engine around `module` on the accelerator's device; batches go to `_train_step` directly (no
    loader). `sharding`: one that sharded the module already (a meta-device start); `engine_kwargs`: the Engine's
    (a LoRA run's frozen_base and save_trained, for its checkpoint)."""
    from magclip.training.engine import Engine

    return Engine(cfg, acc, module.to(acc.device), run_dir, lambda epoch: [], steps_per_epoch=1000,
                  save_model=lambda m, step_dir: None, sharding=sharding, **engine_kwargs)


class StateProbe:
    """`memory_record` in AdamW's step pre-hook: the gradients still exist there (zero_grad frees them after)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.records: list[dict[str, int]] = []
        self._handle = engine._inner_optimizer.register_step_pre_hook(self._hook)

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.records.append(self.engine.sharding.memory_record(self.engine.unwrapped, self.engine.optimizer))

    def close(self) -> None:
        self._handle.remove()


def parameter_count(module: Any) -> int:
    """Parameters of the whole (unsharded) model: the DTensors' global shapes."""
    return int(sum(p.numel() for p in module.parameters()))


# ============================================================================ CPU memory readings


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


@contextmanager
def rss_peak() -> Iterator[dict[str, int]]:
    """The kernel's peak RSS (VmHWM) over the block, reset on entry through /proc/self/clear_refs (Linux >= 4.0)."""
    out: dict[str, int] = {"rss_start_bytes": rss_bytes(), "rss_peak_before_bytes": _status_kib("VmHWM") * 1024}
    with open("/proc/self/clear_refs", "w") as f:  # also resets ru_maxrss: the peak before is kept above
        f.write("5")
    yield out
    out["rss_peak_bytes"] = _status_kib("VmHWM") * 1024


def tensor_accounting(prof: Any, marker: str) -> dict[str, int]:
    """Live torch CPU bytes at the start of the `marker` window and their peak inside it, from the profiler's
    allocation events (the allocator's running total over everything allocated while profiling)."""
    from torch._C._profiler import _EventType

    def walk(nodes: list) -> Iterator[Any]:
        for node in nodes:
            yield node
            yield from walk(node.children)

    nodes = list(walk(prof.profiler.kineto_results.experimental_event_tree()))
    window = next(n for n in nodes if n.name == marker)
    start, end = window.start_time_ns, window.end_time_ns
    allocations = sorted((n for n in nodes if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns)
    before = [n.extra_fields.total_allocated for n in allocations if n.start_time_ns < start]
    live = before[-1] if before else 0
    inside = [n.extra_fields.total_allocated for n in allocations if start <= n.start_time_ns <= end]
    return {"tensor_start_bytes": int(live), "tensor_peak_bytes": int(max([live, *inside]))}


# ============================================================================ one rank


def worker(args: argparse.Namespace) -> None:
    """One rank: build, warm up, measure one step, write this rank's JSON. With --profile the whole worker runs
    under torch's profiler (tensor accounting); without, nothing else runs in the process (its RSS is the run's)."""
    import torch
    import torch.distributed as dist

    from magclip.training.accelerator import make_accelerator

    torch.set_num_threads(1)
    prof = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.start()  # before any tensor of the run exists: the allocator's running total is then absolute
    cfg = train_config(args.sharding, "fp32", args.batch)
    run_dir = Path(args.result_dir) / "run"
    acc = make_accelerator(cfg, run_dir)   # joins the gloo group torchrun set up
    rank, world = acc.process_index, acc.num_processes
    assert world == args.world == (dist.get_world_size() if dist.is_initialized() else 1), \
        f"{world} processes, {args.world} asked for"
    runtime = rss_bytes()  # imports and the process group, no model yet
    module, batch = model_and_batch(args.model, args.tiny, args.batch, args.seq, seed=rank)
    engine = make_engine(module, cfg, acc, run_dir)
    del module
    count = parameter_count(engine.unwrapped)
    probe = StateProbe(engine)
    engine._train_step([batch])  # warm-up: AdamW's state, first-touch allocations
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    with rss_peak() as rss, torch.profiler.record_function(MARKER):
        out = engine._train_step([batch])
    step_s = time.perf_counter() - t0
    after = engine.sharding.memory_record(engine.unwrapped, engine.optimizer)
    probe.close()
    record = {"rank": rank, "world": world, "model": args.model, "sharding": args.sharding, "parameters": count,
              "loss": float(out["loss"].detach()), **probe.records[-1], "after_step": after,
              "rss_runtime_bytes": runtime, **rss, "rss_lifetime_peak_bytes": max(rss["rss_peak_before_bytes"],
                                                                                  rss["rss_peak_bytes"]),
              "step_s": step_s, "profiled": prof is not None}
    if prof is not None:
        prof.stop()
        record.update(tensor_accounting(prof, MARKER))
    (Path(args.result_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    if world > 1:
        dist.barrier()


# ============================================================================ the parent


def launch(model: str, sharding: str, world: int, args: argparse.Namespace, profile: bool) -> list[dict[str, Any]]:
    """One torchrun of `world` CPU processes; every rank's record."""
    with tempfile.TemporaryDirectory(prefix="sharding_mem_") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               __file__, "--worker", "--model", model, "--sharding", sharding, "--world", str(world),
               "--batch", str(args.batch), "--seq", str(args.seq), "--result-dir", tmp,
               *(["--tiny"] if args.tiny else []), *(["--profile"] if profile else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               **(PINNED_MALLOC if profile else {})}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode:
            raise RuntimeError(f"{model} {sharding} W={world} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        records = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
        print(f"{model} {sharding} W={world}{' (profiled)' if profile else ''}: {time.perf_counter() - t0:.0f} s",
              flush=True)
        return records


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def wait_for_memory(need: int, limit_s: float) -> bool:
    """Wait (up to `limit_s`) until the machine has `need` bytes available: it is shared, and a launch that does not
    fit would put the other jobs at risk of the OOM killer. False when it never did."""
    deadline = time.monotonic() + limit_s
    while available_bytes() < need:
        if time.monotonic() > deadline:
            return False
        print(f"waiting for {need / 2**30:.1f} GiB available (now {available_bytes() / 2**30:.1f})", flush=True)
        time.sleep(30)
    return True


def measure(model: str, sharding: str, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Two launches: plain (memory_record, RSS) and profiled (tensor accounting; memory_record again, which must
    agree). Each rank's record merges both."""
    plain = launch(model, sharding, world, args, profile=False)
    profiled = launch(model, sharding, world, args, profile=True)
    for a, b in zip(plain, profiled):
        if any(a[k] != b[k] for k in STATE_KEYS):
            raise RuntimeError(f"memory_record differs between the two launches: {a} vs {b}")
        a.update({k: b[k] for k in TENSOR_KEYS})
    return plain


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest rank's figure of each kind (ranks differ by FSDP's padding and the replicated loss parameters)."""
    keys = (*STATE_KEYS, *TENSOR_KEYS, "rss_start_bytes", "rss_peak_bytes", "rss_runtime_bytes",
            "rss_lifetime_peak_bytes")
    out = {k: max(r[k] for r in records) for k in keys}
    out["state_bytes"] = max(sum(r[k] for k in STATE_KEYS) for r in records)
    out["parameters"] = records[0]["parameters"]
    return out


COLUMNS = (("parameters", "parameter_bytes"), ("gradients", "gradient_bytes"), ("AdamW state", "optimizer_state_bytes"),
           ("sum", "state_bytes"), ("tensors at start", "tensor_start_bytes"),
           ("tensor peak of the step", "tensor_peak_bytes"), ("RSS at start", "rss_start_bytes"),
           ("RSS peak of the step", "rss_peak_bytes"), ("RSS peak of the process", "rss_lifetime_peak_bytes"))


def markdown(results: dict[str, Any], worlds: list[int]) -> str:
    """One row per (model, sharding, world): MiB per process, and fsdp / ddp at the same world size."""
    header = ["model", "sharding", "W", *(f"{name} MiB" for name, _ in COLUMNS[:4]), "fsdp / ddp (sum)",
              *(f"{name} MiB" for name, _ in COLUMNS[4:6]), "fsdp / ddp (tensor peak)",
              *(f"{name} MiB" for name, _ in COLUMNS[6:])]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for model, by_sharding in results.items():
        for sharding in ("ddp", "fsdp"):
            for w in worlds:
                s = by_sharding.get(sharding, {}).get(str(w))
                if s is None:
                    continue
                ddp = by_sharding.get("ddp", {}).get(str(w)) if sharding == "fsdp" else None
                mib = [f"{s[key] / MIB:,.0f}" for _, key in COLUMNS]
                ratios = [f"{s[k] / ddp[k]:.2f}" if ddp else "—" for k in ("state_bytes", "tensor_peak_bytes")]
                lines.append("| " + " | ".join([model, sharding, str(w), *mib[:4], ratios[0], *mib[4:6], ratios[1],
                                                 *mib[6:]]) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--models", default="clip,text")
    p.add_argument("--shardings", default="ddp,fsdp")
    p.add_argument("--batch", type=int, default=2, help="per process")
    p.add_argument("--seq", type=int, default=32, help="text tokens per query / passage")
    p.add_argument("--tiny", action="store_true", help="tiny-vit and a 2-layer decoder: a smoke check")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    p.add_argument("--wait-s", type=float, default=900, help="how long to wait for memory before skipping a launch")
    p.add_argument("--out", default=None, help="default results/sharding_memory.json (--tiny: sharding_memory_tiny.json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--sharding", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    out = Path(args.out or RESULTS_DIR / ("sharding_memory_tiny.json" if args.tiny else "sharding_memory.json"))
    doc = {"machine": {**machine_info(1), "backend": "gloo", "processes_per_world": "one per rank, 1 thread each"},
           "setup": {"batch_per_process": args.batch, "text_tokens": args.seq, "precision": "fp32", "tiny": args.tiny,
                     "clip_model": "tiny-vit" if args.tiny else "ViT-B-16",
                     "text_decoder": TINY_DECODER if args.tiny else TEXT_DECODER},
           "measures": _measures(), "results": {}, "ranks": {}, "skipped": []}
    for model in args.models.split(","):
        per_process: dict[str, int] = {}  # the largest lifetime RSS peak of a process so far, by sharding: the next launch's need
        for world in worlds:
            for sharding in args.shardings.split(","):
                need = int(1.15 * world * per_process.get(sharding, 0))
                if not wait_for_memory(need, args.wait_s):
                    print(f"SKIP {model} {sharding} W={world}: {need / 2**30:.1f} GiB never became available")
                    doc["skipped"].append({"model": model, "sharding": sharding, "world": world, "need_bytes": need})
                    continue
                records = measure(model, sharding, world, args)
                per_process[sharding] = max(per_process.get(sharding, 0), *(r["rss_lifetime_peak_bytes"] for r in records))
                doc["results"].setdefault(model, {}).setdefault(sharding, {})[str(world)] = summary(records)
                doc["ranks"][f"{model}_{sharding}_{world}"] = records
                write_json(out, doc)  # after every launch: a cut-off run keeps what it measured
    table = markdown(doc["results"], worlds)
    doc["table_markdown"] = table
    write_json(out, doc)
    print(f"\nMiB per process (largest rank), fp32, batch {args.batch} per process\n")
    print(table)
    print(f"\nwrote {out}")


def _measures() -> dict[str, str]:
    return {"parameter/gradient/optimizer_state_bytes": "engine.sharding.memory_record in AdamW's step pre-hook of "
            "the measured (second) step: after backward and clipping, before the update and zero_grad; DTensors' "
            "local shards",
            "after_step": "the same record after the step (gradients freed by zero_grad(set_to_none=True))",
            "tensor_start/peak_bytes": "live torch CPU tensor bytes (profiler allocation events, the whole worker "
                                       "profiled) at the start of the measured step / at its peak",
            "rss_start/peak_bytes": "VmRSS at the start of the measured step / VmHWM during it (reset via "
                                    "/proc/self/clear_refs): includes the runtime and glibc's kept memory",
            "rss_runtime_bytes": "RSS after imports and the process group, before the module is built",
            "rss_lifetime_peak_bytes": "the process's peak RSS over its life (VmHWM before the reset, or the step's)"}


if __name__ == "__main__":
    main()
