"""The speed levers of a training process, each a `train.*` key resolved here once and logged once:

| key | what | default, and why (benchmarks/README.md, "Speed levers") |
|---|---|---|
| `optimizer_impl` | AdamW's kernel: fused (one kernel over all parameters), foreach, for_loop | `auto` = fused where torch has it (CPU and CUDA floats): 1.34x the train step on an AVX2 CPU |
| `channels_last` | conv towers (ResNets) and their images in channels_last memory | on: 1.14x on the same CPU; a tower without convolutions ignores it (logged) |
| `precision` | fp32, bf16 / fp16 autocast through accelerate, `auto` | fp32: bf16 only pays where the device computes it natively (CUDA with bf16, a CPU with AVX512-BF16 or AMX); elsewhere it is emulated, 12x slower on an AVX2 CPU. `auto` picks it by that rule, and says so |
| `compile` | torch.compile of the towers (`compile_mode`) | `auto` = on for a run of at least COMPILE_AUTO_MIN_STEPS steps whose batches keep one shape, unsharded, without LoRA (`compile_choice`): a cold compile costs minutes on a CPU and paid for itself after ~840 steps of the tiny ResNet |

Scores and the softmax stay in float32 under any autocast (magclip.similarity). A compiled tower keeps
its parameter names (`nn.Module.compile` compiles in place), so checkpoints load in plain open_clip.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger("magclip.training.levers")


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively (so autocast to it is faster, not emulated), and why."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"CUDA device {'supports' if ok else 'lacks'} bf16"
    flags = {name: bool(getattr(torch.cpu, probe, lambda: False)())
             for name, probe in (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))}
    found = [name for name, ok in flags.items() if ok]
    if found:
        return True, f"this CPU has {' and '.join(found)}"
    return False, f"this CPU has neither AVX512-BF16 nor AMX (capability {torch.backends.cpu.get_cpu_capability()}): bf16 would be emulated"


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """(fp32 | bf16 | fp16, why): `auto` is bf16 where the device computes it natively, else fp32."""
    if precision != "auto":
        return precision, "as configured"
    ok, why = native_bf16(device)
    return ("bf16" if ok else "fp32"), f"auto: {why}"


def evaluation_autocast(precision: str, device: torch.device) -> tuple[Any, str]:
    """A context manager that sets the encoding precision of an evaluation whatever autocast surrounds
    it (fp32 switches the training run's autocast off), and the precision it resolved to. A run's
    evaluations before and after training go through it, so their difference is training's alone."""
    resolved, why = resolve_precision(precision, device)
    if resolved == "fp32":
        return torch.autocast(device_type=device.type, enabled=False), f"fp32 ({why})"
    dtype = torch.bfloat16 if resolved == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype), f"{resolved} ({why})"


def optimizer_kwargs(impl: str, params: list[nn.Parameter]) -> tuple[dict[str, Any], str]:
    """AdamW's implementation keywords for `train.optimizer_impl`, and why. `auto`: fused where every
    parameter is a floating-point tensor on a CPU or CUDA device (what torch's fused kernel takes)."""
    if impl == "auto":
        fusable = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
        impl = "fused" if fusable else "foreach"
        why = "auto: fused AdamW" if fusable else "auto: foreach AdamW (a parameter the fused kernel does not take)"
    else:
        why = f"{impl} AdamW, as configured"
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[impl], why


def has_convolutions(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())


def use_channels_last(module: nn.Module, wanted: bool) -> bool:
    """Put a module with convolutions in channels_last memory (in place); True where that was done."""
    if not wanted:
        return False
    if not has_convolutions(module):
        log.info("train.channels_last: the towers have no convolutions; nothing to change")
        return False
    module.to(memory_format=torch.channels_last)
    return True


COMPILE_AUTO_MIN_STEPS = 1000  # a cold CPU compile of the tiny ResNet paid for itself after ~840 steps (benchmarks/README.md)


def compile_choice(setting: bool | str, steps: int, blocker: str | None, sharded: bool) -> tuple[bool, str]:
    """(compile the towers?, why) for `train.compile` (auto, True, False). `auto` compiles only where it pays: a
    run long enough to repay a cold compile, batches of one shape (`blocker` names what recompiles or is untested,
    e.g. text batches that change length every step), towers not sharded (compiling FSDP units is not supported)."""
    if setting is True or setting is False:
        return setting, "train.compile=" + str(setting).lower()
    if sharded:
        return False, "auto: train.sharding=fsdp"
    if blocker is not None:
        return False, f"auto: {blocker}"
    if steps < COMPILE_AUTO_MIN_STEPS:
        return False, f"auto: {steps} steps, fewer than the {COMPILE_AUTO_MIN_STEPS} a cold compile needs to pay"
    return True, f"auto: {steps} steps, at least {COMPILE_AUTO_MIN_STEPS}"


def compile_module(module: nn.Module, wanted: bool, mode: str) -> bool:
    """torch.compile `module` in place (its parameter names, and so every checkpoint, are unchanged)."""
    if not wanted:
        return False
    module.compile(mode=None if mode == "default" else mode)
    return True
