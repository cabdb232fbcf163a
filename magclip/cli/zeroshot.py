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

Classification on an image folder (DIR/<class>/<image>, torchvision's ImageFolder, CLIP_benchmark's
--dataset_root layout; no shards, no labels file): the classes are its folders, named by the folder names
('_' as spaces) or by --classes; CLIP_benchmark's JSON files (en_classnames.json: {data set: [names]},
en_zeroshot_classification_templates.json: {data set: [templates with "{c}"]}) give the entry of the set's
NAME (then the folder's name, or --class-set KEY; templates fall back to "imagenet1k" like CLIP_benchmark):
    python eval/zeroshot.py --checkpoint runs/x --data eurosat=~/data/eurosat/test --classes en_classnames.json \\
        --templates en_zeroshot_classification_templates.json --out r.json
    python eval/zeroshot.py --checkpoint runs/x --data ~/data/pets/test --templates 'a photo of a {c}.' --workers 4 \\
        --out r.json
Plain names in --classes (.txt, a JSON list or a dict entry) match the sorted folders in order, as in
CLIP_benchmark; results record the name each folder was scored as (sets.<set>.classification.folder_classes).
Unreadable images are skipped and counted (sets.<set>.counts.skipped). A folder holding .tar files is its shards.

A plain open_clip model (pretrained tag or local file; random init without --pretrained):
    python eval/zeroshot.py --model ViT-B-32 --pretrained laion2b_s34b_b79k --mode cosine --data SHARDS --out r.json
    python eval/zeroshot.py --model tiny-resnet --mode qnorm --emoji ../shared/data/emoji --out /tmp/r.json

--mode overrides both directions (fixed/learnable need --gamma-q and --gamma-d). results.json is
written atomically once everything is computed. --save-embeddings DIR writes, in sample order (per set
in a sub-folder when there are several sets):
    image_features.npy   [N, D] float32, raw (unnormalized: the Scorer's exponents are applied at scoring)
    text_features.npy    [N, D] float32, raw (retrieval sets)
    captions.jsonl       one JSON string per line: the caption each text feature encodes (retrieval sets)
    keys.txt             the sample keys (an image folder: paths relative to it)
    labels.npy           class index per sample (classification)
    classes/             class-text features [C, T, D] per template and the class names (per set, in the
                         set's sub-folder, when sets have class lists or templates of their own)

Top-k accuracy is reported for k in (1, 5) up to the number of classes (3 classes: top-1 only).
"""

from __future__ import annotations

import argparse
import logging
import re

from magclip.cli import UsageError, as_command, check_paths
from magclip.cli.clip_args import add_clip_model_arguments, check_clip_model_arguments, load_clip_model
from magclip.config import MATCHINGS
from magclip.data.eval_sets import EvalSet, eval_set_inputs, lookup_keys, resolve_eval_set
from magclip.evaluation import ZEROSHOT_TASKS as TASKS
from magclip.metrics.ranks import write_results_with_outcomes

_NAMED = re.compile(r"^([A-Za-z0-9_.-]+)=(.+)$")


def parse_data(values: list[str]) -> dict[str, str]:
    """`NAME=SHARDS|DIR` or `SHARDS|DIR` (named 'data', or data1, data2, ... when there are several)."""
    out: dict[str, str] = {}
    for i, value in enumerate(values):
        m = _NAMED.match(value)
        name, urls = (m.group(1), m.group(2)) if m else ("data" if len(values) == 1 else f"data{i + 1}", value)
        if name in out:
            raise UsageError(f"--data: set name {name!r} given twice")
        out[name] = urls
    return out


def check_inputs(args: argparse.Namespace) -> dict[str, EvalSet]:
    """Local inputs exist and each --data set's layout is recognised (magclip.data.eval_sets: a CLIP_benchmark
    folder, a Karpathy split file, an image folder, shards), before torch, open_clip or a model is loaded; a
    local folder that is none of them is an error naming it."""
    check_paths(args, "checkpoint", "emoji", "classes", "images")
    return {name: resolve_eval_set(name, path, split=args.split, matching=args.matching, caption_key=args.caption_key,
                                   images=args.images, where=f"--data {name}")
            for name, path in parse_data(args.data).items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_clip_model_arguments(p)
    data = p.add_argument_group("data")
    data.add_argument("--data", action="append", default=[], metavar="[NAME=]SHARDS|DIR",
                      help="webdataset shards (brace patterns, '::' between sources, a folder of .tar), or an "
                           "image folder DIR/<class>/<image> (torchvision's ImageFolder: classification over its "
                           "folders); repeat for several sets")
    data.add_argument("--emoji", metavar="DIR", help="the emoji benchmark folder (splits.json, emoji_index.jsonl)")
    data.add_argument("--splits", nargs="+", help="with --emoji: only these splits")
    data.add_argument("--task", choices=(*TASKS, "both"),
                      help="default: the set's own (a CLIP_benchmark folder's dataset_type.txt, classification for "
                           "an image folder, retrieval for a Karpathy or COCO caption file); shards: both with a class list (or "
                           "--emoji), else retrieval")
    data.add_argument("--split", help="split of a CLIP_benchmark folder (ROOT/<split>/, default test, as CLIP_benchmark) "
                                      "or of a Karpathy file (default test)")
    data.add_argument("--matching", choices=MATCHINGS,
                      help="retrieval relevance: image (a caption is relevant to its own image only: CLIP_benchmark's, "
                           "the default for its folders and Karpathy files) or caption (caption identity: identical "
                           "captions count as one; the default for shards)")
    data.add_argument("--caption-key", help="where shard captions are: txt (KEY.txt, one caption a line; default) or "
                                            "json:FIELD (a KEY.json field holding a caption or a list of captions)")
    data.add_argument("--images", metavar="DIR", help="with a Karpathy split file or a COCO caption file: the images "
                                                      "folder (default: the file's folder; Karpathy's COCO: "
                                                      "DIR/<filepath>/<filename>; captions_val2014.json: DIR/<file_name>, "
                                                      "DIR the val2014 folder)")
    data.add_argument("--workers", type=int, default=0, help="DataLoader processes reading image folders (%(default)s)")
    cls = p.add_argument_group("classification")
    cls.add_argument("--classes", help="class list: .txt (one name a line), .json (a list, CLIP_benchmark's "
                     "{data set: [names]} dict, or {key: name}) or .jsonl; an image folder's default: its folder "
                     "names, '_' as spaces; plain names match its sorted folders in order")
    cls.add_argument("--class-set", metavar="KEY", help="entry of {data set: ...} JSON class/template files "
                     "(default: the set's NAME, then its folder's name)")
    cls.add_argument("--class-name-field", default="name", help="name field of JSON class objects (%(default)s)")
    cls.add_argument("--class-key-field", help="field matched against sample labels (default: the index)")
    cls.add_argument("--class-group-field", help="group field (e.g. category) for --exclude-group and per-group top-1")
    cls.add_argument("--label-field", help="KEY.json field holding the label (default: KEY.cls)")
    cls.add_argument("--exclude-group", action="append", default=[], help="also report without this group")
    cls.add_argument("--templates", nargs="+", help="prompt templates: identity (default), simple, openai, "
                     "a .txt file (one a line), a .json file (a list, or CLIP_benchmark's {data set: [templates]}, "
                     "else its 'imagenet1k' entry), or strings with '{}' or '{c}'")
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
    check_clip_model_arguments(args)
    if bool(args.emoji) == bool(args.data):
        raise UsageError("give --data SHARDS|DIR (one or more) or --emoji DIR")
    if args.emoji and (args.split or args.matching or args.caption_key or args.images):
        raise UsageError("--split, --matching, --caption-key and --images go with --data, not --emoji")
    eval_sets = check_inputs(args)

    import torch

    from magclip.data.classes import resolve_templates
    from magclip.evaluation.emoji import emoji_benchmark
    from magclip.evaluation.zeroshot import evaluate_zeroshot, format_zeroshot_table

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    exclude = list(args.exclude_group)
    set_info, label_field = None, args.label_field
    if args.emoji:
        bench = emoji_benchmark(args.emoji, args.splits)
        data, classes, set_info = bench["data"], bench["classes"], bench["set_info"]
        label_field = label_field or bench["label_field"]
        exclude = exclude or list(bench["exclude_groups"])
        templates = resolve_templates(args.templates, lookup_keys("emoji", None, args.class_set))
        tasks = {name: TASKS if args.task in (None, "both") else (args.task,) for name in data}
    else:  # per set: CLIP_benchmark's JSON files hold an entry per data set, its folders and image folders their own
        data = eval_sets
        inputs = {name: eval_set_inputs(name, es, task=args.task, classes=args.classes, templates=args.templates,
                                        class_set=args.class_set, where=f"--data {name}",
                                        classes_hint="--classes (or --emoji)", name_field=args.class_name_field,
                                        key_field=args.class_key_field, group_field=args.class_group_field)
                  for name, es in data.items()}
        tasks = {name: i.tasks for name, i in inputs.items()}
        classes = {name: i.classes for name, i in inputs.items()}
        templates = {name: i.templates for name, i in inputs.items()}

    model = load_clip_model(args, args.device)
    results = evaluate_zeroshot(model, data, tasks=tasks, classes=classes,
                                templates=templates, label_field=label_field, exclude_groups=exclude,
                                set_info=set_info, batch_size=args.batch_size, device=args.device,
                                workers=args.workers, save_embeddings=args.save_embeddings,
                                export_index=args.export_index)
    write_results_with_outcomes(args.out, results)  # per-query outcomes beside it: <stem>.queries.npz / .ranks.npz
    print(format_zeroshot_table(results))
    print(f"results: {args.out}" + (f"   embeddings: {args.save_embeddings}" if args.save_embeddings else ""))
    return results



console = as_command(main)  # the installed command and the launcher: expected errors in one line

if __name__ == "__main__":
    console()
