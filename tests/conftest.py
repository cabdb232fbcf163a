"""Shared test set-up: tests/builders.py importable from every folder; a one-thread fixture."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def one_thread():
    """Two busy cores: keep in-process runs on one thread (and bitwise comparable with each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
