"""The offline consolidation streams: a DCP checkpoint written by 2 processes' worth of shards is read one tensor at a
time and written as a safetensors file that safetensors' own reader reads back equal, with the process's peak memory
growing by about the largest tensor, not the weights (measured with ru_maxrss in a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TENSORS, ROWS = 48, 1024 * 1024 // 2  # 48 tensors [2, 524288] in fp32 (4 MB), bf16 and fp16 (2 MB): 128 MB of weights

# the peak resident memory of the streaming alone: VmHWM reset to the current size first (Linux's clear_refs 5),
# so the imports' own transient peak does not hide it
MEASURE = """
import json, re, sys
import torch
from magclip.training.consolidate import ShardedCheckpoint, stream_safetensors

def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

checkpoint = ShardedCheckpoint(sys.argv[1])
entries = [checkpoint.entry(name) for name in sorted(checkpoint.tensors)]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
largest = stream_safetensors(sys.argv[2], entries, lambda e: checkpoint.load(e.name), {"format": "pt"})
print(json.dumps({"grown": status("VmHWM") - before, "largest": largest, "total": sum(e.nbytes for e in entries)}))
"""


def can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def synthetic_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    state = {f"tower.block{i}.weight": torch.randn(2, ROWS, generator=g).to(dtypes[i % 3]) for i in range(TENSORS)}
    state["scale"] = torch.tensor(2.5)  # a 0-d tensor
    state["mask"] = torch.tensor([True, False, True])
    return state


@pytest.mark.skipif(not can_reset_peak(), reason="no /proc/self/clear_refs here: the peak memory cannot be reset")
def test_streaming_consolidation_holds_one_tensor_at_a_time(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    state = synthetic_state()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: as intended
        dcp.save({"model": state}, checkpoint_id=str(tmp_path / "step" / "sharded"), no_dist=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "step"), str(tmp_path / "out.safetensors")],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert measured["total"] == total and measured["largest"] == 2 * ROWS * 4
    # every tensor held at once would grow the peak by the weights (128 MB); one at a time by a few of the largest
    # (measured: 21 MB, the read buffers of DCP's reader and the allocator's own beside the 4 MB tensor)
    assert measured["grown"] < min(total / 4, 8 * measured["largest"]), measured
    print(measured)
    with safe_open(tmp_path / "out.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(state)
        for name, t in state.items():
            read = f.get_tensor(name)
            assert read.dtype == t.dtype and torch.equal(read, t), name


def test_a_folder_without_shards_is_refused(tmp_path):
    from magclip.training.consolidate import consolidate

    with pytest.raises(FileNotFoundError, match="holds no sharded/.metadata: not a sharded checkpoint"):
        consolidate(tmp_path)
