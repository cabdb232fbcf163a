"""Run by tests/training/test_engine.py under `torchrun --nproc_per_node 2`: each rank trains on its half."""

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # + builders
from test_engine import GLOBAL_BATCH, collate, fixed_batches, run_engine  # noqa: E402


def main(out: Path) -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("MAGCLIP_TEST_HANG_S", 240)), exit=True)  # a hang fails loudly
    samples = fixed_batches(2 * GLOBAL_BATCH)
    steps = [samples[:GLOBAL_BATCH], samples[GLOBAL_BATCH:]]
    run_dir = out / "run"
    # Accelerator() joins the gloo group that torchrun set up; each rank takes half of every step's batch
    half = GLOBAL_BATCH // 2
    rank_of = int(os.environ["RANK"])
    mine = [collate(step[rank_of * half:(rank_of + 1) * half]) for step in steps]
    weights = run_engine(run_dir, mine)
    assert dist.get_world_size() == 2, dist.get_world_size()
    if dist.get_rank() == 0:
        torch.save(weights, out / "weights.pt")
        (out / "world.json").write_text(json.dumps({"world_size": dist.get_world_size()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
