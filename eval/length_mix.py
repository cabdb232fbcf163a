"""The length-mixing control: each BEIR set with a share p of its documents replaced by a short form of
itself (title, else first sentence), scored per query for every model and mode; every option: --help
(magclip/cli/length_mix.py).

    python eval/length_mix.py --data ../shared/data/text/{scifact,cranfield,med,xquad_en} \
        --variants .cache/length_mix/variants                      # the variant folders only
    python tools/keep_grid_records.py --grid configs/compare/text_squad_long.yaml --restore docs/data/text_squad_long
    python eval/length_mix.py --data ../shared/data/text/{scifact,cranfield,med,xquad_en} \
        --variants .cache/length_mix/variants --cache .cache/length_mix/tables \
        --model zero_shot=minilm \
        --model cosine=runs/compare/text_squad_long/models/loss=cosine,seed=0 \
        --model dot=runs/compare/text_squad_long/models/loss=dot,seed=0 \
        --alpha-set scifact --predict-on scifact \
        --out docs/results_text_length_mix.json --records docs/data/text_length_mix/per_query.json \
        --report docs/results_text_length_mix.md --figure docs/text_length_mix.png
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.length_mix import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
