"""A magclip step folder opened the way plain open_clip opens it (`local-dir:STEP`, or a model name with the
folder's weights file) scores with the scorers magclip.json records, as `--checkpoint` does; `mode` overrides
and the results say which rule applied. A model name that does not fit the weights is one line, exit 2.

One tiny qnorm run (tiny-resnet, 4 steps on the embedded synthetic scenes) is trained here; the val shards
are read directly (tar + PIL), so the comparison does not depend on the data pipeline.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import open_clip
import pytest
import torch
from builders import ROOT, tiny_run
from PIL import Image

from magclip.config import load_config
from magclip.evaluation.checkpoint import NO_RECORD, EvalModel, load_checkpoint, load_open_clip
from magclip.metrics.retrieval import retrieval_metrics
from magclip.models.clip import (
    CHECKPOINT_META,
    OPEN_CLIP_CONFIG,
    WEIGHTS_FILE,
    create_clip,
    save_open_clip_folder,
)
from magclip.training.clip import train_clip

pytestmark = pytest.mark.usefixtures("one_thread")

QNORM = {"mode": "qnorm", "gamma_q": 1.0, "gamma_d": 0.0}
COSINE = {"mode": "cosine", "gamma_q": 1.0, "gamma_d": 1.0}


@pytest.fixture(scope="module")
def run(one_thread, tmp_path_factory) -> tuple[Path, Path]:
    """(the step folder of a tiny qnorm run as the trainer writes it, its synthetic data folder)."""
    out, synth = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("synthetic")
    train_clip(load_config(None, tiny_run(out, synth, "q", "loss.i2t=qnorm", "loss.t2i=qnorm", "train.max_steps=4",
                                          "data.synthetic.num_val=64", train=128, epochs=1)))
    checkpoints = out / "q" / "checkpoints"
    step = checkpoints / (checkpoints / "latest").read_text().strip()
    assert json.loads((step / CHECKPOINT_META).read_text())["scorers"]["i2t"]["mode"] == "qnorm"
    return step, next(synth.iterdir())


@pytest.fixture(scope="module")
def samples(run) -> list[tuple[Image.Image, str]]:
    """The val scenes (image, caption) in shard order."""
    out = []
    for shard in sorted(run[1].glob("val-*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        for name in sorted(n for n in members if n.endswith(".txt")):
            key = name[:-4]
            image = next(members[k] for k in members if k.startswith(key + ".") and not k.endswith((".txt", ".json")))
            out.append((Image.open(io.BytesIO(image)).convert("RGB"), members[name].decode()))
    assert len(out) == 64
    return out


def encode(model: EvalModel, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw image and caption features, as the evaluator encodes them (the model's own preprocess/tokenizer)."""
    images = torch.stack([model.preprocess(img) for img, _ in samples])
    with torch.no_grad():
        return model.clip.encode_image(images), model.clip.encode_text(model.tokenizer([c for _, c in samples]))


def scored(model: EvalModel, samples) -> dict[str, float]:
    img, txt = encode(model, samples)
    return dict(retrieval_metrics(img, txt, i2t=model.scorers["i2t"], t2i=model.scorers["t2i"]))


def scorer_dicts(model: EvalModel) -> dict[str, dict]:
    return {d: s.to_dict() for d, s in model.scorers.items()}


def test_local_dir_of_a_step_folder_scores_like_its_checkpoint(run, samples):
    step = run[0]
    own = load_checkpoint(step)
    folder = load_open_clip(f"local-dir:{step}", None, mode=None)
    assert scorer_dicts(folder) == scorer_dicts(own) == {"i2t": QNORM, "t2i": QNORM}
    assert folder.source["scorers_from"] == f"{CHECKPOINT_META} (local-dir:{step})"
    assert folder.source["checkpoint"] == str(step) and folder.source["pretrained"] == str(step / WEIGHTS_FILE)
    assert folder.source["logit_scale"] == own.source["logit_scale"]
    expected = scored(own, samples)
    assert scored(folder, samples) == expected  # the same numbers as --checkpoint, exactly

    cosine = load_open_clip(f"local-dir:{step}", None, mode="cosine")
    assert scorer_dicts(cosine) == {"i2t": COSINE, "t2i": COSINE}
    assert cosine.source["scorers_from"] == "--mode cosine"
    as_cosine = scored(cosine, samples)
    # the case separates the modes (qnorm t2i keeps the image norms; cosine drops them)
    assert as_cosine["text_to_image_mean_rank"] != expected["text_to_image_mean_rank"]


def test_local_dir_model_is_open_clips_own(run, samples):
    """Parity with the peer: the model evaluated is the one plain open_clip builds from the folder."""
    step = run[0]
    folder = load_open_clip(f"local-dir:{step}", None)
    peer, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{step}")
    peer.eval()
    images = torch.stack([preprocess(img) for img, _ in samples[:8]])
    texts = open_clip.get_tokenizer(f"local-dir:{step}")([c for _, c in samples[:8]])
    with torch.no_grad():
        assert torch.equal(folder.clip.encode_image(images), peer.encode_image(images, normalize=False))
        assert torch.equal(folder.clip.encode_text(texts), peer.encode_text(texts, normalize=False))


def test_pretrained_weights_of_a_step_folder_use_its_scorers(run, samples, tmp_path):
    step = run[0]
    weights = str(step / WEIGHTS_FILE)
    named = load_open_clip("tiny-resnet", weights, mode=None)
    assert scorer_dicts(named) == {"i2t": QNORM, "t2i": QNORM}
    assert named.source["scorers_from"] == f"{CHECKPOINT_META} (--pretrained {weights})"
    assert scored(named, samples) == scored(load_checkpoint(step), samples)
    # the same weights copied elsewhere: nothing records how they were trained, so open_clip's cosine
    copy = tmp_path / "copy.safetensors"
    shutil.copyfile(weights, copy)
    plain = load_open_clip("tiny-resnet", str(copy), mode=None)
    assert scorer_dicts(plain) == {"i2t": COSINE, "t2i": COSINE}
    assert plain.source == {"checkpoint": None, "pretrained": str(copy), "scorers_from": NO_RECORD}
    # ... and a plain open_clip folder (no magclip.json) is cosine too
    hub = tmp_path / "hub"
    hub.mkdir()
    for name in (WEIGHTS_FILE, OPEN_CLIP_CONFIG):
        shutil.copyfile(step / name, hub / name)
    assert load_open_clip(f"local-dir:{hub}", None).source["scorers_from"] == NO_RECORD


def test_pretrained_weights_of_a_sigmoid_step_folder_get_its_bias(tmp_path):
    """A sigmoid-loss step folder's weights hold open_clip's logit_bias: with the folder's own weights file the
    model is built with the recorded bias (as `--checkpoint` does), so the weights fit the model name."""
    step = tmp_path / "step"
    bundle = create_clip("tiny-resnet", init_logit_bias=-10.0)
    save_open_clip_folder(bundle.model, step, bundle.model_name, logit_scale=10.0, logit_bias=-10.0)
    (step / CHECKPOINT_META).write_text(json.dumps({"model": "tiny-resnet", "loss_type": "siglip", "logit_scale": 10.0,
                                                    "logit_bias": -10.0, "scorers": {"i2t": QNORM, "t2i": QNORM}}))
    for model, pretrained in (("tiny-resnet", str(step / WEIGHTS_FILE)), (f"local-dir:{step}", None)):
        loaded = load_open_clip(model, pretrained)
        assert loaded.clip.clip.logit_bias.item() == -10.0 and loaded.source["loss_type"] == "siglip"
        assert scorer_dicts(loaded) == {"i2t": QNORM, "t2i": QNORM}
    copy = tmp_path / "copy.safetensors"  # without its record the bias is a key the model does not have
    shutil.copyfile(step / WEIGHTS_FILE, copy)
    with pytest.raises(ValueError, match=f"checkpoint {copy} does not fit model 'tiny-resnet'"):
        load_open_clip("tiny-resnet", str(copy))


def test_folders_open_clip_would_misread_are_refused(run, tmp_path):
    step = run[0]
    with pytest.raises(ValueError, match="goes with a model name: local-dir:.* loads the weights in its folder"):
        load_open_clip(f"local-dir:{step}", str(step / WEIGHTS_FILE))
    no_weights = tmp_path / "config_only"
    no_weights.mkdir()
    shutil.copyfile(step / OPEN_CLIP_CONFIG, no_weights / OPEN_CLIP_CONFIG)
    with pytest.raises(FileNotFoundError, match="no weights there .* open_clip would build an untrained model"):
        load_open_clip(f"local-dir:{no_weights}", None)
    legacy = tmp_path / "legacy"  # a step folder written before the hub layout: model.pt + magclip.json
    legacy.mkdir()
    shutil.copyfile(step / CHECKPOINT_META, legacy / CHECKPOINT_META)
    with pytest.raises(FileNotFoundError, match=f"no {OPEN_CLIP_CONFIG} there .* --checkpoint {legacy}"):
        load_open_clip(f"local-dir:{legacy}", None)
    with pytest.raises(ValueError, match="gamma_q/gamma_d go with mode fixed or learnable"):
        load_open_clip(f"local-dir:{step}", None, gamma_q=0.3)


def test_a_model_that_does_not_fit_the_weights_is_one_line(run, tmp_path):
    step, synth = run
    weights = step / WEIGHTS_FILE
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "eval" / "zeroshot.py"), "--model", "ViT-B-32", "--pretrained",
                           str(weights), "--data", str(synth / "val-000000.tar"), "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    lines = [line for line in proc.stderr.splitlines() if " INFO " not in line and line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and f"checkpoint {weights} does not fit model 'ViT-B-32'" in lines[0]
    assert f"evaluate it with --checkpoint {step}" in lines[0]
    assert not out.exists()

