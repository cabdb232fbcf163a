"""Run a grid of trainings (modes per direction x weights x seeds x datasets) and tabulate them.

    python eval/compare.py --grid configs/compare/synthetic.yaml                 # run missing cells, then report
    python eval/compare.py --grid configs/compare/synthetic.yaml --print-commands   # one shell line per missing cell
    python eval/compare.py --grid configs/compare/synthetic.yaml --max-cells 2      # at most 2 cells this time
    python eval/compare.py --grid configs/compare/synthetic.yaml --only-report --report docs/results_synthetic.md
    python eval/compare.py --grid configs/compare/clip_emoji.yaml
    python eval/compare.py --grid configs/compare/synthetic.yaml --output-dir /tmp/smoke train.max_steps=2
    python eval/compare.py --grid configs/compare/clip_emoji_seeds.yaml --only-report --report docs/results_emoji_seeds.md

Cells run one after another as subprocesses (`python train/clip.py --config BASE k=v ...`), or
--jobs N at a time, from the current directory (run from the repository root); a finished cell
(its results.json exists) is skipped, so re-running after a kill finishes only the missing
cells, and an interrupted cell restarts (overwrite=true) or continues from its last checkpoint
(train.resume=latest). Extra positional `key=value` overrides go to every cell (a cell finished
with another value of an experiment key is reported as stale, naming the key and both values; so
is one whose run differs from what the current code would run, e.g. after a default changed:
--allow-stale KEY ... accepts a known-harmless difference). --print-commands prints the pending
cells' commands for a cluster scheduler (one line per cell, run from the repository root) and
runs nothing.

Writes <output_dir>/compare.md (the table: one row per setting, mean ± std over the aggregated
axes -- seeds -- with the best row per column in bold), compare.csv (the same numbers), cells.csv
(one row per cell), compare.json, plots/*.png (a bar chart per column, overview.png and
differences.png), and
prints the table. Below it, every row's difference to the baseline row (the grid's `baseline:`,
else the first row) per ranked column: paired by seed, with a 95 % CI over seeds, a 95 % CI and
permutation p over the evaluation queries when the runs kept per-query outcomes (results.ranks.npz:
CLIP ranks; results.queries.npz: text metrics per query, STS scores per pair), a verdict, and the
minimum detectable effect (magclip/experiments/stats.py). --report PATH writes
the Markdown section also to PATH (plot links relative to it), with PATH's .json beside it, for
docs/results.md to include; a PATH that records more finished runs than this report is refused
(exit 2) unless --overwrite-report. The grid format is documented in magclip/experiments/grid.py.
"""

from __future__ import annotations

import argparse
import signal

from magclip.cli import as_command
from magclip.experiments.grid import GridError, load_grid, validate_cells
from magclip.experiments.report import unresolved_columns, write_report
from magclip.experiments.runner import grid_commands, run_grid


def _terminate(signum, frame):  # SIGTERM -> SystemExit, so the running cell's process is stopped too
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", required=True, help="grid YAML (see magclip/experiments/grid.py)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every cell, e.g. train.max_steps=2")
    parser.add_argument("--output-dir", default=None, help="replace the grid's output_dir")
    parser.add_argument("--print-commands", action="store_true", help="print the pending cells' commands and exit")
    parser.add_argument("--all", action="store_true", help="with --print-commands: finished cells too")
    parser.add_argument("--only-report", action="store_true", help="run nothing; collect what is there")
    parser.add_argument("--max-cells", type=int, default=None, help="run at most N unfinished cells")
    parser.add_argument("--jobs", type=int, default=1,
                        help="cells run at the same time (default 1; more: parallel processes sharing the machine)")
    parser.add_argument("--report", default=None, help="also write the Markdown section to this file")
    parser.add_argument("--overwrite-report", action="store_true",
                        help="replace --report even when it records more finished runs than this report")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG bar plots")
    parser.add_argument("--allow-stale", nargs="+", default=[], metavar="KEY",
                        help="config keys whose difference between a finished cell's run and the current config is "
                             "known to be harmless: the cell stays current (e.g. train.precision)")
    parser.add_argument("--no-validate", action="store_true",
                        help="skip loading every cell's config before running (done by default)")
    args = parser.parse_args(argv)
    for item in args.overrides:
        if "=" not in item:
            parser.error(f"override {item!r} must look like key.sub=value")
    try:
        grid = load_grid(args.grid, args.overrides, args.output_dir, allow_stale=args.allow_stale)
        if not (args.print_commands or args.only_report or args.no_validate):
            validate_cells(grid)
    except GridError as e:
        parser.error(str(e))

    if args.print_commands:
        for line in grid_commands(grid, include_finished=args.all):
            print(line)
        return 0

    failed: list[str] = []
    if not args.only_report:
        signal.signal(signal.SIGTERM, _terminate)
        outcome = run_grid(grid, max_cells=args.max_cells, jobs=args.jobs)
        failed = outcome["failed"]
    written = write_report(grid, report=args.report, plots=not args.no_plots, overwrite_report=args.overwrite_report)
    print()
    print(written["table"])
    if written["comparison_table"]:
        print()
        print(written["comparison_table"])
    for key, cells in unresolved_columns(written["records"]).items():
        print(f"warning: column {key!r} has no number in finished cells: {', '.join(cells)}")
    print(f"\nreport: {written['markdown']}  csv: {written['csv']}  per cell: {written['cells_csv']}")
    if written["plots"]:
        print(f"plots: {written['plots'][0].parent}/")
    if failed:
        print(f"failed cells ({len(failed)}): {', '.join(failed)}; logs in {grid.output_dir / 'logs'}")
        return 1
    return 0


def _main_exit() -> None:
    status = main()
    if status:
        raise SystemExit(status)


console = as_command(_main_exit)

if __name__ == "__main__":
    console()
