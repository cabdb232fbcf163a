"""The benchmark suite: one YAML, several sets, one table; per-set results equal to eval/zeroshot.py's; a killed
suite continues; two checkpoints' suites compare query by query."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from builders import png, write_tar

from magclip.evaluation.suite import load_suite
from magclip.experiments.paired import compare_suites
from magclip.models.clip import create_clip

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("eval_suite", ROOT / "eval" / "suite.py")
eval_suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_suite)
spec = importlib.util.spec_from_file_location("eval_zeroshot", ROOT / "eval" / "zeroshot.py")
eval_zeroshot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_zeroshot)

COLOURS = ["red", "blue", "green", "yellow"]


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory) -> Path:
    """Two tiny sets and a suite naming them by relative paths: a CLIP_benchmark-style retrieval folder with
    2 captions per image, and classification shards with KEY.cls."""
    root = tmp_path_factory.mktemp("suite")
    members = []
    for i in range(12):
        members += [(f"s{i:07d}.png", png(i, 16)), (f"s{i:07d}.txt", f"a {COLOURS[i % 4]} thing {i}\nshape {i}".encode())]
    write_tar(root / "retr" / "test" / "0.tar", members)
    (root / "retr" / "test" / "nshards.txt").write_text("1\n")
    (root / "retr" / "dataset_type.txt").write_text("retrieval\n")
    write_tar(root / "cls" / "c-000000.tar", [m for i in range(12) for m in
                                             ((f"k{i}.png", png(50 + i, 16)), (f"k{i}.cls", str(i % 4).encode()))])
    (root / "classes.txt").write_text("".join(c + "\n" for c in COLOURS))
    (root / "suite.yaml").write_text(yaml.safe_dump({"sets": {
        "coco_like": {"path": "retr"},
        "colours": {"path": "cls/c-000000.tar", "task": "classification", "classes": "classes.txt",
                    "templates": ["a photo of a {c} thing."]}}}))
    return root


def _weights(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    torch.save(create_clip("tiny-resnet", None).model.clip.state_dict(), path)
    return path


def _two_checkpoints_suites(suite: Path, tmp_path: Path) -> list[Path]:
    """The suite run for two random-init checkpoints (seeds 0 and 1): their output folders."""
    outs = []
    for seed in (0, 1):
        out = tmp_path / f"s{seed}"
        eval_suite.main(["--suite", str(suite), "--model", "tiny-resnet", "--pretrained",
                         str(_weights(tmp_path / f"{seed}.pt", seed)), "--out", str(out)])
        outs.append(out)
    return outs


def test_suite_table_equals_each_set_alone_and_resumes(suite_dir, tmp_path):
    weights = _weights(tmp_path / "a.pt", 0)
    out = tmp_path / "out"
    model = ["--model", "tiny-resnet", "--pretrained", str(weights)]
    summary = eval_suite.main(["--suite", str(suite_dir / "suite.yaml"), *model, "--out", str(out), "--cosine-too"])
    alone = eval_zeroshot.main([*model, "--data", f"coco_like={suite_dir / 'retr'}", "--out", str(tmp_path / "z.json")])
    in_suite = json.loads((out / "sets" / "coco_like.json").read_text())
    assert in_suite["sets"]["coco_like"]["metrics"] == json.loads(json.dumps(alone["sets"]["coco_like"]["metrics"]))
    rows = {r["set"]: r for r in csv.DictReader((out / "suite.csv").open())}
    assert list(rows) == ["coco_like", "coco_like (cosine)", "colours", "colours (cosine)", "mean", "mean (cosine)"]
    retrieval = in_suite["sets"]["coco_like"]["metrics"]["retrieval"]
    assert float(rows["coco_like"]["i2t_R@1"]) == pytest.approx(retrieval["image_to_text_R@1"])
    assert float(rows["coco_like"]["main"]) == pytest.approx((retrieval["image_to_text_R@1"]
                                                              + retrieval["text_to_image_R@1"]) / 2)
    assert float(rows["mean"]["main"]) == pytest.approx((float(rows["coco_like"]["main"]) + float(rows["colours"]["main"])) / 2)
    assert summary["rows"][-1]["set"] == "mean (cosine)" and "| mean |" in (out / "suite.md").read_text()
    # a second run finds both sets finished and evaluates nothing
    before = (out / "sets" / "colours.json").stat().st_mtime_ns
    eval_suite.main(["--suite", str(suite_dir / "suite.yaml"), *model, "--out", str(out), "--cosine-too"])
    assert (out / "sets" / "colours.json").stat().st_mtime_ns == before


def test_two_checkpoints_compare_query_by_query(suite_dir, tmp_path):
    outs = _two_checkpoints_suites(suite_dir / "suite.yaml", tmp_path)
    found, skipped = compare_suites(*outs, n_resamples=200)
    keys = {m.row_key for m in found}
    assert {"coco_like/image_to_text_R@1", "coco_like/text_to_image_R@10", "colours/top1"} <= keys and not skipped
    by_key = {m.row_key: m for m in found}
    a = json.loads((outs[0] / "sets" / "colours.json").read_text())["sets"]["colours"]["metrics"]["classification"]
    b = json.loads((outs[1] / "sets" / "colours.json").read_text())["sets"]["colours"]["metrics"]["classification"]
    assert by_key["colours/top1"].diff == pytest.approx(b["all"]["top1"] - a["all"]["top1"])
    assert by_key["coco_like/text_to_image_R@1"].n_queries == 24  # every caption is a text->image query


def test_a_suite_with_a_missing_set_is_refused_before_the_model_loads(suite_dir, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"root": str(suite_dir), "sets": {"there": {"path": "retr"},
                                                                    "gone": {"path": "wds_nothing"}}}))
    proc = subprocess.run([sys.executable, str(ROOT / "eval" / "suite.py"), "--suite", str(bad), "--model",
                           "no-such-model", "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "wds_nothing" in proc.stderr.strip().splitlines()[-1]
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"sets": {"x": {"path": "retr", "spilt": "test"}}}))
    with pytest.raises(ValueError, match=r"unknown config key 'sets.x.spilt'"):
        load_suite(typo)
    suite = load_suite(bad, only=["there"])
    assert list(suite.sets) == ["there"] and suite.root == suite_dir


def test_the_shipped_suites_parse():
    for path in sorted((ROOT / "configs" / "suites").glob("*.yaml")):
        suite = load_suite(path)
        assert suite.sets, path


def test_a_suite_is_prepared_whole_before_the_model_loads(suite_dir, tmp_path):
    """Every set's layout, tasks, class list and templates are read before any model loads: shards classified
    without a class list are refused, naming the set."""
    from magclip.evaluation.suite import prepare_suite

    prepared = prepare_suite(load_suite(suite_dir / "suite.yaml"))
    assert {name: inputs.tasks for name, (_, inputs) in prepared.sets.items()} == {
        "coco_like": ("retrieval",), "colours": ("classification",)}
    assert prepared.sets["colours"][1].classes.names == COLOURS
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"root": str(suite_dir), "sets": {
        "colours": {"path": "cls/c-000000.tar", "task": "classification"}}}))
    with pytest.raises(ValueError, match=r"set colours: classification of shards needs classes:"):
        prepare_suite(load_suite(bad))


def test_a_multilabel_set_in_a_suite_is_its_mean_average_precision_and_pairs_by_class(tmp_path):
    """A CLIP_benchmark multilabel folder: the table's mAP and main are its mean average precision, and two
    checkpoints pair class by class on each class's AP."""
    import io

    import numpy as np

    members = []
    for i in range(16):
        buf = io.BytesIO()
        np.save(buf, np.array([i % 2, i % 3 == 0, 1, i % 4 == 1], dtype=np.float32))
        members += [(f"s{i:07d}.png", png(300 + i, 16)), (f"s{i:07d}.npy", buf.getvalue())]
    root = tmp_path / "voc"
    write_tar(root / "test" / "0.tar", members)
    (root / "test" / "nshards.txt").write_text("1\n")
    (root / "dataset_type.txt").write_text("multilabel\n")
    (root / "classnames.txt").write_text("".join(c + "\n" for c in COLOURS))
    (root / "zeroshot_classification_templates.txt").write_text("a photo of a {c} thing.\n")
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump({"sets": {"voc": {"path": "voc"}}}))
    outs = _two_checkpoints_suites(tmp_path / "suite.yaml", tmp_path)
    results = [json.loads((o / "sets" / "voc.json").read_text())["sets"]["voc"]["metrics"]["classification"]["all"]
               for o in outs]
    row = next(csv.DictReader((outs[0] / "suite.csv").open()))
    assert float(row["mAP"]) == pytest.approx(results[0]["mean_average_precision"]) == pytest.approx(float(row["main"]))
    assert row["top1"] == "" and "| mAP | main |" in (outs[0] / "suite.md").read_text()
    found, skipped = compare_suites(*outs, n_resamples=200)
    (ap,) = [m for m in found if m.row_key == "voc/AP"]
    assert ap.n_queries == len(COLOURS) and not skipped
    assert ap.diff == pytest.approx(results[1]["mean_average_precision"] - results[0]["mean_average_precision"])


def test_main_is_the_metric_an_entry_names_and_a_metric_the_set_lacks_is_refused(suite_dir, tmp_path):
    """DataComp scores Caltech-101, FGVC Aircraft, Flowers-102 and Pets by mean per-class recall: an entry's
    main_metric picks the column `main` takes, the table names it, and changing it re-reads no set."""
    from magclip.evaluation.suite import prepare_suite

    labels = [0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 3, 3]  # unbalanced: top-1 and mean per-class recall differ
    write_tar(tmp_path / "cls" / "c-000000.tar", [m for i, y in enumerate(labels) for m in
                                                  ((f"k{i}.png", png(70 + i, 16)), (f"k{i}.cls", str(y).encode()))])
    spec = yaml.safe_load((suite_dir / "suite.yaml").read_text())
    spec["sets"]["coco_like"]["path"] = str(suite_dir / "retr")
    spec["sets"]["colours"].update(path="cls/c-000000.tar", classes=str(suite_dir / "classes.txt"))
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(spec))
    spec["sets"]["colours"]["main_metric"] = "mean_per_class_recall"
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    model = ["--model", "tiny-resnet", "--pretrained", str(_weights(tmp_path / "a.pt", 0)), "--out", str(out)]
    eval_suite.main(["--suite", str(tmp_path / "plain.yaml"), *model])
    assert next(r for r in csv.DictReader((out / "suite.csv").open()) if r["set"] == "colours")["main_metric"] == "top1"
    before = (out / "sets" / "colours.json").stat().st_mtime_ns
    eval_suite.main(["--suite", str(tmp_path / "suite.yaml"), *model])
    assert (out / "sets" / "colours.json").stat().st_mtime_ns == before  # only the table changed
    rows = {r["set"]: r for r in csv.DictReader((out / "suite.csv").open())}
    assert rows["colours"]["main_metric"] == "mean_per_class_recall"
    assert float(rows["colours"]["main"]) == pytest.approx(float(rows["colours"]["mean_per_class_recall"]))
    assert float(rows["colours"]["main"]) != pytest.approx(float(rows["colours"]["top1"]))  # a real difference
    assert rows["coco_like"]["main_metric"] == "mean_R@1"
    assert "| main is |" in (out / "suite.md").read_text()
    spec["sets"]["colours"]["main_metric"] = "mAP"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match=r"main_metric mAP needs a multilabel set; colours is scored for classification"):
        prepare_suite(load_suite(tmp_path / "bad.yaml"))
    spec["sets"]["colours"]["main_metric"] = "top_1"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match=r"sets\.colours\.main_metric 'top_1'; allowed: mean_R@1, top1"):
        load_suite(tmp_path / "bad.yaml")
