#!/usr/bin/env python3
"""Keep a grid's finished runs as records a fresh checkout can re-render (and resume) from: run folders
do not survive a change of machine, and checkpoints are too large to commit.

    python tools/keep_grid_records.py --grid configs/compare/synthetic_specificity.yaml \
        --to docs/data/synthetic_specificity
    python tools/keep_grid_records.py --grid configs/compare/text_squad_long.yaml \
        --to docs/data/text_squad_long --models          # and an fp16 copy of every final model
    python tools/keep_grid_records.py --grid configs/compare/text_squad_long.yaml \
        --restore docs/data/text_squad_long               # back into the grid's output_dir

For every finished cell: `runs/<cell>/` with its results (`results.json` and the per-query outcomes
beside it: `results.ranks.npz`, `results.queries.npz`), `zero_shot.*` (a text run's evaluation of its
start), `evals/` (a text run's evaluations after `train.val_at` steps), `config.yaml` (the resolved
config: what grid staleness compares) and `metrics.jsonl` (the training log); and `cells/<cell>.json`
(the cell's spec). Not the checkpoints or tensorboard. A restored cell counts as finished; one the
current code would run differently is reported stale, as any other.

`--models` keeps, besides, each finished text run's final model (results.json's `final_model`) with its
weights in float16 under `models/<cell>/` (MiniLM: 45 MB instead of 90 MB), for a later grid that
starts from it (configs/compare/text_geometry.yaml), and writes its float32 restoration to
`<output_dir>/models/<cell>/` at once: that grid starts from the restoration, on this machine and on any
other alike, so its starts do not depend on which machine trained them. `--restore` copies the records
back into the grid's output_dir, and the models, in float32, to `<output_dir>/models/<cell>/`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from magclip.experiments.grid import load_grid
from magclip.io import copy_weights_folder

KEPT = ("results.json", "results.ranks.npz", "results.queries.npz", "zero_shot.json", "zero_shot.queries.npz",
        "config.yaml", "metrics.jsonl")
KEPT_DIRS = ("evals",)
MODELS = "models"


def keep(grid_path: str | Path, dest: str | Path, models: bool = False) -> list[str]:
    """Copy the records of every finished cell into `dest` (and its final model in float16, `models`);
    returns the cells kept."""
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
        if models:
            keep_model(cell.run_dir, dest / MODELS / cell.name, Path(grid.output_dir) / MODELS / cell.name)
        kept.append(cell.name)
    return kept


def keep_model(run_dir: Path, kept: Path, restored: Path) -> None:
    """The run's final model in float16 at `kept`, and its float32 restoration at `restored`."""
    final = json.loads((run_dir / "results.json").read_text()).get("final_model")
    if not final or not (Path(final) / "model.safetensors").is_file():
        raise SystemExit(f"error: {run_dir / 'results.json'} names no final model with model.safetensors "
                         f"({final}); --models keeps text runs' models")
    kept.parent.mkdir(parents=True, exist_ok=True)
    copy_weights_folder(final, kept, "float16")
    restored.parent.mkdir(parents=True, exist_ok=True)
    copy_weights_folder(kept, restored, "float32")


def restore(grid_path: str | Path, src: str | Path) -> list[str]:
    """Copy kept records back into the grid's output_dir, the kept models in float32; returns the cells."""
    grid, src = load_grid(grid_path), Path(src)
    out = Path(grid.output_dir)
    for part in ("runs", "cells"):
        if (src / part).is_dir():
            shutil.copytree(src / part, out / part, dirs_exist_ok=True)
    for kept in sorted((src / MODELS).glob("*")) if (src / MODELS).is_dir() else []:
        copy_weights_folder(kept, out / MODELS / kept.name, "float32")
    return sorted(p.name for p in (src / "runs").iterdir()) if (src / "runs").is_dir() else []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", required=True)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--to", help="the records folder to write (docs/data/<grid>)")
    where.add_argument("--restore", metavar="FROM",
                       help="a records folder to copy back into the grid's output_dir")
    p.add_argument("--models", action="store_true", help="with --to: each final model too, in float16")
    a = p.parse_args()
    if a.restore:
        cells = restore(a.grid, a.restore)
        print(f"{len(cells)} cells restored from {a.restore} into {load_grid(a.grid).output_dir}")
        return 0
    kept = keep(a.grid, a.to, models=a.models)
    print(f"{len(kept)} finished cells kept in {a.to}{' (with their models in float16)' if a.models else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
