"""Shared test set-up: tests/builders.py importable from every folder; one intra-op thread per run."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Runs in this process and in the subprocesses the tests start choose their threads alike (the trainer
# reads OMP_NUM_THREADS, magclip/training/threads.py), so their weights stay bitwise comparable.
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="module")
def one_thread():
    """Two busy cores: keep in-process runs on one thread (and bitwise comparable with each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
