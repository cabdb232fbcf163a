"""Run by tests/training/test_multinode.py on each host, as the script of torchrun: the main job
(magclip-train-clip's own command, arguments passed through), recording what this rank did into
$MAGCLIP_TEST_RECORD/rank<R>.json: the world size and host it saw, the keys and skip counts of every
micro-batch it trained on (with the epoch), and the checkpoint folders it published.

MAGCLIP_TEST_STALL_AFTER_STEP=N (set on one host): after step N's checkpoint the rank writes
rank<R>.stalled and sleeps, so that the test kills or freezes its host at a known point of the run.
"""

import faulthandler
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

import torch.distributed as dist

from magclip.cli.train_clip import console
from magclip.training import checkpoints as checkpoints_module
from magclip.training import engine as engine_module

OUT = Path(os.environ["MAGCLIP_TEST_RECORD"])
STALL = os.environ.get("MAGCLIP_TEST_STALL_AFTER_STEP")
batches: list[dict] = []
published: list[str] = []

_count_skips = engine_module.Engine._count_skips
_publish_dir = checkpoints_module.publish_dir
_save_checkpoint = engine_module.Engine.save_checkpoint


def count_skips(self, batch: dict) -> None:
    batches.append({"epoch": self.state.epoch, "step": self.state.step + 1, "keys": list(batch.get("keys", [])),
                    "skipped": dict(batch.get("skipped", {}))})
    _count_skips(self, batch)


def publish_dir(tmp, final):
    published.append(Path(final).name)
    return _publish_dir(tmp, final)


def save_checkpoint(self):
    out = _save_checkpoint(self)
    if STALL and self.state.step == int(STALL):
        (OUT / f"rank{dist.get_rank()}.stalled").write_text(str(os.getpid()))
        time.sleep(600)
    return out


def record() -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    world = dist.get_world_size() if dist.is_initialized() else 1
    (OUT / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world_size": world, "host": socket.gethostname(), "batches": batches, "published": published}))


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("MAGCLIP_TEST_HANG_S", 300)), exit=True)
    engine_module.Engine._count_skips = count_skips
    checkpoints_module.publish_dir = publish_dir
    engine_module.Engine.save_checkpoint = save_checkpoint
    OUT.mkdir(parents=True, exist_ok=True)
    console()
    record()
