"""The retrieval side of retrieval-augmented QA, scored with the model's own Scorer(s), and a hook
that feeds the retrieved passages to a causal LM (metrics: `magclip.metrics.rag`; data:
`magclip.data.qa`).

Generator hook (`generate_answers`): loads any Hugging Face causal LM and its tokenizer from a
*local* folder (`local_files_only=True`; nothing is downloaded), builds one prompt per question from
its top `k_ctx` passages (`PROMPT_TEMPLATE` / `PASSAGE_TEMPLATE`, below), decodes greedily for
`max_new_tokens` tokens and keeps the first line of the continuation, stripped. Prompts that do not
fit the model's context (minus `max_new_tokens`) have their passages cut, each to an equal share of
the remaining tokens; the question and the "Answer:" cue are always kept. Plain completion prompt:
no chat template is applied. The repository's tests run this hook only with a tiny randomly
initialized GPT-2 (no real LLM can be loaded there), which checks that it runs end to end and that
EM is computed; the EM such a model gets is meaningless.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from magclip.data.beir import doc_text
from magclip.data.qa import QAData
from magclip.metrics.ir import search
from magclip.metrics.rag import DEFAULT_KS, match_normalizer, rag_metrics
from magclip.metrics.ranks import RetrievalMetrics
from magclip.similarity import Scorer

log = logging.getLogger("magclip.rag")

PASSAGE_TEMPLATE = "Passage {i}: {text}"
PROMPT_TEMPLATE = ("Answer the question using the passages. Reply with a short answer only.\n\n"
                   "{passages}\n\nQuestion: {question}\nAnswer:")


def evaluate_rag(encode: Callable[[list[str], str], Tensor], data: QAData, scorers: Sequence[Scorer | str], *,
                 distractors: Mapping[str, dict[str, str]] | None = None, ks: Sequence[int] = DEFAULT_KS,
                 backend: str = "auto", keep_ranked: int = 0, answer_match: str = "token") -> dict[str, Any]:
    """Encode once, rank the pool (corpus + distractors) under every scorer, score each ranking.

    Returns {"modes": {label: metrics (a RetrievalMetrics: each question's hits ride along)},
    "ranked": {label: [[passage id] per question]} (top `keep_ranked`, when > 0), "qids", "passages",
    "distractor_passages", timings}. Passages are encoded as title + " " + text (`doc_text`, as BEIR);
    answers are matched against the text alone.
    """
    scorers = [Scorer.build(s) for s in scorers]
    distractors = dict(distractors or {})
    clash = set(distractors) & set(data.corpus)
    if clash:
        raise ValueError(f"distractor ids collide with corpus ids, e.g. {sorted(clash)[:3]}")
    main_ids, extra_ids = list(data.corpus), list(distractors)
    pool_ids = main_ids + extra_ids
    docs = {**data.corpus, **distractors}
    norm_fn = match_normalizer(answer_match)
    normalized = {d: norm_fn(docs[d].get("text", "")) for d in pool_ids}
    qids = list(data.questions)
    t0 = time.perf_counter()
    doc_vecs = encode([doc_text(data.corpus[d]) for d in main_ids], "passage")
    if extra_ids:  # separately: the main vectors never depend on the distractors
        doc_vecs = torch.cat([doc_vecs, encode([doc_text(distractors[d]) for d in extra_ids], "passage")])
    t1 = time.perf_counter()
    query_vecs = encode([data.questions[q] for q in qids], "query")
    t2 = time.perf_counter()
    depth = max(max(ks), keep_ranked)
    by_mode, ranked_by_mode = {}, {}
    for scorer in scorers:
        _, idx = search(query_vecs, doc_vecs, scorer, depth, backend=backend)
        ranked = [[pool_ids[j] for j in row if j >= 0] for row in idx.tolist()]
        m = rag_metrics(ranked, [data.answers[q] for q in qids], [data.gold[q] for q in qids], normalized, ks,
                        frozenset(extra_ids), answer_match, per_question=True)
        hits = m.pop("per_question")
        m = RetrievalMetrics(m)
        for key, (index, values) in hits.items():
            m.add_values(key, values, [qids[i] for i in index])
        m["scorer"] = scorer.to_dict()
        label = scorer.label
        by_mode[label] = m
        if keep_ranked:
            ranked_by_mode[label] = [r[:keep_ranked] for r in ranked]
    t3 = time.perf_counter()
    return {"modes": by_mode, "ranked": ranked_by_mode, "qids": qids, "passages": len(pool_ids),
            "distractor_passages": len(extra_ids), "doc_norm_mean": float(doc_vecs.norm(dim=-1).mean()),
            "query_norm_mean": float(query_vecs.norm(dim=-1).mean()), "encode_docs_s": round(t1 - t0, 2),
            "encode_queries_s": round(t2 - t1, 2), "search_s": round(t3 - t2, 3)}


# ---------------------------------------------------------------------------- generator hook
def build_prompt(question: str, passages: Sequence[str]) -> str:
    """PROMPT_TEMPLATE filled with the passages (numbered from 1, best first) and the question."""
    block = "\n".join(PASSAGE_TEMPLATE.format(i=i, text=" ".join(p.split())) for i, p in enumerate(passages, 1))
    return PROMPT_TEMPLATE.format(passages=block, question=" ".join(question.split()))


def context_limit(model, tokenizer) -> int | None:
    """The model's context length in tokens, when it says (max_position_embeddings / n_positions)."""
    cfg = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**7 else None


def fit_prompt(tokenizer, question: str, passages: Sequence[str], limit: int | None) -> tuple[str, int]:
    """(prompt, passages cut): the passages are cut, each to an equal token share, until the prompt fits `limit`."""
    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=True)["input_ids"])

    prompt = build_prompt(question, passages)
    if limit is None or not passages or length(prompt) <= limit:
        return prompt, 0
    tokens = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in passages]
    spare = limit - length(build_prompt(question, [""] * len(passages)))
    share = max(spare // len(passages), 0)
    while True:
        cut = [tokenizer.decode(t[:share], skip_special_tokens=True) if len(t) > share else p
               for t, p in zip(tokens, passages)]
        prompt = build_prompt(question, cut)
        if share == 0 or length(prompt) <= limit:
            return prompt, sum(len(t) > share for t in tokens)
        share = int(share * 0.9)


@torch.no_grad()
def generate_answers(generator_path: str | Path, questions: Sequence[str], retrieved_passages: Sequence[Sequence[str]],
                     k_ctx: int = 3, max_new_tokens: int = 16, *, batch_size: int = 8, device: str | None = None,
                     max_prompt_tokens: int | None = None) -> list[str]:
    """One answer per question from a local Hugging Face causal LM given its top `k_ctx` passages.

    Greedy decoding, left-padded batches, the first line of the continuation (stripped). See the
    module docstring for the prompt and for how over-long prompts are cut.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(generator_path)
    if not path.is_dir():
        raise FileNotFoundError(f"generator {generator_path}: not a local folder (a causal LM saved with "
                                "save_pretrained; nothing is downloaded)")
    if len(questions) != len(retrieved_passages):
        raise ValueError(f"{len(questions)} questions but {len(retrieved_passages)} passage lists")
    if k_ctx < 1 or max_new_tokens < 1:
        raise ValueError(f"k_ctx and max_new_tokens must be >= 1, got {k_ctx} and {max_new_tokens}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).to(device).eval()
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"generator {generator_path}: its tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"  # last resort: keep the question and the "Answer:" cue
    limit = max_prompt_tokens
    if limit is None:
        ctx = context_limit(model, tokenizer)
        limit = None if ctx is None else ctx - max_new_tokens
    if limit is not None and limit < 1:
        raise ValueError(f"generator context too short for max_new_tokens={max_new_tokens}")
    prompts, cut = [], 0
    for q, ps in zip(questions, retrieved_passages):
        prompt, n = fit_prompt(tokenizer, q, list(ps)[:k_ctx], limit)
        prompts.append(prompt)
        cut += n
    if cut:
        log.info("generator: %d passages cut to fit %d prompt tokens", cut, limit)
    eos = tokenizer.eos_token_id
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True,
                        truncation=limit is not None, max_length=limit)
        enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
        continuation = out[:, enc["input_ids"].shape[1]:]
        for text in tokenizer.batch_decode(continuation, skip_special_tokens=True):
            answers.append(text.strip().split("\n")[0].strip())
    return answers


def format_rag_table(results: dict) -> str:
    ks = sorted({int(key.split("@")[1]) for entry in results.values() for key in entry
                 if key.startswith("answer_recall@")})
    head = "| data | mode | " + " | ".join(f"AR@{k}" for k in ks) + " | gold@1 | questions | passages |"
    rows = [head, "|" + "---|" * (len(ks) + 5)]
    for name, entry in results.items():
        for label, m in (entry.get("modes") or {Scorer.build(entry["scorer"]).label: entry}).items():
            gold = m["gold_passage_acc@1"]
            rows.append(f"| {name} | {label} | " + " | ".join(f"{100 * m[f'answer_recall@{k}']:.2f}" for k in ks)
                        + f" | {'-' if gold is None else f'{100 * gold:.2f}'} | {m['questions']} | "
                        f"{entry['passages']} |")
    return "\n".join(rows)
