"""Magnitude diagnostics and the Fisher-information predictor for a text bi-encoder or a CLIP model.

Installed as `magclip-diagnose` (the same arguments); every option: --help (magclip/cli/diagnose.py).

    OMP_NUM_THREADS=1 python eval/diagnose.py --text-model minilm --beir ../shared/data/text/scifact \\
        --max-queries 100 --max-docs 1000 --fisher-pairs 48 --logit-scale default matched \\
        --out runs/diagnose/scifact_minilm
    OMP_NUM_THREADS=1 python eval/diagnose.py --checkpoint /tmp/runs/emoji \\
        --data ../shared/data/emoji/id_novel-000000.tar --logit-scale default matched --out runs/diagnose/emoji
    MAGCLIP_CACHE=/tmp/mc_cache OMP_NUM_THREADS=1 python eval/diagnose.py --model tiny-resnet --synthetic \\
        --logit-scale default matched --out runs/diagnose/synthetic_init
    python eval/diagnose.py --metrics runs/compare/synthetic/runs/loss=qnorm,seed=0/metrics.jsonl --out /tmp/curves
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.diagnose import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
