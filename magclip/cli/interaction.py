"""Does a fine-tuning mode's gain over the baseline mode depend on where the model started? The
interaction of a grid's start axis with its mode axis, paired by seed and query:

    python eval/interaction.py --grid configs/compare/text_geometry.yaml --start-axis start \
        --mode-axis loss --baseline-start cosine --baseline-mode cosine --report docs/results_text_geometry_interaction.md

I = (mode − baseline mode | start) − (mode − baseline mode | baseline start), for every other start and
mode and every metric (default: the grid's `metrics.` columns), with its seed interval, query interval,
permutation p, MDE and verdict (magclip.experiments.interaction). Runs of one seed evaluated on other
queries are refused. --out writes the records as JSON.
"""

from __future__ import annotations

import argparse
import sys

from magclip.cli import as_command
from magclip.experiments import stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", required=True, help="the grid YAML whose finished cells are read")
    parser.add_argument("--start-axis", default="start", help="the axis of starting models (%(default)s)")
    parser.add_argument("--mode-axis", default="loss", help="the axis of fine-tuning modes (%(default)s)")
    parser.add_argument("--baseline-start", required=True, help="the start the others are compared with")
    parser.add_argument("--baseline-mode", default="cosine", help="the mode the others are compared with")
    parser.add_argument("--keys", nargs="*", help="metrics (default: the grid's metrics.* columns)")
    parser.add_argument("--resamples", type=int, default=stats.N_RESAMPLES, help="bootstrap and permutation draws")
    parser.add_argument("--report", help="a Markdown file for the table")
    parser.add_argument("--out", help="a JSON file for the records (a list, and keyed: by_key.KEY.START.MODE)")
    parser.add_argument("--figure", help="a PNG: each mode's gain from both starts and I with its interval")
    args = parser.parse_args(argv)
    command = sys.argv[1:] if argv is None else argv

    from magclip.experiments.grid import load_grid
    from magclip.experiments.interaction import (
        as_lookup,
        grid_runs,
        interaction,
        markdown_table,
        plot_interaction,
    )
    from magclip.io import atomic_write_json, atomic_write_text

    grid = load_grid(args.grid)
    axes = {a.name: [v.name for v in a.values] for a in grid.axes}
    for axis, value in ((args.start_axis, args.baseline_start), (args.mode_axis, args.baseline_mode)):
        if axis not in axes or value not in axes[axis]:
            raise ValueError(f"{args.grid}: no axis {axis!r} with a value {value!r} (axes: {axes})")
    columns = {c.key: c for c in grid.columns}
    keys = args.keys or [k for k in columns if k.startswith("metrics.")]
    runs = grid_runs(grid, args.start_axis, args.mode_axis)
    found = [interaction(runs, key, start=start, baseline_start=args.baseline_start, mode=mode,
                         baseline_mode=args.baseline_mode, n_resamples=args.resamples,
                         higher_is_better=getattr(columns.get(key), "better", "max") != "min")
             for key in keys for start in axes[args.start_axis] if start != args.baseline_start
             for mode in axes[args.mode_axis] if mode != args.baseline_mode]
    scales, labels = {k: c.scale for k, c in columns.items()}, {k: c.label for k, c in columns.items()}
    table = markdown_table(found, scales, labels)
    print(table)
    if args.report:
        atomic_write_text(args.report, f"# {grid.name}: start × mode interaction\n\nI = (mode − {args.baseline_mode} "
                          f"| start) − (mode − {args.baseline_mode} | {args.baseline_start} start), paired by seed and "
                          f"query; each metric in its column's scale (×{grid.scale:g} for a 0–1 metric).\n\n{table}\n\n`{' '.join(['python eval/interaction.py', *command])}`\n")
    if args.out:
        atomic_write_json(args.out, {"grid": args.grid, "records": [x.to_dict() for x in found],
                                     "by_key": as_lookup(found)})
    if args.figure:
        plot_interaction(found, args.figure, labels=labels, scales=scales)


console = as_command(main)

if __name__ == "__main__":
    console()
