"""Small builders shared by the tests: PNG bytes, tar shards written member by member, free ports."""

import io
import random
import socket
import tarfile
import zlib
from pathlib import Path

from PIL import Image


def png(seed: int, size: int = 8) -> bytes:
    """A deterministic random-pixel RGB PNG."""
    rng = random.Random(seed)
    img = Image.new("RGB", (size, size))
    img.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(size * size)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar with exactly these members, in this order (bad members included on purpose)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def good(key: str, size: int = 8) -> list[tuple[str, bytes]]:
    """A valid sample: KEY.png + KEY.txt."""
    return [(f"{key}.png", png(zlib.crc32(key.encode()), size)), (f"{key}.txt", f"caption {key}".encode())]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _RunsCode:
    """Unpickling this calls `open(marker, "w")`: the marker file appears if the payload ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def crafted_torch_file(path: Path, marker: Path, content: dict | None = None) -> Path:
    """A torch.save file as an attacker would share it: plausible content plus a payload that runs
    on an unsafe `torch.load` (weights_only=False) and creates `marker`."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**(content or {}), "payload": _RunsCode(marker)}, path)
    return path
