"""The offline merge of a LoRA step folder (`magclip-consolidate STEP --merge`, magclip/training/merge.py) equals the
in-process merge a ddp LoRA run writes at each checkpoint (peft's merge_and_unload of an fp32 copy), tensor for
tensor: an open_clip model from a weights file and a decoder text tower whose base was held in bf16; the merged
folders open with open_clip and sentence-transformers. A changed base is refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import load_weights, make_tiny_decoder, tiny_run
from test_text_training import toy_run

from magclip.config import load_config, load_text_config
from magclip.models.clip import WEIGHTS_FILE, create_clip, save_checkpoint_for_open_clip
from magclip.training.clip import train_clip
from magclip.training.frozen_base import BaseChangedError, read_base
from magclip.training.merge import merge_lora
from magclip.training.text import train_text

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


def assert_equal_files(a: Path, b: Path) -> None:
    left, right = load_weights(a), load_weights(b)
    assert left.keys() == right.keys()
    unequal = [k for k in left if left[k].dtype != right[k].dtype or not torch.equal(left[k], right[k])]
    assert not unequal, (len(unequal), unequal[:5])


def test_the_offline_merge_of_a_clip_run_equals_the_in_process_merge(tmp_path):
    torch.manual_seed(0)
    save_checkpoint_for_open_clip(create_clip("tiny-vit").model, tmp_path / "base.safetensors")
    run = train_clip(load_config(None, tiny_run(tmp_path, tmp_path / "synthetic", "lora", "model.name=tiny-vit",
                                                f"model.pretrained={tmp_path / 'base.safetensors'}", "model.lora.r=4",
                                                "train.precision=fp32", "train.max_steps=2", "train.lr=1e-2")))
    step = Path(run["checkpoint"])
    assert read_base(step)["fingerprint"] and (step / "adapter" / "adapter_model.safetensors").is_file()
    state = torch.load(step / "state.pt", weights_only=True)
    assert not any("base_layer" in k for k in state["module"])   # the frozen base is not in the checkpoint
    done = merge_lora(step, tmp_path / "merged")
    assert_equal_files(done.weights, step / WEIGHTS_FILE)
    import open_clip

    model, _, _ = open_clip.create_model_and_transforms("local-dir:" + str(tmp_path / "merged"))
    assert sum(p.numel() for p in model.parameters()) > 0


def test_the_offline_merge_of_a_text_run_equals_the_in_process_merge_and_refuses_a_changed_base(tmp_path):
    """bf16 base: the merge rounds the base to bf16 as training held it, then adds the fp32 delta, as peft's merge of
    the training's fp32 copy does."""
    from sentence_transformers import SentenceTransformer

    decoder = make_tiny_decoder(tmp_path / "decoder")
    overrides = [o for o in toy_run(tmp_path, 16) if not o.startswith("model.name=")]
    cfg = load_text_config(ROOT / "configs" / "text" / "scifact.yaml",
                           [*overrides, f"model.name={decoder}", "model.pooling=last", "model.lora.r=4", "name=lora",
                            "train.precision=bf16", "train.max_steps=2", "train.lr=1e-2", "eval.beir={}", "eval.sts={}"])
    run = train_text(cfg)
    step = Path(run["checkpoint"])
    assert read_base(step)["dtype"] == "bfloat16"
    done = merge_lora(step, tmp_path / "merged")
    assert_equal_files(done.weights, step / "model" / "model.safetensors")
    assert SentenceTransformer(str(done.folder), device="cpu").encode(["a cat"]).shape == (1, 32)
    # the base changed under the checkpoint: refused in one line, by the merge and by a resume
    from safetensors.torch import load_file, save_file

    weights = load_file(decoder / "model.safetensors")
    first = min(weights)
    save_file({**weights, first: weights[first][:1].clone()}, decoder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BaseChangedError, match="another frozen base") as err:
        merge_lora(step, tmp_path / "merged_again")
    assert "\n" not in str(err.value)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "consolidate.py"), str(step), "--merge", "--out",
                           str(tmp_path / "cli")], check=False, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "another frozen base" in proc.stderr, \
        proc.stderr[-2000:]
