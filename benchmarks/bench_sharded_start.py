"""Every process's peak memory of a real text run of a ~0.5 B decoder embedder: ddp, fsdp with the meta-device
start, fsdp + LoRA, at 1, 2 and 4 CPU processes (issue 54, part 4).

    OMP_NUM_THREADS=1 python benchmarks/bench_sharded_start.py                      # the 0.5 B decoder (~10 min here)
    OMP_NUM_THREADS=1 python benchmarks/bench_sharded_start.py --tiny --worlds 1,2  # smoke check, ~3 min

Why: under `train.sharding: fsdp` no process should ever hold the full fp32 model (magclip/training/meta_start.py:
built on the meta device, sharded, each rank reading its rows of the weights files). This measures it on the
magclip text trainer as a user runs it: its real YAML config and overrides, `magclip.cli.train_text.main` under
`torchrun --nproc_per_node W` (gloo, one CPU process per rank, the world size asserted).

The model: a Qwen2 decoder built here with transformers from a config alone (hidden 896, 24 layers, 14 heads /
2 kv heads, intermediate 4864, vocab 151,936: the Qwen2-0.5B layout, 494 M parameters, 1.98 GB in fp32), random
weights, saved once as a Hugging Face folder of sharded safetensors (`save_pretrained(max_shard_size="500MB")`:
model.safetensors.index.json + 5 files), with a small WordPiece tokenizer; one shared tower pooled at its last
token. The data: a synthetic pairs JSONL (random words). Each run: `--steps` optimizer steps of `--batch` pairs
per process, fp32, AdamW, grad clipping, no evaluation, the final checkpoint as the trainer writes it.

Rows (`train.sharding` and overrides): `ddp` full fine-tuning (every process builds and loads the whole model
eagerly: also the pre-change fsdp start, which built the whole model on every rank and broadcast it), `fsdp` full
fine-tuning (meta-device start), `fsdp_lora` (`model.lora.r=16`, started on the meta device too: peft wraps the
meta-built towers) and `fsdp_lora_bf16` (the same with `train.precision=bf16`: the frozen base held in bf16, as a
LoRA run in bf16 holds it). A row whose override the config does not know is skipped, with the reason. A row
whose estimated need (16 bytes a parameter per replica or /W per shard, the frozen base's shards under LoRA, plus
the consolidated model on the main process at the checkpoint, plus ~0.7 GiB of runtime and ~2.5 GiB (LoRA:
~1.5 GiB) of a step's transients a process, as measured) does not fit in the memory available is skipped and
said so.

What is measured, per process: `ru_maxrss` (resource.getrusage(RUSAGE_SELF), the peak resident set since the
process started), read after the trainer's imports (`runtime_kib`), when the meta-device start has filled the
rank's shards (`peak_after_fill_kib`: before any forward; a LoRA run then runs its probe forward, which gathers
each FSDP unit once as a training forward does), when the training loop begins
(`peak_at_start_kib`: the model built, loaded, sharded, the optimizer made), when the trainer enters its first
checkpoint (`peak_before_checkpoint_kib`: the start, the
optimizer state and the training steps) and at the end (`peak_kib`: also the checkpoint, where the main process
gathers the consolidated model files unless `train.save_full_model=never` is known and passed). Beside: the full
fp32 weight bytes. Writes benchmarks/results/sharded_start.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(BENCH), str(REPO)]
from _common import RESULTS_DIR, machine_info, write_json
from bench_sharding_memory import available_bytes

GIB = 2 ** 30
KIB = 1024
# the Qwen2-0.5B layout (tied embeddings: the AutoModel holds the vocabulary once)
DECODER = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
           "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 512,
           "tie_word_embeddings": True}
TINY_DECODER = {"vocab_size": 400, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
ROWS = {"ddp": ["train.sharding=ddp"], "fsdp": ["train.sharding=fsdp"],
        "fsdp_lora": ["train.sharding=fsdp", "model.lora.r=16"],
        "fsdp_lora_bf16": ["train.sharding=fsdp", "model.lora.r=16", "train.precision=bf16"]}
RUNTIME_BYTES = int(0.7 * GIB)   # a process's Python, torch, transformers and gloo before any model (0.58 measured)
STEP_BYTES = int(2.5 * GIB)      # a step's transients beyond the state, as measured here at fsdp W=2 (0.5 B decoder)
LORA_STEP_BYTES = int(1.5 * GIB)  # the same under LoRA (no base gradients), as measured at fsdp_lora W=2
WORDS = ["the", "a", "of", "and", "to", "in", "is", "was", "for", "on", "with", "as", "by", "at", "from", "cat", "dog",
         "sat", "mat", "query", "passage", "protein", "cell", "cancer", "brain", "white", "matter", "gene", "study",
         "results", "human", "model", "data", "red", "blue", "green", "small", "large"]


# ============================================================================ the model folder and the data


def make_decoder_folder(folder: Path, config: dict[str, Any], shard_size: str) -> int:
    """A randomly initialised Qwen2 saved as sharded safetensors with a WordPiece tokenizer; its parameter count."""
    import torch
    from transformers import BertTokenizerFast, Qwen2Config, Qwen2Model

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab=str(folder / "vocab.txt"), vocab_file=str(folder / "vocab.txt"), model_max_length=512)
    torch.manual_seed(0)
    model = Qwen2Model(Qwen2Config(**config)).eval()
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(folder), max_shard_size=shard_size)
    tok.save_pretrained(str(folder))
    del model
    return count


def make_pairs(path: Path, count: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(count):
            f.write(json.dumps({"query": " ".join(rng.choices(WORDS, k=8)),
                                "positive": " ".join(rng.choices(WORDS, k=24))}) + "\n")


def config_yaml(path: Path, model: Path, pairs: Path, args: argparse.Namespace) -> None:
    path.write_text(f"""name: sharded_start
model:
  name: {model}
  pooling: last
  query_max_length: {args.seq}
  passage_max_length: {args.seq}
data:
  train: {pairs}
  group_size: 1
loss:
  mode: cosine
train:
  epochs: 1
  batch_size: {args.batch}
  max_steps: {args.steps}
  lr: 1.0e-5
  warmup_steps: 0
  log_every: 1
  precision: fp32
eval:
  at_start: false
""")


# ============================================================================ one rank


def worker(args: argparse.Namespace) -> None:
    """One rank of the real command; its ru_maxrss at the first checkpoint and at the end into RESULT_DIR."""
    import torch.distributed as dist

    import magclip.training.text  # noqa: F401  (the trainer's imports: the runtime before any model)
    from magclip.cli import as_command
    from magclip.cli.train_text import main
    from magclip.training import shard_fill
    from magclip.training.engine import Engine

    record: dict[str, Any] = {"runtime_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    save = Engine.save_checkpoint

    def noting_the_peak(engine: Engine):
        record.setdefault("peak_before_checkpoint_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return save(engine)

    Engine.save_checkpoint = noting_the_peak   # reads a number, changes nothing the run does
    fit = Engine.fit

    def noting_the_start(engine: Engine):
        record["peak_at_start_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if args.start_only:   # the start alone: where training would not fit this machine
            record.update({"rank": engine.acc.process_index, "world": engine.acc.num_processes, "start_only": True})
            (Path(args.result_dir) / f"rank{engine.acc.process_index}.json").write_text(json.dumps(record))
            engine.acc.wait_for_everyone()
            os._exit(0)
        return fit(engine)

    Engine.fit = noting_the_start
    fill = shard_fill.materialise

    def noting_the_reads(module, device):   # the meta-device start: what this rank read of the weights files
        record["meta_start_read"] = fill(module, device)
        record["peak_after_fill_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return record["meta_start_read"]

    shard_fill.materialise = noting_the_reads
    as_command(lambda: main(["--config", args.config, *args.overrides]))()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    assert world == args.world, f"{world} processes, {args.world} asked for"
    record.update({"rank": rank, "world": world, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
    (Path(args.result_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ============================================================================ the parent


def known_keys() -> set[str]:
    """The dotted config keys of this checkout's TextRunConfig (a row's override is skipped when unknown)."""
    from magclip.config import TextModelConfig, TrainConfig

    keys = {f"train.{f.name}" for f in fields(TrainConfig)} | {f"model.{f.name}" for f in fields(TextModelConfig)}
    return keys


def unknown_override(overrides: list[str]) -> str | None:
    keys = known_keys()
    for item in overrides:
        key = item.split("=", 1)[0]
        if not any(key == k or key.startswith(k + ".") for k in keys):
            return key
    return None


def estimated_need(row: str, world: int, parameters: int, start_only: bool = False) -> int:
    """Bytes the launch needs on this machine: weights, gradients, AdamW's two moments (16 B a parameter) whole on
    every ddp process or /W under fsdp (LoRA: the frozen weights /W, a few MB trained), the main process's
    consolidated model at the checkpoint (4 B a parameter), and each process's runtime."""
    fp32 = 4 * parameters
    if start_only:   # the weights whole (eager) or their shards, the runtime, the reading
        return world * ((fp32 if row == "ddp" else fp32 // world) + RUNTIME_BYTES + fp32 // 4)
    per_process = {"ddp": 4 * fp32, "fsdp": 4 * fp32 // world, "fsdp_lora": fp32 // world,
                   "fsdp_lora_bf16": fp32 // 2 // world}[row]
    step = LORA_STEP_BYTES if row.startswith("fsdp_lora") else STEP_BYTES
    transients = step * parameters // 494_032_768   # scaled from the measured 0.5 B decoder
    return world * (per_process + RUNTIME_BYTES + transients) + fp32 // 2   # + the main process's checkpoint


def launch(row: str, world: int, args: argparse.Namespace, config: Path, run_root: Path) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="sharded_start_") as tmp:
        overrides = [*ROWS[row], *args.extra, f"output_dir={run_root}", f"name={row}_{world}", "overwrite=true"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", __file__,
               "--worker", "--world", str(world), "--result-dir", tmp, "--config", str(config),
               *(["--start-only"] if args.start_only else []), "--", *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=args.timeout)
        shutil.rmtree(run_root / f"{row}_{world}", ignore_errors=True)   # the checkpoint: gigabytes
        if done.returncode:
            raise RuntimeError(f"{row} W={world} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        records = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
        print(f"{row} W={world}: {time.perf_counter() - t0:.0f} s; peak KiB by rank "
              f"{[r.get('peak_kib', r.get('peak_at_start_kib')) for r in records]}", flush=True)
        return records


def markdown(doc: dict[str, Any]) -> str:
    full = doc["setup"]["fp32_weight_bytes"]
    header = (f"| row | W | peak RSS of each rank when its shards are filled (GiB) | peak RSS of each rank after the "
              f"start (GiB) | largest / full fp32 weights ({full / GIB:.2f} GiB) | peak RSS of each rank, to the "
              "checkpoint (GiB) | peak RSS of each rank, whole run (GiB) |")
    lines = [header, "|---|---|---|---|---|---|---|"]

    def gib(records: list[dict[str, Any]], key: str) -> str:
        return ", ".join(f"{r[key] * KIB / GIB:.2f}" if key in r else "—" for r in records)

    for key, records in sorted(doc["ranks"].items(), key=lambda kv: (list(ROWS).index(kv[0].rsplit("_", 1)[0]),
                                                                       int(kv[0].rsplit("_", 1)[1]))):
        row, world = key.rsplit("_", 1)
        start = max(r.get("peak_at_start_kib", 0) for r in records) * KIB / full
        row += " (the start only)" if records[0].get("start_only") else ""
        lines.append(f"| {row} | {world} | {gib(records, 'peak_after_fill_kib')} | {gib(records, 'peak_at_start_kib')} | "
                     f"{start:.2f} | "
                     f"{gib(records, 'peak_before_checkpoint_kib')} | {gib(records, 'peak_kib')} |")
    for s in doc["skipped"] + doc.get("failed", []):
        lines.append(f"| {s['row']} | {s['world']} | skipped: {s['why'][:120]} | | | | |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--rows", default="ddp,fsdp,fsdp_lora,fsdp_lora_bf16")
    p.add_argument("--batch", type=int, default=2, help="pairs per process")
    p.add_argument("--seq", type=int, default=32, help="tokens per query / passage")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps (AdamW allocates its state in the first)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer decoder: a smoke check")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    p.add_argument("--work-dir", default=None, help="where the model folder and runs go (default: a temporary one)")
    p.add_argument("--extra", nargs="*", default=[], help="overrides for every row (e.g. train.save_full_model=never)")
    p.add_argument("--start-only", action="store_true", help="stop each launch when training would begin: the "
                   "start's peak alone (rows that cannot train on this machine)")
    p.add_argument("--append", action="store_true", help="keep the other rows of an existing --out")
    p.add_argument("--out", default=None, help="default results/sharded_start.json (--tiny: sharded_start_tiny.json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out or RESULTS_DIR / ("sharded_start_tiny.json" if args.tiny else "sharded_start.json"))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_sharded_start_"))
    decoder = TINY_DECODER if args.tiny else DECODER
    t0 = time.perf_counter()
    if (work / "decoder" / "config.json").is_file():   # a --work-dir kept from an earlier run: the same folder
        parameters = json.loads((work / "decoder_parameters.json").read_text())["parameters"]
    else:
        parameters = make_decoder_folder(work / "decoder", decoder, "20KB" if args.tiny else "500MB")
        (work / "decoder_parameters.json").write_text(json.dumps({"parameters": parameters}))
    print(f"decoder folder: {parameters / 1e6:.1f} M parameters, {time.perf_counter() - t0:.0f} s", flush=True)
    make_pairs(work / "pairs.jsonl", 256)
    config = work / "config.yaml"
    config_yaml(config, work / "decoder", work / "pairs.jsonl", args)
    doc = {"machine": {**machine_info(1), "backend": "gloo", "processes": "one per rank, 1 thread each"},
           "setup": {"decoder": decoder, "parameters": parameters, "fp32_weight_bytes": 4 * parameters,
                     "weights_files": sorted(f.name for f in (work / "decoder").glob("*.safetensors*")),
                     "batch_per_process": args.batch, "tokens": args.seq, "steps": args.steps, "precision": "fp32",
                     "config": config.read_text(), "extra_overrides": args.extra},
           "measures": {"runtime_kib": "ru_maxrss (KiB) after the trainer's imports, before the process group "
                                        "and any model: the runtime every process pays",
                        "peak_after_fill_kib": "ru_maxrss (KiB) when the meta-device start has filled this rank's "
                                               "shards, before any forward (a LoRA run's probe forward comes after)",
                        "peak_at_start_kib": "ru_maxrss (KiB) when the training loop begins: the model built, "
                                              "loaded (and under fsdp sharded), the optimizer made, no step taken",
                        "peak_before_checkpoint_kib": "ru_maxrss (KiB) when the trainer enters its first checkpoint: "
                                                      "the start, the optimizer state and the training steps",
                        "peak_kib": "ru_maxrss (KiB) at the end of the command: the whole run, checkpoint included"},
           "ranks": {}, "skipped": [], "failed": []}
    if args.append and out.is_file():   # add rows to an earlier run's results (the same setup)
        before = json.loads(out.read_text())
        redo = {(r, int(w)) for r in args.rows.split(",") for w in args.worlds.split(",")}
        doc["ranks"] = {k: v for k, v in before["ranks"].items()
                        if (k.rsplit("_", 1)[0], int(k.rsplit("_", 1)[1])) not in redo}
        doc["skipped"] = [s for s in before["skipped"] if (s["row"], s["world"]) not in redo]
    for row in args.rows.split(","):
        for world in [int(w) for w in args.worlds.split(",")]:
            unknown = unknown_override([*ROWS[row], *args.extra])
            need, free = estimated_need(row, world, parameters, args.start_only), available_bytes()
            why = (f"the config has no key {unknown} in this checkout" if unknown else
                   f"needs ~{need / GIB:.1f} GiB, {free / GIB:.1f} GiB available" if need > free else None)
            if why:
                print(f"SKIP {row} W={world}: {why}", flush=True)
                doc["skipped"].append({"row": row, "world": world, "why": why, "need_bytes": need})
                continue
            try:
                doc["ranks"][f"{row}_{world}"] = launch(row, world, args, config, work / "runs")
            except RuntimeError as exn:   # recorded; the next row goes on (a shared machine's OOM killer, ...)
                print(str(exn)[-2000:], flush=True)
                doc["failed"].append({"row": row, "world": world, "why": str(exn)[-600:]})
            write_json(out, doc)   # after every launch: a cut-off run keeps what it measured
    doc["table_markdown"] = markdown(doc)
    write_json(out, doc)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(doc["table_markdown"])
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
