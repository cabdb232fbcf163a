"""Running a grid: one command line per cell, resumable, logged (magclip.experiments.grid documents
the format and the resume rules)."""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from magclip.experiments.grid import Cell, Grid
from magclip.io import atomic_write_json
from magclip.training.preemption import STOPPED_EXIT

# ----------------------------------------------------------------------------- running


def grid_commands(grid: Grid, include_finished: bool = False) -> list[str]:
    """One shell line per cell (its pending steps joined by &&), for a scheduler; run from the repo root."""
    lines = []
    for cell in grid.cells():
        if cell.finished and not include_finished:
            continue
        commands = cell.pending_commands() if not cell.finished else \
            [cell.argv(s, ["overwrite=true"] if s.trainer else []) for s in cell.steps]
        lines.append(" && ".join(shlex.join(c) for c in commands))
    return lines


_LOCK = threading.Lock()            # ran.jsonl and the echo, shared by parallel cells
_RUNNING: set[subprocess.Popen] = set()
_STOPPING = threading.Event()      # set when the runner is interrupted: no cell starts another step


def _log_event(grid: Grid, **record: Any) -> None:
    with _LOCK:
        grid.output_dir.mkdir(parents=True, exist_ok=True)
        path = grid.output_dir / "ran.jsonl"
        record = {"time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **record}
        torn = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")  # killed mid-line
        with open(path, "a") as f:
            f.write(("\n" if torn else "") + json.dumps(record) + "\n")
            f.flush()


def ran_log(output_dir: str | Path) -> list[dict[str, Any]]:
    """The launches recorded in <output_dir>/ran.jsonl (events `start` and `end`); a torn line is skipped."""
    path = Path(output_dir) / "ran.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


STOP_GRACE_S = 300.0   # how long a cell may take to save its step after the runner's SIGTERM


def _stop(proc: subprocess.Popen) -> int | None:
    """SIGTERM the cell and wait for it: a trainer finishes its step, saves it and exits 75 (a text
    run's evaluation in progress finishes first); the next invocation continues it from that checkpoint."""
    proc.terminate()
    try:
        return proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None


def _run_command(argv: list[str], log_path: Path, env: dict[str, str],
                 interrupted: Callable[[int | None], None]) -> int:
    if argv and argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"\n$ {shlex.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **env})
        with _LOCK:
            _RUNNING.add(proc)
        try:
            return proc.wait()
        except BaseException:              # Ctrl-C / SIGTERM of the runner: don't leave the cell running
            interrupted(_stop(proc))       # (a trainer saves its step: 75)
            raise
        finally:
            with _LOCK:
                _RUNNING.discard(proc)


def _run_cell(grid: Grid, cell: Cell, i: int, n: int, echo: Callable[[str], None]) -> bool:
    """The cell's pending steps, one after another; True when all of them succeeded."""
    def say(text: str) -> None:
        with _LOCK:
            echo(text)

    t0 = time.perf_counter()
    rc = 0
    for step in cell.steps:
        if cell.step_done(step):
            continue
        if _STOPPING.is_set():
            return False
        argv = cell.argv(step, cell.restart_args(step))
        atomic_write_json(cell.spec_path, cell.spec())
        say(f"[{i}/{n}] {cell.name}: {shlex.join(argv)}")
        _log_event(grid, event="start", cell=cell.name, command=argv)
        rc = _run_command(argv, cell.log_path, grid.env, lambda code: _log_event(
            grid, event="end", cell=cell.name, rc=code, wall_s=round(time.perf_counter() - t0, 2), interrupted=True))
        _log_event(grid, event="end", cell=cell.name, rc=rc, wall_s=round(time.perf_counter() - t0, 2))
        if rc == 0 and not cell.step_done(step):
            say(f"  step exited 0 but did not write {cell.path(step.creates)}")
            rc = -1
        if rc != 0:
            break
    wall = time.perf_counter() - t0
    if rc == 0:
        say(f"[{i}/{n}] {cell.name}: done in {wall:.1f} s")
    elif rc == STOPPED_EXIT:
        say(f"[{i}/{n}] {cell.name}: stopped after {wall:.1f} s, its step saved; the next invocation continues it")
    else:
        say(f"[{i}/{n}] {cell.name}: FAILED (exit {rc}) after {wall:.1f} s; log: {cell.log_path}")
    return rc == 0


def run_grid(grid: Grid, max_cells: int | None = None, echo: Callable[[str], None] = print,
             jobs: int = 1) -> dict[str, list[str]]:
    """Run the unfinished cells (at most `max_cells`), `jobs` at a time (1: one after another; more:
    parallel processes, e.g. several small runs sharing one accelerator); returns ran/failed/skipped
    names, in the grid's cell order."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    grid.output_dir.mkdir(parents=True, exist_ok=True)
    cells = grid.cells()
    todo = [c for c in cells if not c.finished]
    skipped = [c.name for c in cells if c.finished]
    for c in cells:
        reasons = c.stale_reasons() if c.finished else []
        if reasons:
            echo(f"warning: finished cell {c.name} is stale ({'; '.join(reasons)}); it is kept -- delete "
                 f"{c.run_dir} to re-run it, or accept the difference with --allow-stale KEY")
    if max_cells is not None:
        todo = todo[:max_cells]
    echo(f"grid {grid.name}: {len(cells)} cells, {len(skipped)} finished, running {len(todo)}"
         + (f", {jobs} at a time" if jobs > 1 else ""))
    _STOPPING.clear()
    if jobs == 1:
        ok = [_run_cell(grid, cell, i, len(todo), echo) for i, cell in enumerate(todo, 1)]
    else:
        pool = ThreadPoolExecutor(max_workers=jobs)
        futures = []
        try:
            futures = [pool.submit(_run_cell, grid, cell, i, len(todo), echo) for i, cell in enumerate(todo, 1)]
            ok = [f.result() for f in futures]
        except BaseException:              # Ctrl-C / SIGTERM: stop every running cell, start no other
            _STOPPING.set()
            for f in futures:
                f.cancel()
            with _LOCK:
                running = list(_RUNNING)
            for proc in running:
                _stop(proc)
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    return {"ran": [c.name for c, good in zip(todo, ok) if good],
            "failed": [c.name for c, good in zip(todo, ok) if not good], "skipped": skipped}
