"""The evaluation layer: CLIP retrieval (training validation and zero-shot), zero-shot classification,
the emoji benchmark, text BEIR/STS and RAG retrieval. It never imports magclip.training.

One result shape for every text evaluator (BEIR, STS, RAG; `modes_entry`): a data set's entry holds
the metrics of the first scorer, each metrics record holds its "scorer" ({mode, gamma_q, gamma_d}),
and with several scorers the entry adds "modes": {scorer label: metrics}, the first one included."""

from typing import Any

from magclip.data.eval_sets import TASKS as ZEROSHOT_TASKS  # noqa: F401  (torch-free: --help needs no torch)


def modes_entry(by_label: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A data set's entry from {scorer label: metrics} (the shape in this module's docstring)."""
    entry = next(iter(by_label.values())).copy()  # a RetrievalMetrics keeps its per-query values
    if len(by_label) > 1:
        entry["modes"] = by_label
    return entry
