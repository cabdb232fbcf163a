"""A frozen token embedding under fsdp is looked up where its rows are, never gathered (magclip/training/
sharded_lookup.py): at 2 and 3 gloo processes, each with a batch of its own length, the lookup equals the whole
table's bit for bit and each rank holds exactly its torch.chunk rows; the final weights' digest reads such a
parameter shard after shard in pieces, whose concatenation is the whole tensor."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("sharded_lookup_ranks.py")


@pytest.mark.parametrize("nproc", [2, 3])
def test_the_sharded_lookup_equals_the_whole_table(tmp_path, nproc):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "EXPECTED_WORLD_SIZE": str(nproc)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", str(free_port()), str(WORKER), str(tmp_path)],
                          check=False, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(nproc)]
    assert all(r["rows_equal"] and r["lookup_equal"] and r["second_lookup_equal"] and r["pieces_equal"] for r in ranks), \
        ranks
    assert ranks[0]["rows"][0] == 0 and ranks[-1]["rows"][1] == 103
    assert all(a["rows"][1] == b["rows"][0] for a, b in itertools.pairwise(ranks))
