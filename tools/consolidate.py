"""Write the model files of a sharded step folder from its DCP shards, offline, on one process.

Installed as `magclip-consolidate` (the same arguments); every option: --help (magclip/cli/consolidate.py).

    python tools/consolidate.py runs/big/checkpoints/step_00000500                 # into the step folder
    python tools/consolidate.py runs/big/checkpoints/step_00000500 --out exported/  # elsewhere
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.consolidate import console, main  # noqa: F401  (main: for callers)

if __name__ == "__main__":
    console()
