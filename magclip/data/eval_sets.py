"""What an evaluation set path is, told apart by its layout before anything heavy loads.

`resolve_eval_set(name, path, ...)` recognises, in this order:

| layout | what the path is | task | relevance (`matching`) |
|---|---|---|---|
| clip_benchmark | a CLIP_benchmark webdataset folder, or one of its split folders (magclip.data.clip_benchmark) | its dataset_type.txt | image |
| karpathy | a Karpathy split file, dataset_coco.json ... (magclip.data.karpathy) | retrieval | image |
| coco_captions | COCO's caption file, captions_val2014.json (magclip.data.coco_captions) | retrieval | image |
| image_folder | class sub-folders of images (torchvision's ImageFolder) | classification | - |
| shards | webdataset shards: a pattern, '::'-joined sources, a folder of .tar; `synthetic:val` the embedded scenes | retrieval, or classification with a class list | caption |

A .json file is told apart by its keys: `images` entries with `sentences` (Karpathy), else `images` and
`annotations` lists (COCO); anything else is refused naming both. Both are read over an images folder
(`images`, default the file's folder) into the same list of images with their captions.

The relevance rule follows the layout: the benchmarks' own sets are scored as their papers and
CLIP_benchmark score them (by image); magclip's and img2dataset's shards by caption identity, which
their duplicate captions need. Either can be asked for (`matching`), and every result records the rule.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from magclip.config import MATCHINGS
from magclip.data.captioned_images import CaptionedImages, is_json_file, read_json
from magclip.data.captions import TXT, CaptionKey
from magclip.data.classes import ClassSet, load_classes, resolve_templates
from magclip.data.clip_benchmark import is_clip_benchmark_folder, open_clip_benchmark_folder, split_folder
from magclip.data.coco_captions import LAYOUT_HELP as COCO_LAYOUT
from magclip.data.coco_captions import CocoCaptionsSet, is_coco_captions_data
from magclip.data.image_folder import ImageFolderSet, resolve_image_folder
from magclip.data.karpathy import KarpathySet, is_karpathy_data
from magclip.data.urls import check_sources_exist

log = logging.getLogger("magclip.data")

TASKS = ("retrieval", "classification")  # the zero-shot tasks (magclip.evaluation.ZEROSHOT_TASKS)
LAYOUT_NAMES = {"clip_benchmark": "a CLIP_benchmark folder", "karpathy": "a Karpathy split file",
                "coco_captions": "a COCO caption file", "image_folder": "an image folder", "shards": "shards"}
SYNTHETIC_PREFIX = "synthetic:"  # synthetic:val / synthetic:train, the embedded scenes (generated on first use)
LAYOUT_MATCHING = {"clip_benchmark": "image", "karpathy": "image", "coco_captions": "image", "shards": "caption",
                   "image_folder": "caption"}
TRAINING_HINT = "a training run evaluates retrieval; classify the set with eval/zeroshot.py or eval/suite.py"


@dataclass
class EvalSet:
    """One named evaluation set, its layout recognised and checked."""

    name: str
    layout: str                     # LAYOUT_MATCHING's keys
    data: str                       # the path or pattern as given
    task: str | None                # the layout's own task; None: shards, retrieval unless a class list is given
    matching: str                   # "image" or "caption" (magclip.metrics.relevance)
    caption_key: str = TXT
    split: str | None = None
    urls: str | None = None         # shards (clip_benchmark: its split's {0..n-1}.tar)
    folder: Path | None = None      # image_folder
    opened: ImageFolderSet | None = None  # image_folder, indexed and matched to its class list
    captioned: CaptionedImages | None = None  # karpathy, coco_captions: the images found, with their captions
    classes: str | None = None      # the layout's class list (clip_benchmark: classnames.txt)
    templates: str | None = None    # the layout's template file (clip_benchmark: zeroshot_classification_templates.txt)
    multilabel: bool = False        # labels are KEY.npy vectors over the classes (a CLIP_benchmark multilabel folder)
    benchmark_root: str | None = None  # a CLIP_benchmark split folder given as `data`: the folder it is a split of

    def refuse_task(self, task: str, where: str, hint: str | None = None) -> ValueError:
        """The error for a task this set's layout cannot do; `hint`: what to do instead (default: --task)."""
        why = " (no captions): retrieval needs captions" if task == "retrieval" else ""
        return ValueError(f"{where}: {self.data} is {LAYOUT_NAMES[self.layout]}{why}; it is scored for {self.task} "
                          f"only: {hint or f'use --task {self.task}'}")

    def describe(self) -> dict[str, object]:
        """What results.json records about where the set came from and how it was read."""
        out: dict[str, object] = {"data": self.data, "layout": self.layout, "matching": self.matching}
        if self.split is not None:
            out["split"] = self.split
        if self.layout in ("shards", "clip_benchmark"):
            out["caption_key"] = self.caption_key
        if self.benchmark_root is not None:
            out["benchmark_root"] = self.benchmark_root
        if self.captioned is not None:
            out.update(self.captioned.describe())
        if self.multilabel:
            out["multilabel"] = True
        return out


def resolve_eval_set(name: str, path: str, *, split: str | None = None, matching: str | None = None,
                     caption_key: str | None = None, images: str | None = None, where: str | None = None) -> EvalSet:
    """The set at `path` (see the module docstring); `where` names the flag or key in errors."""
    where = where or f"data set {name}"
    given = path
    if path.startswith(SYNTHETIC_PREFIX):
        path = synthetic_urls(path, where)
    if matching is not None and matching not in MATCHINGS:
        raise ValueError(f"{where}: matching {matching!r}; allowed: {', '.join(MATCHINGS)}")
    if caption_key is not None:
        CaptionKey(caption_key)
    local = Path(path).expanduser()
    in_split = split_folder(local, split, where) if "::" not in path and "{" not in path else None
    if in_split is not None:  # ROOT/test given: the benchmark it is a split of, scored as ROOT is
        local, split = in_split
        log.info("%s: %s is the split %r of the CLIP_benchmark folder %s: read as that folder's split", where, path,
                 split, local)
    if "::" not in path and "{" not in path and is_clip_benchmark_folder(local):
        folder = open_clip_benchmark_folder(local, split)
        return EvalSet(name, "clip_benchmark", path, folder.task, matching or "image", TXT,  # its captions: KEY.txt
                       folder.split, urls=folder.urls,
                       classes=str(folder.classnames) if folder.classnames is not None else None,
                       templates=str(folder.templates) if folder.templates is not None else None,
                       multilabel=folder.multilabel, benchmark_root=str(local) if in_split is not None else None)
    if is_json_file(local):
        layout, captioned = open_caption_file(local, images, split, where)
        return EvalSet(name, layout, path, "retrieval", matching or "image", TXT, captioned.split, captioned=captioned)
    if split is not None:
        raise ValueError(f"{where}: split {split!r} goes with a CLIP_benchmark folder or a Karpathy split file; "
                         f"{path} is neither")
    if images is not None:
        raise ValueError(f"{where}: images: goes with a Karpathy split file (dataset_coco.json ...) or a COCO caption "
                         f"file (captions_val2014.json), not {path}")
    folder_root = resolve_image_folder(path, where)
    if folder_root is not None:
        return EvalSet(name, "image_folder", path, "classification", matching or "caption", folder=folder_root)
    check_sources_exist(path, where)
    return EvalSet(name, "shards", given, None, matching or "caption", caption_key or TXT, urls=path)


def open_caption_file(source: Path, images: str | None, split: str | None,
                      where: str) -> tuple[str, CaptionedImages]:
    """(layout, the images with their captions) of a .json caption file, its layout told from its keys."""
    data = read_json(source)
    if is_karpathy_data(data):
        return "karpathy", KarpathySet.from_data(source, data, images, split)
    if is_coco_captions_data(data):
        if split is not None:
            raise ValueError(f"{where}: split {split!r}: {source} is a COCO caption file, which holds one split "
                             "(captions_val2014.json is the val split); leave split out")
        return "coco_captions", CocoCaptionsSet.from_data(source, data, images)
    raise ValueError(f"{source}: neither a Karpathy split file ({{\"images\": [{{\"filename\", \"split\", "
                     f"\"sentences\"}}, ...]}}, as dataset_coco.json) nor a COCO caption file ({COCO_LAYOUT})")


def resolve_retrieval_set(name: str, path: str, *, hint: str, matching: str | None = None,
                          caption_key: str | None = None, where: str | None = None) -> EvalSet:
    """`resolve_eval_set` for a reader of image-caption pairs (a training run's validation, the diagnostics): a
    set scored for classification only (an image folder, a CLIP_benchmark classification or multilabel folder)
    is refused at once, naming it, with `hint` (what to do instead)."""
    es = resolve_eval_set(name, path, matching=matching, caption_key=caption_key, where=where)
    if es.task == "classification":
        raise es.refuse_task("retrieval", where or f"data set {name}", hint)
    return es


def eval_set_tasks(es: EvalSet, task: str | None, has_classes: bool, where: str) -> tuple[str, ...]:
    """`task` (retrieval, classification or both), else the set's own (a CLIP_benchmark folder's dataset_type,
    an image folder's classification, a Karpathy or COCO caption file's retrieval), else retrieval for shards, and
    classification too with a class list. A task the layout cannot do is an error naming the set."""
    if task is not None:
        if task not in (*TASKS, "both"):
            raise ValueError(f"{where}: task {task!r}; allowed: {', '.join(TASKS)}, both")
        asked = TASKS if task == "both" else (task,)
        if es.task is not None and set(asked) - {es.task}:
            raise es.refuse_task(next(t for t in asked if t != es.task), where)
        return asked
    if es.task is not None:
        return (es.task,)
    return TASKS if has_classes else ("retrieval",)


@dataclass
class SetInputs:
    """What one set is evaluated with: its tasks, and for classification its class list and templates."""

    tasks: tuple[str, ...]
    classes: ClassSet | None = None
    templates: list = field(default_factory=lambda: ["{}"])


def eval_set_inputs(name: str, es: EvalSet, *, task: str | None, classes: str | None,
                    templates: Sequence[str] | None, class_set: str | None, where: str, classes_hint: str,
                    name_field: str = "name", key_field: str | None = None,
                    group_field: str | None = None) -> SetInputs:
    """The tasks of a set (`eval_set_tasks`) and, for classification, the class list (`classes`, else the set's
    own: a CLIP_benchmark folder's classnames.txt; None for an image folder without either, which then uses its
    folder names) and templates (`templates`: presets, strings, files; else the set's own file), all read and
    checked before a model loads. Shards without a class list, and a CLIP_benchmark folder without templates
    (CLIP_benchmark refuses it too), are errors naming the set; `classes_hint` says how to give a class list."""
    tasks = eval_set_tasks(es, task, bool(classes or es.classes), where)
    if "classification" not in tasks:
        return SetInputs(tasks)
    lookup = lookup_keys(name, es, class_set)
    path = classes or es.classes
    class_list = (load_classes(path, name_field=name_field, key_field=key_field, group_field=group_field,
                               lookup=lookup) if path is not None else None)
    if es.layout == "shards" and class_list is None:
        raise ValueError(f"{where}: classification of shards needs {classes_hint}")
    if not templates and es.layout == "clip_benchmark" and es.templates is None:
        raise ValueError(f"{where}: {es.data} has no zeroshot_classification_templates.txt (CLIP_benchmark refuses "
                         "such a folder for classification): give templates")
    chosen = list(templates) if templates else ([es.templates] if es.templates else None)
    return SetInputs(tasks, class_list, resolve_templates(chosen, lookup))


def lookup_keys(name: str, es: EvalSet | None, class_set: str | None) -> list[str]:
    """Keys to look a set up by in CLIP_benchmark's {data set: ...} JSON files: `class_set`, else the set's
    name, then its folder's name (`--data ~/data/cifar10` finds "cifar10")."""
    if class_set:
        return [class_set]
    folder = Path(es.data).expanduser().name if es is not None and es.layout != "shards" else None
    return [name, *([folder] if folder and folder != name else [])]


def synthetic_urls(spec: str, where: str) -> str:
    """`synthetic:val` / `synthetic:train`: the embedded scenes' shards at the default size (generated once,
    magclip.data.synthetic)."""
    from magclip.data.synthetic import ensure_synthetic

    split = spec[len(SYNTHETIC_PREFIX):]
    if split not in ("val", "train"):
        raise ValueError(f"{where}: {spec!r}: the synthetic scenes have the splits synthetic:val and synthetic:train")
    data = ensure_synthetic()
    return data.val_urls if split == "val" else data.train_urls
