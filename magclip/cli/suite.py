"""A checkpoint on a benchmark suite (one YAML file listing the sets), or two suites compared query by query.

    python eval/suite.py --suite configs/suites/offline.yaml --root ../shared/data --checkpoint runs/default \
        --out runs/suite/default --cosine-too
    python eval/suite.py --suite configs/suites/clip_benchmark.yaml --root ~/data/clip_benchmark \
        --model ViT-B-32 --pretrained laion2b_s34b_b79k --out runs/suite/vitb32 --skip-missing
    python eval/suite.py --compare runs/suite/cosine runs/suite/qnorm --out runs/suite/qnorm_vs_cosine.json

Each set is read and scored as `eval/zeroshot.py --data` would (its layout recognised: a CLIP_benchmark
folder, a Karpathy split file, an image folder, shards; magclip.evaluation.suite documents the file).
Writes OUT/sets/<set>.json (+ per-query ranks and hits beside it), OUT/suite.md and OUT/suite.csv (a row per
set and the suite's mean), OUT/suite.json. A set finished earlier for the same model and entry is not
evaluated again (--overwrite does). --compare BASE ROW: ROW − BASE per set and metric with a bootstrap CI over
queries and a permutation p (the paired statistics of eval/paired.py), on the sets both suites scored alike.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from magclip.cli import UsageError, as_command, check_paths
from magclip.cli.clip_args import add_clip_model_arguments, check_clip_model_arguments, load_clip_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", help="suite YAML (configs/suites/)")
    p.add_argument("--root", help="where the suite's relative paths start (default: its root: key, else its folder)")
    p.add_argument("--only", nargs="+", default=[], metavar="SET", help="only these sets of the suite")
    p.add_argument("--skip-missing", action="store_true", help="leave out (and list) sets whose files are not there")
    p.add_argument("--cosine-too", action="store_true",
                   help="also score every set in cosine, as CLIP_benchmark scores every model (same features)")
    p.add_argument("--overwrite", action="store_true", help="evaluate sets finished earlier again")
    p.add_argument("--compare", nargs=2, metavar=("BASE", "ROW"), help="two suite output folders: ROW − BASE")
    add_clip_model_arguments(p)
    p.add_argument("--out", help="output folder (--compare: a JSON file for the paired records)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=0, help="DataLoader processes reading image files (%(default)s)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    return p


def main(argv: list[str] | None = None) -> Any:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.compare:
        return compare(args)
    if not args.suite or not args.out:
        raise UsageError("give --suite FILE --out DIR and a model (--checkpoint or --model), or --compare BASE ROW")
    check_clip_model_arguments(args)
    check_paths(args, "suite", "checkpoint")
    from magclip.evaluation.suite import load_suite, prepare_suite, run_suite

    # every set read and checked (layout, tasks, class list, templates) before the model loads
    prepared = prepare_suite(load_suite(args.suite, args.root, args.only), args.skip_missing)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_clip_model(args, device)
    summary = run_suite(model, prepared, args.out, cosine_too=args.cosine_too, overwrite=args.overwrite,
                        batch_size=args.batch_size, device=device, workers=args.workers)
    print((Path(args.out) / "suite.md").read_text())
    print(f"results: {Path(args.out) / 'suite.json'}   table: {Path(args.out) / 'suite.md'}, {Path(args.out) / 'suite.csv'}")
    return summary


def compare(args: argparse.Namespace) -> Any:
    from magclip.experiments.paired import as_records, compare_suites, markdown_table
    from magclip.io import atomic_write_json

    base, row = args.compare
    found, skipped = compare_suites(base, row)
    if not found:
        raise ValueError(f"no set of {base} was scored on the same queries in {row}: " + "; ".join(skipped[:5]))
    print(markdown_table(found))
    for line in skipped:
        print(f"not paired: {line}")
    if args.out:
        atomic_write_json(args.out, {"base": base, "row": row, "paired": as_records(found), "not_paired": skipped})
        print(f"paired records: {args.out}")
    return found


console = as_command(main)

if __name__ == "__main__":
    console()
