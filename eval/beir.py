"""Evaluate a text bi-encoder on BEIR folders: nDCG@10, MRR@10, Recall@100, MAP@100 (pytrec_eval).

Installed as `magclip-beir` (the same arguments); every option: --help (magclip/cli/beir.py).

    python eval/beir.py --model minilm --data ../shared/data/text/scifact --out results/scifact_minilm.json
    python eval/beir.py --model minilm --data ../shared/data/text/scifact --mode dot --out results/scifact_dot.json
    python eval/beir.py --model minilm --data ../shared/data/text/{scifact,cranfield,med} \
        --mode cosine dot qnorm --out results/beir_minilm.json      # several modes, one encoding per folder
    python eval/beir.py --model minilm --data ../shared/data/text/{scifact,cranfield,med} \
        --mode cosine dot qnorm dnorm --length-bins 4 --out results/beir_length.json   # + length confounds
    python eval/beir.py --model runs/text_qnorm/checkpoints/step_00000100/model --data ../shared/data/text/scifact \
        --out results/scifact_qnorm.json                              # the model's own mode (magclip_text.json)
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.beir import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
