"""Train a CLIP model with per-direction magnitude-aware losses.

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

Without --config the built-in defaults are the main job (configs/clip/default.yaml spells them out).
The scoring settings studied (cosine, dot, qnorm, dnorm, learnable, one direction, mixed) are
overrides of loss.i2t / loss.t2i, and the axes of configs/compare/*.yaml.

Overrides are dotted `key=value` pairs (YAML values; `null` drops a direction). Unknown keys and
bad values are errors that name the key.
"""

import argparse
import logging

from magclip.cli import as_command, check_inputs
from magclip.config import load_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="experiment YAML (default: none, the built-in defaults are the main job)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.epochs=2")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)
    check_inputs(cfg)  # bad input is reported before torch is imported
    from magclip.training.preemption import StopGuard

    # listening before torch loads: a stop signal during the imports ends the command with exit 75 too
    with StopGuard(cfg.train.save_on_signal, cfg.train.time_limit):
        _train_clip(cfg)


def _train_clip(cfg) -> None:
    from magclip.distributed import rank
    from magclip.training.clip import format_results_table, train_clip

    results = train_clip(cfg)
    if rank() == 0:
        print(format_results_table(results))
        print(f"run directory: {results['run_dir']}")


console = as_command(main)  # the installed command and the launcher: expected errors in one line

if __name__ == "__main__":
    console()
