"""What a LoRA run's checkpoint records of its frozen base, and the check a resume makes against it.

A LoRA checkpoint holds what trains (the adapters, their optimizer state, the logit scale and γ, the loader and RNG
state: training/engine.py) and not the frozen base, which is read again from its files on resuming. So the step
folder names the base (`base.json`): its path, the dtype it was held in during training (the offline merge rounds
the base as training saw it: magclip.training.consolidate) and a fingerprint of its weights files: each file's name
and size and each tensor's name and shape, read from the headers (no weights are read, so it costs milliseconds for
a 15 GB base). A resume, or a merge, whose base differs is refused in one line naming both fingerprints and the
first difference: adapters trained on one base mean nothing on another.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from magclip.config import ConfigError
from magclip.io import atomic_write_json

BASE_FILE = "base.json"   # a LoRA step folder's record of its frozen base
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class BaseChangedError(ConfigError):
    """A LoRA checkpoint resumed (or merged) onto a base whose weights files are not the ones it was trained on."""


def weights_listing(path: Path) -> list[dict[str, Any]]:
    """Every weights file of a base (the file itself, or those under a folder): name, size, tensor names and shapes."""
    from magclip.models.build import file_tensors

    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.suffix in WEIGHT_SUFFIXES)
    listing = []
    for f in files:
        tensors = file_tensors(f) if f.suffix in (".safetensors", ".pt", ".pth") else {}
        listing.append({"file": f.name if f == path else str(f.relative_to(path)), "bytes": f.stat().st_size,
                        "tensors": sorted([name, list(shape)] for name, shape in tensors.items())})
    return listing


def base_identity(path: str | Path | None, dtype: torch.dtype | None, seed: int | None = None) -> dict[str, Any]:
    """`base.json`: the base's path, its training dtype and the fingerprint of its weights files; a base initialised
    at random (no weights file) is named by the seed that drew it."""
    record: dict[str, Any] = {"path": None if path is None else str(path),
                              "dtype": str(dtype or torch.float32).replace("torch.", "")}
    local = Path(path) if path is not None else None
    if local is None or not local.exists():
        record.update({"fingerprint": None, "files": 0, "seed": seed if local is None else None})
        return record
    listing = weights_listing(local)
    record["fingerprint"] = hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()
    record["files"] = len(listing)
    record["bytes"] = sum(f["bytes"] for f in listing)
    return record


def write_base(folder: Path, base: dict[str, Any]) -> None:
    atomic_write_json(folder / BASE_FILE, base)


def read_base(step: Path) -> dict[str, Any] | None:
    """A step folder's `base.json`, None where there is none (not a LoRA checkpoint)."""
    path = step / BASE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def check_base(saved: dict[str, Any] | None, current: dict[str, Any], step: Path, doing: str = "train.resume") -> None:
    """Refuse, in one line, `step`'s adapters on another base than the one they were trained on."""
    if saved is None:
        raise BaseChangedError(f"{doing}: {step} records no frozen base ({BASE_FILE}): not a LoRA checkpoint of this "
                               "magclip; start a new run")
    keys = ("fingerprint", "dtype") if doing == "train.resume" else ("fingerprint",)
    if saved.get("fingerprint") is None or current.get("fingerprint") is None:   # a base drawn at random: its seed
        keys = ("path", "fingerprint", "seed")
    changed = [k for k in keys if saved.get(k) != current.get(k)]
    if not changed:
        return
    what = "; ".join(f"{k} {saved.get(k)!r} in the checkpoint, {current.get(k)!r} now" for k in changed)
    raise BaseChangedError(f"{doing}: {step} trained adapters on another frozen base ({what}; the fingerprint covers "
                           "the names, shapes and sizes of its weights files): point the run at the base it was "
                           "trained on, or start a new run")
