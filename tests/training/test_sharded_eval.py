"""train.sharding=fsdp evaluates on every rank with the sharded model: a 2-process run's validation record (CLIP
retrieval; text BEIR + STS through the text task's evaluation) equals the evaluation of the consolidated model on one
process, feature for feature; train.save_full_model decides which checkpoints hold the model files."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import free_port, make_tiny_decoder

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("sharded_eval_ranks.py")


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("sharded_eval")
    decoder = make_tiny_decoder(out / "decoder")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "EXPECTED_WORLD_SIZE": "2"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(WORKER), "run", str(out), str(decoder)],
                          env=env, capture_output=True, text=True, timeout=420, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = torch.load(out / "eval.pt", weights_only=True)
    assert record["world_size"] == 2
    return out, record


def drop_load_flags(tokenizer_config: dict) -> dict:
    """A tokenizer_config.json without what transformers writes of the loading process (local_files_only follows
    HF_HUB_OFFLINE in the process that loaded it, so an earlier test in the same worker can flip it)."""
    return {k: v for k, v in tokenizer_config.items() if k not in ("local_files_only", "is_local")}


def without_timings(metrics: dict) -> dict:
    """The numbers but the wall times, NaN (a length bin too small to score) as a string so that it equals itself."""
    return {k: "nan" if isinstance(v, float) and math.isnan(v) else v
            for k, v in metrics.items() if not k.endswith("_s")}


def test_the_sharded_clip_validation_equals_one_process(sharded_run):
    record = sharded_run[1]
    sharded, alone = record["clip_sharded_features"], record["clip_one_process_features"]
    assert sharded["keys"] == alone["keys"] == [str(i) for i in range(18)]  # in order, each once
    assert torch.equal(sharded["image_features"], alone["image_features"])
    assert torch.equal(sharded["text_features"], alone["text_features"])
    assert record["clip_val"] == record["clip_one_process"]
    assert record["clip_val"]["num_samples"] == 18 and 0 < record["clip_val"]["image_to_text_R@1"] <= 1


def test_the_sharded_text_evaluation_equals_one_process(sharded_run):
    record = sharded_run[1]
    val, alone = without_timings(record["text_val"]), without_timings(record["text_one_process"])
    assert val == alone
    assert val["toy/queries"] == 18 and val["toy/docs"] == 18 and val["toysts/pairs"] == 18
    assert 0 < val["toy/ndcg@10"] <= 1


def test_save_full_model_last_and_never(sharded_run):
    out = sharded_run[0]
    clip, text = out / "clip" / "checkpoints", out / "text" / "checkpoints"
    assert not (clip / "step_00000001" / "model.pt").exists() and (clip / "step_00000002" / "model.pt").is_file()
    for step in ("step_00000001", "step_00000002"):
        assert (clip / step / "sharded" / ".metadata").is_file() and (text / step / "sharded" / ".metadata").is_file()
        assert not (text / step / "model.pt").exists()


def test_save_full_model_is_checked():
    from magclip.config import ConfigError, TrainConfig, _check_train

    with pytest.raises(ConfigError, match="train.save_full_model='sometimes'; allowed: every, last, never"):
        _check_train(TrainConfig(sharding="fsdp", save_full_model="sometimes"))


def consolidate_command(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "tools" / "consolidate.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def consolidate_here(capsys, *args: str) -> str:
    """tools/consolidate.py's work (its `main`) in this process, which has loaded torch already; what it printed.
    The command's own refusal (exit 2, one line) still runs as a process of its own."""
    from magclip.cli.consolidate import main

    capsys.readouterr()
    main(list(args))
    return capsys.readouterr().out


def test_a_sharded_clip_step_consolidates_offline_as_the_run_writes_it(sharded_run, tmp_path, capsys):
    """The last step's shards, consolidated on one process, equal bit for bit what the run's own writer makes of the
    gathered weights (open_clip's file, its config and magclip.json), and open in open_clip; a step folder without
    model files (save_full_model=last) gets them in place, and a second time is refused in one line."""
    import open_clip
    from safetensors.torch import load_file

    from magclip.config import RunConfig, from_dict
    from magclip.models.clip import (
        CHECKPOINT_META,
        OPEN_CLIP_CONFIG,
        WEIGHTS_FILE,
        create_clip,
        save_open_clip_folder,
    )
    from magclip.training.clip import CLIPTrainModule, build_logit_scale, build_loss, checkpoint_meta

    out, record = sharded_run
    steps = out / "clip" / "checkpoints"
    printed = consolidate_here(capsys, str(steps / "step_00000002"), "--out", str(tmp_path / "offline"))
    cfg = from_dict(RunConfig, __import__("yaml").safe_load((steps / "step_00000002" / "config.yaml").read_text()))
    module = CLIPTrainModule(create_clip("tiny-vit").model, build_loss(cfg.loss), build_logit_scale(cfg.loss))
    module.load_state_dict(record["clip_weights"])
    save_open_clip_folder(module.clip, tmp_path / "run", "tiny-vit", logit_scale=module.logit_scale.value)
    offline, own = load_file(tmp_path / "offline" / WEIGHTS_FILE), load_file(tmp_path / "run" / WEIGHTS_FILE)
    assert offline.keys() == own.keys() and all(torch.equal(offline[k], own[k]) for k in own)
    assert (tmp_path / "offline" / OPEN_CLIP_CONFIG).read_text() == (tmp_path / "run" / OPEN_CLIP_CONFIG).read_text()
    meta = __import__("json").loads((tmp_path / "offline" / CHECKPOINT_META).read_text())
    assert meta == __import__("json").loads(__import__("json").dumps(checkpoint_meta(module, cfg)))
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'offline'}")
    assert all(torch.equal(v, own[k]) for k, v in model.state_dict().items() if k in own)
    assert "MB held at once" in printed

    first = steps / "step_00000001"
    assert not (first / WEIGHTS_FILE).exists()
    consolidate_here(capsys, str(first))
    model, _, _ = open_clip.create_model_and_transforms("tiny-vit", pretrained=str(first / WEIGHTS_FILE))
    again = consolidate_command(str(first))
    assert again.returncode == 2 and "Traceback" not in again.stderr and "exists already" in again.stderr


def test_a_sharded_text_step_consolidates_offline_as_the_run_writes_it(sharded_run, tmp_path, capsys):
    """A text run's shards (save_full_model=never), consolidated on one process into `model/`: every file what the
    run's own writer makes of the gathered weights (the weights tensor for tensor, bit for bit; the rest byte for byte),
    and sentence-transformers opens it and encodes as magclip's encoder does."""
    import yaml
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer
    from sharding_ranks import text_module

    from magclip.config import TextRunConfig, from_dict
    from magclip.models.text import BiEncoder
    from magclip.training.text import save_text_model

    out, record = sharded_run
    step = out / "text" / "checkpoints" / "step_00000002"
    consolidate_here(capsys, str(step))
    module = text_module(out / "decoder")
    module.load_state_dict(record["text_weights"])
    save_text_model(module, from_dict(TextRunConfig, yaml.safe_load((step / "config.yaml").read_text())), tmp_path)
    offline, own = step / "model", tmp_path / "model"
    files = sorted(p.relative_to(own) for p in own.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(offline) for p in offline.rglob("*") if p.is_file())
    for name in files:
        if name.suffix == ".safetensors":
            a, b = load_file(offline / name), load_file(own / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        elif name.name == "tokenizer_config.json":  # transformers also writes how the tokenizer was loaded
            a, b = (json.loads((d / name).read_text()) for d in (offline, own))
            assert drop_load_flags(a) == drop_load_flags(b), name
        else:
            assert (offline / name).read_bytes() == (own / name).read_bytes(), name
    texts = ["a query about cats", "another passage"]
    st = torch.from_numpy(SentenceTransformer(str(offline), device="cpu").encode(texts, normalize_embeddings=False))
    ours = BiEncoder.from_pretrained(offline).encode(texts, "query")
    assert torch.allclose(st, ours, atol=1e-5)
