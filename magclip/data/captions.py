"""Where a sample's captions come from, and how many it has: `data.caption_key` / `--caption-key`.

- `txt` (the default): KEY.txt, ONE CAPTION PER LINE. One line is img2dataset's and open_clip's
  single caption; several lines are CLIP_benchmark's retrieval sets (`convert_retrieval_dataset`
  writes every caption of an image into KEY.txt, one a line, and reads them back with
  `str.splitlines`, as here). Joining the lines into one caption scores a different task.
- `json:FIELD` (or `json:a.b` inside nested objects): a field of KEY.json, img2dataset's metadata,
  for shards whose caption lives only there. A string is one caption; a list of strings is several
  (the emoji shards' `json:captions` holds every caption variant of an emoji).

Each caption is stripped. Blank lines and empty list entries are not captions: they are left out and
counted (`empty_caption_line`); a sample left with none is skipped as `empty_caption`, one whose KEY.txt /
field is absent as `missing_caption`.

Training takes one caption per sample and step (`choose_caption`: drawn per sample and epoch from the
run's seed, so a resumed run draws the same); evaluation scores every caption (magclip.metrics.relevance).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from magclip.config import CAPTION_KEY, CAPTION_KEY_HELP

TXT = "txt"
JSON_PREFIX = "json:"


@dataclass(frozen=True)
class CaptionKey:
    """`txt` or `json:FIELD[.SUB...]`: where `read` finds a sample's captions."""

    spec: str = TXT

    def __post_init__(self) -> None:
        if not CAPTION_KEY.match(self.spec):
            raise ValueError(f"caption key {self.spec!r}: {CAPTION_KEY_HELP}")

    @property
    def field_path(self) -> list[str]:
        return self.spec[len(JSON_PREFIX):].split(".") if self.spec.startswith(JSON_PREFIX) else []

    @property
    def member(self) -> str:
        """The sample member the captions are read from."""
        return "txt" if self.spec == TXT else "json"

    def read(self, sample: Mapping[str, Any]) -> tuple[list[str] | None, str, str, int]:
        """(captions, "", "", blank entries left out) or (None, skip reason, detail, blank entries)."""
        raw = sample.get(self.member)
        if raw is None:
            return None, "missing_caption", f"no KEY.{self.member}", 0
        try:
            text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else str(raw)
        except UnicodeDecodeError as exn:
            return None, "bad_caption_encoding", str(exn), 0
        if self.spec == TXT:
            entries: list[Any] = text.splitlines()
        else:
            found, detail = self._field(text)
            if found is None:
                return None, "missing_caption", detail, 0
            entries = found
        captions = [e.strip() for e in entries if isinstance(e, str) and e.strip()]
        blank = len(entries) - len(captions)
        if not captions:
            return None, "empty_caption", f"{len(entries)} empty caption entries", blank
        return captions, "", "", blank

    def _field(self, text: str) -> tuple[list[Any] | None, str]:
        try:
            node: Any = json.loads(text)
        except json.JSONDecodeError as exn:
            return None, f"KEY.json is not valid JSON ({exn})"
        for part in self.field_path:
            if not isinstance(node, Mapping) or part not in node:
                return None, f"KEY.json has no field {self.spec[len(JSON_PREFIX):]!r}"
            node = node[part]
        if isinstance(node, str):
            return [node], ""
        if isinstance(node, list):
            return node, ""
        return None, f"KEY.json field {self.spec[len(JSON_PREFIX):]!r} is a {type(node).__name__}, not a caption"


def choose_caption(captions: Sequence[str], *seed_parts: object) -> str:
    """One of a sample's captions for a training step: the only one, or a draw fixed by `seed_parts`
    (the run's seed, the epoch and the sample key), the same in every process and on a resume."""
    if len(captions) == 1:
        return captions[0]
    digest = hashlib.sha256(":".join(map(str, seed_parts)).encode("utf-8")).digest()
    return captions[int.from_bytes(digest[:8], "little") % len(captions)]


DEFAULT_CAPTION_KEY = CaptionKey()
