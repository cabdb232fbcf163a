"""The retrieval side of RAG on QA folders: answer recall@k and gold-passage accuracy@1.

    python eval/rag.py --model minilm --data ../shared/data/text/xquad_en --out results/rag_xquad_minilm.json
    python eval/rag.py --model minilm --data ../shared/data/text/xquad_en --mode cosine dot qnorm dnorm \
        --distractors ../shared/data/text/scifact --out results/rag_xquad_scifact.json   # a harder pool
    python eval/rag.py --model minilm --data ../shared/data/text/xquad_en --out results/rag_gen.json \
        --generator /path/to/local/causal-lm --k-ctx 3 --max-new-tokens 16 --max-questions 200

--data: QA folders, each `qa.jsonl` (`id`, `question`, `answers`, optional `passage_id`) over a BEIR
`corpus.jsonl`, gold passages from `qrels/<split>.tsv` (else `passage_id`). --distractors: BEIR
folders whose corpus.jsonl documents join every pool, ids prefixed `<folder name>:`. Passages are
encoded as title + " " + text; the answer is looked for in the text (--answer-match token, the
default: SQuAD normalization with punctuation turned into spaces, whole tokens only; substring: SQuAD
normalization, anywhere).
Definitions: magclip/metrics/rag.py. --model, --mode and the encoder options are as in eval/beir.py.

results.json maps each QA folder name to the first mode's `answer_recall@k`, `gold_passage_acc@1`,
`gold_passage_recall@k`, `answer_in_gold_passage` (the bound on answer recall) (0-1 scale),
`questions`, `gold_questions`, `passages` (distractors included), `distractor_passages`,
`distractors` ({name: passages}), with distractors `distractor_top1` and
`answer_only_in_distractors@k` (answer credited by a distractor alone), `mode`, `scorer`,
`answer_match`, `gold_source`, `warnings` (counted input problems), timings, and `modes`
({mode: metrics}) when several are given.

--generator: a *local* folder holding any Hugging Face causal LM and its tokenizer. Each question
gets a prompt with its top --k-ctx passages under the first mode (template in magclip/metrics/rag.py),
greedy decoding for --max-new-tokens tokens, first line kept; the entry gets `generator` with
`exact_match` (SQuAD EM) and the predictions. --max-questions caps the questions sent to the
generator (the first N in qa.jsonl order); retrieval metrics always use every question. The tests
run this path only with a tiny randomly initialized GPT-2, so they show that it works end to end,
not what EM any real model reaches.
"""

import argparse
import logging
import time
from dataclasses import asdict
from pathlib import Path

from magclip.cli import as_command, check_paths
from magclip.cli.text_args import device_of, load_model_and_scorers, model_arguments, parse_args
from magclip.data.beir import doc_text
from magclip.data.qa import load_distractors, load_qa
from magclip.evaluation import modes_entry
from magclip.metrics.ranks import write_results_with_outcomes
from magclip.metrics.rag import ANSWER_MATCHES, DEFAULT_KS, exact_match


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--data", nargs="+", required=True, help="QA folder(s): qa.jsonl over corpus.jsonl")
    parser.add_argument("--distractors", nargs="+", default=[], help="BEIR folder(s) whose corpus joins every pool")
    parser.add_argument("--k", nargs="+", type=int, default=list(DEFAULT_KS), help="answer recall cut-offs")
    parser.add_argument("--backend", choices=("auto", "torch", "faiss"), default="auto", help="search backend")
    parser.add_argument("--answer-match", choices=ANSWER_MATCHES, default="token",
                        help="how an answer is found in a passage (magclip/metrics/rag.py; default: %(default)s)")
    parser.add_argument("--generator", default=None, help="local folder of a Hugging Face causal LM (optional)")
    parser.add_argument("--k-ctx", type=int, default=3, help="passages in the generator's prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-questions", type=int, default=None, help="questions sent to the generator (first N)")
    parser.add_argument("--generator-batch-size", type=int, default=8)
    args = parse_args(parser, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if min(args.k) < 1:
        parser.error("--k values must be >= 1")
    if args.max_questions is not None and args.max_questions < 1:
        parser.error("--max-questions must be >= 1")
    if args.k_ctx < 1 or args.max_new_tokens < 1:
        parser.error("--k-ctx and --max-new-tokens must be >= 1")
    if args.generator is not None and not Path(args.generator).is_dir():
        parser.error(f"--generator {args.generator}: not a local folder")
    check_paths(args, "distractors")
    datasets = [load_qa(folder, args.split) for folder in args.data]  # bad input fails before the model loads

    from magclip.evaluation.rag import PROMPT_TEMPLATE, evaluate_rag, format_rag_table, generate_answers

    model, scorers = load_model_and_scorers(args)
    device = device_of(args)

    def encode(texts: list[str], side: str):
        return model.encode(texts, side, batch_size=args.batch_size, device=device, progress=args.progress)

    results: dict[str, dict] = {}
    for data in datasets:
        t0 = time.perf_counter()
        distractors, counts = load_distractors(args.distractors, taken=data.corpus)
        keep = args.k_ctx if args.generator else 0
        out = evaluate_rag(encode, data, scorers, distractors=distractors, ks=args.k, backend=args.backend,
                           keep_ranked=keep, answer_match=args.answer_match)
        first = next(iter(out["modes"]))
        entry = modes_entry(out["modes"])
        entry.update({"passages": out["passages"], "distractor_passages": out["distractor_passages"],
                      "distractors": counts, "gold_source": data.gold_source, "warnings": data.warnings,
                      "doc_norm_mean": out["doc_norm_mean"], "query_norm_mean": out["query_norm_mean"],
                      "encode_docs_s": out["encode_docs_s"], "encode_queries_s": out["encode_queries_s"],
                      "search_s": out["search_s"], "split": args.split, "model": args.model,
                      "settings": asdict(model.settings)})
        if args.generator:
            qids = out["qids"][:args.max_questions] if args.max_questions else out["qids"]
            ranked = out["ranked"][first][:len(qids)]
            passages = [[doc_text(data.corpus[d] if d in data.corpus else distractors[d]) for d in ids]
                        for ids in ranked]
            tg = time.perf_counter()
            preds = generate_answers(args.generator, [data.questions[q] for q in qids], passages, args.k_ctx,
                                     args.max_new_tokens, batch_size=args.generator_batch_size, device=device)
            ems = [exact_match(p, data.answers[q]) for p, q in zip(preds, qids)]
            entry["generator"] = {
                "path": args.generator, "mode": first, "k_ctx": args.k_ctx, "max_new_tokens": args.max_new_tokens,
                "questions": len(qids), "exact_match": sum(ems) / len(ems), "prompt_template": PROMPT_TEMPLATE,
                "generate_s": round(time.perf_counter() - tg, 2),
                "predictions": [{"id": q, "prediction": p, "answers": data.answers[q], "em": e}
                                for q, p, e in zip(qids, preds, ems)]}
        entry["wall_s"] = round(time.perf_counter() - t0, 2)
        results[data.name] = entry
    write_results_with_outcomes(args.out, results)  # per-query outcomes beside it: <stem>.queries.npz / .ranks.npz
    print(format_rag_table(results))
    for name, entry in results.items():
        if entry["warnings"]:
            print(f"{name}: input warnings {entry['warnings']}")
        if "generator" in entry:
            g = entry["generator"]
            print(f"{name}: generator EM {100 * g['exact_match']:.2f} on {g['questions']} questions "
                  f"(mode {g['mode']}, top {g['k_ctx']} passages)")
    print(f"results: {args.out}")
    return results



console = as_command(main)  # the installed command and the launcher: expected errors in one line

if __name__ == "__main__":
    console()
