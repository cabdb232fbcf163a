"""A grid of runs -> one table (Markdown + CSV) and bar plots: "does magnitude help here?".

A grid YAML names a base experiment config, overrides applied to every cell, and axes whose
cartesian product gives the cells; each cell is a training run (+ optional evaluation steps)
launched as a subprocess, one after another, or printed as shell commands for a scheduler.

    name: synthetic                      # title of the report
    output_dir: runs/compare/synthetic   # cells in <output_dir>/runs/<cell>, report in <output_dir>
    launcher: clip                       # clip | text | custom (see below); default clip
    base: configs/clip/default.yaml      # the experiment YAML every cell starts from
    overrides: {train.epochs: 5}         # dotted key -> value (or a list of "key=value"), every cell
    axes:                                # cells = product of the axes
      loss:                              # a list of named settings ...
        - {name: cosine, set: {loss.i2t: cosine, loss.t2i: cosine}}
        - {name: i2t_qnorm, set: {loss.i2t: qnorm, loss.t2i: null}}
      seed: [0, 1]                       # ... or plain values of one key ("seed" = train.seed,
      lr: {key: train.lr, values: [0.001, 0.002]}   #     any other axis: {key:, values:})
    aggregate: [seed]                    # axes averaged in the table (default: the axis "seed")
    scale: 100                           # default multiplier of every column (recall 0-1 -> %)
    env: {OMP_NUM_THREADS: "1"}          # extra environment of every cell's processes
    columns:                             # what to tabulate, paths into the cell's results.json
      - val.image_to_text_R@1            # "val" = the run's validation `metrics`
      - {key: eval_sets.ood_seen.text_to_image_R@1, label: "ood_seen t→i R@1"}
      - {key: val.image_to_text_median_rank, better: min, scale: 1, digits: 0}
      - {key: wall_time_s, better: none, scale: 1, digits: 0}

A value of an axis may also replace `base` (`{name: emoji, base: configs/clip/emoji.yaml}`), so a
dataset axis can switch experiments. Cell names join the axis values, `loss=cosine,seed=0`, in the
order of the axes; cells run with the aggregated axes outermost (every setting's seed 0 first, so
a half-finished grid already has a full table). The overrides of one cell are applied in order:
grid overrides, then each axis's `set`, then the runner's `name=<cell>`,
`output_dir=<output_dir>/runs` and the restart flag.

Launchers. `clip` runs `python train/clip.py --config {base} {overrides} ...` and collects
`{run_dir}/results.json`; `text` the same with train/text.py. A mapping adds to (or, with
`name: custom`, replaces) those:

    launcher:
      name: clip
      steps:                             # after the built-in training step; each runs while the
        - command: >-                    # file it `creates` is missing
            python eval/zeroshot.py --checkpoint {run_dir} --emoji ../shared/data/emoji
            --out {run_dir}/zeroshot.json
          creates: "{run_dir}/zeroshot.json"
      results: {zeroshot: "{run_dir}/zeroshot.json"}
    columns: ["zeroshot:sets.ood_novel.metrics.classification.all.top1"]   # NAME:PATH reads results NAME

Placeholders: {python}, {base}, {overrides} (expands to one argument per override), {name} (the
cell), {runs_dir}, {run_dir}, {output_dir}, {restart}, and {AXIS} (the cell's value name on that
axis, e.g. `--mode {loss}`); other braces (shard patterns, code) are left alone. A column path
without a `NAME:` prefix reads the first results file (`main`; for clip/text the run's results.json).

Resumable: a cell is finished when every step's `creates` file exists (the trainers write
results.json atomically, last); finished cells are skipped. An unfinished training step restarts
with `overwrite=true`, or continues with `train.resume=latest` when its run directory holds a
checkpoint written under the same cell spec (recorded in <output_dir>/cells/<cell>.json). A
finished cell whose recorded spec differs from the grid's is reported as stale, not re-run
(delete its run directory to re-run it). Every launch is logged in <output_dir>/ran.jsonl and its
output in <output_dir>/logs/<cell>.log; a failing cell is reported and the grid goes on.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import itertools
import json
import math
import os
import re
import shutil
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from magclip.io import atomic_write_json, atomic_write_text

GRID_KEYS = ("name", "output_dir", "launcher", "base", "overrides", "axes", "aggregate", "scale", "env", "columns",
             "description")
COLUMN_KEYS = ("key", "label", "scale", "better", "digits")
BETTER = ("max", "min", "none")
VALUE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")   # other braces (shard patterns, code) stay as they are
AXIS_KEYS = {"seed": "train.seed"}   # plain-valued axes that need no `key:`

BUILTIN_LAUNCHERS: dict[str, dict[str, Any]] = {
    "clip": {"script": "train/clip.py", "config": "clip"},
    "text": {"script": "train/text.py", "config": "text"},
}
MAIN = "main"


class GridError(ValueError):
    """A grid YAML that cannot be used; the message names the key."""


# ----------------------------------------------------------------------------- specification


@dataclass
class Column:
    key: str                      # path into a results file; "name:path" picks a results file
    label: str
    scale: float = 1.0
    better: str = "max"
    digits: int = 2

    @property
    def source(self) -> str:
        return self.key.split(":", 1)[0] if ":" in self.key else MAIN

    @property
    def path(self) -> str:
        return self.key.split(":", 1)[1] if ":" in self.key else self.key


@dataclass
class AxisValue:
    name: str
    set: dict[str, Any] = field(default_factory=dict)
    base: str | None = None


@dataclass
class Axis:
    name: str
    values: list[AxisValue]


@dataclass
class Step:
    command: list[str]            # argv with placeholders still in (see `Cell.argv`)
    creates: str                  # placeholder path; the step is done when it exists
    trainer: bool = False         # the built-in training step: gets {restart}, `name=` and `output_dir=`


@dataclass
class Cell:
    """One point of the grid: its axis values, overrides and steps, placeholders resolved."""

    name: str
    values: dict[str, str]        # axis name -> value name
    base: str | None
    overrides: list[str]          # key=value, grid overrides then the axes' `set`
    output_dir: Path
    steps: list[Step]
    results_templates: dict[str, str]

    @property
    def runs_dir(self) -> Path:
        return self.output_dir / "runs"

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.name

    @property
    def spec_path(self) -> Path:
        return self.output_dir / "cells" / f"{self.name}.json"

    @property
    def log_path(self) -> Path:
        return self.output_dir / "logs" / f"{self.name}.log"

    def _fill(self, template: str, restart: list[str] | None = None) -> list[str]:
        """One template argument -> zero or more arguments."""
        if template == "{overrides}":
            return list(self.overrides)
        if template == "{restart}":
            return list(restart or [])
        subs = {axis: value for axis, value in self.values.items() if axis.isidentifier()}
        subs.update({"python": "python", "base": self.base or "", "name": self.name, "runs_dir": str(self.runs_dir),
                     "run_dir": str(self.run_dir), "output_dir": str(self.output_dir)})

        def sub(match: re.Match) -> str:
            if match.group(1) not in subs:
                raise GridError(f"cell {self.name}: unknown placeholder {match.group(0)} in {template!r}; known: "
                                + ", ".join(f"{{{k}}}" for k in [*subs, "overrides", "restart"]))
            return subs[match.group(1)]

        return [PLACEHOLDER.sub(sub, template)]

    def path(self, template: str) -> Path:
        return Path(self._fill(template)[0])

    def argv(self, step: Step, restart: list[str] | None = None) -> list[str]:
        return [arg for template in step.command for arg in self._fill(template, restart)]

    @property
    def results(self) -> dict[str, Path]:
        return {name: self.path(t) for name, t in self.results_templates.items()}

    def step_done(self, step: Step) -> bool:
        return self.path(step.creates).is_file()

    @property
    def finished(self) -> bool:
        return all(self.step_done(s) for s in self.steps)

    def spec(self) -> dict[str, Any]:
        """What identifies the cell's work: a finished cell with another spec is stale."""
        return {"name": self.name, "values": self.values, "base": self.base, "overrides": self.overrides,
                "commands": [self.argv(s) for s in self.steps]}

    def recorded_spec(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.spec_path.read_text())
        except (OSError, ValueError):
            return None

    @property
    def stale(self) -> bool:
        recorded = self.recorded_spec()
        return recorded is not None and _spec_key(recorded) != _spec_key(self.spec())

    def restart_args(self, step: Step) -> list[str]:
        """`train.resume=latest` when a checkpoint of this very spec is there, else `overwrite=true`."""
        if not step.trainer:
            return []
        resumable = (self.run_dir / "checkpoints" / "latest").is_file() and not self.stale \
            and self.recorded_spec() is not None
        return ["train.resume=latest"] if resumable else ["overwrite=true"]

    def pending_commands(self) -> list[list[str]]:
        return [self.argv(s, self.restart_args(s)) for s in self.steps if not self.step_done(s)]


def _spec_key(spec: dict[str, Any]) -> str:
    return json.dumps({k: spec.get(k) for k in ("base", "overrides", "commands")}, sort_keys=True)


@dataclass
class Grid:
    name: str
    path: Path | None
    output_dir: Path
    launcher: str
    base: str | None
    overrides: list[str]
    axes: list[Axis]
    aggregate: list[str]
    columns: list[Column]
    steps: list[Step]
    results: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    description: str | None = None
    scale: float = 1.0
    command: str = ""             # the eval/compare.py line that regenerates the report

    @property
    def table_axes(self) -> list[Axis]:
        return [a for a in self.axes if a.name not in self.aggregate]

    def cells(self) -> list[Cell]:
        """Every cell, aggregated axes outermost (all settings of seed 0 run first)."""
        order = [a for a in self.axes if a.name in self.aggregate] + self.table_axes
        cells = []
        for combo in itertools.product(*(a.values for a in order)):
            chosen = {a.name: v for a, v in zip(order, combo)}
            picked = [chosen[a.name] for a in self.axes]           # YAML order for name and overrides
            base = self.base
            overrides = list(self.overrides)
            for value in picked:
                base = value.base or base
                overrides += [f"{k}={format_value(v)}" for k, v in value.set.items()]
            name = ",".join(f"{a.name}={v.name}" for a, v in zip(self.axes, picked)) or "all"
            cells.append(Cell(name=name, values={a.name: v.name for a, v in zip(self.axes, picked)}, base=base,
                              overrides=overrides, output_dir=self.output_dir, steps=self.steps,
                              results_templates=self.results))
        return cells


def format_value(value: Any) -> str:
    """A Python value as the YAML text of a `key=value` override (read back with yaml.safe_load)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        try:
            same = yaml.safe_load(value) == value
        except yaml.YAMLError:
            same = False
        return value if same and value.strip() == value and value else json.dumps(value)
    return json.dumps(value)


def _overrides(raw: Any, where: str) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, dict):
        return [f"{k}={format_value(v)}" for k, v in raw.items()]
    if isinstance(raw, list) and all(isinstance(x, str) and "=" in x for x in raw):
        return list(raw)
    raise GridError(f"{where} must be a mapping of dotted keys to values or a list of 'key=value', got {raw!r}")


def _check_keys(raw: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise GridError(f"unknown key {unknown[0]!r} in {where}; allowed: {', '.join(allowed)}")


def _axis(name: str, raw: Any) -> Axis:
    if not isinstance(name, str) or not VALUE_NAME.match(name):
        raise GridError(f"axis name {name!r} must match {VALUE_NAME.pattern}")
    if isinstance(raw, dict):
        _check_keys(raw, ("key", "values"), f"axis {name!r}")
        if "key" not in raw or not isinstance(raw.get("values"), list):
            raise GridError(f"axis {name!r}: a mapping needs `key:` and a list `values:`")
        key, items = raw["key"], raw["values"]
    elif isinstance(raw, list):
        key, items = AXIS_KEYS.get(name, name if "." in name else None), raw
    else:
        raise GridError(f"axis {name!r} must be a list of values or settings, or {{key:, values:}}; got {raw!r}")
    if not items:
        raise GridError(f"axis {name!r} has no values")
    values = []
    for item in items:
        if isinstance(item, dict):
            _check_keys(item, ("name", "set", "base"), f"a value of axis {name!r}")
            if "name" not in item:
                raise GridError(f"axis {name!r}: every setting needs a `name:` ({item!r})")
            value = AxisValue(str(item["name"]), dict(item.get("set") or {}), item.get("base"))
            if not isinstance(item.get("set") or {}, dict):
                raise GridError(f"axis {name!r}, value {value.name!r}: `set` must map dotted keys to values")
        else:
            if key is None:
                raise GridError(f"axis {name!r} has plain values {items!r} but no key to set: write "
                                f"`{name}: {{key: section.key, values: [...]}}` or name the axis by its dotted key")
            value = AxisValue(str(item), {key: item})
        if not VALUE_NAME.match(value.name):
            raise GridError(f"axis {name!r}: value name {value.name!r} must match {VALUE_NAME.pattern} "
                            "(it becomes part of a directory name)")
        values.append(value)
    names = [v.name for v in values]
    if len(set(names)) != len(names):
        raise GridError(f"axis {name!r} repeats a value name: {names}")
    return Axis(name, values)


def default_label(key: str) -> str:
    """`eval_sets.ood_seen.text_to_image_R@1` -> `ood_seen t→i R@1`."""
    label = key.split(":", 1)[1] if ":" in key else key
    for old, new in (("eval_sets.", ""), ("metrics.", "val."), ("image_to_text_", "i→t "), ("text_to_image_", "t→i "),
                     ("_", " ")):
        label = label.replace(old, new)
    return label.replace(".", " ").replace("/", " ").strip()


def _column(raw: Any, scale: float) -> Column:
    if isinstance(raw, str):
        raw = {"key": raw}
    if not isinstance(raw, dict) or not isinstance(raw.get("key"), str):
        raise GridError(f"a column must be a results path or {{key:, label:, scale:, better:, digits:}}, got {raw!r}")
    _check_keys(raw, COLUMN_KEYS, f"column {raw.get('key')!r}")
    col = Column(key=raw["key"], label=str(raw.get("label") or default_label(raw["key"])),
                 scale=float(raw.get("scale", scale)), better=str(raw.get("better", "max")),
                 digits=int(raw.get("digits", 2)))
    if col.better not in BETTER:
        raise GridError(f"column {col.key!r}: better={col.better!r}; allowed: {', '.join(BETTER)}")
    return col


def _launcher(raw: Any) -> tuple[str, list[Step], dict[str, str]]:
    if raw is None or isinstance(raw, str):
        raw = {"name": raw or "clip"}
    if not isinstance(raw, dict):
        raise GridError(f"launcher must be clip, text or a mapping, got {raw!r}")
    _check_keys(raw, ("name", "steps", "results"), "launcher")
    name = raw.get("name", "clip")
    steps: list[Step] = []
    results: dict[str, str] = {}
    if name in BUILTIN_LAUNCHERS:
        script = BUILTIN_LAUNCHERS[name]["script"]
        steps.append(Step(["{python}", script, "--config", "{base}", "{overrides}", "name={name}",
                           "output_dir={runs_dir}", "{restart}"], "{run_dir}/results.json", trainer=True))
        results[MAIN] = "{run_dir}/results.json"
    elif name != "custom":
        raise GridError(f"launcher name {name!r}; allowed: {', '.join(BUILTIN_LAUNCHERS)}, custom")
    for i, s in enumerate(raw.get("steps") or []):
        if not isinstance(s, dict) or "command" not in s or "creates" not in s:
            raise GridError(f"launcher step {i} needs `command:` and `creates:` (got {s!r})")
        _check_keys(s, ("command", "creates"), f"launcher step {i}")
        command = s["command"]
        argv = shlex.split(command) if isinstance(command, str) else [str(x) for x in command]
        steps.append(Step(argv, str(s["creates"])))
    extra = raw.get("results") or {}
    if not isinstance(extra, dict):
        raise GridError("launcher.results must map names to result-file paths")
    results.update({str(k): str(v) for k, v in extra.items()})
    if not steps:
        raise GridError("a custom launcher needs `steps:`")
    if not results:
        results[MAIN] = steps[-1].creates
    if MAIN not in results:                       # the first named file is the default source
        first = next(iter(results))
        results = {MAIN: results[first], **results}
    return name, steps, results


def load_grid(path: str | Path | dict, extra_overrides: list[str] | None = None,
              output_dir: str | Path | None = None) -> Grid:
    """Read and check a grid YAML (or an equivalent dict); `extra_overrides` go to every cell."""
    if isinstance(path, dict):
        raw, where = path, None
    else:
        where = Path(path)
        if not where.is_file():
            raise GridError(f"grid file not found: {where}")
        raw = yaml.safe_load(where.read_text()) or {}
    if not isinstance(raw, dict):
        raise GridError("the top level of a grid must be a mapping")
    _check_keys(raw, GRID_KEYS, "the grid")
    for required in ("output_dir", "columns"):
        if required not in raw:
            raise GridError(f"the grid needs `{required}:`")
    launcher, steps, results = _launcher(raw.get("launcher"))
    axes_raw = raw.get("axes") or {}
    if not isinstance(axes_raw, dict):
        raise GridError("axes must map axis names to values")
    axes = [_axis(name, values) for name, values in axes_raw.items()]
    aggregate = raw.get("aggregate", ["seed"] if "seed" in axes_raw else [])
    aggregate = [aggregate] if isinstance(aggregate, str) else list(aggregate or [])
    unknown = [a for a in aggregate if a not in axes_raw]
    if unknown:
        raise GridError(f"aggregate names {unknown[0]!r}, which is not an axis ({', '.join(axes_raw)})")
    scale = float(raw.get("scale", 1.0))
    columns = [_column(c, scale) for c in raw.get("columns") or []]
    if not columns:
        raise GridError("the grid needs at least one column")
    for col in columns:
        if col.source not in results:
            raise GridError(f"column {col.key!r} reads results {col.source!r}; known: {', '.join(results)}")
    env = raw.get("env") or {}
    if not isinstance(env, dict):
        raise GridError("env must map variable names to values")
    base = raw.get("base")
    if launcher in BUILTIN_LAUNCHERS and base is None and not any(v.base for a in axes for v in a.values):
        raise GridError(f"launcher {launcher!r} needs `base:` (an experiment YAML)")
    grid = Grid(name=str(raw.get("name") or (where.stem if where else "grid")), path=where,
                output_dir=Path(output_dir or raw["output_dir"]), launcher=launcher, base=base,
                overrides=_overrides(raw.get("overrides"), "overrides") + list(extra_overrides or []),
                axes=axes, aggregate=aggregate, columns=columns, steps=steps, results=results,
                env={str(k): str(v) for k, v in env.items()}, description=raw.get("description"), scale=scale)
    grid.command = shlex.join(["python", "eval/compare.py", "--grid", where.as_posix() if where else "GRID.yaml",
                               *(["--output-dir", str(output_dir)] if output_dir else []),
                               *(extra_overrides or []), "--only-report"])
    grid.cells()  # placeholders and names resolve
    return grid


def validate_cells(grid: Grid) -> None:
    """Load every cell's experiment config in-process: a typo fails now, not hours into the grid."""
    if grid.launcher not in BUILTIN_LAUNCHERS:
        return
    if BUILTIN_LAUNCHERS[grid.launcher]["config"] == "clip":
        from magclip.config import load_config as loader
    else:
        from magclip.text_training import load_text_config as loader
    for cell in grid.cells():
        try:
            loader(cell.base, [*cell.overrides, f"name={cell.name}", f"output_dir={cell.runs_dir}"])
        except Exception as e:
            raise GridError(f"cell {cell.name}: {e}") from e


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


def _log_event(grid: Grid, **record: Any) -> None:
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


def _run_command(argv: list[str], log_path: Path, env: dict[str, str]) -> int:
    if argv and argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"\n$ {shlex.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **env})
        try:
            return proc.wait()
        except BaseException:              # Ctrl-C / SIGTERM of the runner: don't leave the cell running
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise


def run_grid(grid: Grid, max_cells: int | None = None, echo: Callable[[str], None] = print) -> dict[str, list[str]]:
    """Run the unfinished cells one after another (at most `max_cells`); returns ran/failed/skipped names."""
    grid.output_dir.mkdir(parents=True, exist_ok=True)
    cells = grid.cells()
    todo = [c for c in cells if not c.finished]
    skipped = [c.name for c in cells if c.finished]
    for c in cells:
        if c.finished and c.stale:
            echo(f"warning: finished cell {c.name} was run with another spec ({c.spec_path}); "
                 "it is kept -- delete its run directory to re-run it")
    if max_cells is not None:
        todo = todo[:max_cells]
    echo(f"grid {grid.name}: {len(cells)} cells, {len(skipped)} finished, running {len(todo)}")
    ran, failed = [], []
    for i, cell in enumerate(todo, 1):
        t0 = time.perf_counter()
        rc = 0
        for step in cell.steps:
            if cell.step_done(step):
                continue
            argv = cell.argv(step, cell.restart_args(step))
            atomic_write_json(cell.spec_path, cell.spec())
            echo(f"[{i}/{len(todo)}] {cell.name}: {shlex.join(argv)}")
            _log_event(grid, event="start", cell=cell.name, command=argv)
            rc = _run_command(argv, cell.log_path, grid.env)
            _log_event(grid, event="end", cell=cell.name, rc=rc, wall_s=round(time.perf_counter() - t0, 2))
            if rc == 0 and not cell.step_done(step):
                echo(f"  step exited 0 but did not write {cell.path(step.creates)}")
                rc = -1
            if rc != 0:
                break
        wall = time.perf_counter() - t0
        if rc == 0:
            ran.append(cell.name)
            echo(f"[{i}/{len(todo)}] {cell.name}: done in {wall:.1f} s")
        else:
            failed.append(cell.name)
            echo(f"[{i}/{len(todo)}] {cell.name}: FAILED (exit {rc}) after {wall:.1f} s; log: {cell.log_path}")
    return {"ran": ran, "failed": failed, "skipped": skipped}


# ----------------------------------------------------------------------------- collecting


def lookup(results: Any, path: str) -> Any:
    """Follow a dotted path; a key may itself hold dots or slashes (the longest match wins), a
    number indexes a list. `val` stands for the run's validation `metrics`."""
    parts = path.split(".")
    node = results
    i = 0
    while i < len(parts):
        if isinstance(node, list) and parts[i].isdigit():  # a list element by index, e.g. `bins.0`
            node, i = (node[int(parts[i])] if int(parts[i]) < len(node) else None), i + 1
            continue
        if not isinstance(node, dict):
            return None
        for j in range(len(parts), i, -1):
            key = ".".join(parts[i:j])
            if key in node:
                node, i = node[key], j
                break
        else:
            if i == 0 and parts[0] == "val" and "metrics" in node:
                node, i = node["metrics"], 1
                continue
            return None
    return node


def collect(grid: Grid) -> list[dict[str, Any]]:
    """One record per cell: its axis values, finished/stale flags and the columns' raw values (or None)."""
    records = []
    for cell in grid.cells():
        loaded: dict[str, Any] = {}
        for name, path in cell.results.items():
            try:
                loaded[name] = json.loads(path.read_text())
            except (OSError, ValueError):
                loaded[name] = None
        values = {}
        for col in grid.columns:
            v = lookup(loaded.get(col.source), col.path) if loaded.get(col.source) is not None else None
            values[col.key] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
        finished = cell.finished
        records.append({"cell": cell.name, **cell.values, "finished": finished, "stale": finished and cell.stale,
                        "values": values, "results": {k: str(p) for k, p in cell.results.items()},
                        "unresolved": [k for k, v in values.items() if v is None] if finished else []})
    return records


@dataclass
class Stat:
    mean: float | None
    std: float | None
    n: int


def _stat(values: list[float | None]) -> Stat:
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return Stat(None, None, 0)
    return Stat(statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None, len(xs))


def summarize(grid: Grid, records: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Table rows: one per combination of the non-aggregated axes (in YAML order), each column's
    mean and sample std over the aggregated axes, the number of finished cells, and the best flags."""
    records = collect(grid) if records is None else records
    axes = grid.table_axes
    per_group = 1
    for a in grid.axes:
        if a.name in grid.aggregate:
            per_group *= len(a.values)
    rows = []
    for combo in itertools.product(*(a.values for a in axes)):
        key = {a.name: v.name for a, v in zip(axes, combo)}
        members = [r for r in records if all(r[k] == v for k, v in key.items())]
        stats = {col.key: _stat([r["values"][col.key] for r in members]) for col in grid.columns}
        rows.append({"labels": key, "finished": sum(r["finished"] for r in members), "cells": per_group,
                     "stats": stats, "best": {}})
    for col in grid.columns:
        means = [round(r["stats"][col.key].mean * col.scale, col.digits) for r in rows
                 if r["stats"][col.key].mean is not None]
        best = None if col.better == "none" or not means else (max(means) if col.better == "max" else min(means))
        for r in rows:
            m = r["stats"][col.key].mean
            r["best"][col.key] = best is not None and m is not None and round(m * col.scale, col.digits) == best
    return rows


def _fmt(x: float, digits: int) -> str:
    return f"{x:.{digits}f}"


def _cell_text(stat: Stat, col: Column) -> str:
    if stat.mean is None:
        return "–"
    text = _fmt(stat.mean * col.scale, col.digits)
    if stat.std is not None:
        text += f" ± {_fmt(stat.std * col.scale, col.digits)}"
    return text


def markdown_table(grid: Grid, rows: list[dict[str, Any]]) -> str:
    axes = [a.name for a in grid.table_axes] or ["cells"]
    head = [*axes, "runs", *(c.label for c in grid.columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        labels = [r["labels"][a] for a in axes] if grid.table_axes else ["all"]
        vals = []
        for col in grid.columns:
            text = _cell_text(r["stats"][col.key], col)
            vals.append(f"**{text}**" if r["best"][col.key] else text)
        lines.append("| " + " | ".join([*labels, f"{r['finished']}/{r['cells']}", *vals]) + " |")
    return "\n".join(lines)


def write_csv(grid: Grid, rows: list[dict[str, Any]], path: Path) -> None:
    """One row per table row: axis labels, runs finished, and per column mean, std, n and best (1/0)."""
    axes = [a.name for a in grid.table_axes]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    header = [*axes, "runs_finished", "runs"]
    for col in grid.columns:
        header += [f"{col.label} mean", f"{col.label} std", f"{col.label} n", f"{col.label} best"]
    w.writerow(header)
    for r in rows:
        line: list[Any] = [r["labels"][a] for a in axes] + [r["finished"], r["cells"]]
        for col in grid.columns:
            s = r["stats"][col.key]
            line += ["" if s.mean is None else repr(s.mean * col.scale),
                     "" if s.std is None else repr(s.std * col.scale), s.n, int(r["best"][col.key])]
        w.writerow(line)
    atomic_write_text(path, buf.getvalue())


def write_cells_csv(grid: Grid, records: list[dict[str, Any]], path: Path) -> None:
    """One row per cell (no aggregation): axis values, finished, stale, each column's scaled value."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["cell", *(a.name for a in grid.axes), "finished", "stale", *(c.label for c in grid.columns)])
    for r in records:
        w.writerow([r["cell"], *(r[a.name] for a in grid.axes), int(r["finished"]), int(r["stale"]),
                    *("" if r["values"][c.key] is None else repr(r["values"][c.key] * c.scale) for c in grid.columns)])
    atomic_write_text(path, buf.getvalue())


def _slug(text: str) -> str:
    text = text.replace("→", "2").replace("@", "at")
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "column"


def write_plots(grid: Grid, rows: list[dict[str, Any]], plot_dir: Path) -> list[Path]:
    """One bar chart per column (mean, std error bars, best bar highlighted) + overview.png: the ranked
    columns at the grid's scale side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    axes = [a.name for a in grid.table_axes]
    names = [",".join(r["labels"][a] for a in axes) or "all" for r in rows]
    agg = f" (mean ± std over {', '.join(grid.aggregate)})" if grid.aggregate else ""
    paths = []
    for col in grid.columns:
        means = [r["stats"][col.key].mean for r in rows]
        heights = [0.0 if m is None else m * col.scale for m in means]
        errs = [0.0 if r["stats"][col.key].std is None else r["stats"][col.key].std * col.scale for r in rows]
        colors = ["tab:orange" if r["best"][col.key] else "tab:blue" for r in rows]
        fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * len(rows) + 2), 3.6))
        ax.bar(range(len(rows)), heights, yerr=errs if any(errs) else None, color=colors, capsize=3)
        for i, m in enumerate(means):
            ax.annotate("–" if m is None else _fmt(m * col.scale, col.digits), (i, heights[i]), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(col.label)
        ax.set_title(f"{grid.name}: {col.label}{agg}", fontsize=9)
        fig.tight_layout()
        path = plot_dir / f"{_slug(col.label)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    shown = [c for c in grid.columns if c.better != "none" and c.scale == grid.scale] or grid.columns
    fig, ax = plt.subplots(figsize=(max(6.0, len(shown) * (0.8 + 0.15 * len(rows)) + 2), 4.0))
    width = 0.8 / max(1, len(rows))
    for i, (r, name) in enumerate(zip(rows, names)):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(shown))]
        hs = [0.0 if r["stats"][c.key].mean is None else r["stats"][c.key].mean * c.scale for c in shown]
        es = [0.0 if r["stats"][c.key].std is None else r["stats"][c.key].std * c.scale for c in shown]
        ax.bar(xs, hs, width, yerr=es if any(es) else None, label=name, capsize=2)
    ax.set_xticks(range(len(shown)), [c.label for c in shown], rotation=30, ha="right", fontsize=8)
    ax.set_title(f"{grid.name}{agg}", fontsize=9)
    ax.legend(fontsize=7, ncol=max(1, len(rows) // 6 + 1))
    fig.tight_layout()
    path = plot_dir / "overview.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def unresolved_columns(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Column key -> finished cells whose results have no number at that path."""
    out: dict[str, list[str]] = {}
    for r in records:
        for key in r["unresolved"]:
            out.setdefault(key, []).append(r["cell"])
    return out


def markdown_report(grid: Grid, rows: list[dict[str, Any]], records: list[dict[str, Any]], plots: list[Path],
                    relative_to: Path) -> str:
    """The grid's section for docs: title, provenance, table, notes on the cells, plots."""
    n_cells = len(records)
    done = sum(r["finished"] for r in records)
    source = grid.path.as_posix() if grid.path else "(in-memory grid)"
    command = grid.command or f"python eval/compare.py --grid {source} --only-report"
    lines = [f"## {grid.name}", ""]
    if grid.description:
        lines += [grid.description.strip(), ""]
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines += [(f"Grid `{source}`: {done}/{n_cells} runs finished; collected {when}. "
               f"Generated by `{command}`; no number is typed by hand."), ""]
    lines.append(markdown_table(grid, rows))
    lines.append("")
    notes = []
    if grid.aggregate:
        notes.append(f"mean ± sample std over {', '.join(grid.aggregate)}; `runs` = finished/planned runs per row")
    scales = sorted({c.scale for c in grid.columns})
    if scales == [100.0]:
        notes.append("values ×100 (recall etc. in %)")
    elif 100.0 in scales:
        notes.append("columns with a 0–1 metric are ×100")
    notes.append("bold: the best row per column (at the shown precision)")
    lines.append("; ".join(notes) + ".")
    lines.append("")
    settings = [f"`{a.name}={v.name}`: " + (" ".join(f"`{k}={format_value(x)}`" for k, x in v.set.items()) or "—")
                + (f" (base `{v.base}`)" if v.base else "") for a in grid.axes for v in a.values
                if a.name not in grid.aggregate and (v.set or v.base)]
    common = [f"base `{grid.base}`"] if grid.base else []
    if grid.overrides:
        common.append("overrides " + " ".join(f"`{o}`" for o in grid.overrides))
    if common:
        lines.append("Every run: " + ", ".join(common) + ".")
        lines.append("")
    if settings:
        lines += ["Settings: " + "; ".join(settings) + ".", ""]
    missing = [r["cell"] for r in records if not r["finished"]]
    stale = [r["cell"] for r in records if r["stale"]]
    if missing:
        lines += [f"Not finished: {', '.join(f'`{m}`' for m in missing)}.", ""]
    if stale:
        lines += [f"Stale (finished under another spec): {', '.join(f'`{s}`' for s in stale)}.", ""]
    for key, cells in unresolved_columns(records).items():
        where = ", ".join(f"`{c}`" for c in cells)
        lines += [(f"Column `{key}` has no number in finished runs {where} (a typo in the path, or a metric "
                   "the run does not report)."), ""]
    for p in plots:
        rel = os.path.relpath(p, relative_to)
        lines.append(f"![{p.stem}]({Path(rel).as_posix()})")
    return "\n".join(lines).rstrip() + "\n"


def write_report(grid: Grid, report: str | Path | None = None, plots: bool = True) -> dict[str, Any]:
    """Collect every cell's results and write compare.md, compare.csv, cells.csv and plots/*.png under
    the grid's output_dir (and the Markdown also to `report`, with plot links relative to it)."""
    out = grid.output_dir
    out.mkdir(parents=True, exist_ok=True)
    records = collect(grid)
    rows = summarize(grid, records)
    plot_paths = write_plots(grid, rows, out / "plots") if plots else []
    md = markdown_report(grid, rows, records, plot_paths, out)
    atomic_write_text(out / "compare.md", md)
    write_csv(grid, rows, out / "compare.csv")
    write_cells_csv(grid, records, out / "cells.csv")
    summary_rows = [{"labels": r["labels"], "finished": r["finished"], "cells": r["cells"],
                     "stats": {k: vars(s) for k, s in r["stats"].items()}, "best": r["best"]} for r in rows]
    atomic_write_json(out / "compare.json", {"grid": str(grid.path) if grid.path else None, "records": records,
                                             "rows": summary_rows})
    written = {"markdown": out / "compare.md", "csv": out / "compare.csv", "cells_csv": out / "cells.csv",
               "json": out / "compare.json", "plots": plot_paths, "table": markdown_table(grid, rows),
               "rows": rows, "records": records}
    if report is not None:
        report = Path(report)
        # a report lives in docs/ and is committed; run folders are not: it gets its own copy of the
        # overview plot (the per-column bars stay in the run folder)
        shown = []
        overview = next((p for p in plot_paths if p.name == "overview.png"), None)
        if overview is not None:
            report.parent.mkdir(parents=True, exist_ok=True)
            shown = [report.with_name(f"{report.stem}_overview.png")]
            shutil.copyfile(overview, shown[0])
        atomic_write_text(report, markdown_report(grid, rows, records, shown, report.parent))
        # the rows beside the report: what docs/results.md's {{grid ...}} placeholders read (magclip.results_doc)
        atomic_write_json(report.with_suffix(".json"), {"grid": str(grid.path) if grid.path else None,
                                                        "rows": summary_rows})
        written["report"] = report
    return written


__all__ = [
    "Cell",
    "Column",
    "Grid",
    "GridError",
    "collect",
    "format_value",
    "grid_commands",
    "load_grid",
    "lookup",
    "markdown_table",
    "ran_log",
    "run_grid",
    "summarize",
    "unresolved_columns",
    "validate_cells",
    "write_report",
]
