"""Where captions are read from (`data.caption_key`, `--caption-key`): KEY.txt one caption a line, or a KEY.json
field (img2dataset's metadata without KEY.txt), for training and zero-shot alike."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import png, write_tar

from magclip.data.captions import CaptionKey, choose_caption
from magclip.data.shards import build_clip_loader

ROOT = Path(__file__).resolve().parents[2]
CAPTIONS = ["a red circle", "a blue square on the left", "two green crosses", "a yellow star", "a purple heart",
            "an orange fish", "a grey cat", "a pink flower"]


def _shards(folder: Path, txt: bool, json_field: str | None = "caption") -> str:
    """Two shards of 4 samples each: KEY.png, KEY.txt (when `txt`) and KEY.json (the caption in `json_field`)."""
    for shard in range(2):
        members = []
        for i in range(4):
            n = shard * 4 + i
            key = f"{n:06d}"
            members.append((f"{key}.png", png(n, size=16)))
            if txt:
                members.append((f"{key}.txt", CAPTIONS[n].encode()))
            meta = {"url": f"http://example.org/{n}.png", **({json_field: CAPTIONS[n]} if json_field else {})}
            members.append((f"{key}.json", json.dumps(meta).encode()))
        write_tar(folder / f"s-{shard:06d}.tar", members)
    return str(folder / "s-{000000..000001}.tar")


def test_caption_key_reads_a_field_a_list_and_lines():
    assert CaptionKey("json:caption").read({"json": b'{"caption": " a dog "}'})[:2] == (["a dog"], "")
    assert CaptionKey("json:meta.captions").read({"json": b'{"meta": {"captions": ["a", "", "b"]}}'}) == (
        ["a", "b"], "", "", 1)
    assert CaptionKey("txt").read({"txt": b"first\n\nsecond\n"}) == (["first", "second"], "", "", 1)
    assert CaptionKey("json:caption").read({"json": b'{"title": "x"}'})[:2] == (None, "missing_caption")
    assert CaptionKey("json:caption").read({"json": b'{"caption": 3}'})[:2] == (None, "missing_caption")
    with pytest.raises(ValueError, match="use 'txt'"):
        CaptionKey("caption")


def test_training_draws_one_caption_per_sample_and_epoch_evaluation_keeps_all(tmp_path):
    lines = "\n".join(CAPTIONS[:3]).encode()
    write_tar(tmp_path / "m-000000.tar", [(f"{i:04d}.{ext}", png(i) if ext == "png" else lines)
                                          for i in range(6) for ext in ("png", "txt")])
    urls = str(tmp_path / "m-000000.tar")

    def captions(all_captions: bool, epoch: int) -> list[str]:
        loader = build_clip_loader(urls, preprocess=lambda im: torch.zeros(3, 4, 4), tokenizer=lambda c: torch.zeros(len(c), 2),
                                   batch_size=6, shuffle=False, epoch=epoch, all_captions=all_captions, drop_last=False)
        batch = next(iter(loader))
        return batch["captions"], batch["caption_counts"]

    drawn, counts = captions(False, 0)
    assert counts == [1] * 6 and set(drawn) <= set(CAPTIONS[:3]) and len(set(drawn)) > 1
    assert drawn == [choose_caption(CAPTIONS[:3], 0, 0, f"{i:04d}") for i in range(6)]  # the same on a resume
    assert captions(False, 1)[0] != drawn  # another epoch, another draw
    everything, counts = captions(True, 0)
    assert counts == [3] * 6 and everything == CAPTIONS[:3] * 6


def test_zeroshot_reads_the_caption_from_key_json(tmp_path):
    """Shards with the caption only in KEY.json score exactly as the same shards with KEY.txt."""
    spec = importlib.util.spec_from_file_location("eval_zeroshot", ROOT / "eval" / "zeroshot.py")
    zs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zs)
    with_txt = _shards(tmp_path / "txt", txt=True, json_field=None)
    json_only = _shards(tmp_path / "json", txt=False)
    with pytest.raises(ValueError, match=r"has no KEY.txt captions .* --caption-key json:FIELD"):
        zs.main(["--model", "tiny-resnet", "--data", json_only, "--out", str(tmp_path / "refused.json")])
    torch.manual_seed(0)
    a = zs.main(["--model", "tiny-resnet", "--data", with_txt, "--out", str(tmp_path / "a.json")])
    torch.manual_seed(0)
    b = zs.main(["--model", "tiny-resnet", "--data", json_only, "--caption-key", "json:caption",
                 "--out", str(tmp_path / "b.json")])
    ra, rb = a["sets"]["data"]["metrics"]["retrieval"], b["sets"]["data"]["metrics"]["retrieval"]
    assert b["sets"]["data"]["caption_key"] == "json:caption"
    assert {k: ra[k] for k in ra if "R@" in k} == {k: rb[k] for k in rb if "R@" in k}


def _benchmark_layouts(folder: Path) -> tuple[Path, Path]:
    """A CLIP_benchmark retrieval folder (2 captions per image in KEY.txt) and a Karpathy split file over 4 images."""
    cb = folder / "cb"
    write_tar(cb / "test" / "0.tar", [m for i in range(6) for m in
                                      ((f"s{i:07d}.png", png(i, 16)), (f"s{i:07d}.txt", f"{CAPTIONS[i]}\nimage {i}".encode()))])
    (cb / "test" / "nshards.txt").write_text("1\n")
    (cb / "dataset_type.txt").write_text("retrieval\n")
    images = []
    for i in range(4):
        (folder / "k" / f"{i}.png").parent.mkdir(parents=True, exist_ok=True)
        (folder / "k" / f"{i}.png").write_bytes(png(20 + i, 16))
        images.append({"filename": f"{i}.png", "split": "test", "sentences": [{"raw": CAPTIONS[i]}, {"raw": f"photo {i}"},
                                                                            {"raw": f"picture {i}"}]})
    (folder / "k" / "dataset_flickr30k.json").write_text(json.dumps({"images": images}))
    return cb, folder / "k" / "dataset_flickr30k.json"


def test_training_reads_the_caption_from_key_json_and_evaluates_the_benchmarks_layouts(tmp_path):
    urls = _shards(tmp_path / "json", txt=False)
    cb, karpathy = _benchmark_layouts(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "train" / "clip.py"), f"data.train={urls}", f"data.val={urls}",
                           "data.caption_key=json:caption", "train.batch_size=4", "train.max_steps=2", "data.workers=0",
                           f"data.eval_sets={{cb: {cb}, flickr: {karpathy}}}",
                           "train.precision=fp32", f"output_dir={tmp_path / 'runs'}", "name=json_caption"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "runs" / "json_caption" / "results.json").read_text())
    assert results["caption_key"] == "json:caption" and results["metrics"]["num_captions"] == 8
    assert not results["skipped_samples"]
    assert results["eval_data"]["val"]["matching"] == "caption"
    assert (results["eval_data"]["cb"]["layout"], results["eval_data"]["cb"]["matching"]) == ("clip_benchmark", "image")
    assert (results["eval_sets"]["cb"]["num_samples"], results["eval_sets"]["cb"]["num_captions"]) == (6, 12)
    assert (results["eval_sets"]["flickr"]["num_samples"], results["eval_sets"]["flickr"]["num_captions"]) == (4, 12)
    assert results["eval_sets"]["flickr"]["image_to_text_chance_R@1"] == pytest.approx(3 / 12)
    bad = subprocess.run([sys.executable, str(ROOT / "train" / "clip.py"), "data.caption_key=caption"],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "data.caption_key='caption': use 'txt'" in bad.stderr.strip().splitlines()[-1]



def test_training_refuses_a_classification_set_among_its_eval_sets_before_it_starts(tmp_path):
    """A CLIP_benchmark classification (or multilabel) folder has no captions: a run that would fail only at
    its end evaluating it is refused at once, naming the key."""
    cls = tmp_path / "voc"
    write_tar(cls / "test" / "0.tar", [("s0.png", png(1, 16)), ("s0.cls", b"0")])
    (cls / "test" / "nshards.txt").write_text("1\n")
    (cls / "classnames.txt").write_text("cat\ndog\n")
    proc = subprocess.run([sys.executable, str(ROOT / "train" / "clip.py"), f"data.eval_sets={{voc: {cls}}}",
                           f"output_dir={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (f"data.eval_sets.voc: {cls} is a CLIP_benchmark folder (no captions): retrieval needs captions; it is "
            "scored for classification only: a training run evaluates retrieval") in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "runs").exists()


def test_training_refuses_an_eval_set_without_captions_under_its_key_before_it_starts(tmp_path):
    """Every set of shards is read with data.caption_key: an evaluation set whose captions are elsewhere would
    lose every sample, found only when it is evaluated after training; the first shard is looked at first."""
    urls = _shards(tmp_path / "json", txt=False)
    txt_only = _shards(tmp_path / "txt", txt=True, json_field=None)
    proc = subprocess.run([sys.executable, str(ROOT / "train" / "clip.py"), f"data.train={urls}", f"data.val={urls}",
                           "data.caption_key=json:caption", f"data.eval_sets={{plain: '{txt_only}'}}",
                           "train.batch_size=4", "train.max_steps=2", f"output_dir={tmp_path / 'runs'}"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert (f"data.eval_sets.plain: shard {tmp_path / 'txt' / 's-000000.tar'} has no captions where "
            "data.caption_key='json:caption' looks (a KEY.json field 'caption') in any of its 4 images") in last
    assert "train:" not in proc.stderr and not (tmp_path / "runs").exists()
