"""Files in and out: atomic writes (a reader, or a resumed run, sees the old file or the new one,
never half of one) and the one safe way to read a torch file that a user hands us."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def looks_like_path(value: str) -> bool:
    """A local weights file rather than an open_clip pretrained tag (no slash, no weights suffix) or a hub
    name (`hf-hub:...`): the one rule by which training and evaluation decide to look on disk."""
    return not value.startswith("hf-hub:") and ("/" in value or value.startswith("~") or value.endswith(WEIGHT_SUFFIXES))


def umask_mode(kind: str = "file") -> int:
    """The mode a plain `open` (file) or `mkdir` (dir) would give under the process's umask; temp files
    and folders are created 0600/0700, and what we publish should look like any other file."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if kind == "dir" else 0o666) & ~mask


def atomic_write_with(path: str | Path, write: Callable[[str], None]) -> None:
    """`write(temp_path)` writes the file's content; it is synced and renamed onto `path` only when complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, umask_mode())
        os.close(fd)
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write_with(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def atomic_write_jsonl(path: str | Path, records: Any) -> None:
    """One JSON object per line (UTF-8, not ASCII-escaped)."""
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    import torch  # here, not at the top: configs and files are handled before torch is imported

    atomic_write_with(path, lambda tmp: torch.save(obj, tmp))


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


def staging_dir(final_dir: str | Path) -> Path:
    """A new empty folder `.NAME.*.tmp` beside `final_dir`: on the same file system, so `publish_dir` is a
    rename, unique, so two writers never share one, and with the mode a plain mkdir would give."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final_dir.parent, prefix=f".{final_dir.name}.", suffix=".tmp"))
    tmp.chmod(umask_mode("dir"))
    return tmp


@contextmanager
def publishing_dir(final_dir: str | Path) -> Iterator[Path]:
    """Yield a `staging_dir` to write a whole folder into; publish it on success, delete it on any failure,
    so `final_dir` is the old complete folder or the new complete one, never a mix."""
    tmp = staging_dir(final_dir)
    try:
        yield tmp
        publish_dir(tmp, final_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # how a Git LFS pointer file begins
LFS_POINTER_MAX_BYTES = 1024  # pointers are ~130 bytes; no tar, torch or safetensors file with data is this small


def is_lfs_pointer(path: str | Path) -> bool:
    """A Git LFS pointer where a data or weights file should be (its repository cloned without LFS files)."""
    path = Path(path)
    try:
        if path.stat().st_size >= LFS_POINTER_MAX_BYTES:
            return False
        with path.open("rb") as f:
            return f.read(len(LFS_POINTER)) == LFS_POINTER
    except OSError:
        return False


def lfs_pointer_error(path: str | Path, what: str, where: str = "") -> ValueError:
    """The error for `is_lfs_pointer(path)` where `what` was expected; `where`: a prefix naming the key or flag."""
    return DamagedFileError(f"{where}{path} is a Git LFS pointer, not {what}: it was cloned without its LFS files; "
                            "fetch them (git lfs pull in its repository) or download the files")


class UnsafeFileError(ValueError):
    """A torch file holds Python objects beyond tensors and plain values: unpickling them could run code."""


class DamagedFileError(ValueError):
    """A torch or safetensors file is truncated or not such a file at all."""


def load_error(path: str | Path, exn: BaseException) -> ValueError | None:
    """What went wrong when `torch.load(path, weights_only=True)` (or safetensors' reader) raised `exn`, as an
    error that names the file; None where `exn` is not about the file's content (e.g. a missing file)."""
    if isinstance(exn, OSError) and exn.errno != errno.EINVAL:  # EINVAL: torch's zip reader seeking past a cut end
        return None
    if is_lfs_pointer(path):
        return lfs_pointer_error(path, "weights")
    if isinstance(exn, pickle.UnpicklingError) and "weights only load failed" in str(exn).lower():
        found = re.search(r"GLOBAL ([\w.]+)", str(exn))
        what = f" such as {found.group(1)}" if found else ""
        return UnsafeFileError(
            f"refusing to load {path}: it holds Python objects{what} beyond tensors and plain values, and "
            "unpickling them could run arbitrary code. Files written by magclip never do; do not load a "
            "file from an untrusted source any other way")
    first = str(exn).splitlines()[0].split(". ")[0][:200] if str(exn) else type(exn).__name__
    writer = "safetensors" if str(path).endswith(".safetensors") else "torch.save"
    return DamagedFileError(f"{path} is damaged: truncated, or not a file written by {writer} ({first})")


def safe_torch_load(path: str | Path) -> Any:
    """`torch.load` that never runs code from the file (weights_only) and names a bad file in its error."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exn:
        error = load_error(path, exn)
        if error is None:
            raise
        raise error from None


def _weights_copy_ignore(root: Path):
    """copytree's ignore for `copy_weights_folder`: the root's weights (rewritten cast) and exported copies
    anywhere; a module folder's own weights (2_Dense/, a learned magnitude head) are copied as they are."""
    exported = shutil.ignore_patterns("onnx", "openvino")
    at_root = shutil.ignore_patterns("model.safetensors", "*.bin")

    def ignore(folder: str, names: list[str]) -> set[str]:
        skipped = set(exported(folder, names))
        return skipped | set(at_root(folder, names)) if Path(folder) == root else skipped
    return ignore


def copy_weights_folder(src: str | Path, dst: str | Path, dtype_name: str) -> None:
    """Copy a model folder (HF / sentence-transformers), its model.safetensors cast to `dtype_name`:
    float16 halves what a transfer or a repository must hold, float32 restores trainable weights (each
    weight is then the float16 rounding of the original, relative error <= 2^-11). Written beside `dst`
    and swapped in at the end, so `dst` is the old folder or the complete new one."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dtype = getattr(torch, dtype_name)
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=_weights_copy_ignore(src))
    weights = load_file(src / "model.safetensors")
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()},
              tmp / "model.safetensors", metadata={"format": "pt"})
    config_file = tmp / "config.json"
    if config_file.is_file():   # the dtype a config records (transformers 5 `dtype`, 4 `torch_dtype`) says the new one
        config = json.loads(config_file.read_text())
        recorded = {key: dtype_name for key in ("dtype", "torch_dtype") if key in config}
        if recorded:
            config_file.write_text(json.dumps({**config, **recorded}, indent=2) + "\n")
    publish_dir(tmp, dst)
