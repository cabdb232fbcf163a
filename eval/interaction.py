"""The interaction of a grid's start axis with its mode axis, paired by seed and query.

Installed as `magclip-interaction` (the same arguments); every option: --help (magclip/cli/interaction.py).

    python eval/interaction.py --grid configs/compare/text_geometry.yaml --start-axis start \
        --mode-axis loss --baseline-start cosine --baseline-mode cosine
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.interaction import console, main  # noqa: F401  (main: for callers)

if __name__ == "__main__":
    console()
