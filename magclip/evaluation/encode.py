"""Raw features of an evaluation set, whatever its layout (magclip.data.eval_sets): shards (img2dataset's,
magclip's, a CLIP_benchmark folder's split), a Karpathy split file or a COCO caption file over its images, an image folder.

Every caption of an image is encoded (KEY.txt one a line, a KEY.json field, Karpathy's sentences), in
order: `EncodedSet.captions` and `.text_features` hold one row per caption, `.caption_counts` how many
each image has, so retrieval can score by image or by caption identity (magclip.metrics.relevance).
Captions longer than the text tower's context are counted (`.long_captions`, magclip.models.tokens).

Bad data is skipped and counted by reason in `.skipped` (the shard reader's reasons), never fatal; a
missing shard, a shard without captions when retrieval is asked, a sample without a label or with a
label the class list does not hold is an error naming the file.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from magclip.data import dotted_keys
from magclip.data.captioned_images import CaptionedImages
from magclip.data.captions import TXT, CaptionKey
from magclip.data.classes import ClassSet
from magclip.data.image_folder import ImageFolderSet
from magclip.data.shard_reader import DEFAULT_MAX_IMAGE_PIXELS, check_sample, iter_tar_samples
from magclip.data.shard_start import IMAGE_EXTS
from magclip.data.urls import check_sources_exist
from magclip.evaluation.checkpoint import EvalModel
from magclip.evaluation.clip import encode_loader
from magclip.models.tokens import long_captions

log = logging.getLogger("magclip.evaluation.zeroshot")


@dataclass
class EncodedSet:
    """Raw features of one set: images in sample order, captions in order within their image."""

    keys: list[str]
    image_features: Tensor
    text_features: Tensor | None
    captions: list[str] | None
    labels: Tensor | None  # class indices [N] (int64) when a class list was given; multilabel: 0/1 [N, C] (float32)
    skipped: dict[str, int]
    shards: list[str]  # empty for an image folder or a Karpathy file
    files: int | None = None  # image files an image folder or a Karpathy split indexes (None for shards)
    caption_counts: list[int] | None = None  # captions per image (retrieval sets)
    long_captions: dict[str, int] = field(default_factory=dict)

    @property
    def multi_caption(self) -> bool:
        return self.caption_counts is not None and any(n != 1 for n in self.caption_counts)

    def caption_ids(self) -> list[str]:
        """One id per caption: the sample key, `KEY#j` for the j-th caption of an image with several."""
        if not self.multi_caption:
            return list(self.keys)
        return [f"{key}#{j}" for key, n in zip(self.keys, self.caption_counts or []) for j in range(n)]


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


def _label_vector_of(members: dict[str, bytes], num_classes: int, where: str) -> np.ndarray:
    """A multilabel sample's KEY.npy (CLIP_benchmark's form): a 0/1 vector with one entry per class."""
    if "npy" not in members:
        raise ValueError(f"{where} has no .npy label vector (a multilabel set's label: 0/1 over its classes)")
    try:
        vector = np.load(io.BytesIO(members["npy"]), allow_pickle=False)
    except (ValueError, OSError) as exn:
        raise ValueError(f"{where}: .npy is not a NumPy array file ({exn})") from exn
    if vector.shape != (num_classes,):
        raise ValueError(f"{where}: .npy has shape {vector.shape}; a multilabel label is one 0/1 entry per class "
                         f"({num_classes} in classnames.txt)")
    if not np.isin(vector, (0, 1)).all():
        raise ValueError(f"{where}: .npy holds {sorted(set(vector.tolist()) - {0, 1})[:3]}, not only 0 and 1: "
                         "average precision needs presence (1) or absence (0) of each class")
    return vector.astype(np.float32)


def _progress(batches: Iterable[dict[str, Any]], desc: str, skipped: Counter,
              total: int | None = None) -> Iterator[dict[str, Any]]:
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
def encode_captioned(model: EvalModel, captioned: CaptionedImages, *, batch_size: int = 256,
                     device: str | torch.device = "cpu", workers: int = 0, desc: str = "encode images") -> EncodedSet:
    """Encode a caption file's images (a Karpathy split, a COCO caption file): every image found and every
    one of its captions."""
    skipped: Counter[str] = Counter()
    batches = captioned.iter_batches(model.preprocess, model.tokenizer, batch_size, skipped, workers=workers)
    enc = encode_loader(model.clip, _progress(batches, desc, skipped, total=len(captioned)), device, allow_empty=True)
    if enc is None:
        raise ValueError(f"no readable image in {captioned.what} under {captioned.images} "
                         f"(skipped: {dict(skipped) or 'none'})")
    return EncodedSet(enc["keys"], enc["image_features"], enc["text_features"], enc["captions"], None, dict(skipped),
                      [], len(captioned), enc["caption_counts"], long_captions(model.tokenizer, enc["captions"]))


@torch.no_grad()
def encode_shards(model: EvalModel, urls: str | list[str], *, captions: bool = True,
                  classes: ClassSet | None = None, label_field: str | None = None, batch_size: int = 256,
                  device: str | torch.device = "cpu", desc: str = "encode samples",
                  max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                  caption_key: str | CaptionKey = TXT, multilabel: bool = False) -> EncodedSet:
    """Read shards in order and encode every usable sample (raw features, float32, on CPU).

    captions: retrieval needs them (`caption_key`: KEY.txt one a line, or a KEY.json field); every caption
    of a sample is encoded. A shard whose images have no caption at all is an error that names it; a
    single sample without one (or with an empty one) is skipped and counted.
    classes: with a class list, every sample needs a label (KEY.cls, or KEY.json[label_field]) that
    the list holds; a missing or unknown label is an error naming the shard, the key and the list
    (raised while reading, before the rest is encoded). `multilabel`: the label is KEY.npy, a 0/1 vector
    over the classes (labels [N, C]).
    """
    caption_key = CaptionKey(caption_key) if isinstance(caption_key, str) else caption_key
    flat = check_sources_exist(urls)
    skipped: Counter[str] = Counter()
    per_shard: dict[str, list[int]] = {}  # url -> [samples with an image, of which have the caption member]

    def samples():
        for url, key, members in iter_tar_samples(flat, skipped):
            where = f"shard {url} key {key}"
            folded = dotted_keys.folded_samples(members, IMAGE_EXTS)
            if folded:
                skipped[dotted_keys.REASON] += len(folded)
                log.warning("skipped %s: %s: %d samples (%s.%s ...) read as one: %s", dotted_keys.REASON, where,
                            len(folded), key, folded[0], dotted_keys.CAUSE)
            if not any(e in members for e in IMAGE_EXTS):
                if not folded:  # a folded group's samples are counted above
                    skipped["missing_image"] += 1
                continue
            counts = per_shard.setdefault(url, [0, 0])
            counts[0] += 1
            counts[1] += caption_key.member in members
            good, reason, detail = check_sample(members, max_image_pixels, caption=captions, caption_key=caption_key)
            if good is None:
                skipped[reason] += 1
                if "caption" not in reason:
                    log.warning("skipped %s: %s: %s", reason, where, detail)
                continue
            if good["blank_captions"]:
                skipped["empty_caption_line"] += good["blank_captions"]
            label = (-1 if classes is None else _label_vector_of(members, len(classes), where) if multilabel
                     else classes.index_of(_label_of(members, label_field, where), where))
            yield key, model.preprocess(good["image"]), good["captions"] or [], label

    def batches():
        chunk: list = []
        for sample in itertools.chain(samples(), [None]):
            if sample is not None:
                chunk.append(sample)
            if chunk and (sample is None or len(chunk) >= batch_size):
                keys, images, caps, labels = zip(*chunk)
                flat_caps = [c for cs in caps for c in cs]
                batch = {"images": torch.stack(images), "keys": list(keys), "captions": flat_caps,
                         "caption_counts": [len(cs) for cs in caps], "labels": list(labels)}
                if captions:
                    batch["texts"] = model.tokenizer(flat_caps)
                chunk = []
                yield batch

    enc = encode_loader(model.clip, _progress(batches(), desc, skipped), device, allow_empty=True)
    if captions:
        uncaptioned = [u for u, (n, c) in per_shard.items() if n and not c]
        if uncaptioned:
            what = "KEY.txt captions" if caption_key.member == "txt" else f"KEY.json (caption key {caption_key.spec})"
            hint = ("; a caption only in KEY.json is read with --caption-key json:FIELD" if caption_key.member == "txt"
                    else "")
            raise ValueError(f"shard {uncaptioned[0]} has no {what} ({per_shard[uncaptioned[0]][0]} images): "
                             f"retrieval needs captions; for a classification-only set use task classification{hint}")
    if enc is None:
        raise ValueError(f"no usable sample in {urls!r} (skipped: {dict(skipped) or 'none'})")
    return EncodedSet(enc["keys"], enc["image_features"], enc["text_features"] if captions else None,
                      enc["captions"] if captions else None,
                      _labels_tensor(enc["labels"], multilabel) if classes is not None else None,
                      dict(skipped), flat, caption_counts=enc["caption_counts"] if captions else None,
                      long_captions=long_captions(model.tokenizer, enc["captions"]) if captions else {})


def _labels_tensor(labels: list, multilabel: bool) -> Tensor:
    """Class indices [N] (int64), or a multilabel set's 0/1 vectors [N, C] (float32)."""
    return torch.from_numpy(np.stack(labels)) if multilabel else torch.tensor(labels, dtype=torch.long)


@torch.no_grad()
def encode_texts(model: EvalModel, texts: list[str], *, batch_size: int = 256,
                 device: str | torch.device = "cpu") -> Tensor:
    """Raw text features [N, D], float32 on CPU."""
    out = []
    for start in range(0, len(texts), batch_size):
        tokens = model.tokenizer(texts[start:start + batch_size]).to(device)
        out.append(model.clip.encode_text(tokens).float().cpu())
    return torch.cat(out)
