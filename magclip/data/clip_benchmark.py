"""CLIP_benchmark's webdataset folders, read as CLIP_benchmark reads them (`build_wds_dataset`).

    ROOT/
        dataset_type.txt                          retrieval | classification | multilabel (absent: classification)
        classnames.txt                            one class name a line (classification)
        zeroshot_classification_templates.txt     one template a line, "{c}" for the class (classification)
        <split>/nshards.txt                       the number of shards n
        <split>/0.tar ... <split>/{n-1}.tar       KEY.{webp,png,jpg,jpeg} + KEY.txt (every caption, one a line)
                                                  or KEY.cls (the class index), or KEY.npy (multilabel)

A split folder given itself (`ROOT/test`, where nshards.txt is) is read as the split of ROOT it is
(`split_folder`), the same set scored the same way; a --split that names another split is refused.

This is what `clip_benchmark.webdataset_builder.convert_retrieval_dataset` / `convert_dataset` write and
what its `wds_mscoco_captions`, `wds_flickr30k`, `wds_flickr8k`, `wds_imagenet1k`, `wds_vtab-*` ... sets
are. A retrieval folder is scored by image (CLIP_benchmark's `texts_image_index`: a caption is relevant to
its own image) unless asked otherwise; the split defaults to CLIP_benchmark's `test`.

Refused in one line, naming the file: a split that is not there (the splits that are are listed), a
missing or unreadable nshards.txt, shards that disagree with it (a missing {i}.tar, or .tar files beyond
n-1 that CLIP_benchmark would silently leave out), an unknown dataset_type, a classification or multilabel
folder without classnames.txt. A `multilabel` folder (VOC2007's form: KEY.npy, one 0/1 vector over the classes
per image) is classification scored by mean average precision, as CLIP_benchmark scores it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DATASET_TYPE_FILE = "dataset_type.txt"
NSHARDS_FILE = "nshards.txt"
CLASSNAMES_FILE = "classnames.txt"
TEMPLATES_FILE = "zeroshot_classification_templates.txt"
DATASET_TYPES = {"retrieval": "retrieval", "classification": "classification", "multilabel": "classification"}
DEFAULT_SPLIT = "test"  # CLIP_benchmark's --split default
_SHARD = re.compile(r"^(\d+)\.tar$")


@dataclass(frozen=True)
class ClipBenchmarkFolder:
    """One split of a CLIP_benchmark webdataset folder, checked."""

    root: Path
    split: str
    dataset_type: str          # DATASET_TYPES' keys
    shards: tuple[str, ...]    # {0..n-1}.tar, in order
    classnames: Path | None    # classnames.txt where the folder has one
    templates: Path | None     # zeroshot_classification_templates.txt where the folder has one

    @property
    def task(self) -> str:
        return DATASET_TYPES[self.dataset_type]

    @property
    def multilabel(self) -> bool:
        """Labels are KEY.npy vectors over the classes (CLIP_benchmark's `dataset_type` multilabel)."""
        return self.dataset_type == "multilabel"

    @property
    def urls(self) -> str:
        """The shards in order, '::'-joined (what the shard readers take)."""
        return "::".join(self.shards)


def is_clip_benchmark_folder(path: str | Path) -> bool:
    """A local folder with dataset_type.txt, or with a sub-folder holding nshards.txt."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return False
    return (path / DATASET_TYPE_FILE).is_file() or any(p.is_dir() and (p / NSHARDS_FILE).is_file()
                                                        for p in path.iterdir())


def split_folder(path: str | Path, split: str | None, where: str) -> tuple[Path, str] | None:
    """(ROOT, split) where `path` is a split folder of a CLIP_benchmark folder (it holds nshards.txt), else None:
    read as the plain shards in it, the set would be scored by caption identity and without its dataset_type.
    A `split` other than the folder's own is a ValueError naming both."""
    path = Path(path).expanduser()
    if not (path.is_dir() and (path / NSHARDS_FILE).is_file()):
        return None
    if split is not None and split != path.name:
        raise ValueError(f"{where}: {path} is the split {path.name!r} of the CLIP_benchmark folder {path.parent} "
                         f"(it holds {NSHARDS_FILE}), not split {split!r}: give the folder {path.parent} with "
                         f"split {split!r}")
    return path.parent, path.name


def splits(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / NSHARDS_FILE).is_file())


def open_clip_benchmark_folder(root: str | Path, split: str | None = None) -> ClipBenchmarkFolder:
    """Check one split of `root` as CLIP_benchmark would read it; a ValueError/FileNotFoundError naming the
    file where it would read something else (see the module docstring)."""
    root = Path(root).expanduser()
    split = split or DEFAULT_SPLIT
    split_dir = root / split
    if not (split_dir / NSHARDS_FILE).is_file():
        present = splits(root)
        what = f"the splits here are {', '.join(present)}" if present else "no sub-folder has an nshards.txt"
        raise FileNotFoundError(f"{split_dir / NSHARDS_FILE}: not found: CLIP_benchmark folder {root} has no split "
                                f"{split!r} ({what}; choose one with --split / split:)")
    shards = _checked_shards(split_dir)
    dataset_type = _dataset_type(root)
    classnames = root / CLASSNAMES_FILE if (root / CLASSNAMES_FILE).is_file() else None
    templates = root / TEMPLATES_FILE if (root / TEMPLATES_FILE).is_file() else None
    if DATASET_TYPES[dataset_type] == "classification" and classnames is None:
        raise FileNotFoundError(f"{root / CLASSNAMES_FILE}: not found: the {dataset_type} folder {root} needs its "
                                "class names (one a line, in label order), as CLIP_benchmark's convert_dataset writes them")
    return ClipBenchmarkFolder(root, split, dataset_type, shards, classnames, templates)


def _checked_shards(split_dir: Path) -> tuple[str, ...]:
    nshards_file = split_dir / NSHARDS_FILE
    text = nshards_file.read_text(encoding="utf-8", errors="replace").strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{nshards_file}: holds {text[:40]!r}, not a number of shards >= 1 (CLIP_benchmark writes "
                         "the shard count there)")
    n = int(text)
    found = sorted(int(m.group(1)) for p in split_dir.iterdir() if (m := _SHARD.match(p.name)))
    missing = [i for i in range(n) if i not in set(found)]
    if missing:
        raise FileNotFoundError(f"{split_dir / f'{missing[0]}.tar'}: not found: {nshards_file} says {n} shards, "
                                f"{len(missing)} of 0..{n - 1} are missing")
    extra = [i for i in found if i >= n]
    if extra:
        raise ValueError(f"{nshards_file} says {n} shards but {split_dir} also holds {', '.join(f'{i}.tar' for i in extra[:5])}"
                         f"{' ...' if len(extra) > 5 else ''}: CLIP_benchmark would leave them out; fix nshards.txt "
                         "or remove the shards that do not belong")
    return tuple(str(split_dir / f"{i}.tar") for i in range(n))


def _dataset_type(root: Path) -> str:
    """CLIP_benchmark's rule: dataset_type.txt, stripped and lower-cased; absent means classification."""
    path = root / DATASET_TYPE_FILE
    if not path.is_file():
        return "classification"
    value = path.read_text(encoding="utf-8", errors="replace").strip().lower()
    if value not in DATASET_TYPES:
        raise ValueError(f"{path}: unknown dataset type {value[:40]!r}; CLIP_benchmark's are retrieval, classification "
                         "and multilabel")
    return value
