"""Captions' tokens kept by their text, so that a caption met again is not tokenized again.

Why: over a training set held by the decoded-sample cache (data/decoded_cache.py) every epoch tokenizes the same
captions, and the tokenizer is then the largest part of reading a batch (open_clip's: ftfy, regex, BPE in Python;
~30 % of a cached batch of the main job, benchmarks/README.md). A memo gives the same rows bit for bit, because
the tokenizers of open_clip and Hugging Face's fixed-length ones pad every text to the same width: a text's row
does not depend on the batch it came in. A tokenizer whose width varies with the batch (padding to the longest)
is noticed at its second width and then called directly, the memo cleared.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("magclip.data")

ENTRY_OVERHEAD_BYTES = 200  # the dict slot, the key string and the row's tensor object around its storage


class TokenMemo:
    """`tokenizer` with a memo of each text's row, holding at most `max_bytes`; callable like the tokenizer."""

    def __init__(self, tokenizer: Callable[[list[str]], torch.Tensor], max_bytes: int):
        self.tokenizer, self.max_bytes = tokenizer, max_bytes
        self.rows: dict[str, torch.Tensor] = {}
        self.nbytes = 0
        self.width: int | None = None
        self.off = False

    def __call__(self, texts: list[str]) -> torch.Tensor:
        if self.off:
            return self.tokenizer(texts)
        missing = [t for t in dict.fromkeys(texts) if t not in self.rows]
        fresh = dict(zip(missing, self._rows_of(missing))) if missing else {}
        if self.off:
            return self.tokenizer(texts)
        return torch.stack([self.rows.get(t, fresh.get(t)) for t in texts])

    def _rows_of(self, texts: list[str]) -> list[torch.Tensor]:
        out = self.tokenizer(texts)
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or (self.width is not None and out.shape[1] != self.width):
            self._turn_off(out)
            return []
        self.width = out.shape[1]
        rows = list(out.unbind(0))
        for text, row in zip(texts, rows):
            size = row.numel() * row.element_size() + len(text) + ENTRY_OVERHEAD_BYTES
            if self.nbytes + size > self.max_bytes:
                break  # full: later texts are tokenized every time
            self.rows[text] = row
            self.nbytes += size
        return rows

    def _turn_off(self, out: object) -> None:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        log.info("token memo off: the tokenizer gave %s after width %s (its rows depend on the batch); "
                 "tokenizing every batch", shape, self.width)
        self.off, self.rows, self.nbytes = True, {}, 0
