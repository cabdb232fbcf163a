"""A benchmark suite: one checkpoint evaluated on a list of sets from one YAML file, as CLIP_benchmark's
dataset lists and DataComp's evaluation suite are run.

    # configs/suites/clip_benchmark.yaml
    root: ~/data/clip_benchmark          # relative paths start here (default: the suite file's folder; --root)
    sets:
      mscoco_5k:   {path: wds_mscoco_captions}                # a CLIP_benchmark folder: its dataset_type says the task
      flickr30k:   {path: wds_flickr30k, split: test}
      coco_karpathy: {path: coco/dataset_coco.json, images: coco}   # a Karpathy split file over its images
      coco_val:    {path: coco/annotations/captions_val2014.json, images: coco/val2014}  # COCO's own caption file
      emoji:       {path: emoji/id_novel-000000.tar, caption_key: "json:captions", matching: caption}
      cifar10:     {path: wds_vtab-cifar10}                   # classification: classnames.txt + templates
      pets:        {path: pets/test, classes: en_classnames.json, templates: [en_zeroshot_classification_templates.json]}

An entry: `path` (required); `task` (retrieval, classification, both; default the set's own, as
`eval/zeroshot.py` decides it), `split`, `matching` (image / caption), `caption_key`, `images`, `classes`,
`templates` (a list), `class_set`, `class_name_field`, `class_key_field`, `class_group_field`, `label_field`
(as eval/zeroshot.py's options), `main_metric` (the table's `main`, below); `synthetic:val` is the embedded
synthetic scenes' validation shards. Every set is read and scored as `eval/zeroshot.py --data` reads and
scores it (magclip.data.eval_sets, magclip.evaluation.zeroshot); each set's results go to
`OUT/sets/<name>.json` with their per-query outcomes beside it (`.ranks.npz`: each image's and each
caption's rank; `.queries.npz`: each image's top-k hits, or a multilabel set's AP per class), then
`OUT/suite.md` and `OUT/suite.csv`: a row per set and the suite's mean. `main` is DataComp's per-set
number: the mean of the two R@1 for retrieval, top-1 accuracy for classification (mean average
precision for a multilabel set; the mean of the two tasks' for a set scored for both), unless the entry's
`main_metric` names another (DataComp's tasklist.yml scores four sets by mean per-class recall).

A finished set (its JSON, for the same model, scorers and entry) is not evaluated again, so a killed suite
continues where it stopped. With `cosine_too` every set is also scored in cosine as CLIP_benchmark scores
every model (`also.cosine` in each set's JSON, rows `<set> (cosine)` in the table), from the same features.
Two suites compare set by set and query by query on `suite_outcomes` (magclip.experiments.paired.compare_suites).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from magclip.config import ConfigError, from_dict, read_yaml_mapping
from magclip.data.eval_sets import SYNTHETIC_PREFIX, EvalSet, SetInputs, eval_set_inputs, resolve_eval_set
from magclip.io import atomic_write_json, atomic_write_text
from magclip.metrics.ranks import (
    DIRECTIONS,
    load_query_values,
    load_ranks,
    queries_path,
    ranks_path,
    write_results_with_outcomes,
)

log = logging.getLogger("magclip.evaluation.suite")

SETS_DIR = "sets"
RECALL_KS = (1, 5, 10)
COLUMNS = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "top1", "top5",
           "mean_per_class_recall", "mAP", "main")
# what `main` may be (an entry's main_metric), and the task each needs; DataComp's tasklist.yml names the same
MAIN_METRICS = {"mean_R@1": "retrieval", "top1": "classification", "top5": "classification",
                "mean_per_class_recall": "classification", "mAP": "multilabel"}


@dataclass
class SuiteEntry:
    path: str
    task: str | None = None
    split: str | None = None
    matching: str | None = None
    caption_key: str | None = None
    images: str | None = None
    classes: str | None = None
    templates: list[str] = field(default_factory=list)
    class_set: str | None = None
    class_name_field: str = "name"
    class_key_field: str | None = None
    class_group_field: str | None = None
    label_field: str | None = None
    main_metric: str | None = None  # MAIN_METRICS; None: mean_R@1, top1 or mAP by the set's task


def _check_main_metric(name: str, entry: SuiteEntry, es: EvalSet, tasks: Sequence[str], where: str) -> None:
    """An entry's main_metric is one the set will have."""
    if entry.main_metric is None:
        return
    kind = "multilabel" if es.multilabel else "classification"
    have = {"retrieval"} & set(tasks) | ({kind} if "classification" in tasks else set())
    if MAIN_METRICS[entry.main_metric] not in have:
        raise ConfigError(f"{where}: main_metric {entry.main_metric} needs a {MAIN_METRICS[entry.main_metric]} set; "
                          f"{name} is scored for {' and '.join(sorted(have))}")


@dataclass
class SuiteFile:
    sets: dict[str, Any]
    root: str | None = None


@dataclass
class Suite:
    source: Path
    root: Path
    sets: dict[str, SuiteEntry]

    def resolve(self, name: str) -> EvalSet:
        """The entry's set, recognised and checked (an error names the suite file and the entry)."""
        entry = self.sets[name]
        where = f"{self.source}: set {name}"
        return resolve_eval_set(name, str(self.path(entry.path)), split=entry.split, matching=entry.matching,
                                caption_key=entry.caption_key,
                                images=str(self.path(entry.images)) if entry.images else None, where=where)

    def path(self, value: str) -> Path | str:
        if value.startswith(SYNTHETIC_PREFIX) or "::" in value or "://" in value:
            return value
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.root / path


def load_suite(path: str | Path, root: str | Path | None = None, only: Sequence[str] = ()) -> Suite:
    """Read a suite file (every key checked, as run configs are); `root` replaces its `root:`; `only` keeps
    those sets (an unknown name is an error listing the suite's)."""
    path = Path(path)
    spec = from_dict(SuiteFile, read_yaml_mapping(path, "suite file"), "")
    sets = {name: from_dict(SuiteEntry, entry, f"sets.{name}.") for name, entry in spec.sets.items()}
    if not sets:
        raise ConfigError(f"{path}: no sets")
    for name, entry in sets.items():
        if entry.main_metric is not None and entry.main_metric not in MAIN_METRICS:
            raise ConfigError(f"{path}: sets.{name}.main_metric {entry.main_metric!r}; allowed: {', '.join(MAIN_METRICS)}")
    unknown = [n for n in only if n not in sets]
    if unknown:
        raise ConfigError(f"{path}: no set {unknown[0]!r}; its sets: {', '.join(sets)}")
    if root:  # the command's --root: from where it runs
        base = Path(root).expanduser().resolve()
    elif spec.root:  # the file's root: from the file's folder
        base = (path.parent / Path(spec.root).expanduser()).resolve()
    else:
        base = path.parent.resolve()
    return Suite(path, base, {n: e for n, e in sets.items() if not only or n in only})


# ============================================================================ running


@dataclass
class PreparedSuite:
    """Every set of a suite read and checked (its layout, tasks, class list and templates): what `run_suite`
    evaluates, built before a model loads so that bad input stops the suite first."""

    suite: Suite
    sets: dict[str, tuple[EvalSet, SetInputs]]
    missing: dict[str, str]  # with skip_missing: the sets whose files are not there, and why


def prepare_suite(suite: Suite, skip_missing: bool = False) -> PreparedSuite:
    """Resolve every set of `suite` and its inputs; a missing one is an error, or with `skip_missing` is left out
    and listed."""
    sets, missing = {}, {}
    for name, entry in suite.sets.items():
        where = f"{suite.source}: set {name}"
        try:
            es = suite.resolve(name)
        except FileNotFoundError as exn:
            if not skip_missing:
                raise
            missing[name] = str(exn)
            continue
        sets[name] = (es, eval_set_inputs(
            name, es, task=entry.task, classes=entry.classes and str(suite.path(entry.classes)),
            templates=[_template(suite, t) for t in entry.templates], class_set=entry.class_set, where=where,
            classes_hint="classes:", name_field=entry.class_name_field, key_field=entry.class_key_field,
            group_field=entry.class_group_field))
        _check_main_metric(name, entry, es, sets[name][1].tasks, where)
    return PreparedSuite(suite, sets, missing)


def run_suite(model, prepared: PreparedSuite, out: str | Path, *, cosine_too: bool = False, overwrite: bool = False,
              batch_size: int = 256, device: str = "cpu", workers: int = 0) -> dict[str, Any]:
    """Evaluate `model` (an EvalModel) on every prepared set; writes OUT/sets/<name>.json, OUT/suite.md,
    OUT/suite.csv and OUT/suite.json; returns the summary. `overwrite`: evaluate the sets finished earlier again."""
    from magclip.evaluation.checkpoint import scorers_for_mode
    from magclip.evaluation.zeroshot import evaluate_zeroshot

    out, suite = Path(out), prepared.suite
    also = {"cosine": scorers_for_mode("cosine")} if cosine_too else None
    records: dict[str, dict[str, Any]] = {}
    for name, (es, inputs) in prepared.sets.items():
        entry = suite.sets[name]
        target = out / SETS_DIR / f"{name}.json"
        identity = _identity(model, entry, cosine_too)
        done = None if overwrite else _finished(target, identity)
        if done is not None:
            log.info("%s: finished earlier (%s), not evaluated again", name, target)
            records[name] = done
            continue
        log.info("suite set %s (%s, %s)", name, es.layout, "/".join(inputs.tasks))
        result = evaluate_zeroshot(model, {name: es}, tasks={name: inputs.tasks}, classes={name: inputs.classes},
                                   templates={name: inputs.templates}, label_field=entry.label_field,
                                   batch_size=batch_size, device=device, workers=workers, also_score=also)
        result["suite_entry"] = identity
        write_results_with_outcomes(target, result)
        records[name] = result
    rows = suite_rows(records, {name: suite.sets[name].main_metric for name in records})
    summary = {"suite": str(suite.source), "root": str(suite.root), "model": model.model_name,
               "checkpoint": model.source.get("checkpoint"), "pretrained": model.source.get("pretrained"),
               "scorers": {d: s.to_dict() for d, s in model.scorers.items()}, "scorers_from": model.source.get("scorers_from"),
               "sets": {name: str(out / SETS_DIR / f"{name}.json") for name in records},
               "missing": prepared.missing, "rows": rows}
    atomic_write_json(out / "suite.json", summary)
    atomic_write_text(out / "suite.md", suite_markdown(summary))
    atomic_write_text(out / "suite.csv", suite_csv(rows))
    return summary


def _template(suite: Suite, value: str) -> str:
    """A template file relative to the suite's root; a preset or a template string as it is."""
    path = suite.path(value)
    return str(path) if "{" not in value and path.is_file() else value


def _identity(model, entry: SuiteEntry, cosine_too: bool) -> dict[str, Any]:
    """What makes a finished set's JSON reusable: the entry as it reads the set (its main_metric only picks a
    column of the table), the model and its scorers."""
    read = {k: v for k, v in asdict(entry).items() if k != "main_metric"}
    return {"entry": read, "checkpoint": model.source.get("checkpoint"),
            "pretrained": model.source.get("pretrained"), "model": model.model_name,
            "scorers": {d: s.to_dict() for d, s in model.scorers.items()}, "cosine_too": cosine_too}


def _finished(target: Path, identity: Mapping[str, Any]) -> dict[str, Any] | None:
    if not target.is_file():
        return None
    try:
        record = json.loads(target.read_text())
    except json.JSONDecodeError:
        return None
    return record if record.get("suite_entry") == json.loads(json.dumps(identity)) else None


# ============================================================================ the table


def suite_rows(records: Mapping[str, Mapping[str, Any]],
               main_metrics: Mapping[str, str | None] | None = None) -> list[dict[str, Any]]:
    """One row per set (and per set in cosine where scored), then the suite's mean of every column.
    `main_metrics`: {set: the entry's main_metric}, where it names one."""
    rows = []
    for name, record in records.items():
        entry, chosen_main = record["sets"][name], (main_metrics or {}).get(name)
        rows.append(_row(name, entry, entry["metrics"], chosen_main))
        for label, also in (entry.get("also") or {}).items():
            rows.append(_row(f"{name} ({label})", entry, also["metrics"], chosen_main))
    for label in dict.fromkeys(r["scored"] for r in rows):  # the model's own scorer first
        chosen = [r for r in rows if r["scored"] == label]
        mean: dict[str, Any] = {"set": "mean" if label == "own" else f"mean ({label})", "scored": label,
                                "layout": "", "task": "", "matching": "", "n": len(chosen)}
        for col in COLUMNS:
            values = [r[col] for r in chosen if r.get(col) is not None]
            mean[col] = float(np.mean(values)) if values else None
        mean["main_metric"] = "mean of the rows' main"
        rows.append(mean)
    return rows


def _row(name: str, entry: Mapping[str, Any], metrics: Mapping[str, Any],
         main_metric: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"set": name, "scored": name.rpartition(" (")[2].rstrip(")") if " (" in name else "own",
                           "layout": entry.get("layout", ""), "task": "+".join(entry.get("tasks", [])),
                           "matching": entry.get("matching", "") if "retrieval" in metrics else "",
                           "n": entry.get("counts", {}).get("samples")}
    r, c = metrics.get("retrieval"), (metrics.get("classification") or {}).get("all")
    for short, prefix in (("i2t", "image_to_text"), ("t2i", "text_to_image")):
        for k in RECALL_KS:
            row[f"{short}_R@{k}"] = r.get(f"{prefix}_R@{k}") if r else None
    for key in ("top1", "top5", "mean_per_class_recall"):
        row[key] = c.get(key) if c else None
    row["mAP"] = c.get("mean_average_precision") if c else None
    row["mean_R@1"] = float(np.mean([r["image_to_text_R@1"], r["text_to_image_R@1"]])) if r else None
    defaults = [m for m in ("mean_R@1", "top1", "mAP") if row[m] is not None]
    parts = [main_metric] if main_metric else defaults  # a set scored for both tasks: the mean of the two
    row["main"] = float(np.mean([row[m] for m in parts])) if parts and row[parts[0]] is not None else None
    row["main_metric"] = "+".join(parts)
    del row["mean_R@1"]
    return row


def suite_markdown(summary: Mapping[str, Any]) -> str:
    head = (f"Suite {summary['suite']} — model {summary['model']} "
            f"({summary.get('checkpoint') or summary.get('pretrained') or 'random init'}), scorers "
            + ", ".join(f"{d}={s['mode']}" for d, s in summary["scorers"].items()))
    header = ("| set | layout | task | matching | n | i→t R@1 | i→t R@5 | i→t R@10 | t→i R@1 | t→i R@5 | t→i R@10 | "
              "top-1 | top-5 | mean per-class recall | mAP | main | main is |")
    lines = [head, "", header, "|---" * 17 + "|"]
    for row in summary["rows"]:
        cells = [row["set"], row["layout"], row["task"], row["matching"], row["n"] if row["n"] is not None else "",
                 *(_pct(row[col]) for col in COLUMNS), row.get("main_metric", "")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append("")
    lines.append("Recall and accuracy in %; main: DataComp's per-set number, named in `main is` (by default the "
                 "mean of the two R@1 for retrieval, top-1 for classification, mAP for a multilabel set); mean: over "
                 "the sets that have the column.")
    if summary.get("missing"):
        lines.append("Left out (not found): " + "; ".join(f"{n}: {why}" for n, why in summary["missing"].items()))
    return "\n".join(lines) + "\n"


def suite_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["set", "scored", "layout", "task", "matching", "n", *COLUMNS,
                                             "main_metric"])
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buf.getvalue()


def _pct(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}"


# ============================================================================ two suites, query by query


def suite_outcomes(folder: str | Path) -> dict[str, tuple[np.ndarray, str | None]]:
    """{`<set>/<metric>`: (one value per query, the queries' digest)} of a finished suite: each image's and
    caption's R@k hit (from the ranks), each image's top-k classification hit and a multilabel set's AP per
    class, in the model's own scorer."""
    folder = Path(folder)
    summary_file = folder / "suite.json"
    if not summary_file.is_file():
        raise FileNotFoundError(f"{summary_file}: not found: {folder} is not a finished suite folder")
    out: dict[str, tuple[np.ndarray, str | None]] = {}
    for name, path in json.loads(summary_file.read_text())["sets"].items():
        path = Path(path) if Path(path).is_absolute() else folder / SETS_DIR / f"{name}.json"
        where = f"sets.{name}.metrics.retrieval"
        if ranks_path(path).is_file():
            by_direction = load_ranks(ranks_path(path)).get(where, {})
            digest = by_direction.get("items")
            for direction in DIRECTIONS:
                if direction in by_direction:
                    for k in RECALL_KS:
                        out[f"{name}/{direction}_R@{k}"] = ((by_direction[direction] < k).astype(np.float64),
                                                            f"{digest}:{direction}")
        if queries_path(path).is_file():
            values = load_query_values(queries_path(path))
            for prefix in (f"sets.{name}.metrics.classification.per_sample.",
                           f"sets.{name}.metrics.classification.per_class."):  # a multilabel set's per-class AP
                for key, array in values.items():
                    if key.startswith(prefix) and not key.endswith("#items"):
                        out[f"{name}/{key[len(prefix):]}"] = (array, values.get(key + "#items"))
    return out
