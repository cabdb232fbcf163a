"""An index for serving what was trained: the *prepared* document vectors, their ids and the Scorer
that made them, so any inner-product index ranks exactly as the run scored.

Why: a qnorm, dnorm, dot or learnable model ranks as it was trained only on prepared vectors,
`prepare_docs(d) = d / ||d||^γd` and `prepare_queries(q) = q / ||q||^γq`, searched by inner product.
Plain open_clip's `model(...)` and `encode_*(normalize=True)` return unit vectors, i.e. they score every
model as cosine; an index of L2-normalised vectors agreed with a qnorm model's own top-1 for about
half of the queries.

    DIR/docs.npy         float32 [N, D]: prepared document vectors
    DIR/doc_ids.jsonl    one JSON string per line (the documents' ids, in row order)
    DIR/scorer.json      mode, gamma_q, gamma_d, which side the queries and documents are, and the
                         query preparation to apply before searching
    DIR/index.faiss      faiss IndexFlatIP over docs.npy (with the [faiss] extra installed)

Search: `prepare_queries(spec, q) @ docs.T`, or `faiss.read_index(DIR/index.faiss).search(prepared q, k)`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from magclip.io import publish_dir, umask_mode
from magclip.metrics.ir import faiss_available
from magclip.modes import ScorerSpec
from magclip.similarity import Scorer

QUERY_PREPARATION = "q / max(||q||, 1e-12) ** gamma_q (float32), then inner product with docs.npy"


def export_index(folder: str | Path, docs: torch.Tensor, doc_ids: Sequence[str], scorer: Scorer, *,
                 queries: str, documents: str, faiss_index: bool | None = None) -> Path:
    """Write the index of raw document vectors `docs` under `scorer` into `folder` (whole or not at all).
    `queries`/`documents` name the sides (e.g. "image"/"text"); `faiss_index`: None = when faiss is installed."""
    if len(doc_ids) != docs.shape[0]:
        raise ValueError(f"{len(doc_ids)} ids for {docs.shape[0]} documents")
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    tmp.chmod(umask_mode("dir"))
    try:
        with torch.no_grad():
            prepared = np.ascontiguousarray(scorer.prepare_docs(docs.detach().cpu()).numpy(), dtype=np.float32)
        np.save(tmp / "docs.npy", prepared)
        (tmp / "doc_ids.jsonl").write_text("".join(json.dumps(str(i)) + "\n" for i in doc_ids), encoding="utf-8")
        spec = {**scorer.spec.to_dict(), "queries": queries, "documents": documents,
                "query_preparation": QUERY_PREPARATION, "documents_prepared": True, "count": len(doc_ids)}
        (tmp / "scorer.json").write_text(json.dumps(spec, indent=2) + "\n")
        if faiss_available() if faiss_index is None else faiss_index:
            import faiss

            index = faiss.IndexFlatIP(prepared.shape[1])
            index.add(prepared)
            faiss.write_index(index, str(tmp / "index.faiss"))
        publish_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def load_index(folder: str | Path) -> tuple[np.ndarray, list[str], dict[str, Any]]:
    """(prepared docs, ids, the scorer record) of an exported index."""
    folder = Path(folder)
    docs = np.load(folder / "docs.npy")
    ids = [json.loads(line) for line in (folder / "doc_ids.jsonl").read_text(encoding="utf-8").splitlines()]
    return docs, ids, json.loads((folder / "scorer.json").read_text())


def prepare_queries(record: dict[str, Any], queries: torch.Tensor) -> np.ndarray:
    """Raw query vectors prepared as the exported index expects (its scorer.json's gamma_q)."""
    scorer = Scorer.from_spec(ScorerSpec.from_record({k: record[k] for k in ("mode", "gamma_q", "gamma_d")}))
    with torch.no_grad():
        return np.ascontiguousarray(scorer.prepare_queries(queries.detach().cpu()).numpy(), dtype=np.float32)
