"""A checkpoint on a benchmark suite (configs/suites/*.yaml), or two suites compared query by query.

Installed as `magclip-suite` (the same arguments); every option: --help (magclip/cli/suite.py).

    python eval/suite.py --suite configs/suites/offline.yaml --root ../shared/data --checkpoint runs/default \\
        --out runs/suite/default --cosine-too
    python eval/suite.py --suite configs/suites/clip_benchmark.yaml --root ~/data/clip_benchmark \\
        --model ViT-B-32 --pretrained laion2b_s34b_b79k --out runs/suite/vitb32 --skip-missing
    python eval/suite.py --compare runs/suite/cosine runs/suite/qnorm --out runs/suite/qnorm_vs_cosine.json
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.suite import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
