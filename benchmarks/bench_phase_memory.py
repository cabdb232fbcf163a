"""Every rank's peak resident memory, phase by phase, of a real text run of a ~0.6 B Qwen3-layout decoder embedder:
fsdp + LoRA and full fsdp with an fp32 and a bf16 base, ddp + LoRA beside, at 2 and 4 CPU processes (issue 62).

    nice -n 5 python benchmarks/bench_phase_memory.py                          # every row, one launch at a time
    nice -n 5 python benchmarks/bench_phase_memory.py --rows lora_bf16 --worlds 2,4   # the defaults' row alone
    python benchmarks/bench_phase_memory.py --tiny --worlds 2                  # smoke check, ~1 min

Why: under `train.sharding=fsdp` no rank should ever hold the whole model: not at the meta-device start, not in a
forward (the token embedding is an FSDP unit of its own, gathered around its lookup alone), not at a checkpoint (a
LoRA run writes its adapters; the merged model is made offline by `magclip-consolidate STEP --merge`), not in an
evaluation (sharded, `eval.at_start` included). This measures it on the trainer as a user runs it: its YAML config
and overrides, `magclip.cli.train_text.main` under `torchrun --nproc_per_node W` (gloo, one CPU process per rank,
the world size asserted in every rank).

The model: a Qwen3 decoder built here with transformers from a config alone, the Qwen3-0.6B layout (hidden 1024, 28
layers, 16 heads / 8 kv heads of 128, intermediate 3072, vocabulary 151,936, tied embeddings: 596 M parameters,
2.22 GiB in fp32), random weights, saved as sharded safetensors (`max_shard_size="500MB"`), a small WordPiece
tokenizer; one shared tower pooled at its last token; pairs of random words; a 16-pair STS set evaluated at the
start (`eval.at_start=true`) and at the end. Each run: `--steps` optimizer steps (2) of `--batch` pairs (2) per
process, the final checkpoint as the trainer writes it at its defaults (`train.save_full_model` every).

Rows (overrides on top of the defaults; `train.precision` auto resolves to bf16 on a CPU with AVX512-BF16/AMX, so
`lora_bf16` is the defaults' row): `lora_bf16` (`model.lora.r=16`, `train.sharding=fsdp`), `lora_fp32` (the same,
`train.precision=fp32`), `full_bf16` and `full_fp32` (full fine-tuning under fsdp), `ddp_lora_bf16` (LoRA under ddp:
every process holds the whole base, writes the merged model in process). A row whose estimated need does not fit
the memory available is skipped, and said so.

Phases, each `ru_maxrss` (the peak resident set since the process started, so each is the peak up to that point):
`runtime` (after the trainer's imports), `fill` (the meta-device start has filled this rank's shards), `probe` (the
LoRA probe's forward on the sharded model), `at_start` (the evaluation of the start, sharded), `start` (the training
loop begins: the optimizer made),
`first_forward` (after the first training forward), `step` (after the first optimizer step), `checkpoint` (after the
final checkpoint), `evaluation` (after the final evaluation), `end`. Beside: the fp32 weight bytes, the final step
folder's size against the base folder's. Writes benchmarks/results/phase_memory.json and prints a Markdown table.
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
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(BENCH), str(REPO)]
from _common import RESULTS_DIR, machine_info, write_json
from bench_sharded_start import WORDS, make_pairs
from bench_sharding_memory import available_bytes

GIB = 2 ** 30
KIB = 1024
# the Qwen3-0.6B layout (tied embeddings: the AutoModel holds the vocabulary once)
DECODER = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
           "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 512,
           "tie_word_embeddings": True}
TINY_DECODER = {"vocab_size": 400, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64}
ROWS = {"lora_bf16": ["train.sharding=fsdp", "model.lora.r=16"],
        "lora_fp32": ["train.sharding=fsdp", "model.lora.r=16", "train.precision=fp32"],
        "full_bf16": ["train.sharding=fsdp"],
        "full_fp32": ["train.sharding=fsdp", "train.precision=fp32"],
        "ddp_lora_bf16": ["train.sharding=ddp", "model.lora.r=16"]}
PHASES = ("runtime", "fill", "probe", "at_start", "start", "first_forward", "step", "checkpoint", "evaluation", "end")


def make_decoder_folder(folder: Path, config: dict[str, Any], shard_size: str) -> int:
    """A randomly initialised Qwen3 saved as sharded safetensors with a WordPiece tokenizer; its parameter count."""
    import torch
    from transformers import BertTokenizerFast, Qwen3Config, Qwen3Model

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), model_max_length=512)
    torch.manual_seed(0)
    model = Qwen3Model(Qwen3Config(**config)).eval()
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(folder), max_shard_size=shard_size)
    tok.save_pretrained(str(folder))
    return count


def make_sts(path: Path, count: int = 16) -> None:
    rng = random.Random(1)
    rows = ["sentence1\tsentence2\tscore"]
    rows += [f"{' '.join(rng.choices(WORDS, k=6))}\t{' '.join(rng.choices(WORDS, k=6))}\t{rng.uniform(0, 5):.2f}"
             for _ in range(count)]
    path.write_text("\n".join(rows) + "\n")


def config_yaml(path: Path, model: Path, pairs: Path, sts: Path, args: argparse.Namespace) -> None:
    path.write_text(f"""name: phase_memory
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
  lr: 1.0e-4
  warmup_steps: 0
  log_every: 1
eval:
  at_start: true
  sts:
    toy: {sts}
""")


# ============================================================================ one rank


def worker(args: argparse.Namespace) -> None:
    """One rank of the real command; ru_maxrss at each phase into RESULT_DIR (the hooks read, change nothing)."""
    import torch.distributed as dist

    import magclip.training.text as task  # the trainer's imports: the runtime before any model
    from magclip.cli import as_command
    from magclip.cli.train_text import main
    from magclip.training import shard_fill
    from magclip.training.engine import Engine

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    record: dict[str, Any] = {"runtime": peak()}
    fill, fit, step, save, evaluate = (shard_fill.materialise, Engine.fit, Engine._train_step, Engine.save_checkpoint,
                                       Engine.run_evaluation)

    def noting_the_fill(module, device):
        read = fill(module, device)
        record["fill"] = peak()
        return read

    def noting_the_start(engine: Engine):
        record["start"] = peak()
        record["precision"] = engine.levers["precision"]   # auto's resolution on this CPU, said in the record
        def first_forward(*_: Any) -> None:
            record.setdefault("first_forward", peak())

        engine.unwrapped.register_forward_hook(first_forward)
        return fit(engine)

    def noting_the_step(engine: Engine, micro_batches):
        out = step(engine, micro_batches)
        record.setdefault("step", peak())
        return out

    def noting_the_checkpoint(engine: Engine):
        folder = save(engine)
        record["checkpoint"] = peak()
        return folder

    def noting_the_evaluation(engine: Engine):
        out = evaluate(engine)
        record["evaluation"] = peak()
        return out

    started, start_evaluation = task.start_sharded, task.start_evaluation

    def noting_the_probe(*a: Any, **k: Any):
        out = started(*a, **k)
        record["probe"] = peak()
        return out

    def noting_the_start_evaluation(*a: Any, **k: Any):
        out = start_evaluation(*a, **k)
        record["at_start"] = peak()
        return out

    task.start_sharded, task.start_evaluation = noting_the_probe, noting_the_start_evaluation
    shard_fill.materialise = noting_the_fill
    Engine.fit, Engine._train_step, Engine.save_checkpoint, Engine.run_evaluation = (
        noting_the_start, noting_the_step, noting_the_checkpoint, noting_the_evaluation)
    as_command(lambda: main(["--config", args.config, *args.overrides]))()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    assert world == args.world, f"{world} processes, {args.world} asked for"
    record.update({"rank": rank, "world": world, "end": peak()})
    (Path(args.result_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ============================================================================ the parent


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def estimated_need(row: str, world: int, parameters: int) -> int:
    """Bytes a launch needs here: fp32 master weights, gradients and AdamW's moments (16 B a parameter) over W under
    full fsdp; the base's shards (bf16 or fp32) under fsdp + LoRA, whole on every process under ddp; ~1 GiB of runtime
    and transients a process."""
    per = {"lora_bf16": 2 * parameters // world, "lora_fp32": 4 * parameters // world,
           "full_bf16": 16 * parameters // world, "full_fp32": 16 * parameters // world,
           "ddp_lora_bf16": 2 * parameters + 4 * parameters}[row]   # ddp: + the merged fp32 copy at the checkpoint
    return world * (per + GIB)


def launch(row: str, world: int, args: argparse.Namespace, config: Path, run_root: Path, base: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="phase_memory_") as tmp:
        overrides = [*ROWS[row], f"output_dir={run_root}", f"name={row}_{world}", "overwrite=true"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", __file__,
               "--worker", "--world", str(world), "--result-dir", tmp, "--config", str(config), "--", *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - t0
        run = run_root / f"{row}_{world}"
        if done.returncode:
            shutil.rmtree(run, ignore_errors=True)
            raise RuntimeError(f"{row} W={world} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        step = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
        checkpoint = {"folder_bytes": folder_bytes(step), "base_bytes": folder_bytes(base),
                      "files": sorted(str(f.relative_to(step)) for f in step.rglob("*") if f.is_file())[:40]}
        shutil.rmtree(run, ignore_errors=True)   # a ddp row's merged model: gigabytes
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
        print(f"{row} W={world}: {wall:.0f} s; peak GiB by rank {[round(r['end'] * KIB / GIB, 2) for r in ranks]}; "
              f"checkpoint {checkpoint['folder_bytes'] / 2**20:.1f} MiB", flush=True)
        return {"ranks": ranks, "checkpoint": checkpoint, "wall_s": round(wall, 1)}


def markdown(doc: dict[str, Any]) -> str:
    full = doc["setup"]["fp32_weight_bytes"]
    lines = [(f"peak RSS (ru_maxrss, GiB) of each rank, up to the end of each phase; full fp32 weights "
              f"{full / GIB:.2f} GiB, base folder {doc['setup']['base_folder_bytes'] / GIB:.2f} GiB"),
             "", "| row | W | " + " | ".join(PHASES) + " | largest / fp32 weights | checkpoint folder / base |",
             "|---|---|" + "---|" * (len(PHASES) + 2)]
    for key, found in doc["rows"].items():
        row, world = key.rsplit("_", 1)
        ranks = found["ranks"]
        cells = [", ".join(f"{r[p] * KIB / GIB:.2f}" for r in ranks) if all(p in r for r in ranks) else "—"
                 for p in PHASES]
        largest = max(r["end"] for r in ranks) * KIB / full
        ratio = found["checkpoint"]["folder_bytes"] / found["checkpoint"]["base_bytes"]
        lines.append(f"| {row} | {world} | " + " | ".join(cells) + f" | {largest:.2f} | {ratio:.4f} |")
    for s in doc["skipped"]:
        lines.append(f"| {s['row']} | {s['world']} | skipped: {s['why'][:100]} |" + " |" * (len(PHASES) + 1))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--batch", type=int, default=2, help="pairs per process")
    p.add_argument("--seq", type=int, default=32, help="tokens per query / passage")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a 2-layer decoder: a smoke check")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    p.add_argument("--work-dir", default=None, help="where the model folder and runs go (kept between calls)")
    p.add_argument("--append", action="store_true", help="keep the other rows of an existing --out")
    p.add_argument("--out", default=None, help="default results/phase_memory.json (--tiny: phase_memory_tiny.json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out or RESULTS_DIR / ("phase_memory_tiny.json" if args.tiny else "phase_memory.json"))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_phase_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    decoder = TINY_DECODER if args.tiny else DECODER
    base = work / "decoder"
    if (work / "decoder_parameters.json").is_file():   # a --work-dir kept from an earlier call: the same folder
        parameters = json.loads((work / "decoder_parameters.json").read_text())["parameters"]
    else:
        parameters = make_decoder_folder(base, decoder, "20KB" if args.tiny else "500MB")
        (work / "decoder_parameters.json").write_text(json.dumps({"parameters": parameters}))
    make_pairs(work / "pairs.jsonl", 256)
    make_sts(work / "sts.tsv")
    config = work / "config.yaml"
    config_yaml(config, base, work / "pairs.jsonl", work / "sts.tsv", args)
    doc = {"machine": {**machine_info(1), "backend": "gloo", "processes": "one per rank, 1 thread each"},
           "command": " ".join(["python", "benchmarks/bench_phase_memory.py", *sys.argv[1:]]),
           "setup": {"decoder": decoder, "parameters": parameters, "fp32_weight_bytes": 4 * parameters,
                     "base_folder_bytes": folder_bytes(base), "batch_per_process": args.batch, "tokens": args.seq,
                     "steps": args.steps, "config": config.read_text(), "rows": ROWS},
           "phases": {"runtime": "after the trainer's imports", "fill": "the meta-device start filled this rank's "
                      "shards (fsdp only)", "probe": "the LoRA probe's forward on the sharded model (fsdp only)",
                      "at_start": "eval.at_start's evaluation (sharded under fsdp)", "start": "the training loop begins (model built, sharded, probed, "
                      "evaluated at the start; optimizer made)", "first_forward": "after the first training forward",
                      "step": "after the first optimizer step", "checkpoint": "after the final checkpoint",
                      "evaluation": "after the final evaluation", "end": "the whole command"},
           "unit": "ru_maxrss in KiB, each the peak since the process started", "rows": {}, "skipped": []}
    if args.append and out.is_file():
        before = json.loads(out.read_text())
        doc["rows"], doc["skipped"] = before.get("rows", {}), before.get("skipped", [])
    for row in args.rows.split(","):
        for world in [int(w) for w in args.worlds.split(",")]:
            doc["skipped"] = [s for s in doc["skipped"] if (s["row"], s["world"]) != (row, world)]
            need, free = estimated_need(row, world, parameters), available_bytes()
            if need > free:
                why = f"needs ~{need / GIB:.1f} GiB, {free / GIB:.1f} GiB available"
                print(f"SKIP {row} W={world}: {why}", flush=True)
                doc["skipped"].append({"row": row, "world": world, "why": why})
                continue
            doc["rows"][f"{row}_{world}"] = launch(row, world, args, config, work / "runs", base)
            write_json(out, doc)
    write_json(out, doc)
    print(markdown(doc))


if __name__ == "__main__":
    main()
