"""Two evaluated models, query by query: ROW − BASE with a bootstrap CI and a permutation p.

Installed as `magclip-paired` (the same arguments); every option: --help (magclip/cli/paired.py).

    python eval/paired.py runs/full/scifact_zero_shot.json runs/full/scifact_cosine_s0.json \
        --base-prefix scifact.modes.cosine. --row-prefix scifact.     # a checkpoint against its start
    python eval/paired.py results/beir_a.json results/beir_b.json --out results/b_minus_a.json
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.paired import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
