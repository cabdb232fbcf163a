"""Run by tests/training/test_meta_start.py under `torchrun --nproc_per_node W`.

    meta_start_ranks.py OUT CASES_JSON    every rank builds each case's module twice: eagerly (today's load) and on
                                          the meta device (the loaders that read whole files made to fail), shards
                                          the latter with FSDP2 and fills it from the weights (meta_start); it
                                          compares its own shards, and rank 0 the consolidated state, with the eager
                                          load's, bit for bit; OUT/<W>_<rank>.json holds what each rank found
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from magclip.config import LoRAConfig, LossConfig, TextLossConfig, TrainConfig
from magclip.losses import RetrievalLoss
from magclip.models import build
from magclip.models.clip import create_clip
from magclip.models.lora import PROBE_ATTR, adapt_clip, adapt_text
from magclip.models.text import BiEncoder
from magclip.similarity import make_scorer
from magclip.training.accelerator import make_accelerator
from magclip.training.clip import CLIPTrainModule, build_logit_scale, build_loss
from magclip.training.meta_start import local_rows, start_sharded
from magclip.training.sharding import local
from magclip.training.text import TextTrainModule
from magclip.training.text import build_logit_scale as text_logit_scale


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def module_of(case: dict):
    """The case's module; with "lora" (r), its towers adapted by peft as a training run adapts them, the base held
    in the case's "precision" (models/lora.py)."""
    torch.manual_seed(0)
    lora = LoRAConfig(r=case["lora"]) if case.get("lora") else None
    precision = case.get("precision", "fp32")
    if case["kind"] == "clip":
        loss_cfg = LossConfig(i2t="qnorm", t2i="learnable")
        bundle = create_clip(case["model"], case["weights"])
        if lora:
            adapt_clip(bundle.model, lora, bundle.preprocess_val, bundle.tokenizer, precision, "fsdp")
        return CLIPTrainModule(bundle.model, build_loss(loss_cfg), build_logit_scale(loss_cfg))
    encoder = BiEncoder.from_pretrained(case["weights"], pooling=case.get("pooling"), shared=case.get("shared"))
    if lora:
        adapt_text(encoder, lora, precision)
    cfg = TextLossConfig(mode="dnorm")
    return TextTrainModule(encoder, RetrievalLoss(make_scorer(cfg.mode), 1, True), text_logit_scale(cfg))


class WholeFileRead(AssertionError):
    pass


def refuse(*args, **kwargs):
    raise WholeFileRead("a loader that reads the whole weights file ran during the meta-device build")


def meta_module_of(case: dict):
    """The module built under build.on_meta() with open_clip's and transformers' whole-file loaders failing."""
    import open_clip.factory
    import transformers

    saved = open_clip.factory.load_checkpoint, transformers.AutoModel.from_pretrained
    open_clip.factory.load_checkpoint, transformers.AutoModel.from_pretrained = refuse, refuse
    try:
        with build.on_meta():
            return module_of(case)
    finally:
        open_clip.factory.load_checkpoint, transformers.AutoModel.from_pretrained = saved


def tensors(module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def held_adapters(module) -> dict[str, torch.Tensor]:
    """The adapters' initial values each rank holds whole before the start (build.HeldTensors), by parameter name."""
    return {(f"{prefix}.{key}" if prefix else key): source.read(key).clone()
            for prefix, source in build.weights_on_meta(module) if isinstance(source, build.HeldTensors)
            for key in source.keys}


def adapter_record(module, held: dict[str, torch.Tensor]) -> dict:
    """LoRA's adapters after a meta-device start: every rank's digest of the A matrices it held whole before the
    start (equal on every rank: the shards stitch into one draw), whether the gathered adapters are exactly those
    (each rank filled its own rows), A within peft's kaiming-uniform bound 1/sqrt(fan_in), every B zero (the
    model's output is the base's, as peft starts), and whether the deferred probe ran."""
    import hashlib

    digest, as_held, a_ok, b_zero, n = hashlib.sha256(), True, True, True, 0
    for name, p in sorted(module.named_parameters()):
        if ".lora_A." in name or ".lora_B." in name:
            full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()   # a collective
            n += 1
            as_held &= torch.equal(full, held[name])
            if ".lora_A." in name:
                digest.update(held[name].numpy().tobytes())
                a_ok &= bool(full.abs().max() <= full.shape[1] ** -0.5) and bool(full.abs().max() > 0)
            else:
                b_zero &= bool((full == 0).all())
    return {"adapters": n, "a_sha256": digest.hexdigest(), "as_held": as_held, "a_in_bound": a_ok, "b_zero": b_zero,
            "held": len(held), "probed": not any(hasattr(m, PROBE_ATTR) for m in module.modules())}


def check(case: dict, accelerator) -> dict:
    eager = tensors(module_of(case))
    module = meta_module_of(case)
    loaded = build.weights_on_meta(module)
    on_meta = {n for n, p in module.named_parameters() if p.is_meta}
    precision = case.get("precision", "fp32")
    held = held_adapters(module)
    sharding = start_sharded(module, accelerator, TrainConfig(sharding="fsdp", precision=precision))
    mismatches, sharded, local_numel, full_numel = [], 0, 0, 0
    lora = adapter_record(module, held) if case.get("lora") else {}
    dtypes = sorted({str(local(p).dtype) for n, p in module.named_parameters() if "lora_" not in n and p.ndim > 1})
    for name, t in tensors(module).items():
        if "lora_" in name:   # drawn on every rank alike (adapter_record), not from the eager start's RNG
            continue
        rows = local_rows(t)
        expected = eager[name] if rows is None else eager[name][rows[0]:rows[1]]
        mine = local(t)
        if mine.dtype != expected.dtype or not torch.equal(mine.cpu(), expected):
            mismatches.append(name)
        if name in on_meta and rows is not None:   # the meta-built parameters FSDP2 shards (not 0-d scalars)
            sharded += rows[1] - rows[0] < t.shape[0]
            local_numel += mine.numel()
            full_numel += t.numel()
    with sharding.full_module(module) as full:
        consolidated = None
        if full is not None:
            state, eager_state = full.state_dict(), {k: eager[k] for k in full.state_dict()}
            consolidated = all(torch.equal(state[k].cpu(), eager_state[k]) for k in state if "lora_" not in k)
    return {"loaded_parts": len(loaded), "meta_parameters": len(on_meta), "mismatches": mismatches,
            "sharded": sharded, "local_numel": local_numel, "full_numel": full_numel, "consolidated": consolidated,
            "base_dtypes": dtypes, **lora}


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("MAGCLIP_TEST_HANG_S", "240")), exit=True)
    out, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    accelerator = make_accelerator(TrainConfig(precision="fp32"), out)
    rank, w = world()
    assert w == int(os.environ.get("EXPECTED_WORLD_SIZE", "1")), (w, os.environ.get("EXPECTED_WORLD_SIZE"))
    found = {name: check(case, accelerator) for name, case in cases.items()}
    (out / f"{w}_{rank}.json").write_text(json.dumps({"world_size": w, "cases": found}))
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
