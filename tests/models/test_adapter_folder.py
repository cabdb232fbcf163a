"""A peft adapter folder given as the model (issue 61): was a 5-line tokenizer error naming no folder.
Now it is read as sentence-transformers' `load_adapter` reads it (the base, the adapter over it), and a
base that is not available offline is refused in one line naming the folder and the base."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from builders import make_tiny_bert, write_beir_folder

from magclip.models.text import BiEncoder

st = pytest.importorskip("sentence_transformers")
peft = pytest.importorskip("peft")

TEXTS = ["the cat sat on the mat", "a dog", "protein cell study results in the human brain", "red"]


def write_adapter(tmp_path, base):
    """An adapter as peft's save_pretrained writes it: nonzero LoRA weights, so it changes the vectors."""
    from transformers import AutoModel

    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModel.from_pretrained(str(base)),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"],
                                                init_lora_weights=False))
    model.save_pretrained(str(tmp_path / "adapter"))
    return tmp_path / "adapter"


def test_an_adapter_folder_encodes_as_sentence_transformers_load_adapter_does(tmp_path):
    base = make_tiny_bert(tmp_path / "bert")
    adapter = write_adapter(tmp_path, base)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    peer = st.SentenceTransformer(str(base), device="cpu")
    plain = peer.encode(TEXTS, convert_to_tensor=True)
    peer.load_adapter(str(adapter))
    theirs = peer.encode(TEXTS, convert_to_tensor=True)
    assert not torch.allclose(plain, theirs, atol=1e-4)   # the adapter matters
    model = BiEncoder.from_pretrained(adapter)
    assert torch.allclose(model.encode(TEXTS, "query"), theirs, atol=1e-5)
    assert torch.allclose(model.encode(TEXTS, "passage"), theirs, atol=1e-5)


def test_an_adapter_over_a_base_not_available_offline_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    base = make_tiny_bert(tmp_path / "bert")
    adapter = write_adapter(tmp_path, base)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "some-org/no-such-base-model"
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as err:
        BiEncoder.from_pretrained(adapter)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{adapter}: a peft adapter over the base "
                                                      "'some-org/no-such-base-model', which is not available offline")
    from magclip.cli.beir import console

    beir = write_beir_folder(tmp_path / "set", [("d1", "a cat")], [("q1", "cat")], [("q1", "d1", 1)])
    monkeypatch.setattr(sys, "argv", ["magclip-beir", "--model", str(adapter), "--data", str(beir),
                                      "--out", str(tmp_path / "r.json"), "--no-progress"])
    with pytest.raises(SystemExit) as exit_:
        console()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "which is not available offline" in last and str(adapter) in last
