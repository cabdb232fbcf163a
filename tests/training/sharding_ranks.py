"""Run by tests/training/test_sharding.py under `torchrun --nproc_per_node W` (or alone, W = 1).

    sharding_ranks.py compare OUT DECODER      every rank trains a CLIP module (tiny-vit, qnorm + learnable γ) and a
                                               decoder text module (tiny Qwen3, last-token pooling) for 5 fp32 steps
                                               under ddp and under fsdp on its slice of fixed global batches; rank 0
                                               writes OUT/<W>.pt: losses and consolidated final weights per run, and
                                               the fsdp CLIP run's full optimizer state; that run's checkpoint stays
                                               in OUT/<W>_clip_fsdp/
    sharding_ranks.py resume OUT CKPT          a CLIP fsdp module loads CKPT (written by another world size) and saves
                                               OUT/resumed_<W>.pt: its full weights and optimizer state, and the data
                                               position it continues from
    sharding_ranks.py killed OUT               trains with a checkpoint every step; rank 0 dies (SIGKILL) inside the
                                               sharded save of step 3, after its shard is written
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from test_engine import collate, fixed_batches

from magclip.config import LossConfig, TextLossConfig, TrainConfig
from magclip.losses import RetrievalLoss
from magclip.models.clip import create_clip
from magclip.models.text import BiEncoder
from magclip.similarity import make_scorer
from magclip.training import sharding as sharding_module
from magclip.training.accelerator import make_accelerator
from magclip.training.clip import CLIPTrainModule, build_logit_scale, build_loss
from magclip.training.engine import Engine
from magclip.training.text import TextTrainModule
from magclip.training.text import build_logit_scale as text_logit_scale

STEPS = 5
GLOBAL_BATCH = 16


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def train_config(sharding: str, steps: int = STEPS, checkpoint_every: int | None = None) -> TrainConfig:
    # eps well above float32 gradient noise (see test_engine.run_engine): Adam's first steps are ~lr*sign(g)
    _, w = world()
    return TrainConfig(epochs=1, batch_size=GLOBAL_BATCH // w, lr=1e-3, eps=1e-3, warmup_steps=0, log_every=1,
                       grad_clip=1.0, precision="fp32", sharding=sharding, channels_last=False, max_steps=steps,
                       checkpoint_every=checkpoint_every)


def clip_module() -> CLIPTrainModule:
    torch.manual_seed(0)
    loss_cfg = LossConfig(i2t="qnorm", t2i="learnable")
    return CLIPTrainModule(create_clip("tiny-vit").model, build_loss(loss_cfg), build_logit_scale(loss_cfg))


def clip_batches() -> list[dict]:
    """This rank's slice of each step's global batch."""
    r, w = world()
    samples = fixed_batches(STEPS * GLOBAL_BATCH)
    per = GLOBAL_BATCH // w
    return [collate(samples[s * GLOBAL_BATCH + r * per: s * GLOBAL_BATCH + (r + 1) * per]) for s in range(STEPS)]


def text_module(decoder: Path) -> TextTrainModule:
    torch.manual_seed(0)
    encoder = BiEncoder.from_pretrained(decoder, pooling="last", query_max_length=12, passage_max_length=20)
    cfg = TextLossConfig(mode="dnorm")
    loss = RetrievalLoss(make_scorer(cfg.mode), 1, True)
    return TextTrainModule(encoder, loss, text_logit_scale(cfg))


def text_batches() -> list[dict]:
    r, w = world()
    g = torch.Generator().manual_seed(1)
    per = GLOBAL_BATCH // w
    out = []
    for _ in range(STEPS):
        batch = {}
        for side, length in (("query", 12), ("passage", 20)):
            ids = torch.randint(5, 90, (GLOBAL_BATCH, length), generator=g)
            lengths = torch.randint(3, length + 1, (GLOBAL_BATCH,), generator=g)
            mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
            batch[f"{side}_input_ids"] = (ids * mask)[r * per:(r + 1) * per]
            batch[f"{side}_attention_mask"] = mask[r * per:(r + 1) * per]
        out.append({**batch, "keys": [str(i) for i in range(per)], "skipped": {}})
    return out


def save_model(m, step_dir: Path) -> None:
    torch.save(m.state_dict(), step_dir / "model.pt")


def run(out: Path, name: str, module, batches: list[dict], sharding: str, **cfg) -> dict:
    """Train; the per-step losses (rank 0's records), the consolidated final weights, the engine."""
    config = train_config(sharding, **cfg)
    engine = Engine(config, make_accelerator(config, out / name), module, out / name, lambda epoch: batches,
                    steps_per_epoch=len(batches), save_model=save_model)
    losses = []
    original = engine._after_step

    def keep(step_out, bar):
        losses.append(float(step_out["loss"].detach()))
        original(step_out, bar)

    engine._after_step = keep
    engine.fit()
    engine.close()
    with engine.sharding.full_module(engine.unwrapped) as full:
        weights = {k: v.detach().cpu().clone() for k, v in full.state_dict().items()} if full is not None else None
    return {"losses": losses, "weights": weights, "engine": engine}


def full_optimizer_state(engine: Engine) -> dict | None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(engine.unwrapped, engine._inner_optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if world()[0] == 0 else None


def compare(out: Path, decoder: Path) -> None:
    rank, w = world()
    record: dict = {"world_size": w}
    for sharding in ("ddp", "fsdp"):
        clip = run(out, f"{w}_clip_{sharding}", clip_module(), clip_batches(), sharding)
        text = run(out, f"{w}_text_{sharding}", text_module(decoder), text_batches(), sharding)
        record[f"clip_{sharding}"] = {k: clip[k] for k in ("losses", "weights")}
        record[f"text_{sharding}"] = {k: text[k] for k in ("losses", "weights")}
        if sharding == "fsdp":
            record["clip_fsdp_optimizer"] = full_optimizer_state(clip["engine"])
            record["memory"] = clip["engine"].sharding.memory_record(clip["engine"].unwrapped, clip["engine"].optimizer)
    if rank == 0:
        torch.save(record, out / f"{w}.pt")


def resume(out: Path, checkpoint: Path) -> None:
    """Load CKPT into a fresh fsdp module (no step taken: max_steps is the checkpoint's step)."""
    rank, w = world()
    config = train_config("fsdp")
    config.resume = str(checkpoint)
    engine = Engine(config, make_accelerator(config, out / f"resumed_{w}"), clip_module(), out / f"resumed_{w}",
                    lambda epoch: clip_batches(), steps_per_epoch=STEPS, save_model=save_model)
    engine.load_checkpoint(checkpoint)
    with engine.sharding.full_module(engine.unwrapped) as full:
        weights = {k: v.detach().cpu().clone() for k, v in full.state_dict().items()} if full is not None else None
    optimizer = full_optimizer_state(engine)
    if rank == 0:
        torch.save({"weights": weights, "optimizer": optimizer, "world_size": w,
                    "batches_in_epoch": engine.state.batches_in_epoch, "step": engine.state.step},
                   out / f"resumed_{w}.pt")
    engine.close()


def killed(out: Path) -> None:
    """Rank 0 is killed inside the sharded save of step 3, after writing its shard."""
    real_save = sharding_module.save_sharded

    def save_then_die(folder, module, optimizer, **kwargs):
        real_save(folder, module, optimizer, **kwargs)
        if world()[0] == 0 and folder.parent.name.endswith("00000003"):
            os.kill(os.getpid(), signal.SIGKILL)

    import magclip.training.engine as engine_module

    engine_module.save_sharded = save_then_die
    run(out, "killed", clip_module(), clip_batches(), "fsdp", checkpoint_every=1)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("MAGCLIP_TEST_HANG_S", 240)), exit=True)
    phase, folder = sys.argv[1], Path(sys.argv[2])
    make_accelerator(TrainConfig(precision="fp32"), folder)  # joins the gloo group torchrun set up (none alone)
    assert world()[1] == int(os.environ.get("EXPECTED_WORLD_SIZE", "1")), world()
    {"compare": lambda: compare(folder, Path(sys.argv[3])), "resume": lambda: resume(folder, Path(sys.argv[3])),
     "killed": lambda: killed(folder)}[phase]()
    if dist.is_initialized():  # leave as magclip's commands do: gloo's threads can abort a normal interpreter exit
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
