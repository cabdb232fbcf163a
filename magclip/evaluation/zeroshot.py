"""Zero-shot evaluation scored with the evaluated model's own Scorer: retrieval and classification.

Why not open_clip's zero-shot code or CLIP_benchmark: both L2-normalise images and texts and
multiply by a fixed 100, i.e. they score every model as cosine. A dot/QNorm/DNorm/learnable
model ranks by a different score, so here every score comes from `Scorer` (`magclip.similarity`):
the one per direction that the checkpoint recorded in `magclip.json` (a direction the run did not
train uses the trained one's score, transposed: `similarity.evaluation_scorers`), or the one
given with `mode=`.

Retrieval. Image->text and text->image R@1/5/10, mean and median rank (`magclip.metrics.retrieval`),
with caption identity as relevance: a retrieved item is a hit when it carries the query's caption,
so duplicate captions (two art styles of one emoji) count as one. With unique captions this is
exactly open_clip's `get_clip_metrics` in cosine mode.

Classification. Images are the queries, class prototypes the documents, so the i2t Scorer scores
them. Class names x prompt templates are encoded raw, then reduced to one prototype per class in
the Scorer's *prepared document space* (`class_prototypes`), and an image's scores are
`prepare_queries(image) @ prototypes.T`:

- gamma_d == 1 (cosine, dnorm, or a learnable run that ended at gamma_d = 1): documents carry no
  magnitude by construction, so the prototype is open_clip's `build_zero_shot_classifier`:
  L2-normalise each template embedding, average, L2-normalise again. In cosine mode the result
  equals open_clip's classifier (tests check it).
- gamma_d < 1 (qnorm, dot, learnable): the document's magnitude is part of the score the model
  was trained with, so renormalising would throw away what is evaluated. The prototype is the mean
  of the *prepared* template embeddings, `mean_t prepare_docs(d_t)`. By linearity its score is the
  mean of the per-template scores, `s(q, proto) = mean_t s(q, d_t)` (any gamma_q), and with a
  single template it is exactly `prepare_docs(d)`: the class keeps the mean magnitude its texts
  have under the model's own exponent.

Metrics: top-1, top-5 accuracy (each k up to the number of classes) and mean per-class recall (balanced accuracy over the classes that
occur in the data), over all samples and again without the samples of chosen class groups (e.g.
the emoji Flags category); the candidate set is always every class.

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
import itertools
import json
import logging
import math
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

import magclip
from magclip.data.shards import (
    DEFAULT_MAX_IMAGE_PIXELS,
    IMAGE_EXTS,
    check_sample,
    iter_tar_samples,
)
from magclip.data.classes import ClassSet, fill_template
from magclip.data.image_folder import ImageFolderSet, resolve_image_folder
from magclip.data.urls import check_sources_exist
from magclip.evaluation import ZEROSHOT_TASKS
from magclip.evaluation.checkpoint import EvalModel
from magclip.evaluation.clip import encode_loader, retrieval_from_features
from magclip.evaluation.index import export_index
from magclip.io import publish_dir, umask_mode
from magclip.metrics.classification import classification_metrics
from magclip.metrics.ranks import items_digest
from magclip.modes import ScorerSpec
from magclip.similarity import Scorer

log = logging.getLogger("magclip.evaluation.zeroshot")

TASKS = ZEROSHOT_TASKS
TOP_K = (1, 5)  # classification accuracies reported (each k up to the number of classes)


# ============================================================================ data


@dataclass
class EncodedSet:
    """Raw features of one shard set, in sample order."""

    keys: list[str]
    image_features: Tensor
    text_features: Tensor | None
    captions: list[str] | None
    labels: Tensor | None  # class indices (int64) when a class list was given
    skipped: dict[str, int]
    shards: list[str]  # empty for an image folder
    files: int | None = None  # image files an image folder indexes (None for shards)


def _label_of(members: dict[str, bytes], label_field: str | None, where: str) -> Any:
    if label_field is None:
        if "cls" not in members:
            raise ValueError(f"{where} has no .cls label (use label_field / --label-field for a KEY.json field)")
        return members["cls"].decode("utf-8").strip()
    if "json" not in members:
        raise ValueError(f"{where} has no .json, which should hold the label field {label_field!r}")
    try:
        meta = json.loads(members["json"])
    except (json.JSONDecodeError, UnicodeDecodeError) as exn:
        raise ValueError(f"{where}: .json is not valid JSON ({exn})") from exn
    if not isinstance(meta, dict) or label_field not in meta:
        raise ValueError(f"{where}: .json has no label field {label_field!r}")
    return meta[label_field]


def _progress(batches, desc: str, skipped: Counter, total: int | None = None):
    """Batches passed through while a tqdm bar counts the images read, skipped ones included (so an
    image folder's bar ends at its file count), with the skips so far; hidden when not a terminal."""
    done = 0
    with tqdm(total=total, desc=desc, unit="img", dynamic_ncols=True, disable=None) as bar:
        for batch in batches:
            bad = sum(skipped.values())
            bar.update(done + len(batch["keys"]) + bad - bar.n)
            done += len(batch["keys"])
            if bad:
                bar.set_postfix(skipped=bad)
            yield batch
        bar.update(done + sum(skipped.values()) - bar.n)


@torch.no_grad()
def encode_image_folder(model: EvalModel, folder: ImageFolderSet, *, batch_size: int = 256,
                        device: str | torch.device = "cpu", workers: int = 0, desc: str = "encode images",
                        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> EncodedSet:
    """Encode every readable image of an image folder with the model's own preprocess (raw
    features, float32, on CPU); labels are class indices of `folder.classes`. Bad images are
    skipped and counted by reason, like bad shard samples; none readable at all is an error."""
    skipped: Counter[str] = Counter()
    batches = folder.iter_batches(model.preprocess, batch_size, skipped, workers=workers,
                                  max_image_pixels=max_image_pixels)
    enc = encode_loader(model.clip, _progress(batches, desc, skipped, total=len(folder)), device, allow_empty=True)
    if enc is None:
        raise ValueError(f"no readable image in image folder {folder.root} ({len(folder)} files; skipped: "
                         f"{dict(skipped) or 'none'})")
    return EncodedSet(enc["keys"], enc["image_features"], None, None, torch.tensor(enc["labels"], dtype=torch.long),
                      dict(skipped), [], len(folder))


@torch.no_grad()
def encode_shards(model: EvalModel, urls: str | list[str], *, captions: bool = True,
                  classes: ClassSet | None = None, label_field: str | None = None, batch_size: int = 256,
                  device: str | torch.device = "cpu", desc: str = "encode samples",
                  max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> EncodedSet:
    """Read shards in order and encode every usable sample (raw features, float32, on CPU).

    captions: retrieval needs KEY.txt; a shard whose images have no caption at all is an error that
    names it; a single sample without one (or with an empty one) is skipped and counted.
    classes: with a class list, every sample needs a label (KEY.cls, or KEY.json[label_field]) that
    the list holds; a missing or unknown label is an error naming the shard, the key and the list
    (raised while reading, before the rest is encoded).
    """
    flat = check_sources_exist(urls)
    skipped: Counter[str] = Counter()
    per_shard: dict[str, list[int]] = {}  # url -> [samples with an image, of which captioned]

    def samples():
        for url, key, members in iter_tar_samples(flat, skipped):
            where = f"shard {url} key {key}"
            if not any(e in members for e in IMAGE_EXTS):
                skipped["missing_image"] += 1
                continue
            counts = per_shard.setdefault(url, [0, 0])
            counts[0] += 1
            counts[1] += "txt" in members
            good, reason, detail = check_sample(members, max_image_pixels, caption=captions)
            if good is None:
                skipped[reason] += 1
                if "caption" not in reason:
                    log.warning("skipped %s: %s: %s", reason, where, detail)
                continue
            label = classes.index_of(_label_of(members, label_field, where), where) if classes is not None else -1
            yield key, model.preprocess(good["image"]), good["caption"], label

    def batches():
        chunk: list = []
        for sample in itertools.chain(samples(), [None]):
            if sample is not None:
                chunk.append(sample)
            if chunk and (sample is None or len(chunk) >= batch_size):
                keys, images, caps, labels = zip(*chunk)
                batch = {"images": torch.stack(images), "keys": list(keys), "captions": list(caps), "labels": list(labels)}
                if captions:
                    batch["texts"] = model.tokenizer(list(caps))
                chunk = []
                yield batch

    enc = encode_loader(model.clip, _progress(batches(), desc, skipped), device, allow_empty=True)
    if captions:
        uncaptioned = [u for u, (n, c) in per_shard.items() if n and not c]
        if uncaptioned:
            raise ValueError(f"shard {uncaptioned[0]} has no KEY.txt captions ({per_shard[uncaptioned[0]][0]} images): "
                             "retrieval needs captions; for a classification-only set use task classification")
    if enc is None:
        raise ValueError(f"no usable sample in {urls!r} (skipped: {dict(skipped) or 'none'})")
    return EncodedSet(enc["keys"], enc["image_features"], enc["text_features"] if captions else None,
                      enc["captions"] if captions else None,
                      torch.tensor(enc["labels"], dtype=torch.long) if classes is not None else None,
                      dict(skipped), flat)


@torch.no_grad()
def encode_texts(model: EvalModel, texts: list[str], *, batch_size: int = 256,
                 device: str | torch.device = "cpu") -> Tensor:
    """Raw text features [N, D], float32 on CPU."""
    out = []
    for start in range(0, len(texts), batch_size):
        tokens = model.tokenizer(texts[start:start + batch_size]).to(device)
        out.append(model.clip.encode_text(tokens).float().cpu())
    return torch.cat(out)


def class_text_features(model: EvalModel, names: Sequence[str], templates: Sequence[str | Callable[[str], str]],
                        *, batch_size: int = 256, device: str | torch.device = "cpu") -> Tensor:
    """Raw features of every (class, template) text: [C, T, D]."""
    texts = [fill_template(t, n) for n in names for t in templates]
    return encode_texts(model, texts, batch_size=batch_size, device=device).reshape(len(names), len(templates), -1)


# ============================================================================ scoring


def class_prototypes(template_features: Tensor, scorer: Scorer) -> Tensor:
    """[C, D] class prototypes in the i2t Scorer's prepared-document space from [C, T, D] raw
    template features (see the module docstring for the rule and why).

    gamma_d == 1: normalise, mean, renormalise (open_clip's `build_zero_shot_classifier`, as rows).
    gamma_d < 1: mean over templates of `scorer.prepare_docs(template feature)`.
    """
    if template_features.ndim != 3:
        raise ValueError(f"expected [classes, templates, dim] features, got {tuple(template_features.shape)}")
    prepared = scorer.prepare_docs(template_features)
    mean = prepared.mean(dim=1)
    if scorer.gamma_d == 1.0:
        return mean / mean.norm(dim=-1, keepdim=True)
    return mean


@torch.no_grad()
def top_classes(image_features: Tensor, prototypes: Tensor, scorer: Scorer, k: int = 5,
                chunk_size: int = 4096) -> Tensor:
    """[N, min(k, C)] class indices by descending score `prepare_queries(image) @ prototypes.T`."""
    k = min(k, len(prototypes))
    out = []
    for start in range(0, len(image_features), chunk_size):
        with torch.autocast(device_type=image_features.device.type, enabled=False):
            scores = scorer.prepare_queries(image_features[start:start + chunk_size]) @ prototypes.float().T
        out.append(scores.topk(k, dim=1).indices.cpu())
    return torch.cat(out)


def classify(image_features: Tensor, labels: Tensor, prototypes: Tensor, scorer: Scorer, classes: ClassSet,
             exclude_groups: Sequence[str] = ()) -> dict[str, Any]:
    """Metrics over all samples, without each excluded group and all of them, and top-1 per group.
    Top-k only for k <= the number of classes (a top-5 of 3 classes would always be 1)."""
    ks = tuple(k for k in TOP_K if k <= len(classes))
    top = top_classes(image_features, prototypes, scorer, k=max(ks))
    out: dict[str, Any] = {"all": classification_metrics(top, labels, len(classes), ks)}
    if classes.groups is not None:
        group_of = np.array(classes.groups)[labels.numpy()]
        for g in exclude_groups:
            keep = torch.from_numpy(group_of != g)
            out[f"without_{g}"] = classification_metrics(top[keep], labels[keep], len(classes), ks)
        correct = (top[:, 0] == labels).double().numpy()
        out["per_group_top1"] = {g: float(correct[group_of == g].mean()) for g in sorted(set(group_of.tolist()))}
    return out


# ============================================================================ the evaluation


def evaluate_zeroshot(
    model: EvalModel,
    data: Mapping[str, str | ImageFolderSet],
    *,
    tasks: Sequence[str] = ("retrieval",),
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
) -> dict[str, Any]:
    """Evaluate `model` on named sets; returns the results (writes only embeddings, if asked).

    data: {set: shard URLs, an image folder's path, or an opened `ImageFolderSet`}. classes and
    templates: one for every set, or {set: ...} per set; an image folder without a class list of its
    own is scored against its folder names. `workers`: DataLoader processes reading image folders.

    Everything is computed before anything is written; embeddings go to a temporary folder that is
    moved into place whole (one set: `save_embeddings/`; several: `save_embeddings/<set>/`; class
    texts of classification: `save_embeddings/classes/`, or `<set>/classes/` when sets have lists of
    their own). `export_index`: per set with captions, an index of prepared documents per direction
    (`export_index/<set>/i2t`: the captions, searched by prepared images; `.../t2i`: the images,
    searched by prepared captions; magclip.evaluation.index).
    """
    tasks = tuple(tasks)
    bad = set(tasks) - set(TASKS)
    if bad or not tasks:
        raise ValueError(f"tasks must be a non-empty subset of {TASKS}, got {tasks}")
    do_cls = "classification" in tasks
    sources: dict[str, str | ImageFolderSet] = {}
    set_classes: dict[str, ClassSet] = {}
    set_templates: dict[str, list[str | Callable[[str], str]]] = {}
    for name, src in data.items():
        given = classes.get(name) if isinstance(classes, Mapping) else classes
        root = src.root if isinstance(src, ImageFolderSet) else resolve_image_folder(src, f"data set {name}")
        if root is not None:
            if "retrieval" in tasks:
                raise ValueError(f"data set {name}: {root} is an image folder (no captions): task classification only")
            src = src if isinstance(src, ImageFolderSet) else ImageFolderSet.open(root, given)
            given = src.classes
        elif do_cls and given is None:
            raise ValueError(f"classification of data set {name} ({src}) needs a class list")
        sources[name] = src
        if do_cls:
            assert given is not None
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

    # prototypes once per distinct (class names, templates): a shared list is encoded once
    text_feats: dict[tuple, tuple[Tensor, Tensor]] = {}
    set_proto: dict[str, tuple] = {}
    for name, cs in set_classes.items():
        key = (tuple(cs.names), tuple(fill_template(t, "{}") for t in set_templates[name]))
        if key not in text_feats:
            feats = class_text_features(model, cs.names, set_templates[name], batch_size=batch_size, device=device)
            text_feats[key] = (feats, class_prototypes(feats, model.scorers["i2t"]))
        set_proto[name] = key

    sets: dict[str, Any] = {}
    encoded: dict[str, EncodedSet] = {}
    for name, src in sources.items():
        folder = src if isinstance(src, ImageFolderSet) else None
        if folder is not None:
            log.info("encoding %s (image folder %s: %d files, %d classes)", name, folder.root, len(folder),
                     len(folder.folders))
            enc = encode_image_folder(model, folder, batch_size=batch_size, device=device, workers=workers,
                                      desc=f"encode {name}")
        else:
            log.info("encoding %s (%s)", name, src)
            enc = encode_shards(model, src, captions="retrieval" in tasks, classes=set_classes.get(name),
                                label_field=label_field, batch_size=batch_size, device=device, desc=f"encode {name}")
        entry: dict[str, Any] = {"data": str(folder.root) if folder is not None else src, **(set_info or {}).get(name, {})}
        metrics: dict[str, Any] = {}
        if "retrieval" in tasks:
            assert enc.text_features is not None and enc.captions is not None
            metrics["retrieval"] = retrieval_from_features(enc.image_features, enc.text_features, enc.captions,
                                                           model.scorers)
            metrics["retrieval"].item_digest = items_digest(enc.keys)  # its ranks pair only with runs on these samples
        if do_cls:
            assert enc.labels is not None
            cs = set_classes[name]
            metrics["classification"] = classify(enc.image_features, enc.labels, text_feats[set_proto[name]][1],
                                                 model.scorers["i2t"], cs, exclude_groups)
            entry["classification"] = _class_record(cs, set_templates[name],
                                                    "class folder" if folder else label_field or "KEY.cls")
            if folder is not None:  # which name each folder was scored as (positional lists are easy to misalign)
                entry["classification"]["folder_classes"] = {f: cs.names[i] for f, i in zip(folder.folders, folder.labels)}
        entry["metrics"] = metrics
        entry["counts"] = {"samples": len(enc.keys),
                           **({"files": enc.files} if folder is not None else {"shards": len(enc.shards)}),
                           "skipped": enc.skipped, "skipped_total": sum(enc.skipped.values())}
        if do_cls:
            entry["counts"]["classes"] = len(set_classes[name])
        if "retrieval" in tasks:
            entry["counts"]["unique_captions"] = metrics["retrieval"]["num_unique_captions"]
        if enc.skipped:
            what = "images" if folder is not None else "samples/shards"
            entry["warning"] = f"{sum(enc.skipped.values())} {what} skipped: {enc.skipped}"
        sets[name] = entry
        encoded[name] = enc

    shared: dict[str, Any] = {}
    if do_cls:  # the list every set shares (else None here, and each set's own under sets.<set>.classification)
        records = [{k: v for k, v in s["classification"].items() if k != "folder_classes"} for s in sets.values()]
        shared = {k: (v if all(r[k] == v for r in records) else None) for k, v in records[0].items()}
    results: dict[str, Any] = {
        "model": model.model_name,
        "checkpoint": model.source.get("checkpoint"),
        "pretrained": model.source.get("pretrained"),
        "data": {name: entry["data"] for name, entry in sets.items()},
        "scorers": {d: s.to_dict() for d, s in model.scorers.items()},
        "scorers_from": model.source.get("scorers_from"),
        "logit_scale": model.source.get("logit_scale"),  # recorded only; rankings do not depend on it
        "logit_bias": model.source.get("logit_bias"),  # the sigmoid loss's: a constant shift, no ranking change
        "tasks": list(tasks),
        "retrieval_matching": "caption identity" if "retrieval" in tasks else None,
        "classification": None if not do_cls else {
            **shared,
            "prototype_rule": ("normalize, mean, renormalize (open_clip)" if model.scorers["i2t"].gamma_d == 1.0
                               else "mean of prepare_docs(template features)"),
            "scored_with": "i2t", "excluded_groups": list(exclude_groups)},
        "sets": sets,
        "magclip_version": magclip.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if save_embeddings is not None:
        class_texts = {name: (set_classes[name], text_feats[set_proto[name]][0], set_templates[name])
                       for name in set_classes}
        _save_embeddings(Path(save_embeddings), encoded, class_texts)
        results["embeddings"] = str(save_embeddings)
    if export_index is not None:
        results["index"] = _export_indexes(Path(export_index), encoded, model.scorers)
    return results


def _class_record(classes: ClassSet, templates: Sequence[Any], label_field: str) -> dict[str, Any]:
    """What one set was classified against: the list, its size, how labels matched it, the templates."""
    return {"classes": classes.source, "num_classes": len(classes), "key_field": classes.key_field,
            "label_field": label_field, "templates": [fill_template(t, "{}") for t in templates]}


def _export_indexes(root: Path, encoded: Mapping[str, EncodedSet], scorers: Mapping[str, Scorer]) -> dict[str, str]:
    """{set/direction: folder} of the exported retrieval indexes (sets without captions have none)."""
    out = {}
    for name, enc in encoded.items():
        if enc.text_features is None:
            continue
        for direction, docs, sides in (("i2t", enc.text_features, ("image", "text")),
                                       ("t2i", enc.image_features, ("text", "image"))):
            folder = export_index(root / name / direction, docs, enc.keys, scorers[direction], queries=sides[0],
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
    """Markdown: retrieval R@1/R@5 per direction and classification top-1/top-5/mean per-class recall."""
    scorers = results.get("scorers", {})
    head = (f"model {results.get('model')}  checkpoint {results.get('checkpoint') or results.get('pretrained')}  "
            f"scorers i2t={_scorer_text(scorers.get('i2t'))} t2i={_scorer_text(scorers.get('t2i'))}")
    lines = [head, ""]
    sets = results.get("sets", {})
    if any("retrieval" in s["metrics"] for s in sets.values()):
        lines += ["| set | domain | i→t R@1 | i→t R@5 | t→i R@1 | t→i R@5 | chance R@1 | samples | unique captions |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, s in sets.items():
            m = s["metrics"].get("retrieval")
            if m:
                lines.append(f"| {name} | {s.get('domain', '')} | {_pct(m['image_to_text_R@1'])} | "
                             f"{_pct(m['image_to_text_R@5'])} | {_pct(m['text_to_image_R@1'])} | "
                             f"{_pct(m['text_to_image_R@5'])} | {_pct(m['chance_R@1'])} | {m['num_samples']} | "
                             f"{m['num_unique_captions']} |")
        lines.append("")
    if any("classification" in s["metrics"] for s in sets.values()):
        cls = results.get("classification") or {}
        excluded = cls.get("excluded_groups", [])
        cols = ["all", *(f"without_{g}" for g in excluded)]
        lines += ["| set | domain | subset | top-1 | top-5 | mean per-class recall | samples |",
                  "|---|---|---|---|---|---|---|"]
        for name, s in sets.items():
            c = s["metrics"].get("classification")
            if not c:
                continue
            for col in cols:
                m = c.get(col) or {}
                if m.get("num_samples"):
                    lines.append(f"| {name} | {s.get('domain', '')} | {col} | {_pct(m['top1'])} | "
                                 f"{_pct(m.get('top5'))} | {_pct(m['mean_per_class_recall'])} | "
                                 f"{m['num_samples']} |")
        shared = cls.get("classes") is not None and cls.get("num_classes") is not None
        lists = ([(None, cls)] if shared else
                 [(name, s["classification"]) for name, s in sets.items() if s.get("classification")])
        lines.append("")
        for name, c in lists:
            lines.append(f"{name + ': ' if name else ''}{c.get('num_classes')}-way classification over "
                         f"{c.get('classes')} (chance top-1 {100 / max(1, c.get('num_classes') or 1):.3f} %), "
                         f"prototypes: {cls.get('prototype_rule')}.")
    lines.append("Recall/accuracy in %; retrieval hits by caption identity (identical captions count as one).")
    warnings = [f"{n}: {s['warning']}" for n, s in sets.items() if s.get("warning")]
    if warnings:
        lines.append("WARNING skipped data — " + "; ".join(warnings))
    return "\n".join(lines)


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
