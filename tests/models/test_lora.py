"""model.lora (magclip/models/lora.py): the default targets come from the towers' structure, every adapted module
changes the output (and one that cannot is refused), the merged model written as the usual open_clip or
sentence-transformers folder encodes like the adapter model, and peft loads the adapter folder."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from magclip.config import ConfigError, LoRAConfig, load_config, load_text_config
from magclip.models.clip import create_clip, save_open_clip_folder
from magclip.models.lora import (
    LoRAError,
    adapt_clip,
    adapt_text,
    adapted_layers,
    check_sharding,
    default_targets,
    merged_encoder,
    merged_model,
    save_adapter,
)
from magclip.models.text import BiEncoder
from builders import make_tiny_bert, make_tiny_decoder

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ["the cat sat on the mat", "a small red protein", "brain white matter study"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = tmp_path_factory.mktemp("towers")
    return {"bert": make_tiny_bert(out / "bert"), "decoder": make_tiny_decoder(out / "decoder")}


def clip_inputs(bundle):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    images = torch.stack([bundle.preprocess_val(Image.fromarray(
        torch.randint(0, 255, (32, 32, 3), generator=g, dtype=torch.uint8).numpy())) for _ in range(3)])
    return images, bundle.tokenizer(TEXTS)


def randomise_adapters(model: nn.Module, seed: int = 1) -> None:
    """lora_B starts at zero (the adapter model equals the base): random values make every adapter count."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def lora(r: int = 4, targets=None) -> LoRAConfig:
    return LoRAConfig(r=r, alpha=8.0, dropout=0.0, target_modules=targets)


def encode_clip(raw, images, texts) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([raw.encode_image(images), raw.encode_text(texts)], dim=1)


def test_default_targets_are_the_linear_layers_of_the_repeated_blocks(folders):
    assert default_targets(create_clip("tiny-vit").model.clip) == ["mlp.c_fc", "mlp.c_proj"]  # not attn.out_proj
    bert = BiEncoder.from_pretrained(folders["bert"]).query_model
    assert default_targets(bert) == ["attention.output.dense", "attention.self.key", "attention.self.query",
                                     "attention.self.value", "intermediate.dense", "output.dense"]  # not pooler.dense
    decoder = BiEncoder.from_pretrained(folders["decoder"], pooling="last").query_model
    assert default_targets(decoder) == ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                                        "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]


def test_every_adapted_clip_module_changes_the_output():
    """Each adapter alone (its lora_B non-zero, the others zero) moves the features: none is dead weight, the
    MultiheadAttention adapters (target 'attn') included."""
    torch.manual_seed(0)
    bundle = create_clip("tiny-vit")
    images, texts = clip_inputs(bundle)
    adapt_clip(bundle.model, lora(targets=["attn", "mlp.c_fc", "mlp.c_proj"]), bundle.preprocess_val,
               bundle.tokenizer, "fp32")
    base = encode_clip(bundle.model, images, texts)
    layers = adapted_layers(bundle.model.clip)
    assert len(layers) == 15  # 3 + 2 blocks x (attn, c_fc, c_proj)
    for name, layer in layers.items():
        randomise_adapters(layer)
        assert (encode_clip(bundle.model, images, texts) - base).abs().max() > 1e-4, name
        with torch.no_grad():
            for n, p in layer.named_parameters():
                if "lora_B" in n:
                    p.zero_()


@pytest.mark.parametrize("kind", ["bert", "decoder"])
def test_every_adapted_text_module_changes_the_output(folders, kind):
    encoder = BiEncoder.from_pretrained(folders[kind], pooling="last" if kind == "decoder" else None)
    adapt_text(encoder, lora(), "fp32")
    base = encoder.encode(TEXTS, "query")
    layers = adapted_layers(encoder.query_model)
    assert len(layers) == (12 if kind == "bert" else 14)
    for name, layer in layers.items():
        randomise_adapters(layer)
        assert (encoder.encode(TEXTS, "query") - base).abs().max() > 1e-5, name
        with torch.no_grad():
            for n, p in layer.named_parameters():
                if "lora_B" in n:
                    p.zero_()


def test_a_module_the_forward_never_calls_is_refused():
    """out_proj of an nn.MultiheadAttention is read by weight (F.multi_head_attention_forward): a LoRA there would
    change nothing, so it is refused, naming it."""
    bundle = create_clip("tiny-vit")
    with pytest.raises(LoRAError, match=r"never calls .*visual\.transformer\.resblocks\.0\.attn\.out_proj"):
        adapt_clip(bundle.model, lora(targets=["out_proj"]), bundle.preprocess_val, bundle.tokenizer, "fp32")


@pytest.mark.parametrize("targets", [["nothing_here"], "visual\\.nothing.*"])
def test_targets_that_match_no_module_are_refused(targets):
    bundle = create_clip("tiny-vit")
    with pytest.raises(LoRAError, match="model.lora.target_modules=.* cannot adapt the open_clip model") as err:
        adapt_clip(bundle.model, lora(targets=targets), bundle.preprocess_val, bundle.tokenizer, "fp32")
    assert "\n" not in str(err.value)


def test_peft_attention_adapters_are_refused_under_fsdp():
    bundle = create_clip("tiny-vit")
    adapt_clip(bundle.model, lora(targets=["attn"]), bundle.preprocess_val, bundle.tokenizer, "fp32", "ddp")
    with pytest.raises(LoRAError, match="nn.MultiheadAttention .* train.sharding=fsdp cannot shard"):
        check_sharding(bundle.model.clip, "fsdp")


@pytest.mark.parametrize("override, message", [
    ("model.lora.r=-1", "model.lora.r must be >= 0"),
    ("model.lora.alpha=0", "model.lora.alpha must be > 0"),
    ("model.lora.dropout=1", r"model.lora.dropout must be in \[0, 1\)"),
    ("model.lora.target_modules=[]", "model.lora.target_modules=\\[\\]: give a list"),
    ("model.lock_text=true", "model.lock_text=true: LoRA freezes every weight"),
])
def test_config_refusals(override, message):
    load_config(None, ["model.lora.r=4", "train.save_full_model=never"])  # LoRA writes its adapters whatever it says
    load_config(None, ["model.lora.r=4", "train.precision=bf16"])  # a bf16 base evaluates in bf16: no refusal
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.lora.r=4", override])
    if not override.startswith("model.lock"):
        with pytest.raises(ConfigError, match=message):
            load_text_config(None, ["data.train=x.jsonl", "model.lora.r=4", override])


def test_the_merged_open_clip_folder_encodes_like_the_adapter_model(tmp_path):
    """open_clip loads the merged folder by itself; its features equal the adapter model's at fp32 tolerance, and
    peft's PeftModel.from_pretrained reads the adapter folder back onto the base to the same features."""
    import open_clip
    from peft import PeftModel

    torch.manual_seed(0)
    bundle = create_clip("tiny-vit")
    images, texts = clip_inputs(bundle)
    base = copy.deepcopy(bundle.model.clip)
    base_features = encode_clip(bundle.model.__class__(copy.deepcopy(base)), images, texts)
    adapt_clip(bundle.model, lora(targets=["attn", "mlp.c_fc", "mlp.c_proj"]), bundle.preprocess_val,
               bundle.tokenizer, "fp32")
    randomise_adapters(bundle.model.clip)
    adapter_features = encode_clip(bundle.model, images, texts)
    save_open_clip_folder(merged_model(bundle.model.clip), tmp_path, bundle.model_name)
    save_adapter(bundle.model.clip, tmp_path / "adapter")
    plain, _, _ = open_clip.create_model_and_transforms(f"local-dir:{tmp_path}")
    plain.eval()
    with torch.no_grad():
        merged_features = torch.cat([plain.encode_image(images), plain.encode_text(texts)], dim=1)
        reloaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        peft_features = torch.cat([reloaded.encode_image(images), reloaded.encode_text(texts)], dim=1)
    assert float((adapter_features - base_features).abs().max()) > 1e-3  # the adapters change the features
    torch.testing.assert_close(merged_features, adapter_features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(peft_features, adapter_features, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, shared", [("bert", True), ("decoder", False)])
def test_the_merged_sentence_transformers_folder_encodes_like_the_adapter_model(folders, tmp_path, kind, shared):
    from sentence_transformers import SentenceTransformer

    pooling = "last" if kind == "decoder" else None
    encoder = BiEncoder.from_pretrained(folders[kind], pooling=pooling, shared=shared)
    adapt_text(encoder, lora(), "fp32")
    randomise_adapters(encoder)
    queries, docs = encoder.encode(TEXTS, "query"), encoder.encode(TEXTS, "passage")
    merged_encoder(encoder).save_pretrained(tmp_path / "model")
    st = SentenceTransformer(str(tmp_path / "model"), device="cpu")
    torch.testing.assert_close(torch.as_tensor(st.encode_query(TEXTS)), queries, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.as_tensor(st.encode_document(TEXTS)), docs, rtol=1e-5, atol=1e-5)
    if not shared:
        assert (queries - docs).abs().max() > 1e-4  # two towers, each its own adapters
