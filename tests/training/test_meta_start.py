"""The meta-device start of train.sharding=fsdp (magclip/training/meta_start.py, magclip/models/build.py): towers
built on the meta device, sharded with FSDP2 and filled shard by shard from open_clip checkpoints (.safetensors and
.pt), a Hugging Face folder whose safetensors are a sharded set with its index (a BERT and a decoder), and a
sentence-transformers folder with a Dense head (built eagerly beside the meta-built transformer), equal today's
eager load bit for bit at 2 gloo processes (and at 4 where a tensor splits unevenly there): every rank's shards and
the consolidated state. The whole-file loaders fail if called during the meta build, and each rank holds only its
share of the parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import free_port, make_tiny_bert, make_tiny_decoder

from magclip.models import build
from magclip.models.clip import create_clip, save_checkpoint_for_open_clip

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("meta_start_ranks.py")


def sharded_copy(folder: Path, target: Path) -> Path:
    """The HF folder saved again as a sharded safetensors set (model.safetensors.index.json + several files)."""
    from transformers import AutoModel, AutoTokenizer

    AutoModel.from_pretrained(str(folder)).save_pretrained(str(target), max_shard_size="20KB")
    AutoTokenizer.from_pretrained(str(folder)).save_pretrained(str(target))
    assert (target / build.SAFETENSORS_INDEX).is_file() and len(list(target.glob("*.safetensors"))) > 1
    return target


def st_folder(bert: Path, target: Path) -> Path:
    from sentence_transformers import SentenceTransformer
    try:
        from sentence_transformers.sentence_transformer import modules as stm
    except ImportError:  # sentence-transformers 5
        from sentence_transformers import models as stm

    torch.manual_seed(3)
    transformer = stm.Transformer(str(bert), max_seq_length=32)
    pooling = stm.Pooling(32, "mean")
    SentenceTransformer(modules=[transformer, pooling, stm.Dense(32, 16)], device="cpu").save(str(target))
    return target


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("meta_start")
    torch.manual_seed(0)
    clip = create_clip("tiny-vit").model
    save_checkpoint_for_open_clip(clip, root / "clip.safetensors")
    save_checkpoint_for_open_clip(clip, root / "clip.pt")
    bert = make_tiny_bert(root / "bert")
    decoder = make_tiny_decoder(root / "decoder")
    return {
        "clip_safetensors": {"kind": "clip", "model": "tiny-vit", "weights": str(root / "clip.safetensors")},
        "clip_pt": {"kind": "clip", "model": "tiny-vit", "weights": str(root / "clip.pt")},
        "bert_sharded_index": {"kind": "text", "weights": str(sharded_copy(bert, root / "bert_sharded"))},
        "decoder_sharded_two_towers": {"kind": "text", "weights": str(sharded_copy(decoder, root / "decoder_sharded")),
                                       "pooling": "last", "shared": False},
        "sentence_transformers_dense": {"kind": "text", "weights": str(st_folder(bert, root / "st"))},
    }


@pytest.fixture(scope="module")
def lora_cases(cases) -> dict[str, dict]:
    """LoRA (peft) wrapped on the meta device: a BERT from a sharded set with a bf16 base, a decoder's two towers,
    the open_clip model in fp32."""
    return {
        "lora_bert_bf16": {**cases["bert_sharded_index"], "lora": 4, "precision": "bf16"},
        "lora_decoder_two_towers_bf16": {**cases["decoder_sharded_two_towers"], "lora": 4, "precision": "bf16"},
        "lora_clip": {**cases["clip_safetensors"], "lora": 4},
    }


@pytest.fixture(scope="module")
def at_two(cases, lora_cases, tmp_path_factory) -> list[dict]:
    """Every case, plain and LoRA, in one 2-process launch: the processes' start (torchrun, gloo, the imports) is
    paid once; each test reads its own cases of every rank's record."""
    return launch(2, tmp_path_factory.mktemp("meta_start_at_two"), {**cases, **lora_cases})


def launch(nproc: int, out: Path, cases: dict) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "EXPECTED_WORLD_SIZE": str(nproc)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(WORKER), str(out), str(out / "cases.json")]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = [json.loads((out / f"{nproc}_{rank}.json").read_text()) for rank in range(nproc)]
    assert all(f["world_size"] == nproc for f in found)
    return found


# every format at 2 processes; at 4 the one case whose shards are uneven there (tiny-vit's positional embedding: 17
# rows, 5 + 4 + 4 + 4): every tensor of the decoder and the BERT splits evenly at 2 and 4 alike (the suite's budget)
AT_4 = ("clip_safetensors",)


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_meta_start_equals_the_eager_load(cases, tmp_path, nproc, request):
    cases = cases if nproc == 2 else {name: cases[name] for name in AT_4}
    by_rank = request.getfixturevalue("at_two") if nproc == 2 else launch(nproc, tmp_path, cases)
    for name in cases:
        ranks = [r["cases"][name] for r in by_rank]
        assert all(r["mismatches"] == [] for r in ranks), (name, [r["mismatches"][:5] for r in ranks])
        assert ranks[0]["consolidated"] is True, name
        assert all(r["loaded_parts"] >= 1 and r["meta_parameters"] > 0 for r in ranks), name
        # every rank holds a share of the meta-built parameters, together exactly the whole
        assert all(r["sharded"] > 0 for r in ranks), name
        assert sum(r["local_numel"] for r in ranks) == ranks[0]["full_numel"], name
        assert max(r["local_numel"] for r in ranks) < ranks[0]["full_numel"] * (1.5 / nproc), name


def test_a_file_the_loader_converts_is_built_eagerly(tmp_path):
    """A checkpoint without a key the model has (open_clip fills a missing logit_bias, transformers initialises a
    missing pooler) cannot start on meta bit for bit: that part is built eagerly, as before."""
    bert = make_tiny_bert(tmp_path / "bert")
    from safetensors.torch import load_file, save_file

    state = load_file(bert / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith("pooler.")}, bert / "model.safetensors",
              metadata={"format": "pt"})
    assert build.hf_model_on_meta(bert) is None
    with build.on_meta():
        from magclip.models.text import BiEncoder

        encoder = BiEncoder.from_pretrained(bert)
    assert not build.loaded_on_meta(encoder) and not any(p.is_meta for p in encoder.parameters())


def test_a_lora_start_on_the_meta_device_equals_the_eager_one(lora_cases, at_two):
    """peft wraps the towers on the meta device: every rank's base shards equal an eager LoRA start's (bf16 where the
    base is held in bf16), read with the whole-file loaders failing; the adapters are drawn alike on every rank (A as
    peft draws it, B zero: the model's output is the base's); the probe that every adapted module is called ran on
    the sharded model."""
    by_rank = at_two
    for name, case in lora_cases.items():
        ranks = [r["cases"][name] for r in by_rank]
        assert all(r["mismatches"] == [] for r in ranks), (name, [r["mismatches"][:5] for r in ranks])
        assert ranks[0]["consolidated"] is True, name
        assert all(r["loaded_parts"] >= 2 and r["sharded"] > 0 for r in ranks), name   # the base's files + adapters
        assert all(r["base_dtypes"] == (["torch.bfloat16"] if case.get("precision") == "bf16" else ["torch.float32"])
                   for r in ranks), (name, ranks[0]["base_dtypes"])
        assert all(r["adapters"] == r["held"] > 0 and r["as_held"] and r["a_in_bound"] and r["b_zero"] and r["probed"]
                   for r in ranks), (name, ranks)
        assert len({r["a_sha256"] for r in ranks}) == 1, name


def test_a_lora_module_the_forward_never_calls_is_refused_after_the_meta_start(tmp_path):
    """On the meta device the probe waits for the sharded, filled model (fsdp on one process here): an adapted
    out_proj of an nn.MultiheadAttention (read by weight) is refused there, in the same one line as eagerly."""
    from magclip.config import LoRAConfig, LossConfig, TrainConfig
    from magclip.models.lora import LoRAError, adapt_clip
    from magclip.training.accelerator import make_accelerator
    from magclip.training.clip import CLIPTrainModule, build_logit_scale, build_loss
    from magclip.training.meta_start import start_sharded

    torch.manual_seed(0)
    save_checkpoint_for_open_clip(create_clip("tiny-vit").model, tmp_path / "clip.safetensors")
    with build.on_meta():
        bundle = create_clip("tiny-vit", str(tmp_path / "clip.safetensors"))
    adapt_clip(bundle.model, LoRAConfig(r=4, target_modules=["out_proj", "c_fc"]), bundle.preprocess_val,
               bundle.tokenizer, "fp32", "fsdp")   # wrapped on meta: nothing run yet
    assert all(p.is_meta for p in bundle.model.parameters() if p.ndim > 1)
    loss = LossConfig(i2t="qnorm", t2i="qnorm")
    module = CLIPTrainModule(bundle.model, build_loss(loss), build_logit_scale(loss))
    with pytest.raises(LoRAError, match="never calls .* out_proj"):
        start_sharded(module, make_accelerator(TrainConfig(precision="fp32"), tmp_path),
                      TrainConfig(sharding="fsdp", precision="fp32"))
