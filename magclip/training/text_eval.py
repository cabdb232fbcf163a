"""What a text training run evaluates, as its config lists it (`eval.beir`, `eval.sts`, `eval.rag`): the
sets loaded once at the start, then scored with the run's own Scorer at every validation and at the end,
flattened to {"<set>/<metric>": value} for metrics.jsonl. The evaluators are magclip.evaluation's."""

from __future__ import annotations

from dataclasses import dataclass, field

from magclip.config import TextEvalConfig
from magclip.data.beir import BeirData, load_beir
from magclip.data.qa import QAData, load_qa
from magclip.data.sts import STSData, read_sts
from magclip.diagnostics.length import flat_length_metrics
from magclip.distributed import ONE_PROCESS, Share
from magclip.evaluation.rag import evaluate_rag
from magclip.evaluation.sharded import shared_text_encoding
from magclip.evaluation.text import (
    beir_token_lengths,
    evaluate_beir_data,
    evaluate_sts,
    same_sides,
    sts_path,
)
from magclip.metrics.ranks import RetrievalMetrics
from magclip.models.text import BiEncoder
from magclip.similarity import Scorer


@dataclass
class TextEvalSets:
    """The evaluation data of a text training run, loaded once (`eval.beir`, `eval.sts`, `eval.rag`)."""

    beir: dict[str, BeirData] = field(default_factory=dict)
    sts: dict[str, STSData] = field(default_factory=dict)
    rag: dict[str, QAData] = field(default_factory=dict)
    lengths: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # BEIR token counts

    def __bool__(self) -> bool:
        return bool(self.beir or self.sts or self.rag)

    def read_reports(self) -> dict[str, dict]:
        """Per BEIR set, what reading it as BEIR reads it did (repeated ids, queries left out): results.json's
        `eval_read_report` (empty on the processes that do not evaluate)."""
        return {name: dict(data.read_report) for name, data in self.beir.items()}

    @classmethod
    def load(cls, cfg: TextEvalConfig, model: BiEncoder) -> TextEvalSets:
        beir = {}
        for name, folder in cfg.beir.items():
            data = load_beir(folder, cfg.split)
            beir[name] = data.subset(cfg.max_queries, cfg.max_docs) if (cfg.max_queries or cfg.max_docs) else data
        lengths = {name: beir_token_lengths(model, data) for name, data in beir.items()} if cfg.length_bins else {}
        return cls(beir, {name: read_sts(sts_path(p, cfg.split)[1], name) for name, p in cfg.sts.items()},
                   {name: load_qa(folder, cfg.split) for name, folder in cfg.rag.items()}, lengths)


def evaluate_text_sets(model: BiEncoder, scorer: Scorer, sets: TextEvalSets, cfg: TextEvalConfig,
                       device=None, share: Share = ONE_PROCESS) -> RetrievalMetrics:
    """Every set scored with `scorer`, flattened to {"<set>/<metric>": value} for metrics.jsonl; each
    set's per-query values ride along under the same keys (results.queries.npz of the run). With a sharded
    `share` (a sharded model) every rank calls this and encodes its share; the leading rank, which alone holds
    the sets, gets the metrics, the others an empty record (magclip.evaluation.sharded)."""
    with shared_text_encoding(model, cfg.batch_size, device, share) as encode:
        if encode is None:
            return RetrievalMetrics()
        return _evaluate_text_sets(model, scorer, sets, cfg, device, encode)


def _evaluate_text_sets(model: BiEncoder, scorer: Scorer, sets: TextEvalSets, cfg: TextEvalConfig, device,
                        encode) -> RetrievalMetrics:
    out = RetrievalMetrics()

    def add(name: str, r: dict) -> None:
        out.update({f"{name}/{k}": v for k, v in r.items() if isinstance(v, (int, float))})
        if isinstance(r, RetrievalMetrics):
            out.with_outcomes(r, prefix=f"{name}/")

    for name, data in sets.beir.items():
        r = evaluate_beir_data(model, data, scorer, batch_size=cfg.batch_size, device=device, backend=cfg.backend,
                               identical_ids=cfg.identical_ids, length_bins=cfg.length_bins,
                               lengths=sets.lengths.get(name), encode=encode)
        if "length" in r:
            r.update(flat_length_metrics(r.pop("length")))
        add(name, r)
    for name, data in sets.sts.items():
        add(name, evaluate_sts(encode, data, scorer, same_sides=same_sides(model)))
    for name, data in sets.rag.items():
        add(name, next(iter(evaluate_rag(encode, data, [scorer], backend=cfg.backend)["modes"].values())))
    return out
