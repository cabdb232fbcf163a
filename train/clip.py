"""Train a CLIP model with per-direction magnitude-aware losses.

    python train/clip.py                                      # configs/clip/default.yaml: embedded data, ~3 CPU min
    python train/clip.py --config configs/clip/qnorm.yaml train.epochs=2 name=qnorm_e2
    python train/clip.py --config configs/clip/emoji.yaml loss.i2t=qnorm loss.t2i=null
    python train/clip.py --config configs/clip/default.yaml train.resume=latest
    torchrun --nproc_per_node 2 train/clip.py --config configs/clip/default.yaml      # 2 processes on CPU (gloo)
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml train/clip.py --config configs/clip/emoji.yaml
    accelerate launch --config_file configs/accelerate/multi_node.yaml --machine_rank 0 --main_process_ip HOST \
        train/clip.py --config ...

Overrides are dotted `key=value` pairs (YAML values; `null` drops a direction). Unknown keys and
bad values are errors that name the key.
"""

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from magclip.clip_training import format_results_table, train_clip  # noqa: E402
from magclip.config import load_config  # noqa: E402
from magclip.distributed import rank  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "clip" / "default.yaml"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="experiment YAML (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.epochs=2")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = train_clip(load_config(args.config, args.overrides))
    if rank() == 0:
        print(format_results_table(results))
        print(f"run directory: {results['run_dir']}")


if __name__ == "__main__":
    main()
