"""sentence-transformers' `StaticEmbedding` (a token embedding table whose mean over a text's tokens is the
text's vector: model2vec, static-retrieval-mrl) run as a BiEncoder tower.

`StaticEmbedding` sums each text's token embeddings in an `nn.EmbeddingBag` (mode mean) over its tokens
encoded *without* special tokens, by its `tokenizers` tokenizer as saved: where the saved tokenizer.json
carries a truncation (e.g. a sentence-transformers static model trained at 128 tokens), `encode` cuts there, and so does
magclip (`saved_max_tokens`); without one, nothing is cut. `StaticTower` looks up the same table per token
and returns the token vectors as a transformer's `last_hidden_state`, so the BiEncoder's masked mean
pooling computes that mean; `static_tokenizer` wraps the same `tokenizers` tokenizer with its special
tokens removed and the saved length limit (its side too). Training trains the table; `save_pretrained` writes the module with
sentence-transformers' own `save` (model.safetensors + tokenizer.json).
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

from torch import Tensor, nn
from torch.nn import functional as F

STATIC_KIND = "StaticEmbedding"
NO_LIMIT = 1_000_000   # tokens: StaticEmbedding truncates nothing


class StaticTower(nn.Module):
    """A `StaticEmbedding` module as a tower: `forward` returns per-token embeddings (pooled by the BiEncoder)."""

    def __init__(self, static: nn.Module):
        super().__init__()
        self.static = static
        self.max_tokens = saved_truncation(static.tokenizer).get("max_length") or NO_LIMIT
        self.config = SimpleNamespace(hidden_size=int(static.embedding_dim), max_position_embeddings=None)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **_) -> SimpleNamespace:
        return SimpleNamespace(last_hidden_state=F.embedding(input_ids, self.static.embedding.weight))

    def save_pretrained(self, folder: str | Path, **_) -> None:
        self.static.save(str(folder), safe_serialization=True)


def saved_truncation(tokenizer) -> dict:
    """The truncation a `tokenizers` tokenizer carries ({} when none): StaticEmbedding's encode applies it."""
    return dict(tokenizer.truncation or {})


def saved_max_tokens(folder: Path) -> int:
    """The length at which a saved StaticEmbedding (its tokenizer.json) cuts a text; NO_LIMIT when it does not."""
    import json

    tokenizer_file = folder / "tokenizer.json"
    truncation = json.loads(tokenizer_file.read_text()).get("truncation") if tokenizer_file.is_file() else None
    return int(truncation["max_length"]) if truncation and truncation.get("max_length") else NO_LIMIT


def load_static_tower(folder: Path) -> StaticTower:
    """sentence-transformers' own `StaticEmbedding.load` (tokenizer.json + model.safetensors), as float32."""
    try:
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    except ImportError:   # sentence-transformers 5
        from sentence_transformers.models import StaticEmbedding
    try:
        return StaticTower(StaticEmbedding.load(str(folder)).float())
    except Exception as exn:  # noqa: BLE001 (a missing tokenizer.json or weights file, a damaged one)
        first = " ".join(str(exn).split())[:300]
        raise ValueError(f"{folder}: the StaticEmbedding module does not load ({type(exn).__name__}: {first})") from None


def static_tokenizer(tower: StaticTower):
    """A transformers tokenizer over the module's own `tokenizers` tokenizer, encoding as StaticEmbedding does:
    no special tokens, cut where the saved tokenizer cuts, on its side (padding only batches texts: the padded
    positions are masked out). transformers sets the backend's truncation per call from `max_length`, which the
    BiEncoder takes from `tower.max_tokens`."""
    from transformers import PreTrainedTokenizerFast

    truncation = saved_truncation(tower.static.tokenizer)
    backend = copy.deepcopy(tower.static.tokenizer)
    backend.post_processor = None
    backend.no_truncation()
    backend.no_padding()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=tower.max_tokens)
    tokenizer.truncation_side = truncation.get("direction", "right").lower()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = backend.id_to_token(0)
    return tokenizer
