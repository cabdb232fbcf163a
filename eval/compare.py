"""Run a grid of trainings (modes per direction x weights x seeds x datasets) and tabulate them.

Installed as `magclip-compare` (the same arguments); every option: --help (magclip/cli/compare.py).

    python eval/compare.py --grid configs/compare/synthetic.yaml                 # run missing cells, then report
    python eval/compare.py --grid configs/compare/synthetic.yaml --print-commands   # one shell line per missing cell
    python eval/compare.py --grid configs/compare/synthetic.yaml --max-cells 2      # at most 2 cells this time
    python eval/compare.py --grid configs/compare/synthetic.yaml --only-report --report docs/results_synthetic.md
    python eval/compare.py --grid configs/compare/clip_emoji.yaml
    python eval/compare.py --grid configs/compare/synthetic.yaml --output-dir /tmp/smoke train.max_steps=2
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.compare import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
