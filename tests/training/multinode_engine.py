"""Run by tests/training/test_multinode.py on each host, as the script of torchrun: the engine on
fixed in-memory batches (as engine_two_ranks.py), each of the W ranks taking its 1/W of every
step's global batch. Every rank writes OUT/rank<R>.pt: its final weights, the world size, host
and address it saw."""

import faulthandler
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # + builders
from test_engine import GLOBAL_BATCH, collate, fixed_batches, run_engine

from magclip.distributed import local_addresses


def main(out: Path) -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("MAGCLIP_TEST_HANG_S", 240)), exit=True)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    samples = fixed_batches(2 * GLOBAL_BATCH)
    steps = [samples[:GLOBAL_BATCH], samples[GLOBAL_BATCH:]]
    share = GLOBAL_BATCH // world
    mine = [collate(step[rank * share:(rank + 1) * share]) for step in steps]
    weights = run_engine(out / "run", mine)  # Accelerator() joins the gloo group that torchrun set up
    torch.save({"world_size": dist.get_world_size(), "rank": dist.get_rank(), "host": socket.gethostname(),
                "address": local_addresses()[0], "weights": weights}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
