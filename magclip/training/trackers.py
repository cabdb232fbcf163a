"""Experiment trackers beside metrics.jsonl (`train.report_to`): accelerate's own tracker classes
(`accelerate.tracking`: wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio), in the
main process only. tensorboard is not among them: `MetricsLog` writes RUN/tensorboard itself.

Why not `Accelerator(log_with=...)` + `accelerator.log`: it calls the trackers in turn inside the
training step, so one failing tracker (a lost connection, a full disk, a refused name) would stop the
run and the trackers after it. Here each tracker is created as `Accelerator.init_trackers` creates it
(project name first, the run folder where the class wants a logging directory) and called on its own:
a failure while logging is one warning naming the tracker, which is then left out for the rest of
the run; metrics.jsonl stays the record. A tracker that cannot start fails the run before its first
step (the user asked for it, and can fix it now rather than after a long run).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from magclip.config import ConfigError
from magclip.io import atomic_write_json

log = logging.getLogger("magclip.training.trackers")

PROJECT = "magclip"  # the project (wandb, comet_ml, ...) / experiment (mlflow) of every run
# pip extra of each tracker (pyproject.toml), whose import name is the tracker's name
EXTRAS = {"wandb": "wandb", "mlflow": "mlflow", "comet_ml": "comet-ml", "aim": "aim", "clearml": "clearml",
          "dvclive": "dvclive", "swanlab": "swanlab", "trackio": "trackio"}
# a project set in the tracker's own environment variable wins over PROJECT (accelerate already lets
# MLFLOW_EXPERIMENT_NAME and CLEARML_PROJECT win; wandb and comet would get PROJECT explicitly)
PROJECT_ENV = {"wandb": "WANDB_PROJECT", "comet_ml": "COMET_PROJECT_NAME"}
# characters a tracker refuses in metric and parameter names, replaced by "_" (MLflow: letters,
# digits, _ - . space : / only; magclip's retrieval metrics are named like "image_to_text_R@1")
REFUSED_CHARACTERS = {"mlflow": re.compile(r"[^\w\-. :/]")}


def tracker_names(report_to: Iterable[str]) -> list[str]:
    """The accelerate trackers `train.report_to` asks for, in order, once each ("none" and tensorboard,
    which MetricsLog writes itself, left out)."""
    return [n for n in dict.fromkeys(report_to) if n not in ("none", "tensorboard")]


def check_installed(report_to: Iterable[str]) -> None:
    """A ConfigError naming the pip extra of the first tracker whose package is missing. Checked on every
    rank when a run starts (all fail alike), not when a config loads: a config may be loaded where it is
    not trained (a grid's plan)."""
    report_to = list(report_to)
    for name in tracker_names(report_to):
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        if name not in LOGGER_TYPE_TO_CLASS:  # a tracker newer than the installed accelerate
            raise ConfigError(f"train.report_to={','.join(report_to)}: this accelerate has no {name} "
                              "tracker; pip install -U accelerate")
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"train.report_to={','.join(report_to)}: the {name} tracker's package is not "
                              f"installed; pip install 'magclip[{EXTRAS[name]}]' (the {EXTRAS[name]} extra)")


def numeric_fields(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number of a metrics.jsonl record but its step, keyed as in the record; a nested mapping
    (the skipped-sample counts) by "key/sub"."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(numeric_fields(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and (prefix or key != "step"):
            out[f"{prefix}{key}"] = value
    return out


class Trackers:
    """The started trackers of a run: `log` and `finish` call each on its own (see the module docstring)."""

    def __init__(self) -> None:
        self._live: dict[str, Any] = {}  # name -> accelerate GeneralTracker, started
        self._failed: dict[str, Any] = {}  # the ones that failed to log: only finished
        self._renamed: set[tuple[str, str]] = set()

    @classmethod
    def start(cls, report_to: Iterable[str], run_dir: Path, config: dict[str, Any], resume: bool = False) -> Trackers:
        """Start every tracker `report_to` names with `config` (flat: {"train.lr": ...}) as its parameters;
        with `resume`, continue the runs recorded in RUN/trackers.json (RESUMABLE). A tracker that cannot
        start is a ConfigError naming it; the ones already started are finished."""
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        trackers = cls()
        ids = _read_ids(run_dir) if resume else {}
        for name in tracker_names(report_to):
            tracker_class = LOGGER_TYPE_TO_CLASS[name]
            project = os.environ.get(PROJECT_ENV.get(name, ""), PROJECT)
            continued = _resume_kwargs(name, ids.get(name))
            kwargs = {**_init_kwargs(name, run_dir), **continued}
            try:
                tracker = (tracker_class(project, str(run_dir), **kwargs)
                           if tracker_class.requires_logging_directory else tracker_class(project, **kwargs))
                tracker.start()
                trackers._live[name] = tracker
                if not continued:  # a continued run holds its parameters (mlflow refuses to change one)
                    tracker.store_init_configuration(trackers._keyed(name, config))
            except Exception as exn:
                trackers.finish()
                raise ConfigError(f"train.report_to: the {name} tracker could not start: "
                                  f"{type(exn).__name__}: {exn}") from exn
            log.info("tracker %s: project %s, run %s%s", name, project, run_dir.name,
                     f" (continued: {ids[name]})" if ids.get(name) and name in RESUMABLE else "")
        _write_ids(run_dir, {**ids, **{n: i for n, t in trackers._live.items() if (i := _run_id(n, t))}})
        return trackers

    @property
    def names(self) -> list[str]:
        return list(self._live)

    def log(self, values: dict[str, float], step: int) -> None:
        """`values` at `step` to every live tracker; one that fails is warned about once and left out."""
        for name, tracker in list(self._live.items()):
            try:
                tracker.log(self._keyed(name, values), step=step)
            except Exception as exn:  # noqa: BLE001 (any failure of a tracker's client: training goes on)
                self._failed[name] = self._live.pop(name)  # not logged to again: a broken client may fail
                # (or wait out a timeout) on every call
                log.warning("tracker %s failed at step %d and is off for the rest of the run (metrics.jsonl "
                            "keeps every record): %s: %s", name, step, type(exn).__name__, exn)

    def finish(self) -> None:
        """End every tracker's run (wandb syncs, mlflow marks it finished and leaves no active run behind
        in this process), a failed one's too; a failure here is a warning (a failed tracker's: a debug
        line, it was warned about). Called in this thread: mlflow keeps its active run per thread."""
        for trackers, level in ((self._live, logging.WARNING), (self._failed, logging.DEBUG)):
            for name, tracker in list(trackers.items()):
                del trackers[name]
                try:
                    tracker.finish()
                except Exception as exn:  # noqa: BLE001 (the run is done; metrics.jsonl holds it)
                    log.log(level, "tracker %s did not finish cleanly: %s: %s", name, type(exn).__name__, exn)

    def _keyed(self, name: str, values: dict[str, Any]) -> dict[str, Any]:
        """`values` with the names this tracker accepts; each renamed key is logged once."""
        refused = REFUSED_CHARACTERS.get(name)
        if refused is None:
            return values
        out = {}
        for key, value in values.items():
            new = refused.sub("_", key)
            if new != key and (name, key) not in self._renamed:
                self._renamed.add((name, key))
                log.info("tracker %s: %r is logged as %r (a character it refuses)", name, key, new)
            out[new] = value
        return out


def _init_kwargs(name: str, run_dir: Path) -> dict[str, Any]:
    """What magclip passes beyond accelerate's defaults: the run's name, and wandb's files in the run
    folder unless WANDB_DIR says otherwise. Other trackers get accelerate's defaults, configured by
    their own environment variables."""
    if name == "wandb":
        return {"name": run_dir.name, **({} if "WANDB_DIR" in os.environ else {"dir": str(run_dir)})}
    if name == "mlflow":
        return {"run_name": run_dir.name}
    return {}



# ---------------------------------------------------------------------------- continuing a tracker's run
# A resumed run (a requeued job) logs into the tracker run it started, where the tracker allows it:
# wandb (`id` + resume="allow"; its steps must increase, so the steps between the checkpoint and the
# kill keep the values first logged, and the re-run values of those steps are dropped by wandb) and
# mlflow (the run id; a metric's history then holds both values of a re-run step). Others start a new
# run on every resume (README). metrics.jsonl and tensorboard hold each step once in every case.
RESUMABLE = ("wandb", "mlflow")
IDS_FILE = "trackers.json"


def _run_id(name: str, tracker: Any) -> str | None:
    """The id of the run a started tracker logs into, for the trackers a resume can continue."""
    try:
        if name == "wandb":
            return tracker.run.id
        if name == "mlflow":
            return tracker.active_run.info.run_id
    except AttributeError:
        return None
    return None


def _resume_kwargs(name: str, run_id: str | None) -> dict[str, Any]:
    if run_id is None:
        return {}
    if name == "wandb":
        return {"id": run_id, "resume": "allow"}
    if name == "mlflow":
        return {"run_id": run_id}
    return {}


def _read_ids(run_dir: Path) -> dict[str, str]:
    try:
        ids = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


def _write_ids(run_dir: Path, ids: dict[str, str]) -> None:
    if ids:
        atomic_write_json(run_dir / IDS_FILE, ids)
