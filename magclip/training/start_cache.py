"""A cache of start evaluations shared by the runs of a grid (`eval.start_cache: DIR`).

A text run with `eval.at_start` evaluates the model it starts from before training. Every seed of a
mode evaluates the same model on the same sets with the same scorer, so a grid of modes x seeds
repeats that evaluation once per seed (minutes per cell on a CPU). With a cache folder the first run
of a key evaluates and stores its `zero_shot.json` and per-query outcomes under `DIR/<key>/`; the
others copy them into their run folder, and the run's log and results.json (`zero_shot_cached`) say
so. The evaluation is deterministic (no sampling; fp32 by default), so a copy is the value the run
would have computed.

The key is a digest of everything the start's numbers depend on: the model's files (their bytes),
the encoder settings (`model.*`), the evaluation settings (`eval.*` but where the cache lives), the
starting scorer (`loss.mode`, `loss.gamma_q`, `loss.gamma_d`), each evaluation file's path, size and
modification time, and the versions of magclip, torch and transformers. A model that is not a local
folder (a hub name, resolved by transformers' own cache) is not cached. `DIR/<key>/key.json` keeps the
inputs of the digest, readable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from magclip.config import TextRunConfig, to_dict
from magclip.io import atomic_write_json, publish_dir
from magclip.metrics.ranks import queries_path, ranks_path

log = logging.getLogger("magclip.text")

CACHE_FORMAT = 1
NOT_IN_KEY = ("at_start", "start_cache", "batch_size")   # eval keys that do not change the start's numbers


def start_key(cfg: TextRunConfig, model_folder: Path) -> tuple[str, dict[str, Any]]:
    """(digest, its inputs) of the start evaluation `cfg` asks for, from the model in `model_folder`."""
    import torch
    import transformers

    import magclip

    evaluation = {k: v for k, v in to_dict(cfg.eval).items() if k not in NOT_IN_KEY}
    inputs = {
        "format": CACHE_FORMAT,
        "versions": {"magclip": magclip.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "model_files": {p.relative_to(model_folder).as_posix(): _file_digest(p)
                        for p in sorted(model_folder.rglob("*")) if p.is_file()},
        "model": to_dict(cfg.model) | {"name": None},   # the files say which model; the name is where it was
        "eval": evaluation,
        "scorer": {"mode": cfg.loss.mode, "gamma_q": cfg.loss.gamma_q, "gamma_d": cfg.loss.gamma_d},
        "eval_files": _stat_files([*cfg.eval.beir.values(), *cfg.eval.sts.values(), *cfg.eval.rag.values()]),
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return digest, inputs


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _stat_files(paths: list[str]) -> dict[str, list[int]]:
    """{file: [size, mtime_ns]} of every file under the evaluation paths (a folder or a file)."""
    out = {}
    for root in map(Path, paths):
        for p in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if p.is_file():
                st = p.stat()
                out[str(p.resolve())] = [st.st_size, st.st_mtime_ns]
    return out


def _files(start_file: Path) -> list[Path]:
    """The start evaluation's files: its JSON and whatever per-query outcomes lie beside it."""
    return [p for p in (start_file, queries_path(start_file), ranks_path(start_file)) if p.is_file()]


def cached_start(cache_dir: Path, key: str, start_file: Path) -> bool:
    """Copy the cached start evaluation of `key` to `start_file` (and its outcomes beside it); False if none."""
    entry = cache_dir / key
    cached = entry / start_file.name
    if not cached.is_file():
        return False
    for src in _files(cached):
        shutil.copy2(src, start_file.parent / src.name)
    log.info("eval.at_start: the start's evaluation copied from the cache %s", entry)
    return True


def store_start(cache_dir: Path, key: str, inputs: dict[str, Any], start_file: Path) -> None:
    """Keep the run's start evaluation under `cache_dir/key` (whole or not at all; a run that stored the
    same key first wins, their values being the same)."""
    entry = cache_dir / key
    if entry.is_dir():
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{key}.{start_file.parent.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for src in _files(start_file):
        shutil.copy2(src, tmp / src.name)
    atomic_write_json(tmp / "key.json", inputs)
    if entry.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
        return
    publish_dir(tmp, entry)
