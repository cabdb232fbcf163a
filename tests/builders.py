"""Small builders shared by the tests: PNG bytes, tar shards written member by member, free ports, a
tiny BERT folder, a torch file that carries code, toy text data (pairs, a BEIR folder, STS, QA)."""

import io
import json
import random
import socket
import tarfile
import zlib
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]  # the repository


def png(seed: int, size: int = 8) -> bytes:
    """A deterministic random-pixel RGB PNG."""
    rng = random.Random(seed)
    img = Image.new("RGB", (size, size))
    img.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(size * size)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar with exactly these members, in this order (bad members included on purpose)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def good(key: str, size: int = 8) -> list[tuple[str, bytes]]:
    """A valid sample: KEY.png + KEY.txt."""
    return [(f"{key}.png", png(zlib.crc32(key.encode()), size)), (f"{key}.txt", f"caption {key}".encode())]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _RunsCode:
    """Unpickling this calls `open(marker, "w")`: the marker file appears if the payload ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def crafted_torch_file(path: Path, marker: Path, content: dict | None = None) -> Path:
    """A torch.save file as an attacker would share it: plausible content plus a payload that runs
    on an unsafe `torch.load` (weights_only=False) and creates `marker`."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**(content or {}), "payload": _RunsCode(marker)}, path)
    return path


WORDS = ("the a of and to in is was for on with as by at from cat dog sat mat query passage protein cell "
         "cancer brain white matter gene study results human model data red blue green small large").split()

def make_tiny_bert(folder: Path, seed: int = 0) -> Path:
    """A 2-layer random BERT with a small WordPiece vocabulary, saved as a HF folder."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ":"] + WORDS + list("abcdefghijklmnopqrstuvwxyz") \
        + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    vocab_file = str(folder / "vocab.txt")
    # transformers 5 reads `vocab`, transformers 4 `vocab_file`
    tok = BertTokenizerFast(vocab=vocab_file, vocab_file=vocab_file, do_lower_case=True, model_max_length=64)
    assert tok.convert_ids_to_tokens(tok("cat")["input_ids"]) == ["[CLS]", "cat", "[SEP]"]
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=48, max_position_embeddings=64)
    BertModel(cfg).eval().save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def make_tiny_decoder(folder: Path, seed: int = 0) -> Path:
    """A 2-layer random Qwen3 (a decoder-only embedder's stand-in, pooled at its last token) with the tiny BERT's
    tokenizer, saved as a HF folder."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    bert = make_tiny_bert(folder.with_name(folder.name + "_tokenizer"), seed)
    tok = AutoTokenizer.from_pretrained(str(bert))
    vocab = len((bert / "vocab.txt").read_text().splitlines())  # ids run to the line count (a word can repeat)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(seed)
    Qwen3Model(cfg).eval().save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def load_weights(path: Path) -> dict:
    """A weights file as a state dict: the safetensors a checkpoint holds, or a torch file (weights only)."""
    import torch

    if path.suffix == ".safetensors":
        import safetensors.torch

        return safetensors.torch.load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def max_difference(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def tiny_run(out: Path, synth: Path, name: str, *extra: str, train: int = 128, epochs: int = 2) -> list[str]:
    """Overrides of a main job small enough for a test: `train` synthetic scenes (32 validation), batch
    32, no loader workers, a log line per step; `extra` overrides come last."""
    return [f"output_dir={out}", f"name={name}", "model.name=tiny-resnet", f"data.synthetic.root={synth}",
            f"data.synthetic.num_train={train}", "data.synthetic.num_val=32", "data.workers=0",
            "train.batch_size=32", "train.log_every=1", "train.warmup_steps=1", f"train.epochs={epochs}", *extra]


def copy_run_at(src: Path, dst: Path, step: str) -> Path:
    """A copy of run folder `src` as it was when checkpoint `step` was its latest (later ones and the
    results removed): resuming it must end where `src` ended."""
    import shutil

    shutil.copytree(src, dst)
    (dst / "results.json").unlink()
    for folder in (dst / "checkpoints").glob("step_*"):
        if folder.name != step:
            shutil.rmtree(folder)
    (dst / "checkpoints" / "latest").write_text(step + "\n")
    return dst


# ----------------------------------------------------------------------------- toy text data


def toy_rows(n: int = 24, seed: int = 0) -> list[dict]:
    """Pair records of random words: a query, its positive passage and two negatives."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        w = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (6,), generator=g)]
        rows.append({"query": " ".join(w[:3]), "positive": " ".join(w[:3] + w[3:]),
                     "negatives": [" ".join(w[3:]), " ".join(reversed(w))]})
    return rows


def write_toy_eval(folder: Path, rows: list[dict]) -> tuple[Path, Path]:
    beir = folder / "toybeir"
    (beir / "qrels").mkdir(parents=True)
    with open(beir / "corpus.jsonl", "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": r["positive"]}) + "\n")
    with open(beir / "queries.jsonl", "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"_id": f"q{i}", "text": r["query"]}) + "\n")
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n"
                                             + "".join(f"q{i}\td{i}\t1\n" for i in range(len(rows))))
    sts = folder / "toysts.tsv"
    sts.write_text("score\tsentence1\tsentence2\n" + "".join(
        f"{i % 5}.0\t{r['query']}\t{r['positive'] if i % 2 else r['negatives'][0]}\n" for i, r in enumerate(rows)))
    return beir, sts


def write_toy_qa(folder: Path, rows: list[dict]) -> Path:
    qa = folder / "toyqa"
    qa.mkdir(parents=True)
    with open(qa / "corpus.jsonl", "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"_id": f"p{i}", "title": "", "text": r["positive"]}) + "\n")
    with open(qa / "qa.jsonl", "w") as f:
        for i, r in enumerate(rows):
            answer = r["positive"].split()[-1]
            f.write(json.dumps({"id": f"x{i}", "question": r["query"], "answers": [answer], "passage_id": f"p{i}"}) + "\n")
    return qa


def toy_text_grid(folder: Path, name: str, axes: dict, *, columns: list[str], rows_seed: int = 0,
                  model: str | None = None, baseline: dict | None = None, **overrides) -> Path:
    """A grid YAML of tiny text runs (the base recipe scifact.yaml on toy pairs, a toy BEIR set and toy
    STS, 2 steps of batch 4 unless overridden, no evaluation of the start): its path. `model`: the
    model folder of every cell (default: a tiny BERT built here); an axis may set its own."""
    rows = toy_rows(24, seed=rows_seed)
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    beir, sts = write_toy_eval(folder, rows[:16])
    settings = {"model.name": model or str(make_tiny_bert(folder / "bert")), "model.query_max_length": 16,
                "model.passage_max_length": 24, "data.train": str(folder / "pairs.jsonl"), "data.beir": None,
                "train.batch_size": 4, "train.max_steps": 2, "train.lr": 1.0e-3, "train.warmup_steps": 0,
                "eval.length_bins": 0, "eval.at_start": False, "eval.beir": {"toybeir": str(beir)},
                "eval.sts": {"toysts": str(sts)}, **overrides}
    spec = {"name": name, "output_dir": str(folder / "runs"), "launcher": "text", "env": {"OMP_NUM_THREADS": "1"},
            "base": "configs/text/scifact.yaml", "overrides": settings, "axes": axes, "scale": 100,
            "columns": columns, **({"baseline": baseline} if baseline else {})}
    path = folder / "grid.yaml"
    path.write_text(json.dumps(spec))    # JSON is YAML
    return path


def save_tiny_resnet(folder: Path, seed: int = 0) -> Path:
    """A random-init tiny-resnet's open_clip weights (`tiny.pt`): what magclip and a peer tool both load."""
    import torch

    from magclip.models.clip import create_clip

    torch.manual_seed(seed)
    path = folder / "tiny.pt"
    torch.save(create_clip("tiny-resnet", None).model.clip.state_dict(), path)
    return path


def beir_command_record(tmp_path: Path, monkeypatch, model_dir: Path, folder: Path) -> dict:
    """`magclip-beir --model MODEL --data FOLDER` run in this process; the set's entry of its results.json."""
    import sys

    from magclip.cli.beir import console

    out = tmp_path / "results.json"
    monkeypatch.setattr(sys, "argv", ["magclip-beir", "--model", str(model_dir), "--data", str(folder),
                                      "--out", str(out), "--no-progress"])
    console()
    return json.loads(out.read_text())[folder.name]


def write_beir_folder(folder: Path, docs: list, queries: list, qrels: list, split: str = "test") -> Path:
    """A BEIR folder as BEIR writes it: corpus.jsonl ((id, text), empty titles), queries.jsonl, qrels/SPLIT.tsv with its
    header ((query, document, score) rows, in order: repeated pairs stay repeated)."""
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": "", "text": t}) + "\n" for i, t in docs))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in queries))
    (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n"
                                                   + "".join(f"{q}\t{d}\t{s}\n" for q, d, s in qrels))
    return folder
