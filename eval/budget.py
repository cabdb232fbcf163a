"""The budget curve of a grid of long runs: each mode − the baseline at every evaluated step.

Installed as `magclip-budget` (the same arguments); every option: --help (magclip/cli/budget.py).

    python eval/budget.py --grid configs/compare/text_squad_long.yaml --report docs/results_text_budget.md \
        --figure docs/figures/text_budget.png
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.budget import console, main  # noqa: F401  (main: for callers)

if __name__ == "__main__":
    console()
