"""Zero-shot retrieval and classification, scored with the evaluated model's own Scorer.

open_clip's zero-shot code and CLIP_benchmark score every model as cosine x 100; this scores a
magclip checkpoint with the mode and exponents it recorded per direction (magclip.json), or any
open_clip model with the mode you choose. Library: `magclip.evaluation.zeroshot` (its docstring has the
prototype rule per mode and the data format).

A magclip checkpoint (a run folder -> checkpoints/latest, a step folder, or its weights file):
    python eval/zeroshot.py --checkpoint runs/emoji --data '../shared/data/emoji/id_novel-000000.tar' --out results.json
    python eval/zeroshot.py --checkpoint runs/emoji/checkpoints/step_00000250 --data SHARDS --mode qnorm --out r.json \\
        --save-embeddings emb/

Several named sets in one run (the model and class prototypes are built once):
    python eval/zeroshot.py --checkpoint runs/emoji --data id=SHARDS_A --data ood=SHARDS_B --out r.json

The emoji benchmark: retrieval on each split + 1,906-way classification over emoji names, in-domain
(google+twitter) vs out-of-domain (openmoji), with and without Flags:
    python eval/zeroshot.py --checkpoint runs/emoji --emoji ../shared/data/emoji --out runs/emoji/zeroshot.json

Classification on any shards with a label in KEY.cls (index or class key) or a KEY.json field:
    python eval/zeroshot.py --checkpoint runs/x --data 'val-{000..003}.tar' --task classification \\
        --classes classnames.txt --templates openai --out r.json
    python eval/zeroshot.py --checkpoint runs/x --data SHARDS --classes classes.jsonl --class-name-field name \\
        --class-key-field id --label-field class_id --out r.json

A plain open_clip model (pretrained tag or local file; random init without --pretrained):
    python eval/zeroshot.py --model ViT-B-32 --pretrained laion2b_s34b_b79k --mode cosine --data SHARDS --out r.json
    python eval/zeroshot.py --model tiny-resnet --mode qnorm --emoji ../shared/data/emoji --out /tmp/r.json

--mode overrides both directions (fixed/learnable need --gamma-q and --gamma-d). results.json is
written atomically once everything is computed. --save-embeddings DIR writes, in sample order (per set
in a sub-folder when there are several sets):
    image_features.npy   [N, D] float32, raw (unnormalized: the Scorer's exponents are applied at scoring)
    text_features.npy    [N, D] float32, raw (retrieval sets)
    captions.jsonl       one JSON string per line: the caption each text feature encodes (retrieval sets)
    keys.txt             the sample keys
    labels.npy           class index per sample (classification)
    classes/             class-text features [C, T, D] per template and the class names
"""

from __future__ import annotations

import argparse
import logging
import re

from magclip.cli import UsageError, as_command, check_paths, check_scorer_flags
from magclip.data.urls import check_sources_exist
from magclip.evaluation import ZEROSHOT_TASKS as TASKS
from magclip.io import atomic_write_json
from magclip.modes import MODES


_NAMED = re.compile(r"^([A-Za-z0-9_.-]+)=(.+)$")


def parse_data(values: list[str]) -> dict[str, str]:
    """`NAME=SHARDS` or `SHARDS` (named 'data', or data1, data2, ... when there are several)."""
    out: dict[str, str] = {}
    for i, value in enumerate(values):
        m = _NAMED.match(value)
        name, urls = (m.group(1), m.group(2)) if m else ("data" if len(values) == 1 else f"data{i + 1}", value)
        if name in out:
            raise UsageError(f"--data: set name {name!r} given twice")
        out[name] = urls
    return out


def check_inputs(args: argparse.Namespace) -> None:
    """Local inputs exist: named before torch, open_clip or a model is loaded."""
    check_paths(args, "checkpoint", "emoji", "classes")
    for name, urls in parse_data(args.data).items():
        check_sources_exist(urls, f"--data {name}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model (one of --checkpoint or --model)")
    src.add_argument("--checkpoint", help="magclip run folder, checkpoint step folder, or its weights file")
    src.add_argument("--model", help="open_clip model name / magclip/models/configs name / JSON config (no magclip.json)")
    src.add_argument("--pretrained", help="with --model: open_clip pretrained tag or a local weights file")
    src.add_argument("--mode", choices=MODES, help="score both directions with this mode (default: the "
                     "checkpoint's own scorers; cosine for --model)")
    src.add_argument("--gamma-q", type=float, help="with --mode fixed/learnable")
    src.add_argument("--gamma-d", type=float, help="with --mode fixed/learnable")
    data = p.add_argument_group("data")
    data.add_argument("--data", action="append", default=[], metavar="[NAME=]SHARDS",
                      help="webdataset shards (brace patterns, '::' between sources); repeat for several sets")
    data.add_argument("--emoji", metavar="DIR", help="the emoji benchmark folder (splits.json, emoji_index.jsonl)")
    data.add_argument("--splits", nargs="+", help="with --emoji: only these splits")
    data.add_argument("--task", choices=(*TASKS, "both"),
                      help="default: both with a class list (or --emoji), else retrieval")
    cls = p.add_argument_group("classification")
    cls.add_argument("--classes", help="class list: .txt (one name a line), .json or .jsonl")
    cls.add_argument("--class-name-field", default="name", help="name field of JSON class objects (%(default)s)")
    cls.add_argument("--class-key-field", help="field matched against sample labels (default: the index)")
    cls.add_argument("--class-group-field", help="group field (e.g. category) for --exclude-group and per-group top-1")
    cls.add_argument("--label-field", help="KEY.json field holding the label (default: KEY.cls)")
    cls.add_argument("--exclude-group", action="append", default=[], help="also report without this group")
    cls.add_argument("--templates", nargs="+", help="prompt templates: identity (default), simple, openai, "
                     "a file (one format string a line), or strings with '{}'")
    out = p.add_argument_group("output")
    out.add_argument("--out", required=True, help="results JSON (written atomically)")
    out.add_argument("--save-embeddings", metavar="DIR", help="write raw features and keys here")
    out.add_argument("--export-index", metavar="DIR",
                     help="write a serving index per set and direction: prepared document vectors, ids, the scorer "
                          "(and faiss IndexFlatIP with the [faiss] extra); plain open_clip's normalised features "
                          "would score every model as cosine")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if bool(args.checkpoint) == bool(args.model):
        raise UsageError("give exactly one of --checkpoint or --model")
    if args.pretrained and not args.model:
        raise UsageError("--pretrained goes with --model (a checkpoint's weights come from --checkpoint)")
    if bool(args.emoji) == bool(args.data):
        raise UsageError("give --data SHARDS (one or more) or --emoji DIR")
    check_scorer_flags(args.mode, args.gamma_q, args.gamma_d)
    check_inputs(args)

    import torch

    from magclip.evaluation.checkpoint import load_checkpoint, load_open_clip
    from magclip.evaluation.emoji import emoji_benchmark
    from magclip.data.classes import load_classes, resolve_templates
    from magclip.evaluation.zeroshot import evaluate_zeroshot, format_zeroshot_table

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    exclude = list(args.exclude_group)
    set_info, label_field = None, args.label_field
    if args.emoji:
        bench = emoji_benchmark(args.emoji, args.splits)
        data, classes, set_info = bench["data"], bench["classes"], bench["set_info"]
        label_field = label_field or bench["label_field"]
        exclude = exclude or list(bench["exclude_groups"])
    else:
        data = parse_data(args.data)
        classes = (load_classes(args.classes, name_field=args.class_name_field, key_field=args.class_key_field,
                                group_field=args.class_group_field) if args.classes else None)
    task = args.task or ("both" if classes is not None else "retrieval")
    tasks = TASKS if task == "both" else (task,)
    if "classification" in tasks and classes is None:
        raise UsageError("--task classification needs --classes (or --emoji)")
    templates = resolve_templates(args.templates)

    if args.checkpoint:
        model = load_checkpoint(args.checkpoint, mode=args.mode, gamma_q=args.gamma_q, gamma_d=args.gamma_d,
                                device=args.device)
    else:
        model = load_open_clip(args.model, args.pretrained, mode=args.mode or "cosine", gamma_q=args.gamma_q,
                               gamma_d=args.gamma_d, device=args.device)
    results = evaluate_zeroshot(model, data, tasks=tasks, classes=classes if "classification" in tasks else None,
                                templates=templates, label_field=label_field, exclude_groups=exclude,
                                set_info=set_info, batch_size=args.batch_size, device=args.device,
                                save_embeddings=args.save_embeddings, export_index=args.export_index)
    atomic_write_json(args.out, results)
    print(format_zeroshot_table(results))
    print(f"results: {args.out}" + (f"   embeddings: {args.save_embeddings}" if args.save_embeddings else ""))
    return results



console = as_command(main)  # the installed command and the launcher: expected errors in one line

if __name__ == "__main__":
    console()
