"""The main job with the sigmoid loss (`loss.type=siglip`): every mode trains, a resume is bit-identical,
the trained bias is a checkpointed parameter that plain open_clip loads (in a process that never imports
magclip) with features identical to magclip's, zero-shot evaluation reads the checkpoint, and CLIP-only
keys are refused by name."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from magclip.config import ConfigError, load_config
from magclip.evaluation.checkpoint import load_checkpoint
from magclip.training.clip import train_clip
from builders import copy_run_at, tiny_run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def synth_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("synthetic")


def args(out: Path, synth: Path, name: str, *extra: str) -> list[str]:
    return tiny_run(out, synth, name, "loss.type=siglip", *extra)


@pytest.mark.parametrize("mode", ["cosine", "dot", "qnorm", "dnorm", "learnable"])
def test_every_mode_trains(tmp_path, synth_root, mode, caplog):
    caplog.set_level(logging.INFO, logger="magclip.temperature")
    results = train_clip(load_config(None, args(tmp_path, synth_root, mode, f"loss.mode={mode}", "train.max_steps=2")))
    assert results["loss_type"] == "siglip" and results["scorers"]["i2t"]["mode"] == mode
    assert results["steps"] == 2 and results["logit_bias"] != -10.0  # learnable: it moved
    # magclip.temperature: cosine at 10; a raw side at cosine's effective temperature on the first batch
    matched = [float(m.group(1)) for r in caplog.records
               if (m := re.match(r"logit scale set from initial norms: ([0-9.e+-]+)", r.getMessage()))]
    assert len(matched) == (0 if mode == "cosine" else 1) and (mode == "cosine" or matched[0] != 1.0)
    start = 10.0 if mode == "cosine" else matched[0]
    records = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    assert abs(records[0]["logit_scale"] - start) < 0.01 * start + 0.01 and "logit_bias" in records[0]
    assert "image_to_text_R@1" in results["metrics"]


def test_a_raw_side_can_start_at_scale_1_as_asked(tmp_path, synth_root):
    """The measured default (matched) gives way to an explicit setting: from_norms=false or a given init."""
    for name, extra in (("not_matched", "loss.logit_scale_from_norms=false"), ("given", "loss.logit_scale_init=2.0")):
        train_clip(load_config(None, args(tmp_path, synth_root, name, "loss.mode=dot", "train.max_steps=1", extra)))
        first = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
        assert abs(first["logit_scale"] - {"not_matched": 1.0, "given": 2.0}[name]) < 0.05


def test_resume_is_bit_identical(tmp_path, synth_root):
    whole = train_clip(load_config(None, args(tmp_path, synth_root, "whole", "loss.mode=qnorm",
                                              "train.checkpoint_every=4")))
    copy_run_at(tmp_path / "whole", tmp_path / "part", "step_00000004")
    resumed = train_clip(load_config(None, args(tmp_path, synth_root, "part", "loss.mode=qnorm",
                                                "train.checkpoint_every=4", "train.resume=latest")))
    assert resumed["weights_sha256_by_rank"] == whole["weights_sha256_by_rank"]
    assert resumed["logit_bias"] == whole["logit_bias"]


PLAIN_OPEN_CLIP = """
import json, sys
import open_clip, torch
assert "magclip" not in sys.modules
folder, images, texts = sys.argv[1], sys.argv[2], sys.argv[3]
model, _, _ = open_clip.create_model_and_transforms("local-dir:" + folder)
model.eval()
with torch.no_grad():
    img = model.encode_image(torch.load(images, weights_only=True))
    txt = model.encode_text(torch.load(texts, weights_only=True))
torch.save({"image": img, "text": txt}, folder + "/../plain_features.pt")
print(json.dumps({"logit_bias": float(model.logit_bias), "logit_scale": float(model.logit_scale.exp())}))
"""


def test_plain_open_clip_loads_the_bias_and_the_features(tmp_path, synth_root):
    results = train_clip(load_config(None, args(tmp_path, synth_root, "plain", "loss.mode=dnorm",
                                                "train.max_steps=3")))
    step = Path(results["checkpoint"])
    model = load_checkpoint(step)  # magclip's own reader: a sigmoid-loss checkpoint with its bias
    assert model.source["logit_bias"] == pytest.approx(results["logit_bias"])
    g = torch.Generator().manual_seed(0)
    images = torch.randn(4, 3, 32, 32, generator=g)
    texts = model.tokenizer(["a red circle", "two blue squares", "a green triangle", "three shapes"])
    torch.save(images, tmp_path / "images.pt")
    torch.save(texts, tmp_path / "texts.pt")
    proc = subprocess.run([sys.executable, "-c", PLAIN_OPEN_CLIP, str(step), str(tmp_path / "images.pt"),
                           str(tmp_path / "texts.pt")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plain["logit_bias"] == pytest.approx(results["logit_bias"], abs=1e-6)
    assert plain["logit_scale"] == pytest.approx(results["logit_scale"], rel=1e-5)
    feats = torch.load(step.parent / "plain_features.pt", weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(feats["image"], model.clip.encode_image(images))
        torch.testing.assert_close(feats["text"], model.clip.encode_text(texts))
    # the scorers: the one trained (image as query) and, for text->image, the same score transposed
    assert model.scorers["i2t"].mode == "dnorm" and model.scorers["t2i"].mode == "qnorm"


@pytest.mark.parametrize("key", ["loss.i2t_weight=0.5", "loss.t2i=qnorm", "loss.share_learnable=true"])
def test_clip_only_keys_are_refused_by_name(key):
    with pytest.raises(ConfigError, match=f"{key.split('=')[0]} is a key of loss.type=clip"):
        load_config(None, ["loss.type=siglip", key])
    with pytest.raises(ConfigError, match="loss.mode is a key of loss.type=siglip"):
        load_config(None, ["loss.mode=qnorm"])
