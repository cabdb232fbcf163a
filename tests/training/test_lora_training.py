"""model.lora in training: only the adapters, the logit scale and learnable γ train (every scoring mode), on a base
held in bf16 that does not move; a LoRA run resumed from its checkpoint ends like the unbroken run; a LoRA run under
fsdp on 2 gloo processes (a decoder tower, started on the meta device) trains and writes peft's adapter folder beside the merged
sentence-transformers folder; a combination that cannot work ends the command in one line with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import copy_run_at, free_port, load_weights, make_tiny_decoder, tiny_run
from test_engine import collate, fixed_batches
from test_text_training import toy_run

from magclip.config import LoRAConfig, LossConfig, TrainConfig, load_config
from magclip.models.clip import create_clip
from magclip.models.lora import adapt_clip
from magclip.training.accelerator import make_accelerator
from magclip.training.clip import CLIPTrainModule, build_logit_scale, build_loss, train_clip
from magclip.training.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")
MODES = ("cosine", "dot", "qnorm", "dnorm", "learnable")


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one mixed precision per process: a bf16 engine needs its state cleared, before and after."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("mode", MODES)
def test_lora_trains_only_the_adapters_the_scale_and_gamma(tmp_path, fresh_accelerate_state, mode):
    torch.manual_seed(0)
    cfg = TrainConfig(epochs=1, batch_size=8, lr=1e-2, warmup_steps=0, log_every=1, precision="bf16", max_steps=2)
    acc = make_accelerator(cfg, tmp_path)
    bundle = create_clip("tiny-vit")
    r = 4
    adapt_clip(bundle.model, LoRAConfig(r=r), bundle.preprocess_val, bundle.tokenizer, "bf16")
    loss_cfg = LossConfig(i2t=mode, t2i=mode)
    module = CLIPTrainModule(bundle.model, build_loss(loss_cfg), build_logit_scale(loss_cfg))
    loss_side = {id(p) for p in module.loss_parameters() if p.requires_grad}
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    # r x (in + out) per adapted Linear: mlp.c_fc (128 -> 512) and mlp.c_proj (512 -> 128) of 3 + 2 blocks
    assert sum(p.numel() for p in trainable.values() if id(p) not in loss_side) == 5 * 2 * r * (128 + 512)
    assert all("lora_" in n or id(p) in loss_side for n, p in trainable.items())
    assert all(p.dtype == torch.float32 for p in trainable.values())
    base = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    assert {p.dtype for n, p in base.items() if n.endswith("weight")} == {torch.bfloat16}
    before = {n: p.detach().clone() for n, p in trainable.items()}

    engine = Engine(cfg, acc, module, tmp_path, lambda epoch: [collate(fixed_batches(8, seed=s)) for s in range(2)],
                    steps_per_epoch=2, save_model=lambda m, step_dir: None)
    engine.fit()
    engine.close()
    after = dict(module.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in base.items())  # the frozen base did not move
    moved = {n for n, p in before.items() if not torch.equal(after[n], p)}
    assert {n for n in before if "lora_B" in n} <= moved  # the adapters trained
    if mode == "learnable":
        assert {n for n in before if n.startswith("loss.")} <= moved  # the exponents trained
    assert {n for n in before if n.startswith("logit_scale.")} <= moved or not module.logit_scale.learnable


def test_a_lora_run_resumes_like_the_unbroken_run(tmp_path):
    """From the unbroken run's own step-2 checkpoint (adapter dropout on: the RNG state is part of it): the same
    weights, the same train_loss_recent and the same adapter files."""
    synth = tmp_path / "synthetic"
    extra = ("model.name=tiny-vit", "model.lora.r=4", "model.lora.dropout=0.1", "train.precision=fp32",
             "train.max_steps=4", "train.checkpoint_every=2")
    whole = train_clip(load_config(None, tiny_run(tmp_path, synth, "whole", *extra)))
    copy_run_at(tmp_path / "whole", tmp_path / "part", "step_00000002")
    resumed = train_clip(load_config(None, tiny_run(tmp_path, synth, "part", *extra, "train.resume=latest")))
    assert resumed["steps"] == whole["steps"] == 4
    assert resumed["weights_sha256_by_rank"] == whole["weights_sha256_by_rank"]
    assert resumed["train_loss_recent"] == whole["train_loss_recent"]
    adapters = [load_weights(tmp_path / run / "checkpoints" / "step_00000004" / "adapter" / "adapter_model.safetensors")
                for run in ("whole", "part")]
    assert adapters[0].keys() == adapters[1].keys() and all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    step2 = load_weights(tmp_path / "whole" / "checkpoints" / "step_00000002" / "adapter" / "adapter_model.safetensors")
    assert any(not torch.equal(step2[k], adapters[0][k]) for k in step2)


def launch_text(tmp_path: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    """train/text.py under `torchrun --nproc_per_node nproc` (gloo); the world size is asserted from results.json."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", str(free_port()), str(ROOT / "train" / "text.py"), "--config",
                           str(ROOT / "configs" / "text" / "scifact.yaml"), *overrides],
                          check=False, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_lora_under_fsdp_on_two_processes_checkpoints_the_adapters_and_resumes_exactly(tmp_path):
    """A decoder tower (tiny Qwen3, last-token pooling) with LoRA under FSDP2 on 2 gloo processes, started on the meta
    device, bf16 and gradient checkpointing: eval.at_start runs sharded; every checkpoint holds peft's adapter folder
    (no merged model, no frozen base: the DCP shards hold only what trains) and base.json; PeftModel.from_pretrained
    and sentence-transformers' load_adapter open it; a run resumed from its step-2 checkpoint ends with the unbroken
    run's weights; the offline merge of the last step equals peft's merge of the adapter onto the base."""
    from peft import PeftModel
    from sentence_transformers import SentenceTransformer
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModel

    decoder = make_tiny_decoder(tmp_path / "decoder")
    overrides = [o for o in toy_run(tmp_path, 16) if not o.startswith("model.name=")]
    common = [*overrides, f"model.name={decoder}", "model.pooling=last", "model.lora.r=4", "model.lora.dropout=0.1",
              "model.grad_checkpointing=true", "train.sharding=fsdp", "train.precision=bf16", "eval.precision=bf16",
              "train.batch_size=2", "train.lr=1e-2", "train.max_steps=4", "train.checkpoint_every=2", "eval.beir={}",
              "eval.at_start=true"]
    proc = launch_text(tmp_path, 2, *common, "name=whole")
    out = proc.stdout + proc.stderr
    assert "meta-device start: this process read" in out and "gathering of the full model" not in out
    run = tmp_path / "runs" / "whole"
    whole = json.loads((run / "results.json").read_text())
    assert whole["world_size"] == 2 and whole["sharding"] == "fsdp" and "toy/spearman" in whole["metrics"]
    assert "toy/spearman" in whole["zero_shot"] and whole["final_model"] is None and whole["adapter"]
    steps = [run / "checkpoints" / f"step_{s:08d}" for s in (2, 4)]
    assert all(not (s / "model").exists() and (s / "base.json").is_file() for s in steps)
    stored = FileSystemReader(str(steps[1] / "sharded")).read_metadata().state_dict_metadata
    assert not any("base_layer" in k or "embed_tokens" in k for k in stored)   # the frozen base is not there
    assert any("lora_A" in k for k in stored) and any(k.startswith("optim.state.") for k in stored)
    adapters = [load_weights(s / "adapter" / "adapter_model.safetensors") for s in steps]
    assert len(adapters[0]) == 2 * 2 * 7  # A and B of 7 Linear layers in each of 2 blocks
    assert all(not torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])

    copy_run_at(run, tmp_path / "runs" / "part", steps[0].name)
    launch_text(tmp_path, 2, *common, "name=part", "train.resume=latest")
    part = json.loads((tmp_path / "runs" / "part" / "results.json").read_text())
    assert part["steps"] == whole["steps"] == 4 and part["weights_sha256"] == whole["weights_sha256"]
    assert part["train_loss_recent"] == whole["train_loss_recent"]

    # the adapter folder opens with peft and sentence-transformers; the offline merge equals peft's merge of it onto
    # the base held in bf16, as training held it
    base = AutoModel.from_pretrained(str(decoder))
    for p in base.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    merged_by_peft = PeftModel.from_pretrained(base, str(steps[1] / "adapter")).merge_and_unload()
    from magclip.training.merge import merge_lora

    done = merge_lora(steps[1], tmp_path / "merged")
    offline = load_weights(done.weights)
    reference = merged_by_peft.state_dict()
    assert offline.keys() == reference.keys() and all(torch.equal(offline[k], reference[k]) for k in offline)
    st = SentenceTransformer(str(decoder), device="cpu")
    st.load_adapter(str(steps[1] / "adapter"))
    assert st.encode(["a cat"]).shape[-1] == 32


@pytest.mark.parametrize("override, message, before_run_folder", [
    ("model.lora.r=-1", "model.lora.r must be >= 0", True),                       # the config's own check
    ("model.lora.target_modules=[no_such_layer]", "model.lora.target_modules", False),  # checked on the towers
])
def test_a_combination_that_cannot_work_ends_the_command_in_one_line(tmp_path, override, message, before_run_folder):
    small = [f"data.synthetic.root={tmp_path / 'synthetic'}", "data.synthetic.num_train=64", "data.synthetic.num_val=32"]
    proc = subprocess.run([sys.executable, str(ROOT / "train" / "clip.py"), "model.lora.r=4", override,
                           f"output_dir={tmp_path}", *small], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert (tmp_path / "default").exists() is not before_run_folder


def test_clip_lora_under_fsdp_trains_saves_and_resumes_end_to_end(tmp_path):
    """train/clip.py on 2 gloo processes, train.sharding=fsdp + LoRA (default targets from the structure) on an open_clip
    ViT read from its weights file on the meta device, bf16: the validation runs sharded, every checkpoint holds the
    adapter folder and base.json (no merged model, no frozen base); a run resumed from step 2 ends with the unbroken
    run's weights; PeftModel.from_pretrained opens the adapters, and the offline merge gives an open_clip folder."""
    import open_clip
    from peft import PeftModel

    from magclip.models.clip import save_checkpoint_for_open_clip

    torch.manual_seed(0)
    save_checkpoint_for_open_clip(create_clip("tiny-vit").model, tmp_path / "base.safetensors")
    synth, out = tmp_path / "synthetic", tmp_path / "runs"
    common = [f"output_dir={out}", f"data.synthetic.root={synth}", "data.synthetic.num_train=1001",
              "data.synthetic.num_val=32", "data.workers=0", "train.log_every=1", "train.warmup_steps=1",
              "model.name=tiny-vit", f"model.pretrained={tmp_path / 'base.safetensors'}", "model.lora.r=4",
              "train.sharding=fsdp", "train.precision=bf16", "train.batch_size=16", "train.max_steps=4",
              "train.checkpoint_every=2", "train.lr=1e-2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def launch(*extra: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                               str(free_port()), str(ROOT / "train" / "clip.py"), *common, *extra],
                              check=False, env=env, capture_output=True, text=True, timeout=420)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "meta-device start: this process read" in proc.stdout + proc.stderr
        return json.loads((out / extra[0].split("=", 1)[1] / "results.json").read_text())

    whole = launch("name=whole")
    assert whole["world_size"] == 2 and whole["sharding"] == "fsdp" and whole["metrics"]["num_samples"] == 32
    steps = [out / "whole" / "checkpoints" / f"step_{s:08d}" for s in (2, 4)]
    assert all((s / "adapter" / "adapter_model.safetensors").is_file() and (s / "base.json").is_file()
               and not (s / "open_clip_model.safetensors").exists() for s in steps)
    copy_run_at(out / "whole", out / "part", steps[0].name)
    part = launch("name=part", "train.resume=latest")
    assert part["steps"] == whole["steps"] == 4 and part["weights_sha256"] == whole["weights_sha256"]

    base = create_clip("tiny-vit", str(tmp_path / "base.safetensors")).model.clip
    adapted = PeftModel.from_pretrained(base, str(steps[1] / "adapter"))
    assert sum("lora_A" in n for n, _ in adapted.named_parameters()) == 10   # c_fc and c_proj of 3 + 2 blocks
    from magclip.training.merge import merge_lora

    merge_lora(steps[1], tmp_path / "merged")
    model, _, _ = open_clip.create_model_and_transforms("local-dir:" + str(tmp_path / "merged"))
    assert sum(p.numel() for p in model.parameters()) > 0
