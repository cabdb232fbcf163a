"""magclip's zero-shot retrieval against CLIP_benchmark's own, on CLIP_benchmark-form sets made from the synthetic
validation scenes, for one checkpoint (the main job's by default).

    python train/clip.py name=main_job                                   # the checkpoint (or pass another)
    python benchmarks/bench_clip_benchmark_parity.py --checkpoint runs/main_job --out benchmarks/results/cb_parity.json

Sets, written with CLIP_benchmark's own `convert_retrieval_dataset`:
- multi: every scene with three captions (magclip.data.synthetic.scene_captions: colour+shape+position,
  colour+shape, shape+position of every object), KEY.txt one caption a line. About half the scenes share a
  caption string with another scene: identical captions embed identically, and an image query then ties its
  own caption with another image's. CLIP_benchmark's torch.topk breaks such a tie by position and counts
  some of them as hits; magclip never counts a tie for the query (magclip.metrics.retrieval);
- multi_unique: the scenes whose three captions no other scene has (no ties: the two must agree exactly);
- long: one caption per scene behind a preamble longer than the text tower's context, so every caption is
  cut to the same tokens;
- objects: multilabel classification (CLIP_benchmark's `convert_dataset(..., multilabel=True)`, VOC2007's form):
  the classes are the 24 colour-shape pairs, an image's labels the pairs it shows; scored by mean average
  precision (CLIP_benchmark's `zeroshot_classification.evaluate`).
Each is scored by CLIP_benchmark (`zeroshot_retrieval.evaluate`, cosine on open_clip's model loaded from the
checkpoint's `local-dir:` folder) and by magclip (`eval/zeroshot.py --mode cosine`, scoring by image), and by
the previous magclip reading (the joined lines as one caption, ties credited to the query) where a checkout of
it is given (`--before PATH`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LONG_PREAMBLE = " ".join(["a rendered test scene on a black background showing"] * 4)


def scenes() -> list[tuple[bytes, dict]]:
    from magclip.data.synthetic import ensure_synthetic
    from magclip.data.urls import check_sources_exist

    out = []
    for shard in check_sources_exist(ensure_synthetic().val_urls):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar}
        for name in sorted(members):
            if name.endswith(".png"):
                out.append((members[name], json.loads(members[name[:-4] + ".json"])))
    return out


def write_sets(folder: Path) -> dict[str, Path]:
    from clip_benchmark.webdataset_builder import convert_retrieval_dataset

    from magclip.data.synthetic import scene_captions

    rows = [(png, scene_captions(meta["objects"])) for png, meta in scenes()]
    count = Counter(c for _, captions in rows for c in captions)
    sets = {"multi": rows,
            "multi_unique": [(png, captions) for png, captions in rows if all(count[c] == 1 for c in captions)],
            "long": [(png, [f"{LONG_PREAMBLE} {captions[0]}"]) for png, captions in rows]}
    out = {}
    for name, data in sets.items():
        if not (folder / name / "test" / "nshards.txt").is_file():
            convert_retrieval_dataset(data, "test", str(folder / name), image_format="png", verbose=False)
        out[name] = folder / name
    out["objects"] = write_multilabel_set(folder / "objects")
    return out


def write_multilabel_set(root: Path) -> Path:
    """Every scene labelled with the colour-shape pairs it shows, over all 24 pairs."""
    from clip_benchmark.webdataset_builder import convert_dataset

    from magclip.data.synthetic import COLOURS, SHAPES

    classes = [f"{c} {s}" for c in COLOURS for s in SHAPES]
    if not (root / "test" / "nshards.txt").is_file():
        rows = []
        for png, meta in scenes():
            present = {f"{o['colour']} {o['shape']}" for o in meta["objects"]}
            rows.append((png, torch.tensor([float(c in present) for c in classes])))
        convert_dataset(rows, "test", str(root), image_format="png", multilabel=True, verbose=False)
        (root / "classnames.txt").write_text("".join(c + "\n" for c in classes))
        (root / "zeroshot_classification_templates.txt").write_text("a {c}\na rendered scene with a {c}\n")
    return root


def clip_benchmark_numbers(step: Path, root: Path) -> dict[str, float]:
    import open_clip
    from clip_benchmark.datasets.builder import build_wds_dataset
    from clip_benchmark.metrics import zeroshot_classification, zeroshot_retrieval

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{step}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{step}")
    dataset = build_wds_dataset("wds_synthetic", preprocess, split="test", data_dir=str(root))
    if dataset.classes is not None:  # the multilabel set: torch's collate makes the label vectors a tensor
        loader = torch.utils.data.DataLoader(dataset, batch_size=64)
        return zeroshot_classification.evaluate(model.eval(), loader, tokenizer, dataset.classes, dataset.templates,
                                                "cpu", amp=False)
    loader = torch.utils.data.DataLoader(dataset.batched(64), batch_size=None)
    m = zeroshot_retrieval.evaluate(model.eval(), loader, tokenizer, "cpu", amp=False, recall_k_list=[1, 5, 10])
    return {f"{d}_R@{k}": m[f"{cb}_retrieval_recall@{k}"] for k in (1, 5, 10)
            for d, cb in (("image_to_text", "text"), ("text_to_image", "image"))}


def magclip_numbers(checkout: Path, step: Path, root: Path, out: Path) -> dict:
    cmd = [sys.executable, str(checkout / "eval" / "zeroshot.py"), "--checkpoint", str(step), "--mode", "cosine",
           "--data", f"set={root if (checkout / 'magclip' / 'data' / 'clip_benchmark.py').is_file() else root / 'test'}",
           "--out", str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env={**_env(), "PYTHONPATH": str(checkout)})
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1]}
    m = json.loads(out.read_text())["sets"]["set"]
    if "classification" in m["metrics"]:
        return m["metrics"]["classification"]["all"]
    warning = [line for line in proc.stderr.splitlines() if "longer than the text tower" in line]
    return {**{k: v for k, v in m["metrics"]["retrieval"].items() if "R@" in k or "caption" in k or k == "num_samples"},
            "warning": warning[0].split("WARNING ")[-1] if warning else None}


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="runs/main_job", help="a run folder or step folder of a CLIP run")
    p.add_argument("--sets", default="/tmp/magclip_cb_sets", help="where the CLIP_benchmark-form sets are written")
    p.add_argument("--before", help="a checkout of an earlier magclip, scored the same way")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cb_parity.json"))
    args = p.parse_args()
    from magclip.evaluation.checkpoint import resolve_checkpoint

    step = resolve_checkpoint(args.checkpoint)
    sets = write_sets(Path(args.sets))
    report: dict = {"checkpoint": str(step), "sets": {}}
    for name, root in sets.items():
        entry = {"clip_benchmark": clip_benchmark_numbers(step, root),
                 "magclip": magclip_numbers(ROOT, step, root, Path(args.sets) / f"{name}.magclip.json")}
        if args.before:
            entry["before"] = magclip_numbers(Path(args.before), step, root, Path(args.sets) / f"{name}.before.json")
        report["sets"][name] = entry
        print(f"\n{name}:")
        for who, m in entry.items():
            print(f"  {who:15s} " + "  ".join(f"{k} {100 * m[k]:.2f}" for k in (
                "image_to_text_R@1", "image_to_text_R@5", "text_to_image_R@1", "text_to_image_R@5",
                "mean_average_precision") if k in m)
                  + (f"  ({m['error']})" if "error" in m else ""))
            if m.get("warning"):
                print(f"  {'':15s} {m['warning']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{args.out}")


if __name__ == "__main__":
    main()
