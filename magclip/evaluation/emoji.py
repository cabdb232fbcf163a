"""The emoji benchmark (../shared/data/emoji, see its README): its splits, their domains, and the
1,906-way class list over emoji names, as inputs to `evaluate_zeroshot`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from magclip.data.classes import load_classes

# The emoji benchmark (../shared/data/emoji, see its README): split -> (domain, concept group).
EMOJI_SPLITS: dict[str, tuple[str, str]] = {
    "train": ("in-domain", "seen"),
    "id_novel": ("in-domain", "novel"),
    "id_heldcat": ("in-domain", "heldcat"),
    "ood_seen": ("out-of-domain", "seen"),
    "ood_novel": ("out-of-domain", "novel"),
    "ood_heldcat": ("out-of-domain", "heldcat"),
}
EMOJI_EXCLUDE_GROUPS = ("Flags",)


def emoji_benchmark(root: str | Path, splits: Sequence[str] | None = None) -> dict[str, Any]:
    """Sets, class list and options for the emoji data (../shared/data/emoji, see its README).

    Classes: all emoji of `emoji_index.jsonl` (1,906), named by their CLDR annotation (the caption
    the shards carry in KEY.txt), keyed by code points (`unified`, which each sample's KEY.json
    holds), grouped by `category`; metrics are also given without the Flags category. Domains:
    train/id_* are the google+twitter art styles seen in training (in-domain), ood_* the openmoji
    style (out-of-domain).
    """
    root = Path(root)
    meta_path = root / "splits.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"emoji splits not found: {meta_path}")
    meta = json.loads(meta_path.read_text())["splits"]
    splits = list(splits) if splits else [s for s in EMOJI_SPLITS if s in meta]
    unknown = [s for s in splits if s not in meta]
    if unknown:
        raise ValueError(f"unknown emoji split(s) {unknown}; {meta_path} has {sorted(meta)}")
    data = {s: str(root / meta[s]["pattern"]) for s in splits}
    info = {s: {"domain": EMOJI_SPLITS.get(s, ("?", "?"))[0], "concepts": EMOJI_SPLITS.get(s, ("?", "?"))[1],
                "styles": sorted(meta[s].get("per_vendor", {})), "expected_samples": meta[s].get("count")}
            for s in splits}
    classes = load_classes(root / "emoji_index.jsonl", name_field="annotation", key_field="unified",
                           group_field="category")
    return {"data": data, "set_info": info, "classes": classes, "label_field": "unified",
            "exclude_groups": EMOJI_EXCLUDE_GROUPS}
