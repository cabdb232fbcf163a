"""Each training sample's random augmentation drawn from a stream of its own, seeded by (seed, epoch, pass, key).

Why: open_clip's train transforms (torchvision's RandomResizedCrop, timm's) draw from the process's global RNGs.
In a loader worker those are the worker's, seeded by the DataLoader; in the training process they are the step's,
so a sample's crop depended on where the loader ran, on how many workers there were and on what the step drew
before it. Seeding each sample's draws by what identifies it makes its crop the same wherever it is decoded: any
`data.workers`, the cache on or off, a resume in the middle of an epoch. The global RNGs are left as they were
(their states put back), so the step's own draws (dropout, init) do not move.

Which RNGs: torchvision's transforms draw from torch's default CPU generator only; a transform made only of those
(and of open_clip's steps that draw nothing) gets torch's seeded alone, ~2 µs a sample. Any other step (timm's,
open_clip's colour jitter, a user's) may draw from Python's `random` or numpy's too: those are seeded and put back
as well (~250 µs a sample, numpy's state swap most of it). Measured by benchmarks/bench_augment_seed.py.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# steps known to draw nothing, outside torchvision (whose transforms draw from torch's generator only)
NO_DRAWS = {"open_clip.transform.MaybeConvertMode", "open_clip.transform.MaybeToTensor",
            "open_clip.transform.CenterCropOrPad", "open_clip.transform._convert_to_rgb"}


def sample_seed(seed: int, epoch: int, rep: int, key: str) -> int:
    """A 63-bit seed for one sample's augmentation in one pass of one epoch; stable across processes and hosts."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{rep}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _qualified(step: Any) -> str:
    kind = step if callable(step) and hasattr(step, "__qualname__") else type(step)
    return f"{kind.__module__}.{kind.__qualname__}"


def torch_draws_only(transform: Callable) -> bool:
    """Whether every step of `transform` (a Compose, or one transform) draws from torch's generator or nothing."""
    steps = getattr(transform, "transforms", [transform])
    return all(_qualified(s).startswith("torchvision.") or _qualified(s) in NO_DRAWS for s in steps)


class SeededAugment:
    """`transform` called with its random draws seeded per call: `SeededAugment(t)(image, seed)`."""

    def __init__(self, transform: Callable[[Any], Any]):
        self.transform = transform
        self.torch_only = torch_draws_only(transform)

    def __call__(self, image: Any, seed: int) -> Any:
        generator = torch.default_generator
        torch_state = generator.get_state()
        others = None if self.torch_only else (random.getstate(), np.random.get_state())
        try:
            generator.manual_seed(seed)
            if others is not None:
                random.seed(seed)
                np.random.seed(seed % 2**32)
            return self.transform(image)
        finally:
            generator.set_state(torch_state)
            if others is not None:
                random.setstate(others[0])
                np.random.set_state(others[1])
