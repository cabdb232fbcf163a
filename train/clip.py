"""Train a CLIP model with per-direction magnitude-aware losses.

Installed as `magclip-train-clip` (the same arguments); every option: --help (magclip/cli/train_clip.py).

    python train/clip.py                                      # the main job: embedded data, 5 epochs, ~230 steps
    python train/clip.py name=qnorm loss.i2t=qnorm loss.t2i=qnorm train.epochs=2
    python train/clip.py --config configs/clip/emoji.yaml name=emoji_i2t loss.i2t=qnorm loss.t2i=null
    python train/clip.py train.resume=latest
    torchrun --nproc_per_node 2 train/clip.py name=two_procs  # 2 processes on CPU (gloo)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id JOB \\
        --rdzv-conf is_host=$((R == 0)) train/clip.py --config configs/clip/emoji.yaml   # on each machine R
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml train/clip.py --config configs/clip/emoji.yaml
    accelerate launch --config_file configs/accelerate/multi_node.yaml --machine_rank 0 --main_process_ip HOST \\
        train/clip.py --config configs/clip/emoji.yaml
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.cli.train_clip import console, main  # noqa: E402,F401  (main: for callers)

if __name__ == "__main__":
    console()
