"""Write the model files of a sharded step folder (train.sharding=fsdp, train.save_full_model=last or never) from its
DCP shards, offline, on one process: memory bounded by the largest tensor (magclip/training/consolidate.py).

    python tools/consolidate.py runs/big/checkpoints/step_00000500                 # into the step folder
    python tools/consolidate.py runs/big/checkpoints/step_00000500 --out exported/  # elsewhere
    magclip-consolidate runs/lora/checkpoints/step_00000500 --merge                 # a LoRA run: the merged model

A CLIP run's step folder gets open_clip's files (open_clip_model.safetensors, open_clip_config.json) and
magclip.json, as train.save_full_model=every writes them; they load with
`open_clip.create_model_and_transforms("local-dir:FOLDER")` and magclip's evaluation commands.
"""

import argparse
import logging

from magclip.cli import as_command


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", help="a step folder holding sharded/ (RUN/checkpoints/step_N)")
    parser.add_argument("--out", default=None, help="where the model files go (default: the step folder itself)")
    parser.add_argument("--merge", action="store_true", help="a LoRA run's step folder: merge its adapters (adapter/) "
                        "onto the frozen base, read tensor by tensor from the files base.json names")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from magclip.training.consolidate import consolidate
    from magclip.training.merge import merge_lora

    done = merge_lora(args.step, args.out) if args.merge else consolidate(args.step, args.out)
    print(f"{done.weights}: {done.tensors} tensors, {done.bytes / 2**20:.1f} MB; at most "
          f"{done.largest_tensor_bytes / 2**20:.1f} MB held at once")


console = as_command(main)  # the installed command and the launcher: expected errors in one line

if __name__ == "__main__":
    console()
