"""Shard URLs: brace patterns, '::'-joined sources, and the local files behind them.

Free of torch and webdataset, so a run's data paths are checked (and a missing shard named as
"not found") before any heavy import. Braces expand with `braceexpand`, the library webdataset uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

from braceexpand import braceexpand


def expand_sources(urls: str | list[str]) -> list[list[str]]:
    """Shard URLs per source. A string is split at '::'; a list holds one pattern per source. A local
    folder stands for the .tar shards in it, in name order."""
    parts = urls.split("::") if isinstance(urls, str) else list(urls)
    sources = [[u for pattern in braceexpand(p.strip()) for u in _folder_shards(pattern)] for p in parts if p.strip()]
    if not sources or any(not s for s in sources):
        raise ValueError(f"no shards in {urls!r}")
    return sources


def _folder_shards(url: str) -> list[str]:
    path = local_path(url)
    if path is None or not path.is_dir():
        return [url]
    shards = sorted(str(p) for p in path.glob("*.tar"))
    if not shards:
        raise ValueError(f"{path} is a folder without .tar shards: pass shard files or a brace pattern "
                         f"(e.g. {path}/train-{{000000..000009}}.tar)")
    return shards


def local_path(url: str) -> Path | None:
    """The file behind a local URL (plain path or file:), None for pipe:, http: and the like."""
    scheme = urlparse(url).scheme
    if scheme == "file":
        return Path(urlparse(url).path)
    return Path(url) if scheme == "" else None


def check_shards_exist(urls: Iterable[str], key: str | None = None) -> None:
    """A FileNotFoundError naming the first local shard that is not there (and the config key it came from)."""
    for url in urls:
        path = local_path(url)
        if path is not None and not path.is_file():
            origin = f" (from {url})" if str(path) != url else ""
            where = f"{key}: " if key else ""
            raise FileNotFoundError(f"{where}shard not found: {path}{origin}")


def check_sources_exist(urls: str | list[str], key: str | None = None) -> list[str]:
    """Every shard of every source, checked; returns them flat."""
    flat = [u for source in expand_sources(urls) for u in source]
    check_shards_exist(flat, key)
    return flat
