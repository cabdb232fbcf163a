"""Shard URLs: brace patterns, '::'-joined sources, and the local files behind them.

Free of torch and webdataset, so a run's data paths are checked (and a missing shard named as
"not found") before any heavy import. Braces expand with `braceexpand`, the library webdataset uses.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

from braceexpand import braceexpand

from magclip.io import is_lfs_pointer, lfs_pointer_error


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


# files that hold a table, not samples: an image-caption parquet, a caption table
TABLE_ENDINGS = (".parquet", ".arrow", ".csv", ".tsv", ".csv.gz", ".tsv.gz")


def check_shards_exist(urls: Iterable[str], key: str | None = None) -> None:
    """A FileNotFoundError naming the first local shard that is not there (and the config key it came from);
    a ValueError for a Git LFS pointer in a shard's place (a benchmark cloned without its LFS files), which
    the readers would otherwise skip as a corrupt tar and score the rest of the set."""
    where = f"{key}: " if key else ""
    for url in urls:
        path = local_path(url)
        if path is not None and not path.is_file():
            origin = f" (from {url})" if str(path) != url else ""
            raise FileNotFoundError(f"{where}shard not found: {path}{origin}")
        if path is not None and is_lfs_pointer(path):
            raise lfs_pointer_error(path, "a tar", where)
        if path is not None and path.name.endswith(TABLE_ENDINGS):
            raise ValueError(f"{where}{path} is a table, not webdataset shards: convert it with make_shards ("
                             + (f"python tools/make_shards.py {path} OUT_DIR" if path.suffix == ".parquet" else
                                f"python tools/make_shards.py IMAGES_DIR {path} OUT_DIR")
                             + ") and pass OUT_DIR")


def check_sources_exist(urls: str | list[str], key: str | None = None) -> list[str]:
    """Every shard of every source, checked; returns them flat."""
    flat = [u for source in expand_sources(urls) for u in source]
    check_shards_exist(flat, key)
    return flat


PIPE_PROBE_TIMEOUT_S = 30.0  # a pipe: command that neither sends data nor exits within this is left to the run
PIPE_SIGPIPE_STATUS = 141  # a shell's status when the reader closed the pipe (webdataset ignores it too)


class PipeFailedError(ValueError):
    """A `pipe:` shard's command exits with an error before sending any data."""


def check_pipes_start(urls: str | list[str], key: str | None = None) -> None:
    """The first `pipe:` shard of each source, started and read for one block: a command that fails
    (`pipe:false`, a typo, a missing credential) is a PipeFailedError naming the URL, its exit status
    and its own stderr, before anything is built; a damaged tar it might send is the reader's to count."""
    for source in expand_sources(urls):
        url = next((u for u in source if u.startswith("pipe:")), None)
        if url is not None:
            _probe_pipe(url, key)


def _probe_pipe(url: str, key: str | None) -> None:
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=subprocess.PIPE, stderr=err)
        try:
            first = proc.stdout.read(512) if proc.stdout is not None else b""
            status = proc.wait(PIPE_PROBE_TIMEOUT_S) if not first else None
        except subprocess.TimeoutExpired:
            status = None
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if status not in (None, 0, PIPE_SIGPIPE_STATUS):
            err.seek(0)
            said = " | ".join(line.strip() for line in err.read().decode(errors="replace").splitlines()[-3:]
                              if line.strip()) or "nothing on stderr"
            where = f"{key}: " if key else ""
            raise PipeFailedError(f"{where}{url}: the command exited with status {status} before sending any "
                                  f"data: {said}")
