"""Evaluation speed: BEIR encode + search (magclip vs sentence-transformers) and search alone (torch vs faiss).

    python benchmarks/bench_eval.py --part beir           # SciFact test (300 queries, 5,183 docs), MiniLM, 3 rounds
    python benchmarks/bench_eval.py --part search         # 300 queries x 100k and 1M random docs, torch vs faiss
    python benchmarks/bench_eval.py --part beir --max-docs 1000 --reps 2   # all 300 queries, 1,000 docs (judged + others)
    python benchmarks/bench_eval.py --part beir --tiny    # smoke check (50 queries, 500 docs, 1 round)

BEIR: magclip = exactly what `eval/beir.py --model minilm --mode cosine` runs
(`BiEncoder.from_pretrained("minilm")` + `evaluate_beir_folders`: length-sorted batches of 64,
max length 256, search on the Scorer's prepared vectors, pytrec_eval). sentence-transformers =
`SentenceTransformer(<the same packaged all-MiniLM-L6-v2 folder>).encode(texts, batch_size=64)` for
documents (title + " " + text) and queries, then the same search (`magclip.metrics.ir.search_run`,
same backend) and the same pytrec_eval scoring; nDCG@10 of both is printed as a check. Timed:
encode documents + encode queries + search (model loading reported apart).

Search: `magclip.metrics.ir.search` with backend "torch" (query chunks of 512 x document chunks of
100k, matmul + running top-k merge) vs "faiss" (IndexFlatIP on the same prepared vectors, index
build included), cosine scorer, k=100, random float32 vectors of dim 384 (MiniLM's), faiss and
torch on the same thread count. Peak memory: ru_maxrss of the child, and its increase over the
RSS after the vectors were created (what the search itself adds).

Each measurement is a fresh child process; contenders alternate; medians reported.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, SCIFACT_DIR, machine_info, median, peak_rss_mb, run_child, table, write_json

HERE = Path(__file__).resolve().parent


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_beir(a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    try:
        import faiss

        faiss.omp_set_num_threads(a.threads)
    except ImportError:
        pass
    from magclip.data.beir import load_beir
    from magclip.metrics.ir import evaluate_run, search_run
    from magclip.models.text import BiEncoder, resolve_model_path
    from magclip.similarity import Scorer
    from magclip.evaluation.text import evaluate_beir_data

    data = load_beir(a.data, "test")
    if a.max_queries or a.max_docs:
        data = data.subset(a.max_queries, a.max_docs)
    t0 = time.perf_counter()
    if a.impl == "magclip":
        model = BiEncoder.from_pretrained("minilm")
        t_load = time.perf_counter() - t0
        t1 = time.perf_counter()
        m = evaluate_beir_data(model, data, Scorer("cosine"), batch_size=64, device="cpu", backend=a.backend)
        total = time.perf_counter() - t1
        enc_d, enc_q, srch = m["encode_docs_s"], m["encode_queries_s"], m["search_s"]
        ndcg = m["ndcg@10"]
    else:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(resolve_model_path("minilm"), device="cpu")
        t_load = time.perf_counter() - t0
        dids, qids = list(data.corpus), list(data.queries)
        t1 = time.perf_counter()
        d = model.encode(data.doc_texts(dids), batch_size=64, convert_to_tensor=True, show_progress_bar=False)
        t2 = time.perf_counter()
        q = model.encode([data.queries[i] for i in qids], batch_size=64, convert_to_tensor=True, show_progress_bar=False)
        t3 = time.perf_counter()
        run, _ = search_run(q.float().cpu(), d.float().cpu(), qids, dids, "cosine", 100, backend=a.backend)
        t4 = time.perf_counter()
        ndcg = evaluate_run(data.qrels, run)["ndcg@10"]
        total = time.perf_counter() - t1
        enc_d, enc_q, srch = t2 - t1, t3 - t2, t4 - t3
    return {"impl": a.impl, "queries": len(data.queries), "docs": len(data.corpus), "load_s": t_load,
            "encode_docs_s": enc_d, "encode_queries_s": enc_q, "search_s": srch, "encode_search_s": enc_d + enc_q + srch,
            "total_with_scoring_s": total, "ndcg@10": ndcg, "threads": torch.get_num_threads(), **peak_rss_mb()}


def child_search(a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    if a.impl == "faiss":
        import faiss

        faiss.omp_set_num_threads(a.threads)
    from magclip.metrics.ir import search

    g = torch.Generator().manual_seed(0)
    docs = torch.randn(a.num_docs, a.dim, generator=g)
    queries = torch.randn(a.num_queries, a.dim, generator=g)
    rss_data = _maxrss_mb()
    t0 = time.perf_counter()
    _, idx = search(queries, docs, "cosine", a.k, backend=a.impl)
    dt = time.perf_counter() - t0
    return {"impl": a.impl, "num_docs": a.num_docs, "num_queries": a.num_queries, "dim": a.dim, "k": a.k,
            "search_s": dt, "queries_per_s": a.num_queries / dt, "rss_after_vectors_mb": rss_data,
            "search_extra_peak_mb": _maxrss_mb() - rss_data, "top1_checksum": int(idx[:, 0].sum()),
            "threads": torch.get_num_threads(), **peak_rss_mb()}


def child_main(a) -> None:
    res = child_beir(a) if a.part == "beir" else child_search(a)
    write_json(a.out, res)


def part_beir(a) -> dict:
    if not (SCIFACT_DIR / "corpus.jsonl").is_file():
        raise SystemExit(f"SKIP: SciFact not found at {SCIFACT_DIR} (../shared/data/text/scifact)")
    base = [sys.executable, str(HERE / "bench_eval.py"), "--child", "--part", "beir", "--data", str(SCIFACT_DIR),
            "--threads", str(a.threads), "--backend", a.backend]
    if a.tiny:
        a.max_queries, a.max_docs = 50, 500
    if a.max_queries:
        base += ["--max-queries", str(a.max_queries)]
    if a.max_docs:
        base += ["--max-docs", str(a.max_docs)]
    runs = {"magclip": [], "sentence_transformers": []}
    for r in range(a.reps):
        for impl, done in runs.items():
            res = run_child([*base, "--impl", impl], a.threads, timeout=1800, label=impl)
            done.append(res)
            print(f"  round {r + 1}/{a.reps} {impl:>22}: encode+search {res['encode_search_s']:7.1f} s "
                  f"(docs {res['encode_docs_s']:.1f}, queries {res['encode_queries_s']:.2f}, search {res['search_s']:.3f}) "
                  f"nDCG@10 {res['ndcg@10']:.4f}, RSS {res['peak_rss_main_mb']:.0f} MiB", flush=True)
    s = {}
    for impl, rs in runs.items():
        s[impl] = {k: median([x[k] for x in rs]) for k in
                   ("encode_search_s", "encode_docs_s", "encode_queries_s", "search_s", "load_s", "ndcg@10")}
        s[impl]["peak_rss_main_mb"] = max(x["peak_rss_main_mb"] for x in rs)
        s[impl]["runs_encode_search_s"] = [round(x["encode_search_s"], 2) for x in rs]
        s[impl]["docs"], s[impl]["queries"] = rs[0]["docs"], rs[0]["queries"]
        s[impl]["docs_per_s"] = rs[0]["docs"] / s[impl]["encode_docs_s"]
    speed = s["sentence_transformers"]["encode_search_s"] / s["magclip"]["encode_search_s"]
    rows = [[k, v["encode_search_s"], v["encode_docs_s"], v["encode_queries_s"], v["search_s"], v["docs_per_s"],
             v["ndcg@10"], v["peak_rss_main_mb"]] for k, v in s.items()]
    print(table(rows, ["impl", "encode+search s", "docs s", "queries s", "search s", "docs/s", "nDCG@10", "peak RSS MiB"]))
    print(f"speed magclip / sentence-transformers (time ratio ST/magclip) = {speed:.3f}; target >= 1.0")
    return {"summary": s, "speed_ratio_magclip_over_st": speed, "target": ">= 1.0", "met": speed >= 1.0, "runs": runs}


def part_search(a) -> dict:
    sizes = [2_000, 20_000] if a.tiny else a.sizes
    out = {}
    for n in sizes:
        base = [sys.executable, str(HERE / "bench_eval.py"), "--child", "--part", "search", "--num-docs", str(n),
                "--num-queries", str(a.num_queries), "--dim", str(a.dim), "--k", str(a.k), "--threads", str(a.threads)]
        runs = {"torch": [], "faiss": []}
        for r in range(a.reps):
            for impl, done in runs.items():
                res = run_child([*base, "--impl", impl], a.threads, timeout=1800, label=f"{impl} {n}")
                done.append(res)
                print(f"  {n:>9,} docs round {r + 1}/{a.reps} {impl:>6}: {res['search_s']:7.3f} s "
                      f"(+{res['search_extra_peak_mb']:.0f} MiB over the vectors, peak {res['peak_rss_main_mb']:.0f} MiB)",
                      flush=True)
        out[str(n)] = {impl: {"search_s_median": median([x["search_s"] for x in rs]),
                              "search_s_runs": [round(x["search_s"], 3) for x in rs],
                              "search_extra_peak_mb": max(x["search_extra_peak_mb"] for x in rs),
                              "peak_rss_main_mb": max(x["peak_rss_main_mb"] for x in rs),
                              "top1_checksum": rs[0]["top1_checksum"]} for impl, rs in runs.items()}
        out[str(n)]["ratio_torch_over_faiss_time"] = (out[str(n)]["torch"]["search_s_median"]
                                                      / out[str(n)]["faiss"]["search_s_median"])
    rows = []
    for n, v in out.items():
        for impl in ("torch", "faiss"):
            rows.append([f"{int(n):,}", impl, v[impl]["search_s_median"], a.num_queries / v[impl]["search_s_median"],
                         v[impl]["search_extra_peak_mb"], v[impl]["peak_rss_main_mb"]])
    print(table(rows, ["docs", "backend", "search s (median)", "queries/s", "extra peak MiB", "peak RSS MiB"]))
    for n, v in out.items():
        print(f"{int(n):,} docs: torch / faiss time = {v['ratio_torch_over_faiss_time']:.2f}")
    return {"sizes": out, "num_queries": a.num_queries, "dim": a.dim, "k": a.k}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("beir", "search"), required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "faiss"), help="BEIR search backend (both)")
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--num-queries", type=int, default=300)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    # child mode
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-queries", type=int, default=None, help="BEIR subset: the first N test queries")
    p.add_argument("--max-docs", type=int, default=None,
                   help="BEIR subset: every judged document + others up to N (BeirData.subset)")
    p.add_argument("--num-docs", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child_main(a)
        return
    if a.tiny:
        a.reps = 1
    info = machine_info(a.threads)
    result = part_beir(a) if a.part == "beir" else part_search(a)
    out = Path(a.out) if a.out else RESULTS_DIR / f"eval_{a.part}{'_tiny' if a.tiny else ''}.json"
    write_json(out, {"benchmark": f"eval/{a.part}", "machine": info,
                     "settings": {k: v for k, v in vars(a).items() if k in
                                  ("part", "threads", "reps", "backend", "sizes", "num_queries", "dim", "k", "tiny", "max_queries",
                                             "max_docs")},
                     **result})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
