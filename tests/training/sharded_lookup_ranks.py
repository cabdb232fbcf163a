"""Run by tests/training/test_sharded_lookup.py under `torchrun --nproc_per_node W`: a frozen embedding sharded by rows
(magclip/training/sharded_lookup.py) looks up each rank's own ids (batches of other lengths on each rank, ids on every
rank's rows, the last rank's rows shorter) exactly as the whole table does; the rank's shard is its torch.chunk rows."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from magclip.training.shard_fill import local_rows
from magclip.training.sharded_lookup import can_look_up_sharded, shard_rows

dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
assert world == int(os.environ["EXPECTED_WORLD_SIZE"]), world
torch.manual_seed(0)
whole = nn.Embedding(103, 8).to(torch.bfloat16).requires_grad_(False)   # 103 rows: uneven chunks
table = nn.Embedding(103, 8).to(torch.bfloat16).requires_grad_(False)
table.load_state_dict(whole.state_dict())
assert can_look_up_sharded(table)
shard_rows(table, init_device_mesh("cpu", (world,)))
rows = local_rows(table.weight)
mine = table.weight.to_local()
checks = {"rows_equal": torch.equal(mine, whole.weight[rows[0]:rows[1]]), "rows": list(rows)}
generator = torch.Generator().manual_seed(rank)
ids = torch.randint(0, 103, (2, 5 + 3 * rank), generator=generator)
with torch.no_grad():
    checks["lookup_equal"] = torch.equal(table(ids), whole(ids))
    checks["second_lookup_equal"] = torch.equal(table(ids[:1]), whole(ids[:1]))
# the final weights' digest hashes a row-sharded parameter shard after shard, in pieces, never gathered: the bytes of
# the whole tensor (magclip/training/sharding.py `_pieces_in_rank_order`), here with pieces of 3 rows
from magclip.training import sharding

sharding.DIGEST_PIECE_BYTES = 3 * 8 * 2
hashed = [piece for _, piece in sharding._pieces_in_rank_order(table.weight, rank, world)]
if rank == 0:
    checks["pieces_equal"] = torch.equal(torch.cat(hashed), whole.weight) and len(hashed) > world
else:
    checks["pieces_equal"] = all(piece is None for piece in hashed)
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
    json.dump(checks, f)
dist.destroy_process_group()
