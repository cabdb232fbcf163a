"""Length × relevance: short records at p_non among the non-relevant and p_rel among the relevant documents,
scored per query for every model and mode, with the prediction at p_non = 0.55, p_rel = 0.2; every option:
--help (magclip/cli/length_relevance.py).

    python tools/keep_grid_records.py --grid configs/compare/text_squad_long.yaml --restore docs/data/text_squad_long
    python tools/keep_grid_records.py --grid configs/compare/text_squad_pooling.yaml --restore docs/data/text_squad_pooling
    python eval/length_relevance.py --data ../shared/data/text/{scifact,cranfield,med,xquad_en} \
        --cache .cache/length_mix/tables \
        --model cosine=runs/compare/text_squad_long/models/loss=cosine,seed=0 \
        --model dot=runs/compare/text_squad_long/models/loss=dot,seed=0 \
        --model learned=runs/compare/text_squad_pooling/models/pooling=learned,seed=0 \
        --model sqrt_len=runs/compare/text_squad_pooling/models/pooling=mean_sqrt_len,seed=0 \
        --sqrt-len dot --resamples 2000 \
        --out docs/results_text_length_relevance.json --records docs/data/text_length_relevance/per_query.json \
        --report docs/results_text_length_relevance.md --figure docs/text_length_relevance.png \
        --figure-predictions docs/text_length_relevance_predictions.png
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.length_relevance import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
