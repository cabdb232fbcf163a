#!/usr/bin/env python3
"""Keep a grid's finished runs as records a fresh checkout can re-render (and resume) from: run folders
do not survive a change of machine, and checkpoints are too large to commit.

    python tools/keep_grid_records.py --grid configs/compare/synthetic_specificity.yaml \
        --to docs/data/synthetic_specificity
    mkdir -p runs/compare/synthetic_specificity && \
        cp -r docs/data/synthetic_specificity/{runs,cells} runs/compare/synthetic_specificity/   # restore

For every finished cell: `runs/<cell>/` with its results (`results.json` and the per-query outcomes
beside it: `results.ranks.npz`, `results.queries.npz`), `zero_shot.*` (a text run's evaluation of its
start), `evals/` (a text run's evaluations after `train.val_at` steps), `config.yaml` (the resolved
config: what grid staleness compares) and `metrics.jsonl` (the training log); and `cells/<cell>.json`
(the cell's spec). Not the checkpoints or tensorboard. A restored cell counts as finished; one the
current code would run differently is reported stale, as any other.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from magclip.experiments.grid import load_grid

KEPT = ("results.json", "results.ranks.npz", "results.queries.npz", "zero_shot.json", "zero_shot.queries.npz",
        "config.yaml", "metrics.jsonl")
KEPT_DIRS = ("evals",)


def keep(grid_path: str | Path, dest: str | Path) -> list[str]:
    """Copy the records of every finished cell into `dest`; returns the cells kept."""
    grid, dest = load_grid(grid_path), Path(dest)
    kept = []
    for cell in grid.cells():
        if not cell.finished:
            continue
        out = dest / "runs" / cell.name
        out.mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            if (cell.run_dir / name).is_file():
                shutil.copy2(cell.run_dir / name, out / name)
        for name in KEPT_DIRS:
            if (cell.run_dir / name).is_dir():
                shutil.copytree(cell.run_dir / name, out / name, dirs_exist_ok=True)
        if cell.spec_path.is_file():
            (dest / "cells").mkdir(parents=True, exist_ok=True)
            shutil.copy2(cell.spec_path, dest / "cells" / cell.spec_path.name)
        kept.append(cell.name)
    return kept


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", required=True)
    p.add_argument("--to", required=True, help="the records folder (docs/data/<grid>)")
    a = p.parse_args()
    kept = keep(a.grid, a.to)
    print(f"{len(kept)} finished cells kept in {a.to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
