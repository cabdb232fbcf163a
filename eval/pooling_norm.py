"""Where the norm's length prior comes from: ‖mean pooled‖ against n tokens per model, beside shuffled
tokens, the arithmetic curve and CLS pooling; every option: --help (magclip/cli/pooling_norm.py).

    python tools/keep_grid_records.py --grid configs/compare/text_squad_long.yaml --restore docs/data/text_squad_long
    python eval/pooling_norm.py --data ../shared/data/text/scifact \
        --model zero_shot=minilm \
        --model cosine=runs/compare/text_squad_long/models/loss=cosine,seed=0 \
        --model dot=runs/compare/text_squad_long/models/loss=dot,seed=0 \
        --out docs/results_text_pooling_norm.json --report docs/results_text_pooling_norm.md \
        --figure docs/text_pooling_norm.png
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.pooling_norm import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
