"""Evaluate a text bi-encoder on STS: Spearman (and Pearson) between model scores and gold scores.

Installed as `magclip-sts` (the same arguments); every option: --help (magclip/cli/sts.py).

    python eval/sts.py --model minilm --data ../shared/data/text/stsb --out results/stsb_minilm.json
    python eval/sts.py --model minilm --data ../shared/data/text/stsb --mode cosine dot qnorm dnorm \
        --out results/stsb_modes.json
    python eval/sts.py --model runs/text_qnorm/checkpoints/step_00000100/model --data ../shared/data/text/stsb/dev.tsv \
        --out results/stsb_dev_qnorm.json
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.sts import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
