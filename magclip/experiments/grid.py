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
      - {key: metrics.scifact/len_d_plain, better: diff, scale: 1}   # no better side, but
                                         #   differences tested (verdict higher/lower)
    baseline: {loss: cosine}             # the row every other row is compared with (paired differences,
                                         # 95 % CIs, verdicts: magclip.experiments.stats); default: the
                                         # first row; `baseline: cosine` when one axis is tabulated
    contrasts: []                        # more pairs of rows compared the same way (row − baseline),
                                         # e.g. [{row: {loss: dnorm}, baseline: {loss: qnorm}}]

A value of an axis may also replace `base` (`{name: emoji, base: configs/clip/emoji.yaml}`), so a
dataset axis can switch experiments. Cell names join the axis values, `loss=cosine,seed=0`, in the
order of the axes; cells run with the aggregated axes outermost (every setting's seed 0 first, so
a half-finished grid already has a full table). The overrides of one cell are applied in order:
grid overrides, then each axis's `set`, then the runner's `name=<cell>`,
`output_dir=<output_dir>/runs` and the restart flag.

Launchers. `clip` runs `python -m magclip.cli.train_clip --config {base} {overrides} ...` (what
train/clip.py and `magclip-train-clip` run) and collects `{run_dir}/results.json`; `text` the same
with magclip.cli.train_text. A mapping adds to (or, with
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
checkpoint of the same experiment. A finished cell is stale when the experiment the grid would run
now is not the one it ran: for the clip and text launchers, when the resolved config the current
code builds from the base config and the overrides differs from the run's own config.yaml in a key
that changes the experiment -- the resume guard's rule, `magclip.config.experiment_differences`, so
an edited setting, override or code default counts, a comment or a restated value does not -- or
when the commands of its other steps changed (recorded in <output_dir>/cells/<cell>.json with the
base config's path and a digest of its settings; a custom launcher's cells are judged on that
record). A stale cell is reported with each differing key and both values, not re-run (delete its
run directory to re-run it); `--allow-stale KEY ...` accepts a known-harmless difference. Every
launch is logged in <output_dir>/ran.jsonl and its output in <output_dir>/logs/<cell>.log; a
failing cell is reported and the grid goes on.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from magclip.config import (
    ConfigError,
    experiment_differences,
    from_dict,
    load_config,
    load_text_config,
    to_dict,
)

BETTER = ("max", "min", "diff", "none")
VALUE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")   # other braces (shard patterns, code) stay as they are
AXIS_KEYS = {"seed": "train.seed"}   # plain-valued axes that need no `key:`

BUILTIN_LAUNCHERS: dict[str, dict[str, Any]] = {
    # a module of the installed package, not a script of a checkout: a grid runs from any folder
    "clip": {"module": "magclip.cli.train_clip", "config": "clip"},
    "text": {"module": "magclip.cli.train_text", "config": "text"},
}
MAIN = "main"


class GridError(ValueError):
    """A grid YAML that cannot be used; the message names the key."""


# ----------------------------------------------------------------------------- the file's schema
# Read with magclip.config.from_dict, the run configs' own machinery (unknown, missing and badly typed
# keys are named alike); the fields typed Any have several forms, each checked where it is read.


@dataclass
class GridFile:
    output_dir: str
    columns: Any                        # results paths or ColumnSpec mappings
    name: str | None = None
    description: str | None = None
    launcher: Any = None                # clip, text, or a LauncherSpec mapping
    base: str | None = None
    overrides: Any = None               # {dotted key: value} or ["key=value", ...]
    axes: dict[str, Any] = field(default_factory=dict)  # name -> values, settings, or AxisKeyed
    aggregate: Any = None               # an axis name or a list of them; default: seed, if it is an axis
    scale: float = 1.0
    env: dict[str, Any] = field(default_factory=dict)
    baseline: Any = None
    contrasts: Any = None               # [{row: {...}, baseline: {...}}, ...]: more pairs compared


@dataclass
class ColumnSpec:
    key: str
    label: str | None = None
    scale: float | None = None
    better: str = "max"
    digits: int = 2


@dataclass
class AxisKeyed:                        # `lr: {key: train.lr, values: [...]}`
    key: str
    values: Any


@dataclass
class AxisSetting:                      # `{name: qnorm, set: {...}, base: ...}`
    name: str | int | float
    set: dict[str, Any] = field(default_factory=dict)
    base: str | None = None


@dataclass
class LauncherSpec:
    name: str = "clip"
    steps: Any = None                   # a list of StepSpec mappings
    results: dict[str, str] = field(default_factory=dict)


@dataclass
class StepSpec:
    command: Any                        # a string (split like a shell) or a list of arguments
    creates: str


def _parse(schema: type, raw: Any, where: str) -> Any:
    try:
        return from_dict(schema, raw, where)
    except ConfigError as exn:
        raise GridError(str(exn)) from None


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
    schema: str | None = None     # the built-in launcher's run schema (clip, text): its resolved config is compared
    allow_stale: tuple[str, ...] = ()  # config keys whose difference is accepted as harmless (--allow-stale)

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
        """What identifies the cell's work: a finished cell with another spec is stale. The base
        config's content counts, not only its path: a recipe edited between sittings must not pass
        its old runs off as the new recipe's."""
        return {"name": self.name, "values": self.values, "base": self.base, "base_sha256": self.base_digest(),
                "overrides": self.overrides, "commands": [self.argv(s) for s in self.steps]}

    def base_digest(self) -> str | None:
        """The base config's settings as parsed (an edited comment changes nothing); None without one."""
        if not self.base:
            return None
        try:
            settings = yaml.safe_load(Path(self.base).read_text())
        except (OSError, yaml.YAMLError):
            return None
        return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()

    def recorded_spec(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.spec_path.read_text())
        except (OSError, ValueError):
            return None

    @property
    def stale(self) -> bool:
        return bool(self.stale_reasons())

    def stale_reasons(self) -> list[str]:
        """Why the cell's run is not the experiment the grid would run now, one line per reason (empty:
        current). A built-in launcher's run is judged on its resolved config (run_dir/config.yaml) against
        the one the current code resolves from the base and the overrides, by the resume guard's rule
        (`magclip.config.experiment_differences`): a changed code default counts, a comment or an
        override that restates a value does not; keys in `allow_stale` are accepted. Its other steps are
        judged on their commands. A run without a resolved config is judged on its recorded spec."""
        recorded = self.recorded_spec()
        ran = self.ran_config()
        if ran is None:
            if recorded is None:
                return []
            # a spec recorded before base digests were kept is judged on what it holds
            keys = SPEC_KEYS if "base_sha256" in recorded else SPEC_KEYS[1:]
            changed = _spec_key(recorded, keys) != _spec_key(self.spec(), keys)
            return ["its spec (base config, overrides, commands) changed since it ran"] if changed else []
        now = self.current_config()
        if isinstance(now, str):
            return [now]
        refused, _ = experiment_differences(ran, now, finished=self.finished)
        reasons = [f"{key}: {old!r} when it ran, {new!r} now" for key, (old, new) in refused.items()
                   if key not in self.allow_stale]
        if recorded is not None and self._step_commands(recorded.get("commands") or []) != \
                self._step_commands(self.spec()["commands"]):
            reasons.append("the commands of its evaluation steps changed")
        return reasons

    def _step_commands(self, commands: list[Any]) -> list[Any]:
        """The commands of the steps other than the built-in training (its command is judged on the config)."""
        return [c for step, c in zip(self.steps, commands) if not step.trainer]

    def ran_config(self) -> dict[str, Any] | None:
        """The resolved config the cell's run was trained with (its run folder's config.yaml), if any."""
        if self.schema is None:
            return None
        try:
            return yaml.safe_load((self.run_dir / "config.yaml").read_text()) or None
        except (OSError, yaml.YAMLError):
            return None

    def resolved_config(self) -> dict[str, Any]:
        """The resolved config the current code runs the cell's training with (ConfigError if it does not load)."""
        loader = load_config if self.schema == "clip" else load_text_config
        return to_dict(loader(self.base, [*self.overrides, f"name={self.name}", f"output_dir={self.runs_dir}"]))

    def current_config(self) -> dict[str, Any] | str:
        """`resolved_config`, or why it cannot be resolved (a base config since removed or broken)."""
        try:
            return self.resolved_config()
        except (ConfigError, OSError) as exn:
            return f"its config no longer resolves: {exn}"

    def restart_args(self, step: Step) -> list[str]:
        """`train.resume=latest` when a checkpoint of this very spec is there, else `overwrite=true`."""
        if not step.trainer:
            return []
        resumable = (self.run_dir / "checkpoints" / "latest").is_file() and not self.stale \
            and self.recorded_spec() is not None
        return ["train.resume=latest"] if resumable else ["overwrite=true"]

    def pending_commands(self) -> list[list[str]]:
        return [self.argv(s, self.restart_args(s)) for s in self.steps if not self.step_done(s)]


SPEC_KEYS = ("base_sha256", "base", "overrides", "commands")


def _spec_key(spec: dict[str, Any], keys: tuple[str, ...]) -> str:
    return json.dumps({k: spec.get(k) for k in keys}, sort_keys=True)


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
    baseline: dict[str, str] | None = None   # table-axis labels of the row the others are compared with
    contrasts: list[tuple[dict[str, str], dict[str, str]]] = field(default_factory=list)  # (row, baseline)
    allow_stale: list[str] = field(default_factory=list)  # config keys whose difference keeps a cell current

    @property
    def schema(self) -> str | None:
        """The run schema of a built-in launcher (clip, text); None for a custom one."""
        return BUILTIN_LAUNCHERS[self.launcher]["config"] if self.launcher in BUILTIN_LAUNCHERS else None

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
                              results_templates=self.results, schema=self.schema,
                              allow_stale=tuple(self.allow_stale)))
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


def _axis(name: str, raw: Any) -> Axis:
    if not isinstance(name, str) or not VALUE_NAME.match(name):
        raise GridError(f"axis name {name!r} must match {VALUE_NAME.pattern}")
    if isinstance(raw, dict):
        keyed = _parse(AxisKeyed, raw, f"axes.{name}.")
        if not isinstance(keyed.values, list):
            raise GridError(f"axis {name!r}: a mapping needs `key:` and a list `values:`")
        key, items = keyed.key, keyed.values
    elif isinstance(raw, list):
        key, items = AXIS_KEYS.get(name, name if "." in name else None), raw
    else:
        raise GridError(f"axis {name!r} must be a list of values or settings, or {{key:, values:}}; got {raw!r}")
    if not items:
        raise GridError(f"axis {name!r} has no values")
    values = []
    for item in items:
        if isinstance(item, dict):
            if "name" not in item:
                raise GridError(f"axis {name!r}: every setting needs a `name:` ({item!r})")
            setting = _parse(AxisSetting, {**item, "set": item.get("set") or {}}, f"axes.{name}[{item['name']}].")
            value = AxisValue(str(setting.name), setting.set, setting.base)
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
    spec = _parse(ColumnSpec, raw, f"columns[{raw['key']}].")
    col = Column(key=spec.key, label=spec.label or default_label(spec.key),
                 scale=scale if spec.scale is None else spec.scale, better=spec.better, digits=spec.digits)
    if col.better not in BETTER:
        raise GridError(f"column {col.key!r}: better={col.better!r}; allowed: {', '.join(BETTER)}")
    return col


def _launcher(raw: Any) -> tuple[str, list[Step], dict[str, str]]:
    if raw is None or isinstance(raw, str):
        raw = {"name": raw or "clip"}
    if not isinstance(raw, dict):
        raise GridError(f"launcher must be clip, text or a mapping, got {raw!r}")
    spec = _parse(LauncherSpec, {**raw, "results": raw.get("results") or {}}, "launcher.")
    name = spec.name
    steps: list[Step] = []
    results: dict[str, str] = {}
    if name in BUILTIN_LAUNCHERS:
        module = BUILTIN_LAUNCHERS[name]["module"]
        steps.append(Step(["{python}", "-m", module, "--config", "{base}", "{overrides}", "name={name}",
                           "output_dir={runs_dir}", "{restart}"], "{run_dir}/results.json", trainer=True))
        results[MAIN] = "{run_dir}/results.json"
    elif name != "custom":
        raise GridError(f"launcher name {name!r}; allowed: {', '.join(BUILTIN_LAUNCHERS)}, custom")
    for i, raw_step in enumerate(spec.steps or []):
        if not isinstance(raw_step, dict) or "command" not in raw_step or "creates" not in raw_step:
            raise GridError(f"launcher step {i} needs `command:` and `creates:` (got {raw_step!r})")
        step = _parse(StepSpec, raw_step, f"launcher.steps[{i}].")
        argv = shlex.split(step.command) if isinstance(step.command, str) else [str(x) for x in step.command]
        steps.append(Step(argv, step.creates))
    results.update(spec.results)
    if not steps:
        raise GridError("a custom launcher needs `steps:`")
    if not results:
        results[MAIN] = steps[-1].creates
    if MAIN not in results:                       # the first named file is the default source
        first = next(iter(results))
        results = {MAIN: results[first], **results}
    return name, steps, results


def load_grid(path: str | Path | dict, extra_overrides: list[str] | None = None,
              output_dir: str | Path | None = None, allow_stale: list[str] | None = None) -> Grid:
    """Read and check a grid YAML (or an equivalent dict); `extra_overrides` go to every cell; a difference
    in an `allow_stale` key keeps a finished cell current (a known-harmless change)."""
    if isinstance(path, dict):
        raw, where = path, None
    else:
        where = Path(path)
        if not where.is_file():
            raise GridError(f"grid file not found: {where}")
        raw = yaml.safe_load(where.read_text()) or {}
    if not isinstance(raw, dict):
        raise GridError("the top level of a grid must be a mapping")
    spec = _parse(GridFile, raw, "")
    launcher, steps, results = _launcher(spec.launcher)
    axes = [_axis(name, values) for name, values in spec.axes.items()]
    aggregate = spec.aggregate if spec.aggregate is not None else (["seed"] if "seed" in spec.axes else [])
    aggregate = [aggregate] if isinstance(aggregate, str) else list(aggregate or [])
    unknown = [a for a in aggregate if a not in spec.axes]
    if unknown:
        raise GridError(f"aggregate names {unknown[0]!r}, which is not an axis ({', '.join(spec.axes)})")
    columns = [_column(c, spec.scale) for c in spec.columns or []]
    if not columns:
        raise GridError("the grid needs at least one column")
    for col in columns:
        if col.source not in results:
            raise GridError(f"column {col.key!r} reads results {col.source!r}; known: {', '.join(results)}")
    if launcher in BUILTIN_LAUNCHERS and spec.base is None and not any(v.base for a in axes for v in a.values):
        raise GridError(f"launcher {launcher!r} needs `base:` (an experiment YAML)")
    grid = Grid(name=spec.name or (where.stem if where else "grid"), path=where,
                output_dir=Path(output_dir or spec.output_dir), launcher=launcher, base=spec.base,
                overrides=_overrides(spec.overrides, "overrides") + list(extra_overrides or []),
                axes=axes, aggregate=aggregate, columns=columns, steps=steps, results=results,
                env={k: str(v) for k, v in spec.env.items()}, description=spec.description, scale=spec.scale,
                allow_stale=list(allow_stale or []))
    grid.baseline = _baseline(spec.baseline, grid)
    if not isinstance(spec.contrasts or [], list):
        raise GridError(f"contrasts: {spec.contrasts!r} is not a list of {{row: ..., baseline: ...}}")
    grid.contrasts = [_contrast(c, grid) for c in spec.contrasts or []]
    grid.command = shlex.join(["python", "eval/compare.py", "--grid", where.as_posix() if where else "GRID.yaml",
                               *(["--output-dir", str(output_dir)] if output_dir else []),
                               *(extra_overrides or []), *(["--allow-stale", *allow_stale] if allow_stale else []),
                               "--only-report"])
    grid.cells()  # placeholders and names resolve
    return grid


def _baseline(raw: Any, grid: Grid, what: str = "baseline") -> dict[str, str] | None:
    """`baseline:` as {table axis: value name}; every table axis must be named (one axis: a bare name)."""
    if raw is None:
        return None
    axes = grid.table_axes
    if not isinstance(raw, dict):
        if len(axes) != 1:
            example = ", ".join(f"{a.name}: ..." for a in axes)
            raise GridError(f"{what} {raw!r}: name the row by its axes, e.g. {{{example}}}")
        raw = {axes[0].name: raw}
    chosen = {str(k): str(v) for k, v in raw.items()}
    for axis in axes:
        if axis.name not in chosen:
            raise GridError(f"{what} {raw!r} does not name axis {axis.name!r}")
        names = [v.name for v in axis.values]
        if chosen[axis.name] not in names:
            raise GridError(f"{what}: axis {axis.name!r} has no value {chosen[axis.name]!r} ({', '.join(names)})")
    extra = sorted(set(chosen) - {a.name for a in axes})
    if extra:
        raise GridError(f"{what} names {extra[0]!r}, which is not a tabulated axis "
                        f"({', '.join(a.name for a in axes) or 'none'})")
    return {a.name: chosen[a.name] for a in axes}


def _contrast(raw: Any, grid: Grid) -> tuple[dict[str, str], dict[str, str]]:
    """One `contrasts:` entry, {row: ..., baseline: ...}, each named like `baseline:`."""
    if not isinstance(raw, dict) or set(raw) != {"row", "baseline"}:
        raise GridError(f"contrasts: {raw!r} is not a mapping of `row` and `baseline`, e.g. "
                        "{row: {loss: dnorm}, baseline: {loss: qnorm}}")
    row, base = (_baseline(raw[k], grid, f"contrasts {k}") for k in ("row", "baseline"))
    if row == base:
        raise GridError(f"contrasts: {raw!r} compares a row with itself")
    return row, base


def validate_cells(grid: Grid) -> None:
    """Load every cell's experiment config in-process: a typo fails now, not hours into the grid."""
    if grid.schema is None:
        return
    for cell in grid.cells():
        try:
            cell.resolved_config()
        except Exception as e:
            raise GridError(f"cell {cell.name}: {e}") from e
