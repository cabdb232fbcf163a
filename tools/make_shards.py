"""Convert a folder of images + a caption table into webdataset shards for `build_clip_loader`.

Installed as `magclip-make-shards` (the same arguments); every option: --help (magclip/cli/make_shards.py).

    python tools/make_shards.py data/pets/images data/pets/captions.csv data/pets/shards --shard-size 1000
    python tools/make_shards.py imgs/ captions.jsonl out/ --image-column image --caption-column text \
        --prefix train
    python tools/make_shards.py . train.csv shards/ --separator "\\t"   # open_clip's tab-separated .csv
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.make_shards import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
