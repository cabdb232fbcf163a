"""The embedded default dataset: rendered shape scenes with captions of varying specificity.

Each image is a plain black square with 1-3 objects placed in distinct cells of a 3x3 grid.
An object has a shape (circle, square, triangle, cross), a colour (red, green, blue, yellow,
purple, orange) and a position (the grid cell: "at the top left", "in the center", ...).
The vocabulary is small and every caption is built from the same phrases, so a tiny CLIP
(32x32 inputs, a few transformer layers) learns it in a couple of CPU minutes.

The magnitude-relevant signal, on purpose: captions describe *more or less* of the scene.
Some name every object with colour, shape and position ("a red circle at the top left and a
blue square at the bottom"), some only colour and shape of every object, some a single
object, some just one attribute of one object ("a triangle", "something purple"). A vague
caption matches many images, a detailed one few, so the caption's specificity is exactly the
kind of quantity a text embedding's magnitude can carry (cosine throws it away; dot / DNorm /
QNorm keep it on one side). Each sample's KEY.json records it:

    {"objects": [{"shape", "colour", "position"}...], "num_objects": n,
     "caption_detail": mentioned attributes / (3 * n), "template": name}

Samples are written like img2dataset does: KEY.png, KEY.txt (utf-8 caption), KEY.json, in
webdataset tar shards, plus `sizes.json` ({shard filename: count}, open_clip's convention).
Generation is deterministic (same parameters -> byte-identical tars; tar headers carry fixed
mtime/uid/gid/mode) and atomic (built in a temporary folder, then renamed into place), so
several processes may call `ensure_synthetic` at once and a later call just reuses the folder.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

VERSION = "synthetic-v1"

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (30, 200, 40),
    "blue": (40, 80, 255),
    "yellow": (250, 230, 30),
    "purple": (170, 50, 220),
    "orange": (255, 140, 0),
}
SHAPES = ("circle", "square", "triangle", "cross")
# 3x3 grid cells (row, col) -> phrase; reading order is the caption order.
POSITIONS: dict[tuple[int, int], str] = {
    (0, 0): "at the top left",
    (0, 1): "at the top",
    (0, 2): "at the top right",
    (1, 0): "on the left",
    (1, 1): "in the center",
    (1, 2): "on the right",
    (2, 0): "at the bottom left",
    (2, 1): "at the bottom",
    (2, 2): "at the bottom right",
}
BACKGROUND = (0, 0, 0)
_COLOUR_NAMES = sorted(COLOURS)
_CELLS = sorted(POSITIONS)

# Caption templates: (name, weight). "all_*" describe every object, "one_*" a single one.
TEMPLATES: tuple[tuple[str, float], ...] = (
    ("all_full", 0.35),  # colour + shape + position of every object
    ("all_colour_shape", 0.15),
    ("all_shape_position", 0.10),
    ("one_full", 0.15),
    ("one_colour_shape", 0.10),
    ("one_shape", 0.075),
    ("one_colour", 0.075),
)
_ATTRS = {  # attributes each template mentions per described object
    "full": ("colour", "shape", "position"),
    "colour_shape": ("colour", "shape"),
    "shape_position": ("shape", "position"),
    "shape": ("shape",),
    "colour": ("colour",),
}


@dataclass(frozen=True)
class SyntheticData:
    """Where the generated shards are; `*_urls` are brace patterns for `build_clip_loader`."""

    root: Path
    train_urls: str
    val_urls: str
    num_train: int
    num_val: int

    @property
    def sizes_file(self) -> Path:
        return self.root / "sizes.json"


def default_cache_root() -> Path:
    base = os.environ.get("MAGCLIP_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "magclip") / VERSION


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _describe(obj: dict, attrs: tuple[str, ...]) -> str:
    if attrs == ("colour",):
        return f"something {obj['colour']}"
    words = [obj["colour"]] if "colour" in attrs else []
    words.append(obj["shape"])
    phrase = f"{_article(words[0])} {' '.join(words)}"
    if "position" in attrs:
        phrase += f" {obj['position']}"
    return phrase


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def scene_captions(objects: list[dict]) -> list[str]:
    """Three captions of one scene, each describing every object (colour, shape and position; colour and
    shape; shape and position): the scenes as a multi-caption retrieval set. `objects` as in KEY.json."""
    return [_join([_describe(o, _ATTRS[kind]) for o in objects]) for kind in ("full", "colour_shape", "shape_position")]


def make_scene(rng: random.Random) -> tuple[list[dict], str, str, float]:
    """Draw a scene description and a caption: (objects, caption, template, caption_detail)."""
    n = rng.choice((1, 2, 3))
    cells = sorted(rng.sample(_CELLS, n))  # reading order
    objects = [
        {"shape": rng.choice(SHAPES), "colour": rng.choice(_COLOUR_NAMES), "position": POSITIONS[c],
         "cell": list(c)}
        for c in cells
    ]
    names, weights = zip(*TEMPLATES)
    template = rng.choices(names, weights=weights)[0]
    scope, kind = template.split("_", 1)
    attrs = _ATTRS[kind]
    described = objects if scope == "all" else [rng.choice(objects)]
    caption = _join([_describe(o, attrs) for o in described])
    detail = len(described) * len(attrs) / (3 * n)
    return objects, caption, template, round(detail, 4)


def render(objects: list[dict], size: int, rng: random.Random) -> Image.Image:
    """Draw the objects on a plain background; a pixel of jitter keeps images from repeating."""
    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    cell = size / 3
    r = cell * 0.38
    for obj in objects:
        row, col = obj["cell"]
        j = max(1.0, size / 32)
        cx = (col + 0.5) * cell + rng.uniform(-j, j)
        cy = (row + 0.5) * cell + rng.uniform(-j, j)
        fill = COLOURS[obj["colour"]]
        shape = obj["shape"]
        if shape == "circle":
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        elif shape == "square":
            s = r * 0.85
            draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
        elif shape == "triangle":
            draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)
        elif shape == "cross":
            w = max(1.0, r * 0.35)
            draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
            draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)
        else:  # pragma: no cover - SHAPES is closed
            raise ValueError(shape)
    return img


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def _split_sizes(n: int, num_shards: int) -> list[int]:
    base, extra = divmod(n, num_shards)
    return [base + (i < extra) for i in range(num_shards)]


def _write_split(out: Path, split: str, n: int, num_shards: int, image_size: int, seed: int
                 ) -> dict[str, int]:
    sizes: dict[str, int] = {}
    index = 0
    for shard, count in enumerate(_split_sizes(n, num_shards)):
        name = f"{split}-{shard:06d}.tar"
        with tarfile.open(out / name, "w", format=tarfile.USTAR_FORMAT) as tar:
            for _ in range(count):
                rng = random.Random(f"{seed}:{split}:{index}")
                objects, caption, template, detail = make_scene(rng)
                buf = io.BytesIO()
                render(objects, image_size, rng).save(buf, format="PNG")
                meta = {"objects": [{k: o[k] for k in ("shape", "colour", "position")} for o in objects],
                        "num_objects": len(objects), "caption_detail": detail, "template": template}
                key = f"{index:09d}"
                add_member(tar, f"{key}.png", buf.getvalue())
                add_member(tar, f"{key}.txt", caption.encode("utf-8"))
                add_member(tar, f"{key}.json", json.dumps(meta, sort_keys=True).encode("utf-8"))
                index += 1
        sizes[name] = count
    return sizes


def _pattern(root: Path, split: str, num_shards: int) -> str:
    last = num_shards - 1
    return str(root / (f"{split}-{{000000..{last:06d}}}.tar" if last else f"{split}-000000.tar"))


def ensure_synthetic(
    root: str | Path | None = None,
    *,
    num_train: int = 6000,
    num_val: int = 500,
    image_size: int = 32,
    shard_size: int = 500,
    seed: int = 0,
) -> SyntheticData:
    """Generate the synthetic shards once (atomically) and return where they are.

    `root` is a cache folder (default `$MAGCLIP_CACHE/synthetic-v1`, else
    `~/.cache/magclip/synthetic-v1`); the data goes into a subfolder named after every
    parameter, so different parameters never collide. Val always gets at least 2 shards so that
    two ranks (or two loader workers) each get one.
    """
    if num_train < 1 or num_val < 1 or shard_size < 1 or image_size < 8:
        raise ValueError("need num_train, num_val, shard_size >= 1 and image_size >= 8")
    base = Path(root) if root is not None else default_cache_root()
    name = f"train{num_train}-val{num_val}-px{image_size}-shard{shard_size}-seed{seed}"
    out = base / name
    n_train = math.ceil(num_train / shard_size)
    n_val = max(min(2, num_val), math.ceil(num_val / shard_size))
    data = SyntheticData(out, _pattern(out, "train", n_train), _pattern(out, "val", n_val),
                         num_train, num_val)
    if (out / "sizes.json").is_file():
        return data
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=base))
    try:
        sizes = _write_split(tmp, "train", num_train, n_train, image_size, seed)
        sizes |= _write_split(tmp, "val", num_val, n_val, image_size, seed)
        info = {"version": VERSION, "num_train": num_train, "num_val": num_val, "image_size": image_size,
                "shard_size": shard_size, "seed": seed, "colours": sorted(COLOURS), "shapes": list(SHAPES),
                "positions": list(POSITIONS.values()), "templates": dict(TEMPLATES)}
        (tmp / "info.json").write_text(json.dumps(info, indent=1) + "\n")
        (tmp / "sizes.json").write_text(json.dumps(sizes, indent=1, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            tmp.rename(out)
        except OSError:
            # Another process finished first: its copy is identical, keep it.
            if not (out / "sizes.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return data
