"""LoRA through peft: low-rank adapters on a frozen tower (`model.lora`), beside clip.py and text.py.

The field fine-tunes large encoders this way (tevatron's RepLLaMA recipe): each adapted layer keeps its weight W
frozen and learns W + (alpha / r) * B @ A with A, B of rank r. Here peft does the adapting (`get_peft_model`), so
the adapters are peft's own modules and files:

- `add_lora(model, cfg, probe, base_dtype)` wraps one model (an open_clip CLIP model, a Hugging Face encoder or
  decoder) in a `PeftModel`: only the adapters train; the frozen base is held in `base_dtype` (bf16 when training
  runs in bf16: half the bytes), the adapters in fp32. What `target_modules` names is checked against the model at
  once, in one line: a name that matches nothing, a module peft cannot adapt, and a module whose forward the model
  never calls (its weight is read directly, e.g. `out_proj` of an `nn.MultiheadAttention`, which
  `F.multi_head_attention_forward` uses by weight: a LoRA there would never change an output). `probe` runs the
  model once on a small input to see which adapted modules take part.
- Under `train.sharding: fsdp` the towers are built on the meta device (models/build.py) and wrapped there: the
  weights sources are renamed to peft's names, the adapters get their initial values as peft's
  `reset_lora_parameters` gives them (A kaiming-uniform with a=sqrt(5), B zeros: the model starts as its base),
  drawn whole from a generator seeded with the run's seed and the tower's name, so every rank holds the same ones
  (not the eager start's draws from the global generator); the probe waits until the model is sharded and filled
  (`probe_after_start`, called by training/meta_start.py). No process holds the whole base.
- The default targets (`target_modules: null`) come from the model's structure, not its name: every `nn.Linear`
  inside its repeated blocks (open_clip's residual blocks, a BERT's or a decoder's layers) that the block calls.
  open_clip's attention is an `nn.MultiheadAttention`: peft adapts it as a whole (its in- and out-projection) where
  `target_modules` names it (`attn`), under ddp only: FSDP2 cannot shard peft's MultiheadAttention adapter, whose
  forward swaps the layer's parameters (`check_sharding` refuses it at the start).
- `save_adapter` writes peft's folder (adapter_config.json + adapter_model.safetensors, `PeftModel.save_pretrained`);
  `merged_model` is an fp32 copy with the adapters merged into the weights (peft's `merge_and_unload`): the plain
  model that open_clip or sentence-transformers load, whose outputs equal the adapter model's.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from magclip.models import build
from magclip.models.blocks import repeated_blocks

log = logging.getLogger("magclip.lora")

PROBE_ATTR = "_magclip_lora_probe"   # a PeftModel wrapped on the meta device: (probe, what), run once it is sharded
ADAPTER_DIR = "adapter"  # a step folder's peft adapter (a BiEncoder with two towers: adapter/query, adapter/passage)


class LoRAError(ValueError):
    """A `model.lora` setting that cannot adapt this model; the message names the key, the modules and what to do."""


def lora_on(cfg: Any) -> bool:
    """Whether a `model.lora` section asks for adapters (r > 0)."""
    return cfg is not None and cfg.r > 0


def default_targets(model: nn.Module) -> list[str]:
    """Every nn.Linear inside the repeated blocks whose forward the block calls (not the out_proj inside an
    nn.MultiheadAttention, which F.multi_head_attention_forward reads by weight), as peft's list of name suffixes: the
    names within a block where they match nothing outside the blocks, else the full names. open_clip's attention
    (nn.MultiheadAttention) is adapted only where target_modules names it (peft adapts it as a whole; not under fsdp)."""
    wanted: list[str] = []
    for block_name, block in repeated_blocks(model):
        inside_attention = {f"{n}.{c}" if n else c for n, m in block.named_modules()
                            if isinstance(m, nn.MultiheadAttention) for c, _ in m.named_modules() if c}
        for name, module in block.named_modules():
            if name and isinstance(module, nn.Linear) and name not in inside_attention:
                wanted.append(f"{block_name}.{name}")
    if not wanted:
        return []
    suffixes = sorted(set(_relative(wanted, model)))
    matched = {n for n, _ in model.named_modules() if any(n == s or n.endswith("." + s) for s in suffixes)}
    return suffixes if matched == set(wanted) else wanted


def _relative(names: list[str], model: nn.Module) -> list[str]:
    """Each name within its block (`visual.transformer.resblocks.3.mlp.c_fc` -> `mlp.c_fc`)."""
    blocks = sorted((n for n, _ in repeated_blocks(model)), key=len, reverse=True)
    out = []
    for name in names:
        block = next(b for b in blocks if name.startswith(b + "."))
        out.append(name[len(block) + 1:])
    return out


def peft_config(cfg: Any, model: nn.Module):
    """peft's LoraConfig for `model.lora` (`cfg`: r, alpha, dropout, target_modules) on `model`."""
    from peft import LoraConfig

    targets = cfg.target_modules if cfg.target_modules is not None else default_targets(model)
    if not targets:
        raise LoRAError(f"model.lora: {type(model).__name__} has no nn.Linear inside repeated blocks to adapt by "
                        "default; name the modules in model.lora.target_modules")
    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets)


def add_lora(model: nn.Module, cfg: Any, probe: Callable[[nn.Module], object],
             base_dtype: torch.dtype = torch.float32, what: str = "the model"):
    """`model` wrapped in a peft `PeftModel` with `model.lora`'s adapters: every module `target_modules` matches is
    adapted, and must take part in `probe(peft_model)` (one small forward); only the adapters train, in fp32; the
    frozen base is cast to `base_dtype` (BatchNorm layers keep fp32: their running statistics are fp32)."""
    from peft import get_peft_model

    config = peft_config(cfg, model)
    on_meta = build.loaded_on_meta(model)
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as exn:
        first = " ".join(str(exn).split())
        raise LoRAError(f"model.lora.target_modules={_shown(config.target_modules)} cannot adapt {what}: {first[:400]}"
                        " (list the model's modules with model.named_modules())") from None
    if on_meta:   # the meta-device start: weights read after sharding, the probe run on the sharded model
        _sources_through_peft(peft_model, what)
        setattr(peft_model, PROBE_ATTR, (probe, what))
    else:
        _check_used(peft_model, probe, what)
    _hold_base(peft_model, base_dtype)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log.info("model.lora on %s: r=%d, alpha=%g, dropout=%g, %d modules adapted (%s); %d trainable parameters of %d "
             "(%.2f%%), the frozen base in %s", what, cfg.r, cfg.alpha, cfg.dropout, len(adapted_layers(peft_model)),
             _shown(config.target_modules), trainable, total, 100 * trainable / max(total, 1),
             str(base_dtype).replace("torch.", ""))
    return peft_model


def _shown(targets: Any) -> str:
    if isinstance(targets, str):
        return repr(targets)
    items = sorted(targets)
    return "[" + ", ".join(items[:6]) + (f", ... ({len(items)} names)" if len(items) > 6 else "") + "]"


def adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> peft LoRA layer, the outermost only (peft adapts a MultiheadAttention's out_proj through the
    attention layer, which merges it in its own forward)."""
    from peft.tuners.lora import LoraLayer

    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    return {n: m for n, m in layers.items() if not any(n.startswith(o + ".") for o in layers if o != n)}


def _sources_through_peft(peft_model: nn.Module, what: str) -> None:
    """A tower built on the meta device (models/build.py), wrapped by peft there: its weights source under peft's
    names (a wrapped Linear's `x.weight` is now `x.base_layer.weight`), and the adapters' initial values as peft
    gives them (`reset_lora_parameters`: A kaiming-uniform with a=sqrt(5), B zeros), drawn whole from a generator
    seeded with the run's seed and the tower's name, so every rank holds the same adapters and keeps its rows."""
    for name, module in peft_model.named_modules():
        source = getattr(module, build.WEIGHTS_ATTR, None)
        if isinstance(source, build.WeightsSource):
            names = {key: key.replace(".base_layer.", ".") for key in module.state_dict(keep_vars=True)}
            build.attach(module, source.renamed({new: old for new, old in names.items() if old in source.keys}))
    seed = (torch.initial_seed() + zlib.crc32(what.encode())) % 2**63
    generator = torch.Generator().manual_seed(seed)
    initial: dict[str, torch.Tensor] = {}
    for name, p in peft_model.named_parameters():
        if re.search(r"\.lora_A\.[^.]+\.weight$", name):
            initial[name] = nn.init.kaiming_uniform_(torch.empty(p.shape), a=math.sqrt(5), generator=generator)
        elif re.search(r"\.lora_B\.[^.]+\.weight$", name):
            initial[name] = torch.zeros(p.shape)
        elif p.is_meta and p.requires_grad:
            raise LoRAError(f"model.lora on {what}: peft added {name}, which the meta-device start cannot initialise "
                            "(only lora_A and lora_B): use train.sharding=ddp, or leave out what adds it")
    build.attach(peft_model, build.HeldTensors(initial))


def probe_after_start(model: nn.Module, run: Callable[[Callable[[], object]], object] | None = None) -> None:
    """The check `add_lora` defers for a tower wrapped on the meta device (every adapted module takes part in the
    probe), once the model is sharded and filled; `run(fn)` runs `fn` as a forward of the sharded model (every rank
    calls this: FSDP's all-gathers are collectives)."""
    for module in list(model.modules()):
        if hasattr(module, PROBE_ATTR):
            probe, what = getattr(module, PROBE_ATTR)
            delattr(module, PROBE_ATTR)
            _check_used(module, probe, what, run)


def _check_used(model: nn.Module, probe: Callable[[nn.Module], object], what: str,
                run: Callable[[Callable[[], object]], object] | None = None) -> None:
    """Refuse adapted modules that the model's forward never calls (their weight is read directly elsewhere): their
    adapters would train nothing and change no output."""
    layers = adapted_layers(model)
    called: set[str] = set()
    handles = [m.register_forward_hook(lambda mod, args, out, name=n: called.add(name)) for n, m in layers.items()]
    was_training = model.training
    model.eval()  # no BatchNorm statistics updated, no dropout drawn: the probe leaves the model as it was
    # a deferred probe meets a base held in bf16 already (a convolution's fp32 input would not meet its weights): it
    # computes under bf16 autocast, as training and evaluation do
    frozen = next((p for p in model.parameters() if not p.requires_grad and p.is_floating_point()), None)
    bf16 = frozen is not None and frozen.dtype == torch.bfloat16
    try:
        with torch.no_grad(), torch.autocast(frozen.device.type if bf16 else "cpu", torch.bfloat16, enabled=bf16):
            if run is None:
                probe(model)
            else:
                run(lambda: probe(model))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    unused = sorted(set(layers) - called)
    if unused:
        short = [re.sub(r"^base_model\.model\.", "", n) for n in unused]
        raise LoRAError(f"model.lora.target_modules matches {len(unused)} module(s) of {what} whose forward the model "
                        f"never calls (their weight is read directly, e.g. the out_proj of an nn.MultiheadAttention by "
                        f"F.multi_head_attention_forward), so an adapter there would change no output: {', '.join(short[:4])}"
                        f"{', ...' if len(short) > 4 else ''}; target the module that uses them (e.g. the attention "
                        "layer itself) or leave them out")


@torch.no_grad()
def _hold_base(model: nn.Module, dtype: torch.dtype) -> None:
    """The frozen floating-point parameters in `dtype`, the adapters in fp32 (their updates are small against W)."""
    batchnorm = {id(p) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                 for p in m.parameters()}
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
        elif p.is_floating_point() and id(p) not in batchnorm:
            p.data = p.data.to(dtype)


def base_dtype_for(precision: str, model: nn.Module) -> torch.dtype:
    """The dtype the frozen base is held in: bf16 where training computes in bf16 and the model has no BatchNorm
    (whose fp32 running statistics take fp32 weights; FSDP then gathers fp32 too), else fp32."""
    batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return torch.bfloat16 if precision == "bf16" and not batchnorm else torch.float32


def save_adapter(peft_model: nn.Module, folder: str | Path, trained: dict[str, torch.Tensor] | None = None) -> Path:
    """peft's adapter folder (adapter_config.json + adapter_model.safetensors), as `PeftModel.save_pretrained`
    writes it: `PeftModel.from_pretrained(base, folder)` loads it onto the base model. `trained`: the adapters
    under the PeftModel's own names, gathered whole (a sharded model's state dict holds shards)."""
    folder = Path(folder)
    peft_model.save_pretrained(str(folder), safe_serialization=True,
                               **({"state_dict": trained} if trained is not None else {}))
    return folder


def trained_under(trained: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The gathered trainable tensors of the sub-module at `prefix` (`clip.clip.`), under its own names."""
    return {k[len(prefix):]: v for k, v in trained.items() if k.startswith(prefix)}


def merged_model(peft_model: nn.Module) -> nn.Module:
    """An fp32 copy of the base model with the adapters merged into its weights (peft's merge_and_unload): W + (alpha
    / r) B A in fp32 over the base's weights upcast. The live model is left as it is."""
    copied = copy.deepcopy(peft_model)
    copied.float()
    return copied.merge_and_unload()


def is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


# ----------------------------------------------------------------------------- the two tasks' towers


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def check_sharding(model: nn.Module, sharding: str) -> None:
    """peft's nn.MultiheadAttention adapter replaces the layer's in_proj_weight during each forward and holds parameters
    outside the module tree FSDP2 walks (fully_shard fails on it): refused under fsdp, in one line."""
    from peft.tuners.lora.layer import MultiheadAttention as LoraAttention

    if sharding != "fsdp":
        return
    attention = [re.sub(r"^.*base_model\.model\.", "", n) for n, m in adapted_layers(model).items()
                 if isinstance(m, LoraAttention)]
    if attention:
        raise LoRAError(f"model.lora.target_modules adapts {len(attention)} nn.MultiheadAttention layer(s) "
                        f"({', '.join(attention[:2])}{', ...' if len(attention) > 2 else ''}), which train.sharding=fsdp "
                        "cannot shard (peft's adapter swaps the layer's weights in its forward): leave them out of "
                        "model.lora.target_modules (the default adapts the Linear layers) or use train.sharding=ddp")


def adapt_clip(raw: nn.Module, cfg: Any, preprocess: Callable, tokenizer: Callable, precision: str,
               sharding: str = "ddp") -> torch.dtype:
    """LoRA on a `RawCLIP`'s open_clip model, in place (`raw.clip` becomes a PeftModel over both towers); the probe
    encodes one blank image and one caption. Returns the dtype the frozen base is held in."""
    from PIL import Image

    clip = raw.clip
    image = preprocess(Image.new("RGB", (32, 32))).unsqueeze(0)
    text = tokenizer(["a photo"])
    dtype = base_dtype_for(precision, clip)

    def probe(m: nn.Module) -> object:   # the model's device when it runs (a meta-built one's is known after the start)
        device = _device_of(m)
        return m.encode_image(image.to(device)), m.encode_text(text.to(device))

    raw.clip = add_lora(clip, cfg, probe, dtype, what=f"the open_clip model {type(clip).__name__}")
    check_sharding(raw.clip, sharding)
    return dtype


def adapt_text(encoder: nn.Module, cfg: Any, precision: str) -> torch.dtype:
    """LoRA on a `BiEncoder`'s tower(s), in place (each tower becomes a PeftModel with its own adapters); the modules
    after Pooling (a Dense projection) stay frozen with the base. Returns the dtype the frozen base is held in."""
    dtype = base_dtype_for(precision, encoder)
    for side in ("query", "passage") if encoder.passage_model is not None else ("query",):
        tower = encoder.tower(side)
        batch = {k: v for k, v in encoder.tokenize(["a probe"], side).items()
                 if k in ("input_ids", "attention_mask", "token_type_ids")}
        adapted = add_lora(tower, cfg, lambda m, batch=batch: m(**{k: v.to(_device_of(m)) for k, v in batch.items()}),
                           dtype, what=f"the {side} tower {type(tower).__name__}")
        setattr(encoder, "query_model" if side == "query" else "passage_model", adapted)
    for head in (encoder.query_head, encoder.passage_head):
        if head is not None:
            head.requires_grad_(False)
    _hold_base(encoder, dtype)
    return dtype


def merged_encoder(encoder: nn.Module) -> nn.Module:
    """A BiEncoder like `encoder` whose tower(s) are the merged fp32 models (the heads copied in fp32): what
    `BiEncoder.save_pretrained` writes as the sentence-transformers folder."""
    from magclip.models.text import BiEncoder

    def plain(model: nn.Module | None) -> nn.Module | None:
        return None if model is None else merged_model(model) if is_peft(model) else copy.deepcopy(model).float()

    head = copy.deepcopy(encoder.query_head).float()
    passage_head = None if encoder.passage_head is None else copy.deepcopy(encoder.passage_head).float()
    return BiEncoder(plain(encoder.query_model), encoder.tokenizer, encoder.settings, plain(encoder.passage_model),
                     encoder.passage_tokenizer if encoder.passage_model is not None else None,
                     encoder.default_scorer, encoder.source, query_head=head, passage_head=passage_head)


def save_text_adapters(encoder: nn.Module, folder: str | Path, trained: dict[str, torch.Tensor] | None = None,
                       prefix: str = "encoder.") -> None:
    """adapter/ (one tower) or adapter/query + adapter/passage (two), each peft's folder; `trained`: the module's
    trainable tensors gathered whole, the encoder's at `prefix`."""
    folder = Path(folder)

    def own(side: str) -> dict[str, torch.Tensor] | None:
        return None if trained is None else trained_under(trained, f"{prefix}{side}_model.")

    if encoder.passage_model is None:
        save_adapter(encoder.query_model, folder, own("query"))
        return
    save_adapter(encoder.query_model, folder / "query", own("query"))
    save_adapter(encoder.passage_model, folder / "passage", own("passage"))
