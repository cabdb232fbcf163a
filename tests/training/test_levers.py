"""The speed levers (magclip/training/levers.py) change how fast a step runs, not what it computes:
fused AdamW updates like the for-loop one, channels_last and a compiled tower give the eager loss and
gradients, bf16 stays finite and close to fp32, `precision=auto` follows the hardware, and a non-finite
step skipped on the device (fused kernel, no host sync) leaves the same trace as the synchronous skip."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from magclip.config import LossConfig, TrainConfig
from magclip.models.clip import create_clip
from magclip.training import levers
from magclip.training.accelerator import make_accelerator
from magclip.training.clip import CLIPTrainModule, build_logit_scale, build_loss
from magclip.training.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")


def module(model: str = "tiny-resnet") -> CLIPTrainModule:
    torch.manual_seed(0)
    loss_cfg = LossConfig(i2t="qnorm", t2i="learnable")
    return CLIPTrainModule(create_clip(model).model, build_loss(loss_cfg), build_logit_scale(loss_cfg))


def batches(n: int = 3, size: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"images": torch.randint(0, 255, (size, 3, 32, 32), dtype=torch.uint8, generator=g),
             "texts": torch.randint(1, 400, (size, 32), generator=g), "keys": [f"{i}_{j}" for j in range(size)],
             "skipped": {}} for i in range(n)]


def train(tmp_path, name: str, data: list[dict], **train_cfg) -> tuple[Engine, dict]:
    cfg = TrainConfig(epochs=1, batch_size=8, lr=1e-3, eps=1e-3, warmup_steps=0, log_every=1, **train_cfg)
    engine = Engine(cfg, make_accelerator(cfg, tmp_path / name), module(), tmp_path / name, lambda epoch: data,
                    steps_per_epoch=len(data), save_model=lambda m, d: torch.save(m.state_dict(), d / "m.pt"))
    engine.fit()
    engine.close()
    return engine, {k: v.detach().clone() for k, v in engine.unwrapped.state_dict().items()}


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_fused_adamw_updates_like_the_for_loop_one(tmp_path):
    data = batches()
    fused, w_fused = train(tmp_path, "fused", data, optimizer_impl="fused", channels_last=False)
    _, w_loop = train(tmp_path, "loop", data, optimizer_impl="for_loop", channels_last=False)
    assert fused.levers["optimizer"].startswith("fused") and fused._skips_on_device
    assert worst(w_fused, w_loop) < 1e-5


def test_auto_is_fused_and_levers_are_logged_once(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="magclip.training.engine"):
        engine, _ = train(tmp_path, "auto", batches(1))
    assert engine.levers["optimizer"] == "auto: fused AdamW"
    assert engine.levers["channels_last"] == "on" and engine.levers["compile"].startswith("off (auto: ")
    assert caplog.text.count("speed levers:") == 1


def test_channels_last_gives_the_eager_loss_and_gradients():
    batch = batches(1)[0]
    plain, last = module(), module()
    assert levers.use_channels_last(last.towers(), True)
    last.channels_last = True
    grads = []
    for m in (plain, last):
        out = m.compute_loss(*m(batch))
        out["loss"].backward()
        grads.append((out["loss"].detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and max(float((g0[k] - g1[k]).abs().max()) for k in g0) < 1e-4
    assert any(p.is_contiguous(memory_format=torch.channels_last) and p.ndim == 4 for p in last.parameters())


def test_channels_last_is_ignored_without_convolutions(caplog):
    """A text encoder (no convolution) is left alone, with a log line; a ViT's patch embedding is a conv."""
    with caplog.at_level(logging.INFO, logger="magclip.training.levers"):
        assert not levers.use_channels_last(torch.nn.Sequential(torch.nn.Embedding(9, 4), torch.nn.Linear(4, 4)), True)
    assert "no convolutions" in caplog.text
    assert levers.has_convolutions(module("tiny-vit").towers())


def test_a_compiled_tower_trains_like_eager_and_keeps_plain_keys(tmp_path, monkeypatch):
    """Compiled through the engine (train.compile); the aot_eager backend exercises the same in-place
    compile as inductor in seconds (inductor's kernels are torch's to test; the benchmark times them)."""
    monkeypatch.setattr(torch.nn.Module, "compile",
                        functools.partialmethod(torch.nn.Module.compile, backend="aot_eager"))
    data = batches(2)
    compiled, w_compiled = train(tmp_path, "compiled", data, compile=True, optimizer_impl="for_loop")
    _, w_eager = train(tmp_path, "eager", data, optimizer_impl="for_loop")
    assert compiled.levers["compile"] == "on (mode default; train.compile=true)"
    assert not any("_orig_mod" in k for k in w_compiled)
    saved = torch.load(tmp_path / "compiled" / "checkpoints" / "step_00000002" / "m.pt", weights_only=True)
    assert saved.keys() == w_eager.keys()
    assert worst(w_compiled, w_eager) < 1e-5


def test_bf16_loss_is_finite_and_close_to_fp32():
    batch = batches(1)[0]
    m = module()
    with torch.no_grad():
        fp32 = m.compute_loss(*m(batch))["loss"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = m.compute_loss(*m(batch))["loss"]
    assert torch.isfinite(bf16) and bf16.dtype == torch.float32  # scores and softmax stay float32
    assert abs(float(bf16) - float(fp32)) < 0.02 * float(fp32)


def test_precision_auto_follows_the_hardware(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    precision, why = levers.resolve_precision("auto", cpu)
    assert precision == "fp32" and "neither AVX512-BF16 nor AMX" in why
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert levers.resolve_precision("auto", cpu) == ("bf16", "auto: this CPU has AVX512-BF16")
    assert levers.resolve_precision("fp16", cpu) == ("fp16", "as configured")


def test_optimizer_auto_falls_back_where_fused_does_not_apply():
    doubles = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    assert levers.optimizer_kwargs("auto", doubles)[0] == {"fused": True}  # float64 is a float: fused takes it
    ints = [torch.zeros(2, dtype=torch.int64)]
    assert levers.optimizer_kwargs("auto", ints)[0] == {"foreach": True}
    assert levers.optimizer_kwargs("for_loop", doubles) == ({"foreach": False}, "for_loop AdamW, as configured")


def test_auto_is_the_default_and_evaluations_stay_in_fp32(tmp_path):
    """Both trainers default to train.precision=auto; a CLIP run trained under bf16 autocast validates in
    fp32 (eval.precision): its R@1 is an fp32 evaluation of its final checkpoint, and results.json says
    which precision each part ran in."""
    from builders import tiny_run

    from magclip.config import TextRunConfig, load_config
    from magclip.data.shards import build_clip_loader
    from magclip.evaluation.checkpoint import load_checkpoint
    from magclip.evaluation.clip import evaluate_retrieval
    from magclip.training.clip import train_clip

    assert load_config().train.precision == "auto" and TextRunConfig().train.precision == "auto"
    assert load_config().eval.precision == "fp32"
    res = train_clip(load_config(None, tiny_run(tmp_path, tmp_path / "synth", "bf16", "train.precision=bf16",
                                                "train.max_steps=3")))
    assert res["speed_levers"]["precision"].startswith("bf16") and res["eval_precision"].startswith("fp32")
    model = load_checkpoint(res["checkpoint"])
    loader = build_clip_loader(res["val_data"], preprocess=model.preprocess, tokenizer=model.tokenizer,
                               batch_size=256, num_samples=None, shuffle=False, workers=0, rank=0, world_size=1,
                               drop_last=False)
    again = evaluate_retrieval(model.clip.eval(), model.scorers, loader, "cpu")
    assert again["image_to_text_R@1"] == res["metrics"]["image_to_text_R@1"]
    assert again["text_to_image_mean_rank"] == res["metrics"]["text_to_image_mean_rank"]


def test_a_second_run_in_one_process_may_change_the_precision(tmp_path):
    """accelerate refuses a second Accelerator with another mixed precision in one process; a notebook or
    a test session running an fp32 run after a bf16 one gets the precision it asked for."""
    first = make_accelerator(TrainConfig(precision="bf16"), tmp_path / "a")
    assert first.mixed_precision == "bf16"
    assert make_accelerator(TrainConfig(precision="fp32"), tmp_path / "b").mixed_precision == "no"


@pytest.mark.parametrize("setting, steps, blocker, sharded, wanted", [
    ("auto", 5000, None, False, True), ("auto", 999, None, False, False), ("auto", 5000, "text", False, False),
    ("auto", 5000, None, True, False), (True, 10, "text", False, True), (False, 5000, None, False, False)])
def test_compile_auto_compiles_only_long_runs_of_one_shape(setting, steps, blocker, sharded, wanted):
    from magclip.training.levers import compile_choice

    assert compile_choice(setting, steps, blocker, sharded)[0] is wanted


def test_the_text_task_and_lora_keep_compile_auto_off():
    from magclip.training.clip import CLIPTrainModule
    from magclip.training.text import TextTrainModule

    assert TextTrainModule.compile_blocker and CLIPTrainModule.compile_blocker is None
