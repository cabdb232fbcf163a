"""Run by tests/cli/test_errors.py under `torchrun --nproc_per_node 2`: joins the gloo group,
introduces itself to the other rank as a training run does, then refuses its input through the
commands' `as_command`, as a rank started with another config does. With `--only-rank N` only rank N
refuses; the other stands for a rank that goes on training."""

import sys
import time

import torch.distributed as dist

from magclip import distributed
from magclip.cli import as_command


def main() -> None:
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 2, dist.get_world_size()
    distributed.introduce({"probe": True})
    only = int(sys.argv[sys.argv.index("--only-rank") + 1]) if "--only-rank" in sys.argv else None
    if only is not None and dist.get_rank() != only:
        time.sleep(60)
        return
    raise ValueError(f"refused on rank {dist.get_rank()}")


if __name__ == "__main__":
    as_command(main)()
