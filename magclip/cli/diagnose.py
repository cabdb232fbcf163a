"""Magnitude diagnostics and the Fisher-information predictor for a text bi-encoder or a CLIP model.

Writes OUT/diagnostics.json and PNG plots into OUT/, prints a short summary. Library:
`magclip.diagnostics.magnitude` (norm statistics, Cohen's d of norms by relevance with bootstrap
CIs, plots) and `magclip.diagnostics.fisher` (empirical Fisher per scoring mode, its spectrum and
condition number, a qnorm-vs-dnorm recommendation); their docstrings say exactly what is computed.

Text (BEIR folder; MiniLM on a SciFact subset: ~6.5 min on one busy CPU thread, most of it the two
float64 Fisher passes over 48 pairs):
    OMP_NUM_THREADS=1 python eval/diagnose.py --text-model minilm --beir ../shared/data/text/scifact \\
        --max-queries 100 --max-docs 1000 --fisher-pairs 48 --logit-scale default matched \\
        --out runs/diagnose/scifact_minilm

A magclip CLIP checkpoint (run folder -> checkpoints/latest) on shards; its metrics.jsonl is plotted:
    OMP_NUM_THREADS=1 python eval/diagnose.py --checkpoint /tmp/runs/emoji \\
        --data ../shared/data/emoji/id_novel-000000.tar --logit-scale default matched --out runs/diagnose/emoji

A randomly initialised open_clip model on the embedded synthetic validation shards (BatchNorm
uses batch statistics for a random init, see --batchnorm):
    MAGCLIP_CACHE=/tmp/mc_cache OMP_NUM_THREADS=1 python eval/diagnose.py --model tiny-resnet --synthetic \\
        --logit-scale default matched --out runs/diagnose/synthetic_init

Training curves only (gamma_q/gamma_d, logit scale, norms from a run's metrics.jsonl):
    python eval/diagnose.py --metrics runs/compare/synthetic/runs/loss=qnorm,seed=0/metrics.jsonl --out /tmp/curves

Outputs: diagnostics.json {"magnitude": ..., "fisher": {rule: ...}, "plots": [...]},
norm_hist.png, norm_vs_rank.png, fisher_spectrum.png, training.png (when a metrics.jsonl is known);
text models also get "length" (magclip.diagnostics.length: norm-length Spearman, Cohen's d within
length bins, nDCG@10 by document length) and norm_vs_length.png.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from magclip.cli import UsageError, as_command, check_paths, check_scorer_flags
from magclip.config import MATCHINGS
from magclip.data.eval_sets import resolve_retrieval_set
from magclip.modes import MODES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model (one of)")
    src.add_argument("--text-model", help="text bi-encoder: minilm, a magclip/sentence-transformers folder or a hub name")
    src.add_argument("--checkpoint", help="magclip CLIP run folder, checkpoint step folder, or its weights file")
    src.add_argument("--model", help="open_clip model name (random init without --pretrained)")
    src.add_argument("--pretrained", help="with --model: open_clip pretrained tag or weights file")
    data = p.add_argument_group("data")
    data.add_argument("--beir", help="with --text-model: a BEIR folder")
    data.add_argument("--split", default="test")
    data.add_argument("--max-queries", type=int, help="BEIR subset: first N queries")
    data.add_argument("--max-docs", type=int, help="BEIR subset: their judged documents + others up to N")
    data.add_argument("--data", help="CLIP: webdataset shards (brace pattern) or a CLIP_benchmark folder (its test split)")
    data.add_argument("--matching", choices=MATCHINGS, help="CLIP relevance: caption (identity; default for shards) or "
                                                            "image (CLIP_benchmark's; default for its folders)")
    data.add_argument("--caption-key", help="CLIP: txt (KEY.txt, one caption a line; default) or json:FIELD")
    data.add_argument("--synthetic", action="store_true", help="CLIP: the embedded synthetic validation shards")
    data.add_argument("--metrics", help="a run's metrics.jsonl to plot (default: the checkpoint's run, if any)")
    mg = p.add_argument_group("magnitude")
    mg.add_argument("--mode", choices=MODES, help="scorer that ranks candidates (default: the model's own; "
                    "cosine for a plain model without a magclip.json beside its weights)")
    mg.add_argument("--gamma-q", type=float)
    mg.add_argument("--gamma-d", type=float)
    mg.add_argument("--k", type=int, default=10, help="top-k non-relevant candidates per anchor (%(default)s)")
    mg.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (%(default)s)")
    mg.add_argument("--max-samples", type=int, default=2000, help="CLIP: at most this many samples (%(default)s)")
    fi = p.add_argument_group("fisher")
    fi.add_argument("--fisher-modes", nargs="+", default=None, choices=MODES,
                    help="default: cosine, dot, qnorm, dnorm (magclip.diagnostics.fisher.DEFAULT_MODES)")
    fi.add_argument("--candidates", nargs="+", default=None,
                    help="modes the recommendation picks from (default: qnorm, dnorm; fisher.CANDIDATES)")
    fi.add_argument("--fisher-pairs", type=int, help="held-out pairs (default 128 CLIP, 48 text)")
    fi.add_argument("--block", nargs="+", default=["projection"],
                    help="'projection' (default), 'all', or regexes of parameter names")
    fi.add_argument("--logit-scale", nargs="+", default=["default"],
                    help="'default', 'matched' and/or numbers: one Fisher result per entry")
    fi.add_argument("--directions", nargs="+", default=["i2t", "t2i"], help="CLIP rows (%(default)s)")
    fi.add_argument("--doc-to-query", action="store_true", help="text: add document->query rows")
    fi.add_argument("--batchnorm", choices=("auto", "eval", "batch"), default="auto",
                    help="auto: batch statistics for a random init, running statistics otherwise")
    fi.add_argument("--fisher-dtype", choices=("float64", "float32"), default="float64")
    fi.add_argument("--rtol", type=float, help="non-null cut (default 1000 * rows * eps)")
    p.add_argument("--skip-fisher", action="store_true")
    p.add_argument("--skip-magnitude", action="store_true")
    p.add_argument("--length-bins", type=int, default=4, help="text: length confounds with this many length bins "
                   "(norm-length Spearman, Cohen's d within length bins, nDCG@10 by length); 0: off (%(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", required=True, help="output folder")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    chosen = [x for x in (args.text_model, args.checkpoint, args.model) if x]
    if len(chosen) > 1 or (not chosen and not args.metrics):
        raise UsageError("give one of --text-model, --checkpoint or --model (or only --metrics)")
    check_scorer_flags(args.mode, args.gamma_q, args.gamma_d)
    check_paths(args, "checkpoint", "beir", "metrics")  # local inputs, before torch or a model is loaded
    if args.data:
        resolve_retrieval_set("data", args.data, matching=args.matching, caption_key=args.caption_key, where="--data",
                              hint="the diagnostics read image-caption pairs: give a retrieval set (shards with "
                                   "captions, a retrieval folder, a Karpathy file)")

    import torch

    from magclip.diagnostics import fisher as fim
    from magclip.evaluation.diagnose import format_summary, run_diagnostics

    torch.manual_seed(args.seed)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.fisher_modes = args.fisher_modes or list(fim.DEFAULT_MODES)
    args.candidates = args.candidates or list(fim.CANDIDATES)
    res = run_diagnostics(args)
    if res["kind"] != "metrics":
        print(format_summary(res))
    print(f"results: {Path(args.out) / 'diagnostics.json'}   plots: {', '.join(Path(p).name for p in res['plots'])}")
    return res



console = as_command(main)  # the installed command and the launcher: expected errors in one line

if __name__ == "__main__":
    console()
