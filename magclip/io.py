"""Atomic writes: a reader (or a resumed run) sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def atomic_write_jsonl(path: str | Path, records: Any) -> None:
    """One JSON object per line (UTF-8, not ASCII-escaped)."""
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def publish_dir(tmp_dir: str | Path, final_dir: str | Path) -> None:
    """Move a fully written directory into place; an older one of the same name is replaced.

    Replacing takes two renames (old -> `.NAME.old`, new -> NAME); a process killed between them
    leaves NAME missing and the old version at `.NAME.old`, which `recover_dir` puts back."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    if final_dir.exists():
        old = final_dir.with_name(f".{final_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
        os.replace(tmp_dir, final_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp_dir, final_dir)


def recover_dir(final_dir: str | Path) -> bool:
    """Undo a `publish_dir` interrupted between its two renames: move `.NAME.old` back to NAME if
    NAME is missing (True), else drop a leftover `.NAME.old`. Only while nothing publishes NAME."""
    final_dir = Path(final_dir)
    old = final_dir.with_name(f".{final_dir.name}.old")
    if not old.is_dir():
        return False
    if final_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        return False
    os.replace(old, final_dir)
    return True
