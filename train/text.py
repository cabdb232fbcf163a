"""Fine-tune a text bi-encoder (query -> document retrieval) with a magnitude-aware similarity.

Installed as `magclip-train-text` (the same arguments); every option: --help (magclip/cli/train_text.py).

    python train/text.py --config configs/text/scifact.yaml                      # MiniLM on SciFact train, cosine
    python train/text.py --config configs/text/scifact.yaml loss.mode=qnorm train.max_steps=50 name=qnorm_50
    python train/text.py --config configs/text/scifact.yaml loss.mode=dot data.group_size=2 data.random_negatives=4
    python train/text.py --config configs/text/scifact.yaml data.beir=null data.train=pairs.jsonl
    python train/text.py --config configs/text/scifact.yaml train.resume=latest
    torchrun --nproc_per_node 2 train/text.py --config configs/text/scifact.yaml   # 2 processes on CPU (gloo)
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml train/text.py --config configs/text/scifact.yaml \\
        loss.mode=qnorm
    python train/text.py --make-pairs runs/scifact_train.jsonl --beir ../shared/data/text/scifact
    python train/text.py --make-pairs runs/scifact_train_rand4.jsonl --beir ../shared/data/text/scifact --random-negatives 4
    python train/text.py --make-pairs runs/scifact_train_hn4.jsonl --beir ../shared/data/text/scifact \
        --mine-with minilm --mode cosine --negatives 4 --skip-top 3      # hard negatives retrieved by MiniLM
    python train/text.py --config configs/text/scifact.yaml data.beir=null data.train=runs/scifact_train_hn4.jsonl \
        data.group_size=3
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli import as_command  # noqa: E402
from magclip.cli.train_text import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    as_command(lambda: main(default_config=ROOT / "configs" / "text" / "scifact.yaml"))()
