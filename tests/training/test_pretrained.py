"""Fine-tuning from a checkpoint (`model.pretrained`): every form a user has at hand is accepted, and the
run starts at the checkpoint's logit scale, as open_clip_train does, unless the config sets one."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import safetensors.torch
import torch

from magclip.config import load_config
from magclip.models.clip import WEIGHTS_FILE
from magclip.training.clip import train_clip
from builders import tiny_run

pytestmark = pytest.mark.usefixtures("one_thread")


def args(out: Path, synth: Path, name: str, *extra: str) -> list[str]:
    return tiny_run(out, synth, name, "train.max_steps=1", *extra, train=64, epochs=1)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, Path]:
    """A finished run whose checkpoint holds logit scale 50 (frozen, so it is exactly 50)."""
    out, synth = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("synthetic")
    train_clip(load_config(None, args(out, synth, "src", "loss.logit_scale_init=50", "loss.logit_scale_learnable=false")))
    return out / "src", synth


def first_scale(run_dir: Path) -> float:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["logit_scale"]


def forms(run: Path, tmp_path: Path) -> dict[str, Path]:
    step = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    state = safetensors.torch.load_file(step / WEIGHTS_FILE)
    bare, wrapped = tmp_path / "bare.pt", tmp_path / "epoch_1.pt"
    torch.save(state, bare)
    torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in state.items()}}, wrapped)  # open_clip_train's
    return {"step folder": step, "latest": run / "checkpoints" / "latest", "run folder": run,
            "checkpoints folder": run / "checkpoints", "safetensors": step / WEIGHTS_FILE, "bare state_dict": bare,
            "open_clip_train": wrapped}


@pytest.mark.parametrize("form", ["step folder", "latest", "run folder", "checkpoints folder", "safetensors",
                                  "bare state_dict", "open_clip_train"])
def test_each_checkpoint_form_is_accepted_and_keeps_the_scale(source, tmp_path, form, caplog):
    run, synth = source
    given = forms(run, tmp_path)[form]
    with caplog.at_level(logging.INFO, logger="magclip.clip"):
        train_clip(load_config(None, args(tmp_path, synth, "ft", f"model.pretrained={given}",
                                          "loss.logit_scale_learnable=false")))
    assert first_scale(tmp_path / "ft") == pytest.approx(50.0, rel=1e-5)  # not the cosine default 14.29
    assert f"model.pretrained {given}: logit scale 50 taken from it" in caplog.text


def test_the_config_overrides_the_checkpoints_scale(source, tmp_path):
    run, synth = source
    train_clip(load_config(None, args(tmp_path, synth, "ft", f"model.pretrained={run}", "loss.logit_scale_init=20",
                                      "loss.logit_scale_learnable=false")))
    assert first_scale(tmp_path / "ft") == pytest.approx(20.0, rel=1e-6)
