"""Zero-shot evaluation scored with the evaluated model's own Scorer: retrieval and classification.

Why not open_clip's zero-shot code or CLIP_benchmark: both L2-normalise images and texts and
multiply by a fixed 100, i.e. they score every model as cosine. A dot/QNorm/DNorm/learnable
model ranks by a different score, so here every score comes from `Scorer` (`magclip.similarity`):
the one per direction that the checkpoint recorded in `magclip.json` (a direction the run did not
train uses the trained one's score, transposed: `similarity.evaluation_scorers`), or the one
given with `mode=`.

Retrieval. Image->text and text->image R@1/5/10, mean and median rank (`magclip.metrics.retrieval`),
every caption of an image scored, relevance by the set's rule (`magclip.metrics.relevance`): by image
for the benchmarks' own layouts (CLIP_benchmark's), by caption identity for shards, so duplicate
captions (two art styles of one emoji) count as one. With one unique caption per image both are
exactly open_clip's `get_clip_metrics` in cosine mode.

Classification (magclip.evaluation.classify): images are the queries, class prototypes built from class
names x templates the documents, scored by the i2t Scorer; top-1, top-5 and mean per-class recall, or
for a multilabel set (CLIP_benchmark's VOC2007 form) the mean average precision over the classes.

Data: webdataset shards read in order, one process. A sample is KEY.{jpg,jpeg,png,webp} +
KEY.txt (caption, needed for retrieval) + a label for classification: KEY.cls (an integer index
or a class key) or a field of KEY.json (`label_field`). Or an image folder (ROOT/<class>/<image>,
torchvision's ImageFolder, CLIP_benchmark's `--dataset_root` layout; `magclip.data.image_folder`):
classification only, the label is the class folder, the classes default to the folder names.
Undecodable images and corrupt tars are skipped and counted (reported in `counts.skipped` and as a
warning in the results); a missing shard, a shard without captions when retrieval is asked, a
sample without a label, or a label that the class list does not hold is an error naming the file.

Each set may have its own class list and templates (image folders have their own classes;
CLIP_benchmark's JSON files hold one entry per data set): prototypes are built once per distinct
(class names, templates), and each classified set records its list in `sets.<set>.classification`
(the top-level `classification` keeps the fields every set shares, None where they differ).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

import magclip
from magclip.data import dotted_keys
from magclip.data.classes import ClassSet, fill_template
from magclip.data.eval_sets import EvalSet, resolve_eval_set
from magclip.data.image_folder import ImageFolderSet
from magclip.evaluation import ZEROSHOT_TASKS
from magclip.evaluation.checkpoint import EvalModel
from magclip.evaluation.classify import class_prototypes, class_text_features, classify, top_classes
from magclip.evaluation.clip import caption_items, retrieval_from_features
from magclip.evaluation.encode import (
    EncodedSet,
    encode_captioned,
    encode_image_folder,
    encode_shards,
    encode_texts,
)
from magclip.evaluation.index import export_index
from magclip.io import publish_dir, umask_mode
from magclip.metrics.ranks import items_digest
from magclip.metrics.relevance import MATCHING, caption_owners
from magclip.modes import ScorerSpec
from magclip.similarity import Scorer

log = logging.getLogger("magclip.evaluation.zeroshot")

TASKS = ZEROSHOT_TASKS


# ============================================================================ the evaluation


def evaluate_zeroshot(
    model: EvalModel,
    data: Mapping[str, str | ImageFolderSet | EvalSet],
    *,
    tasks: Sequence[str] | Mapping[str, Sequence[str]] = ("retrieval",),
    classes: ClassSet | Mapping[str, ClassSet | None] | None = None,
    templates: Sequence[str | Callable[[str], str]] | Mapping[str, Sequence[str | Callable[[str], str]]] = ("{}",),
    label_field: str | None = None,
    exclude_groups: Sequence[str] = (),
    set_info: Mapping[str, Mapping[str, Any]] | None = None,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    workers: int = 0,
    save_embeddings: str | Path | None = None,
    export_index: str | Path | None = None,
    also_score: Mapping[str, Mapping[str, Scorer]] | None = None,
) -> dict[str, Any]:
    """Evaluate `model` on named sets; returns the results (writes only embeddings, if asked).

    data: {set: shard URLs, an image folder's path, an opened `ImageFolderSet`, or an `EvalSet`
    (magclip.data.eval_sets: a CLIP_benchmark folder, a Karpathy file, shards with their caption key and
    relevance rule)}. tasks: for every set, or {set: tasks}. classes and templates: one for every set, or
    {set: ...} per set; an image folder without a class list of its own is scored against its folder names.
    `workers`: DataLoader processes reading image files. `also_score`: {label: scorers per direction}
    scored on the same features beside the model's own (`sets.<set>.also.<label>.metrics`; the suite's
    cosine as CLIP_benchmark scores it).

    Everything is computed before anything is written; embeddings go to a temporary folder that is
    moved into place whole (one set: `save_embeddings/`; several: `save_embeddings/<set>/`; class
    texts of classification: `save_embeddings/classes/`, or `<set>/classes/` when sets have lists of
    their own). `export_index`: per set with captions, an index of prepared documents per direction
    (`export_index/<set>/i2t`: the captions, searched by prepared images; `.../t2i`: the images,
    searched by prepared captions; magclip.evaluation.index).
    """
    sets_in = {name: _as_eval_set(name, src) for name, src in data.items()}
    set_tasks = {name: _set_tasks(name, es, tasks[name] if isinstance(tasks, Mapping) else tasks)
                 for name, es in sets_in.items()}
    set_classes: dict[str, ClassSet] = {}
    set_templates: dict[str, list[str | Callable[[str], str]]] = {}
    for name, es in sets_in.items():
        if "classification" not in set_tasks[name]:
            continue
        given = classes.get(name) if isinstance(classes, Mapping) else classes
        if es.layout == "image_folder":
            es.opened = es.opened or ImageFolderSet.open(es.folder, given)
            given = es.opened.classes
        elif given is None:
            raise ValueError(f"classification of data set {name} ({es.data}) needs a class list")
        if exclude_groups and given.groups is None:
            raise ValueError(f"excluding groups {list(exclude_groups)} needs a group field in the class list "
                             f"{given.source} (data set {name})")
        set_classes[name] = given
        if isinstance(templates, Mapping):
            if name not in templates:
                raise ValueError(f"no templates for data set {name} (templates given for {sorted(templates)})")
            set_templates[name] = list(templates[name])
        else:
            set_templates[name] = list(templates)
    model.clip.to(device).eval()
    scorings = {"": model.scorers, **{label: dict(sc) for label, sc in (also_score or {}).items()}}

    # class texts once per distinct (class names, templates): a shared list is encoded once
    text_feats: dict[tuple, Tensor] = {}
    set_proto: dict[str, tuple] = {}
    for name, cs in set_classes.items():
        key = (tuple(cs.names), tuple(fill_template(t, "{}") for t in set_templates[name]))
        if key not in text_feats:
            text_feats[key] = class_text_features(model, cs.names, set_templates[name], batch_size=batch_size,
                                                  device=device)
        set_proto[name] = key

    sets: dict[str, Any] = {}
    encoded: dict[str, EncodedSet] = {}
    for name, es in sets_in.items():
        enc = encode_set(model, es, set_tasks[name], set_classes.get(name), label_field, batch_size=batch_size,
                         device=device, workers=workers, name=name)
        entry: dict[str, Any] = {**es.describe(), "tasks": list(set_tasks[name]), **(set_info or {}).get(name, {})}
        for label, scorers in scorings.items():
            protos = (class_prototypes(text_feats[set_proto[name]], scorers["i2t"]) if name in set_classes else None)
            metrics = _score(enc, es, set_tasks[name], scorers, protos, set_classes.get(name), exclude_groups)
            if label:
                entry.setdefault("also", {})[label] = {"scorers": {d: sc.to_dict() for d, sc in scorers.items()},
                                                       "metrics": metrics}
            else:
                entry["metrics"] = metrics
        if name in set_classes:
            entry["classification"] = _class_record(set_classes[name], set_templates[name],
                                                    _label_source(es, label_field))
            if es.layout == "image_folder":  # which name each folder was scored as (positional lists are easy to misalign)
                folder = es.opened
                entry["classification"]["folder_classes"] = {f: folder.classes.names[i]
                                                             for f, i in zip(folder.folders, folder.labels)}
        entry["counts"] = _counts(enc, es, set_classes.get(name))
        if enc.skipped:
            what = "images" if es.layout in ("image_folder", "karpathy", "coco_captions") else "samples/shards"
            entry["warning"] = f"{sum(enc.skipped.values())} {what} skipped: {enc.skipped}"
            if enc.skipped.get(dotted_keys.REASON):
                entry["warning"] += f"; {dotted_keys.REASON}: {dotted_keys.CAUSE}"
        if es.captioned is not None and es.captioned.merged_duplicates:
            entry["warning"] = "; ".join(filter(None, [entry.get("warning"), es.captioned.duplicates_note()]))
        absent = _classes_without_positives(entry["metrics"])
        if absent:
            entry["warning"] = "; ".join(filter(None, [entry.get("warning"), (
                f"classes without a positive sample: {absent}; each counts 0 in mean_average_precision, as "
                "CLIP_benchmark counts it (mean_average_precision_present leaves them out)")]))
        if enc.long_captions.get("long_captions"):
            lc = enc.long_captions
            entry["warning"] = "; ".join(filter(None, [entry.get("warning"), (
                f"{lc['long_captions']} captions longer than the text tower's context of {lc['context_length']} tokens "
                f"(the longest: {lc['longest_caption_tokens']}), truncated as open_clip does")]))
        sets[name] = entry
        encoded[name] = enc

    shared: dict[str, Any] = {}
    if set_classes:  # the list every set shares (else None here, and each set's own under sets.<set>.classification)
        records = [{k: v for k, v in s["classification"].items() if k != "folder_classes"}
                   for s in sets.values() if "classification" in s]
        shared = {k: (v if all(r[k] == v for r in records) else None) for k, v in records[0].items()}
    all_tasks = sorted({t for ts in set_tasks.values() for t in ts}, key=TASKS.index)
    results: dict[str, Any] = {
        "model": model.model_name,
        "checkpoint": model.source.get("checkpoint"),
        "pretrained": model.source.get("pretrained"),
        "data": {name: entry["data"] for name, entry in sets.items()},
        "scorers": {d: sc.to_dict() for d, sc in model.scorers.items()},
        "scorers_from": model.source.get("scorers_from"),
        "logit_scale": model.source.get("logit_scale"),  # recorded only; rankings do not depend on it
        "logit_bias": model.source.get("logit_bias"),  # the sigmoid loss's: a constant shift, no ranking change
        "tasks": all_tasks,
        "retrieval_matching": _matching_record(sets_in, set_tasks),
        "classification": None if not set_classes else {
            **shared,
            "prototype_rule": ("normalize, mean, renormalize (open_clip)" if model.scorers["i2t"].gamma_d == 1.0
                               else "mean of prepare_docs(template features)"),
            "scored_with": "i2t", "excluded_groups": list(exclude_groups)},
        "sets": sets,
        "magclip_version": magclip.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if save_embeddings is not None:
        class_texts = {name: (set_classes[name], text_feats[set_proto[name]], set_templates[name])
                       for name in set_classes}
        _save_embeddings(Path(save_embeddings), encoded, class_texts)
        results["embeddings"] = str(save_embeddings)
    if export_index is not None:
        results["index"] = _export_indexes(Path(export_index), encoded, model.scorers)
    return results


def _as_eval_set(name: str, src: str | ImageFolderSet | EvalSet) -> EvalSet:
    """A set given as shard URLs or an image folder's path, or an opened image folder, as an `EvalSet`."""
    if isinstance(src, EvalSet):
        return src
    if isinstance(src, ImageFolderSet):
        return EvalSet(name, "image_folder", str(src.root), "classification", "caption", folder=src.root, opened=src)
    return resolve_eval_set(name, src)


def _set_tasks(name: str, es: EvalSet, asked: Sequence[str]) -> tuple[str, ...]:
    tasks = tuple(asked)
    if not tasks or set(tasks) - set(TASKS):
        raise ValueError(f"tasks must be a non-empty subset of {TASKS}, got {tasks}")
    if es.task is not None and set(tasks) - {es.task}:
        raise es.refuse_task(next(t for t in tasks if t != es.task), f"data set {name}")
    return tasks


@torch.no_grad()
def encode_set(model: EvalModel, es: EvalSet, tasks: Sequence[str], classes: ClassSet | None,
               label_field: str | None, *, batch_size: int, device: str | torch.device, workers: int,
               name: str) -> EncodedSet:
    """The raw features one set needs for `tasks`, read as its layout says."""
    if es.layout == "image_folder":
        folder = es.opened
        log.info("encoding %s (image folder %s: %d files, %d classes)", name, folder.root, len(folder), len(folder.folders))
        return encode_image_folder(model, folder, batch_size=batch_size, device=device, workers=workers,
                                   desc=f"encode {name}")
    if es.captioned is not None:
        log.info("encoding %s (%s: %d images)", name, es.captioned.what, len(es.captioned))
        return encode_captioned(model, es.captioned, batch_size=batch_size, device=device, workers=workers,
                                desc=f"encode {name}")
    log.info("encoding %s (%s)", name, es.data)
    return encode_shards(model, es.urls, captions="retrieval" in tasks, classes=classes,
                         label_field=_shard_label_field(es, label_field), batch_size=batch_size, device=device,
                         desc=f"encode {name}", caption_key=es.caption_key, multilabel=es.multilabel)


def _shard_label_field(es: EvalSet, label_field: str | None) -> str | None:
    return None if es.layout == "clip_benchmark" else label_field  # CLIP_benchmark's label is KEY.cls


def _label_source(es: EvalSet, label_field: str | None) -> str:
    if es.layout == "image_folder":
        return "class folder"
    if es.multilabel:
        return "KEY.npy"
    return _shard_label_field(es, label_field) or "KEY.cls"


def _score(enc: EncodedSet, es: EvalSet, tasks: Sequence[str], scorers: Mapping[str, Scorer],
           prototypes: Tensor | None, classes: ClassSet | None, exclude_groups: Sequence[str]) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    if "retrieval" in tasks:
        assert enc.text_features is not None and enc.captions is not None
        retrieval = retrieval_from_features(enc.image_features, enc.text_features, enc.captions, scorers,
                                            caption_counts=enc.caption_counts, matching=es.matching)
        retrieval.item_digest = items_digest(caption_items(enc.keys, enc.caption_counts))  # pairs only on these items
        retrieval.update(enc.long_captions)
        metrics["retrieval"] = retrieval
    if "classification" in tasks:
        assert enc.labels is not None and prototypes is not None and classes is not None
        metrics["classification"] = classify(enc.image_features, enc.labels, prototypes, scorers["i2t"], classes,
                                             exclude_groups, items=enc.keys)
    return metrics


def _classes_without_positives(metrics: Mapping[str, Any]) -> int:
    m = (metrics.get("classification") or {}).get("all", {})
    return m["num_classes"] - m["num_classes_present"] if "mean_average_precision" in m else 0


def _counts(enc: EncodedSet, es: EvalSet, classes: ClassSet | None) -> dict[str, Any]:
    out: dict[str, Any] = {"samples": len(enc.keys),
                           **({"files": enc.files} if enc.files is not None else {"shards": len(enc.shards)}),
                           "skipped": enc.skipped, "skipped_total": sum(enc.skipped.values())}
    if classes is not None:
        out["classes"] = len(classes)
    if enc.captions is not None:
        out["captions"] = len(enc.captions)
        out["unique_captions"] = len(set(enc.captions))
    return out


def _matching_record(sets: Mapping[str, EvalSet], tasks: Mapping[str, Sequence[str]]) -> str | None:
    """The retrieval relevance rule every retrieval set was scored by, or 'per set' (see sets.<set>.matching)."""
    rules = {es.matching for name, es in sets.items() if "retrieval" in tasks[name]}
    if not rules:
        return None
    return MATCHING[rules.pop()] if len(rules) == 1 else "per set (sets.<set>.matching)"


def _class_record(classes: ClassSet, templates: Sequence[Any], label_field: str) -> dict[str, Any]:
    """What one set was classified against: the list, its size, how labels matched it, the templates."""
    return {"classes": classes.source, "num_classes": len(classes), "key_field": classes.key_field,
            "label_field": label_field, "templates": [fill_template(t, "{}") for t in templates]}


def _export_indexes(root: Path, encoded: Mapping[str, EncodedSet], scorers: Mapping[str, Scorer]) -> dict[str, str]:
    """{set/direction: folder} of the exported retrieval indexes (sets without captions have none). The
    i2t index holds every caption (id `KEY#j` for the j-th caption of an image with several, else KEY)."""
    out = {}
    for name, enc in encoded.items():
        if enc.text_features is None:
            continue
        for direction, docs, ids, sides in (("i2t", enc.text_features, enc.caption_ids(), ("image", "text")),
                                            ("t2i", enc.image_features, enc.keys, ("text", "image"))):
            folder = export_index(root / name / direction, docs, ids, scorers[direction], queries=sides[0],
                                  documents=sides[1])
            out[f"{name}/{direction}"] = str(folder)
    return out


def _save_embeddings(root: Path, encoded: Mapping[str, EncodedSet],
                     class_texts: Mapping[str, tuple[ClassSet, Tensor, Sequence[Any]]]) -> None:
    """class_texts: {set: (class list, [C, T, D] raw features, templates)}; one shared list is written
    once (`classes/`), lists of their own per set (`<set>/classes/`)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}.", suffix=".tmp"))
    tmp.chmod(umask_mode("dir"))
    distinct = {(tuple(c.names), tuple(c.keys), tuple(fill_template(t, "{}") for t in tp))
                for c, _, tp in class_texts.values()}
    try:
        for name, enc in encoded.items():
            folder = tmp if len(encoded) == 1 else tmp / name
            folder.mkdir(parents=True, exist_ok=True)
            np.save(folder / "image_features.npy", enc.image_features.numpy())
            if enc.text_features is not None:
                np.save(folder / "text_features.npy", enc.text_features.numpy())
                (folder / "captions.jsonl").write_text("".join(json.dumps(c) + "\n" for c in enc.captions or []))
                if enc.multi_caption:  # the image of each caption: rows of image_features
                    np.save(folder / "caption_image_index.npy", caption_owners(enc.caption_counts or []).numpy())
            (folder / "keys.txt").write_text("".join(k + "\n" for k in enc.keys))
            if enc.labels is not None:
                np.save(folder / "labels.npy", enc.labels.numpy())
            if name in class_texts and (len(distinct) > 1 or not (tmp / "classes").exists()):
                _save_class_texts(tmp / "classes" if len(distinct) == 1 else folder / "classes", *class_texts[name])
        publish_dir(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_class_texts(folder: Path, classes: ClassSet, feats: Tensor, templates: Sequence[Any]) -> None:
    folder.mkdir(parents=True)
    np.save(folder / "class_text_features.npy", feats.numpy())  # [C, T, D] raw
    (folder / "class_names.jsonl").write_text("".join(json.dumps(n) + "\n" for n in classes.names))
    (folder / "class_keys.txt").write_text("".join(k + "\n" for k in classes.keys))
    (folder / "templates.jsonl").write_text("".join(json.dumps(fill_template(t, "{}")) + "\n" for t in templates))


# ============================================================================ table


def format_zeroshot_table(results: Mapping[str, Any]) -> str:
    """Markdown: retrieval R@1/R@5 per direction, classification top-1/top-5/mean per-class recall, and
    multilabel sets' mean average precision."""
    scorers = results.get("scorers", {})
    head = (f"model {results.get('model')}  checkpoint {results.get('checkpoint') or results.get('pretrained')}  "
            f"scorers i2t={_scorer_text(scorers.get('i2t'))} t2i={_scorer_text(scorers.get('t2i'))}")
    lines = [head, ""]
    sets = results.get("sets", {})
    if any("retrieval" in s["metrics"] for s in sets.values()):
        lines += [("| set | domain | matching | i→t R@1 | i→t R@5 | t→i R@1 | t→i R@5 | chance R@1 i→t / t→i | "
                   "images | captions | unique captions |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, s in sets.items():
            m = s["metrics"].get("retrieval")
            if m:
                chance = (f"{_pct(m.get('image_to_text_chance_R@1', m['chance_R@1']))} / "
                          f"{_pct(m.get('text_to_image_chance_R@1', m['chance_R@1']))}")
                lines.append(f"| {name} | {s.get('domain', '')} | {s.get('matching', 'caption')} | "
                             f"{_pct(m['image_to_text_R@1'])} | {_pct(m['image_to_text_R@5'])} | "
                             f"{_pct(m['text_to_image_R@1'])} | {_pct(m['text_to_image_R@5'])} | {chance} | "
                             f"{m['num_samples']} | {m.get('num_captions', m['num_samples'])} | "
                             f"{m['num_unique_captions']} |")
        lines.append("")
    if any("classification" in s["metrics"] for s in sets.values()):
        lines += _classification_lines(results.get("classification") or {}, sets)
    matchings = [f"{rule}: {text}" for rule, text in MATCHING.items()
                 if any(s.get("matching") == rule for s in sets.values() if "retrieval" in s["metrics"])]
    lines.append("Recall/accuracy in %" + (f"; retrieval matching: {'; '.join(matchings)}." if matchings else "."))
    warnings = [f"{n}: {s['warning']}" for n, s in sets.items() if s.get("warning")]
    if warnings:
        lines.append("WARNING — " + "; ".join(warnings))
    return "\n".join(lines)


def _classification_lines(cls: Mapping[str, Any], sets: Mapping[str, Any]) -> list[str]:
    """The single-label table (per excluded group too), the multilabel table, and what each list was."""
    lines: list[str] = []
    multilabel = {name: s["metrics"]["classification"]["all"] for name, s in sets.items()
                  if _multilabel(s["metrics"].get("classification"))}
    single = [name for name, s in sets.items() if "classification" in s["metrics"] and name not in multilabel]
    if single:
        cols = ["all", *(f"without_{g}" for g in cls.get("excluded_groups", []))]
        lines += ["| set | domain | subset | top-1 | top-5 | mean per-class recall | samples |",
                  "|---|---|---|---|---|---|---|"]
        for name in single:
            c = sets[name]["metrics"]["classification"]
            for col in cols:
                m = c.get(col) or {}
                if m.get("num_samples"):
                    lines.append(f"| {name} | {sets[name].get('domain', '')} | {col} | {_pct(m['top1'])} | "
                                 f"{_pct(m.get('top5'))} | {_pct(m['mean_per_class_recall'])} | {m['num_samples']} |")
        lines.append("")
    if multilabel:
        lines += ["| set | domain | mAP | mAP over classes present | classes present | labels a sample | samples |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {name} | {sets[name].get('domain', '')} | {_pct(m['mean_average_precision'])} | "
                  f"{_pct(m['mean_average_precision_present'])} | {m['num_classes_present']} / {m['num_classes']} | "
                  f"{m['labels_per_sample']:.2f} | {m['num_samples']} |" for name, m in multilabel.items()]
        lines.append("")
    shared = cls.get("classes") is not None and cls.get("num_classes") is not None
    lists = ([(None, cls, not single)] if shared else
             [(name, s["classification"], name in multilabel) for name, s in sets.items() if s.get("classification")])
    for name, c, is_multilabel in lists:
        n = c.get("num_classes") or 1
        what = (f"{n}-class multilabel classification" if is_multilabel else f"{n}-way classification")
        chance = "" if is_multilabel else f" (chance top-1 {100 / max(1, n):.3f} %)"
        lines.append(f"{name + ': ' if name else ''}{what} over {c.get('classes')}{chance}, "
                     f"prototypes: {cls.get('prototype_rule')}.")
    return lines


def _multilabel(classification: Mapping[str, Any] | None) -> bool:
    return bool(classification) and "mean_average_precision" in classification.get("all", {})


def _pct(x: float | None) -> str:
    """A share in %; "-" where there is none (top-5 of fewer than 5 classes)."""
    if x is None:
        return "-"
    return "nan" if isinstance(x, float) and math.isnan(x) else f"{100 * x:.2f}"


def _scorer_text(s: Mapping[str, Any] | None) -> str:
    return ScorerSpec.from_record(s).label if s else "-"


__all__ = [
    "EncodedSet",
    "class_prototypes",
    "class_text_features",
    "classify",
    "encode_image_folder",
    "encode_shards",
    "encode_texts",
    "evaluate_zeroshot",
    "format_zeroshot_table",
    "top_classes",
]
