"""Run by tests/training/test_sharded_eval.py under `torchrun --nproc_per_node 2`.

    sharded_eval_ranks.py run OUT DECODER   a CLIP module (tiny-vit) and a decoder text module (tiny Qwen3) train 2 fp32
                                            steps under fsdp, a checkpoint after each (CLIP: train.save_full_model=last,
                                            text: never). The engine's validation runs sharded (every rank encodes its
                                            share: metrics.jsonl's val record), then the main process evaluates the
                                            consolidated model alone (the evaluation of one process); rank 0 writes
                                            OUT/eval.pt with both, the sharded features and the gathered final weights
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from builders import toy_rows, write_toy_eval
from sharding_ranks import clip_batches, clip_module, text_batches, text_module, train_config, world

from magclip.config import (
    LossConfig,
    ModelConfig,
    RunConfig,
    TextEvalConfig,
    TextModelConfig,
    TextRunConfig,
    to_dict,
)
from magclip.distributed import Share
from magclip.evaluation.clip import encode_loader, evaluate_retrieval
from magclip.similarity import evaluation_scorers
from magclip.training.accelerator import make_accelerator
from magclip.training.engine import Engine
from magclip.training.text_eval import TextEvalSets, evaluate_text_sets

STEPS = 2
EVAL_BATCH = 4  # 5 CLIP batches (the last one short), 5 BEIR and STS batches: rank 1 pads where it has fewer


def eval_batches() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    n, out = 18, []
    images, texts = torch.randn(n, 3, 32, 32, generator=g), torch.randint(1, 400, (n, 32), generator=g)
    for start in range(0, n, EVAL_BATCH):
        keys = [str(i) for i in range(start, min(n, start + EVAL_BATCH))]
        out.append({"images": images[start:start + EVAL_BATCH], "texts": texts[start:start + EVAL_BATCH],
                    "keys": keys, "captions": [f"caption {k}" for k in keys], "skipped": {}})
    return out


def train(out: Path, name: str, module, batches, run_config: dict, save_full_model: str, evaluate) -> Engine:
    config = train_config("fsdp", steps=STEPS, checkpoint_every=1)
    config.save_full_model = save_full_model
    engine = Engine(config, make_accelerator(config, out / name), module, out / name, lambda epoch: batches,
                    steps_per_epoch=len(batches), save_model=lambda m, d: torch.save(m.state_dict(), d / "model.pt"),
                    evaluate=evaluate, run_config=run_config)
    engine.fit()
    return engine


def val_record(run: Path) -> dict:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [line for line in lines if any(k.startswith("val/") for k in line)][-1]
    return {k[len("val/"):]: v for k, v in last.items() if k.startswith("val/")}


def gathered(engine: Engine) -> dict | None:
    with engine.sharding.full_module(engine.unwrapped) as full:
        return {k: v.detach().cpu().clone() for k, v in full.state_dict().items()} if full is not None else None


def run(out: Path, decoder: Path) -> None:
    rank, w = world()
    record: dict = {"world_size": w}
    # CLIP: the engine's validation, every rank encoding its share
    batches = eval_batches()
    share = Share(rank, w)

    def clip_eval(m, step, share=share):
        return evaluate_retrieval(m.clip, evaluation_scorers(m.loss.scorers), batches, "cpu", share=share)

    loss = LossConfig(i2t="qnorm", t2i="learnable")
    clip_cfg = RunConfig(model=ModelConfig(name="tiny-vit"), loss=loss)
    clip_cfg.train.sharding = "fsdp"
    engine = train(out, "clip", clip_module(), clip_batches()[:STEPS], to_dict(clip_cfg), "last", clip_eval)
    assert engine.sharding.eval_share() == share
    engine.run_evaluation()
    sharded_features = engine.evaluate_model(lambda m: encode_loader(m.clip, batches, "cpu", share=share))
    with engine.sharding.full_module(engine.unwrapped) as full:
        if full is not None:  # the main process alone, the consolidated model: the evaluation of one process
            full.eval()
            with torch.no_grad():
                record["clip_one_process"] = dict(clip_eval(full, STEPS, Share()))
                record["clip_one_process_features"] = encode_loader(full.clip, batches, "cpu")
            record["clip_weights"] = {k: v.detach().cpu().clone() for k, v in full.state_dict().items()}
    record["clip_sharded_features"] = sharded_features
    engine.close()

    # text: BEIR + STS through the text task's evaluation, the texts on the main process only
    eval_cfg = TextEvalConfig(beir={"toy": str(out / "toybeir")}, sts={"toysts": str(out / "toysts.tsv")},
                              batch_size=EVAL_BATCH, length_bins=2)
    module = text_module(decoder)
    sets = TextEvalSets.load(eval_cfg, module.encoder) if rank == 0 else TextEvalSets()

    def text_eval(m, step, share=share):
        return evaluate_text_sets(m.encoder, m.loss.scorer, sets, eval_cfg, None, share)

    text_cfg = TextRunConfig(model=TextModelConfig(name=str(decoder), pooling="last", query_max_length=12,
                                                   passage_max_length=20), eval=eval_cfg)
    text_cfg.loss.mode = "dnorm"
    text_cfg.train.sharding = "fsdp"
    engine = train(out, "text", module, text_batches()[:STEPS], to_dict(text_cfg), "never", text_eval)
    engine.run_evaluation()
    with engine.sharding.full_module(engine.unwrapped) as full:
        if full is not None:
            full.eval()
            with torch.no_grad():
                record["text_one_process"] = dict(text_eval(full, STEPS, Share()))
            record["text_weights"] = {k: v.detach().cpu().clone() for k, v in full.state_dict().items()}
    engine.close()
    if rank == 0:
        record["clip_val"] = val_record(out / "clip")
        record["text_val"] = val_record(out / "text")
        torch.save(plain(record), out / "eval.pt")   # read back with weights_only=True


def plain(value):
    """`value` with numpy scalars as Python numbers (a weights_only load refuses numpy's globals)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value.item() if hasattr(value, "item") and not torch.is_tensor(value) else value


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("MAGCLIP_TEST_HANG_S", "240")), exit=True)
    phase, folder = sys.argv[1], Path(sys.argv[2])
    from magclip.config import TrainConfig

    make_accelerator(TrainConfig(precision="fp32"), folder)  # joins the gloo group torchrun set up
    assert world()[1] == int(os.environ.get("EXPECTED_WORLD_SIZE", "1")), world()
    if world()[0] == 0:
        write_toy_eval(folder, toy_rows(18))
    if dist.is_initialized():
        dist.barrier()
    {"run": lambda: run(folder, Path(sys.argv[3]))}[phase]()
    if dist.is_initialized():  # leave as magclip's commands do: gloo's threads can abort a normal interpreter exit
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

