"""Zero-shot class lists and prompt templates: what a classifier's documents are made of.

A class list names the classes (what templates are filled with), the keys sample labels are matched
against and optional groups (e.g. emoji categories); templates are format strings with "{}" or
CLIP_benchmark's "{c}" (or callables) from open_clip's presets, a file, or literal strings.

CLIP_benchmark's files are read as it writes them: `en_classnames.json` is a JSON dict
{dataset name: [class names]}, `en_zeroshot_classification_templates.json` a dict
{dataset name: [templates with "{c}"]}; a plain JSON list of either works too. The entry of a dict
is picked by the first of `lookup` (the data set's names) it holds: for class names a missing entry
is an error listing the keys; for templates CLIP_benchmark's fallback "imagenet1k" applies.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPLATE_PRESETS = ("identity", "simple", "openai")
DEFAULT_TEMPLATE_KEY = "imagenet1k"  # CLIP_benchmark's templates for a data set its file does not name


@dataclass
class ClassSet:
    """Class names (what the templates are filled with), the keys that sample labels are matched
    against, and optional groups (e.g. emoji categories) for metrics without some groups."""

    names: list[str]
    keys: list[str]
    groups: list[str] | None = None
    source: str = "<memory>"
    key_field: str | None = None

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError(f"class list {self.source} is empty")
        if len(self.keys) != len(self.names) or (self.groups is not None and len(self.groups) != len(self.names)):
            raise ValueError(f"class list {self.source}: names, keys and groups differ in length")
        dup = [k for k, n in Counter(self.keys).items() if n > 1]
        if dup:
            raise ValueError(f"class list {self.source}: duplicate class keys {dup[:5]}")
        self._by_key = {k: i for i, k in enumerate(self.keys)}
        self._by_name = {n: i for i, n in enumerate(self.names)} if len(set(self.names)) == len(self.names) else {}

    def __len__(self) -> int:
        return len(self.names)

    def index_of(self, label: Any, where: str) -> int:
        """Class index of one sample label: a class key, else (no key field) an index or a name."""
        text = str(label).strip()
        if text in self._by_key:
            return self._by_key[text]
        if self.key_field is None:
            if isinstance(label, int) or text.lstrip("-").isdigit():
                i = int(text)
                if 0 <= i < len(self):
                    return i
            elif text in self._by_name:
                return self._by_name[text]
        what = f"key field {self.key_field!r}" if self.key_field else f"{len(self)} classes (index or name)"
        raise ValueError(f"label {label!r} of {where} is not in the class list {self.source} ({what}): "
                         "the class list does not match the labels")


def text_lines(path: Path, what: str) -> list[str]:
    """A file of one entry a line (classnames.txt, a template file), each line stripped, trailing blank lines
    dropped. A blank line inside is an error naming it: dropping it would shift every later class index
    by one (labels are indices), keeping it would make a class without a name."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    blank = [i + 1 for i, line in enumerate(lines) if not line]
    if blank:
        raise ValueError(f"{path}: line {blank[0]} is blank ({len(blank)} blank lines): every line must name a {what} "
                         "(labels are line indices)" if what == "class" else
                         f"{path}: line {blank[0]} is blank ({len(blank)} blank lines): every line must hold a {what}")
    return lines


def pick_entry(table: dict[str, Any], lookup: Sequence[str], what: str, fallback: str | None = None) -> str:
    """The key of a {data set: value} dict to use: the first of `lookup` it holds, else `fallback`;
    none: a ValueError naming `what` (the file), the names tried and the keys it has."""
    for key in [*lookup, *([fallback] if fallback else [])]:
        if key in table:
            return key
    keys = sorted(table)
    shown = ", ".join(keys[:30]) + (f", ... ({len(keys)} keys)" if len(keys) > 30 else "")
    tried = ", ".join(repr(k) for k in lookup) or "none given"
    raise ValueError(f"{what} is a dict by data set with no entry for {tried} (keys: {shown}): name the set "
                     "like a key (--data KEY=DIR) or pick one with --class-set KEY")


def load_classes(path: str | Path, *, name_field: str = "name", key_field: str | None = None,
                 group_field: str | None = None, lookup: Sequence[str] = ()) -> ClassSet:
    """A class list from a file.

    - `.txt`: one class name per line; labels are indices into the list (or the names).
    - `.json`: a list of names, or a list of objects; `.jsonl`: one object per line. Objects give
      the name in `name_field`, the label key in `key_field` (default: the index) and an optional
      group in `group_field`.
    - `.json` dict by data set, CLIP_benchmark's `en_classnames.json`: {set: [names or objects]}; the
      entry is the first of `lookup` found (`pick_entry`), read as above. A dict of strings
      {key: name} (e.g. ImageNet wnid -> name) is a keyed list: labels are matched to its keys.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"class list not found: {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        rows: list[Any] = text_lines(path, "class")
    elif path.suffix == ".jsonl":
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exn:
            raise ValueError(f"class list {path} is not valid JSONL: {exn}") from exn
    elif path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exn:
            raise ValueError(f"class list {path} is not valid JSON: {exn}") from exn
        if isinstance(rows, dict) and rows and all(isinstance(v, str) for v in rows.values()):
            return ClassSet(list(rows.values()), list(rows), None, str(path), "JSON key")
        if isinstance(rows, dict) and rows and all(isinstance(v, list) for v in rows.values()):
            key = pick_entry(rows, lookup, f"class list {path}")
            rows, path = rows[key], Path(f"{path}[{key}]")
        if not isinstance(rows, list):
            raise ValueError(f"class list {path} must hold a JSON list, a dict {{data set: [class names]}} "
                             "(CLIP_benchmark) or a dict {key: class name}")
    else:
        raise ValueError(f"class list {path}: expected .txt, .json or .jsonl")
    if all(isinstance(r, str) for r in rows):
        if key_field or group_field:
            raise ValueError(f"class list {path} holds plain names: key/group fields need objects")
        return ClassSet(list(rows), [str(i) for i in range(len(rows))], None, str(path), None)

    def get(row: Any, f: str, i: int) -> Any:
        if not isinstance(row, dict) or f not in row:
            raise ValueError(f"class list {path}, entry {i}: no field {f!r}")
        return row[f]

    names = [str(get(r, name_field, i)) for i, r in enumerate(rows)]
    keys = [str(get(r, key_field, i)) for i, r in enumerate(rows)] if key_field else [str(i) for i in range(len(rows))]
    groups = [str(get(r, group_field, i)) for i, r in enumerate(rows)] if group_field else None
    return ClassSet(names, keys, groups, str(path), key_field)


def resolve_templates(specs: Sequence[str] | None, lookup: Sequence[str] = ()) -> list[str | Callable[[str], str]]:
    """Prompt templates from presets ('identity' = "{}", 'simple' / 'openai' = open_clip's ImageNet
    templates), literal strings with "{}" or "{c}", text files (one template per line) or JSON files:
    a list of templates, or CLIP_benchmark's dict {data set: [templates]} (entry: the first of `lookup`
    found, else "imagenet1k" as CLIP_benchmark falls back)."""
    out: list[str | Callable[[str], str]] = []
    for spec in specs or ["identity"]:
        if spec == "identity":
            out.append("{}")
        elif spec in ("simple", "openai"):
            from open_clip import zero_shot_metadata as meta

            out += list(meta.SIMPLE_IMAGENET_TEMPLATES if spec == "simple" else meta.OPENAI_IMAGENET_TEMPLATES)
        elif _has_slot(spec):
            out.append(spec)
        elif Path(spec).is_file() and spec.endswith(".json"):
            out += _json_templates(Path(spec), lookup)
        elif Path(spec).is_file():
            lines = [ln.strip() for ln in Path(spec).read_text(encoding="utf-8").splitlines() if ln.strip()]
            bad = [ln for ln in lines if not _has_slot(ln)]
            if not lines or bad:
                raise ValueError(f"template file {spec}: every line needs a '{{}}' or '{{c}}' (bad: {bad[:3]})")
            out += lines
        else:
            raise ValueError(f"template {spec!r}: not a preset ({', '.join(TEMPLATE_PRESETS)}), "
                             "an existing file, or a string containing '{}' or '{c}'")
    return out


def _has_slot(template: str) -> bool:
    return "{}" in template or "{c}" in template


def _json_templates(path: Path, lookup: Sequence[str]) -> list[str]:
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exn:
        raise ValueError(f"template file {path} is not valid JSON: {exn}") from exn
    where = str(path)
    if isinstance(table, dict):
        key = pick_entry(table, lookup, f"template file {path}", fallback=DEFAULT_TEMPLATE_KEY)
        table, where = table[key], f"{path}[{key}]"
        if isinstance(table, dict):
            raise ValueError(f"template file {where} holds class-specific prompts ({{class: [prompts]}}, as CuPL's): "
                             "not supported; give templates with '{c}'")
    if not isinstance(table, list) or not table or not all(isinstance(t, str) and _has_slot(t) for t in table):
        bad = [t for t in table if not (isinstance(t, str) and _has_slot(t))][:3] if isinstance(table, list) else table
        raise ValueError(f"template file {where}: expected a non-empty JSON list of templates with '{{c}}' or '{{}}' "
                         f"(or a dict {{data set: [templates]}}), bad: {str(bad)[:200]}")
    return list(table)


def fill_template(template: str | Callable[[str], str], name: str) -> str:
    """The prompt of one class: "{}" (open_clip) and "{c}" (CLIP_benchmark) both take the name."""
    return template.format(name, c=name) if isinstance(template, str) else template(name)
