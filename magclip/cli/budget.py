"""The budget curve of a grid of long runs: each mode − the baseline mode at every evaluated step
(`train.val_at` and the final step), paired by seed and query, as a table, a figure (the gap against
steps on a log axis with its 95 % band, one panel per set) and a one-line answer per set and mode:
does the gap close, cross zero, level off, narrow or widen as the budget grows?

    python eval/budget.py --grid configs/compare/text_squad_long.yaml --report docs/results_text_budget.md \
        --figure docs/figures/text_budget.png --out docs/results_text_budget.json
"""

from __future__ import annotations

import argparse

from magclip.cli import as_command
from magclip.experiments import stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", required=True, help="the grid YAML whose runs are read")
    parser.add_argument("--mode-axis", default="loss", help="the axis of modes (%(default)s)")
    parser.add_argument("--baseline", help="the mode the others are compared with (default: the grid's baseline)")
    parser.add_argument("--resamples", type=int, default=stats.N_RESAMPLES, help="bootstrap and permutation draws")
    parser.add_argument("--report", help="a Markdown file for the table and the answers")
    parser.add_argument("--figure", help="a PNG file for the figure")
    parser.add_argument("--out", help="a JSON file for the points")
    args = parser.parse_args(argv)

    from magclip.experiments.budget import as_curves, as_records, budget_points, markdown, plot_budget
    from magclip.experiments.grid import load_grid
    from magclip.io import atomic_write_json, atomic_write_text

    grid = load_grid(args.grid)
    baseline = args.baseline or (grid.baseline or {}).get(args.mode_axis)
    points = budget_points(grid, args.mode_axis, baseline, n_resamples=args.resamples)
    if not points:
        raise ValueError(f"{args.grid}: no step evaluated by both the {baseline} runs and another mode's "
                         f"(RUN/evals/step_N.json, written by train.val_at)")
    labels = {c.path: c.label for c in grid.columns}
    scales = {c.path: c.scale for c in grid.columns}
    table = markdown(points, baseline, labels, scales)
    print(table)
    with_items = [p for p in points if p.n_items or p.n_seeds > 1]
    figure = plot_budget(with_items, args.figure, labels, grid.scale or 1.0) if args.figure else None
    if args.report:
        shown = f"\n\n![mode − {baseline} against steps]({figure.name})" if figure else ""
        atomic_write_text(args.report, f"# {grid.name}: the budget curve\n\nEach mode − {baseline} after each "
                          f"evaluated step, paired by seed and query.{shown}\n\n{table}\n")
    if args.out:
        atomic_write_json(args.out, {"grid": args.grid, "baseline": baseline, "points": as_records(points),
                                     **as_curves(points)})


console = as_command(main)

if __name__ == "__main__":
    console()
