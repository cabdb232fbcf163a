"""The compare runner: grid parsing, commands, restart flags, the table maths on known numbers, a
generic (custom) launcher, the shipped grids, and a real 2x2 grid of very short CLIP runs that is
killed mid-way and finished by a second invocation.

The table has one row per setting of the non-aggregated axes (here: per loss setting), with the
seeds aggregated into mean ± sample std; cells.csv has one row per cell.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from magclip.config import load_config
from magclip.experiments.collect import lookup, summarize
from magclip.experiments.grid import GridError, format_value, load_grid, validate_cells
from magclip.experiments.report import write_report
from magclip.experiments.runner import grid_commands, ran_log, run_grid

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "eval" / "compare.py"


def _cli():
    spec = importlib.util.spec_from_file_location("eval_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


LOSSES = [{"name": "cosine", "set": {"loss.i2t": "cosine", "loss.t2i": "cosine"}},
          {"name": "i2t_qnorm", "set": {"loss.i2t": "qnorm", "loss.t2i": None}}]


def grid_dict(out: Path, **extra) -> dict:
    return {"name": "tiny", "output_dir": str(out), "base": "configs/clip/default.yaml",
            "axes": {"loss": LOSSES, "seed": [0, 1]}, "scale": 100,
            "columns": ["val.image_to_text_R@1", {"key": "val.text_to_image_median_rank", "better": "min", "scale": 1},
                        {"key": "wall_time_s", "better": "none", "scale": 1}], **extra}


def fake_results(cell, i2t_r1: float, t2i_rank: float) -> None:
    path = cell.run_dir / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metrics": {"image_to_text_R@1": i2t_r1, "text_to_image_median_rank": t2i_rank},
                                "eval_sets": {}, "wall_time_s": 1.0}))


# ----------------------------------------------------------------------------- grid spec


def test_cells_names_order_and_overrides(tmp_path):
    grid = load_grid(grid_dict(tmp_path, overrides={"train.epochs": 1, "data.workers": 0}))
    cells = grid.cells()
    # seeds outermost: every setting's seed 0 runs before any seed 1
    assert [c.name for c in cells] == ["loss=cosine,seed=0", "loss=i2t_qnorm,seed=0",
                                       "loss=cosine,seed=1", "loss=i2t_qnorm,seed=1"]
    assert cells[1].overrides == ["train.epochs=1", "data.workers=0", "loss.i2t=qnorm", "loss.t2i=null", "train.seed=0"]
    assert cells[1].run_dir == tmp_path / "runs" / "loss=i2t_qnorm,seed=0"
    cfg = load_config(ROOT / cells[1].base, [*cells[1].overrides, f"name={cells[1].name}"])
    assert (cfg.loss.i2t, cfg.loss.t2i, cfg.train.seed, cfg.name) == ("qnorm", None, 0, "loss=i2t_qnorm,seed=0")
    assert grid.aggregate == ["seed"] and [a.name for a in grid.table_axes] == ["loss"]


def test_axis_forms_and_base_switch(tmp_path):
    grid = load_grid(grid_dict(tmp_path, axes={
        "data": [{"name": "synthetic"}, {"name": "emoji", "base": "configs/clip/emoji.yaml"}],
        "lr": {"key": "train.lr", "values": [0.001, 0.002]},
        "train.epochs": [1, 2]}, aggregate=[]))
    cells = grid.cells()
    assert len(cells) == 8 and cells[0].name == "data=synthetic,lr=0.001,train.epochs=1"
    assert cells[-1].base == "configs/clip/emoji.yaml" and cells[-1].overrides == ["train.lr=0.002", "train.epochs=2"]


@pytest.mark.parametrize("change, message", [
    ({"colums": []}, "unknown config key 'colums'"),
    ({"axes": {"loss": LOSSES, "lr": [0.1, 0.2]}}, "no key to set"),
    ({"aggregate": ["seeds"]}, "not an axis"),
    ({"columns": ["zeroshot:id.R@1"]}, "reads results 'zeroshot'"),
    ({"axes": {"loss": [{"name": "a b", "set": {}}]}}, "must match"),
    ({"axes": {"loss": [LOSSES[0], LOSSES[0]]}}, "repeats"),
    ({"columns": [{"key": "x", "better": "high"}]}, "better='high'"),
    ({"launcher": "slurm"}, "launcher name 'slurm'"),
    # the run configs' schema machinery (config.from_dict) names nested keys and types alike
    ({"columns": [{"key": "x", "lable": "y"}]}, r"unknown config key 'columns\[x\].lable'"),
    ({"axes": {"loss": [{"name": "a", "sett": {}}]}}, r"unknown config key 'axes.loss\[a\].sett'"),
    ({"scale": "large"}, "config key 'scale' must be float"),
    ({"output_dir": None}, "config key 'output_dir' may not be empty"),
    ({"contrasts": [{"row": {"loss": "i2t_qnorm"}, "baseline": {"loss": "dnorm"}}]},
     "contrasts baseline: axis 'loss' has no value 'dnorm'"),
    ({"contrasts": [{"row": {"loss": "cosine"}}]}, "not a mapping of `row` and `baseline`"),
    ({"contrasts": [{"row": "cosine", "baseline": "cosine"}]}, "compares a row with itself"),
])
def test_grid_errors_name_the_key(tmp_path, change, message):
    with pytest.raises(GridError, match=message):
        load_grid(grid_dict(tmp_path, **change))


def test_bad_cell_config_fails_before_running(tmp_path):
    grid = load_grid(grid_dict(tmp_path, overrides={"train.epoch": 1}))
    with pytest.raises(GridError, match="loss=cosine,seed=0.*train.epoch"):
        validate_cells(grid)


@pytest.mark.parametrize("value", [None, True, False, 0, 3, 0.5, 1e-3, "qnorm", "null", "1e-3", "a: b", "", [1, 2]])
def test_format_value_round_trips_through_yaml(value):
    assert yaml.safe_load(format_value(value)) == value


def test_lookup_paths():
    results = {"metrics": {"image_to_text_R@1": 0.5, "scifact/ndcg@10": 0.7, "a.b": {"c": 1}}, "wall_time_s": 3}
    assert lookup(results, "val.image_to_text_R@1") == 0.5
    assert lookup(results, "metrics.scifact/ndcg@10") == 0.7
    assert lookup(results, "metrics.a.b.c") == 1
    assert lookup(results, "wall_time_s") == 3
    assert lookup(results, "val.nope") is None and lookup(results, "wall_time_s.x") is None


def test_restart_flag_resume_only_for_the_same_spec(tmp_path):
    grid = load_grid(grid_dict(tmp_path))
    cell = grid.cells()[0]
    (cell.run_dir / "checkpoints").mkdir(parents=True)
    (cell.run_dir / "checkpoints" / "latest").write_text("step_00000001\n")
    assert cell.pending_commands()[0][-1] == "overwrite=true"          # no recorded spec: start over
    cell.spec_path.parent.mkdir(parents=True)
    cell.spec_path.write_text(json.dumps(cell.spec()))
    assert cell.pending_commands()[0][-1] == "train.resume=latest"     # same spec: continue
    changed = load_grid(grid_dict(tmp_path), ["train.lr=0.01"]).cells()[0]
    assert changed.pending_commands()[0][-1] == "overwrite=true"       # other spec: start over
    assert changed.stale and not cell.stale



def test_a_base_config_edited_since_the_run_makes_the_cell_stale(tmp_path):
    """Same path, same overrides, other content: the finished run is not the recipe's any more."""
    base = tmp_path / "recipe.yaml"
    base.write_text((ROOT / "configs/clip/default.yaml").read_text())
    cell = load_grid(grid_dict(tmp_path, base=str(base))).cells()[0]
    cell.spec_path.parent.mkdir(parents=True)
    cell.spec_path.write_text(json.dumps(cell.spec()))
    assert not cell.stale
    base.write_text(base.read_text() + "\n# a comment edited: the same recipe\n")
    assert not cell.stale
    base.write_text(base.read_text().replace("lr: 0.002", "lr: 0.001", 1))              # a setting edited
    assert cell.stale
    (cell.run_dir / "checkpoints").mkdir(parents=True)
    (cell.run_dir / "checkpoints" / "latest").write_text("step_00000001\n")
    assert cell.pending_commands()[0][-1] == "overwrite=true"          # never resume into the old recipe
    # a spec recorded before digests were kept is judged on the path, overrides and commands it holds
    old = {k: v for k, v in cell.spec().items() if k != "base_sha256"}
    cell.spec_path.write_text(json.dumps(old))
    assert not cell.stale and cell.pending_commands()[0][-1] == "train.resume=latest"

def _ran(cell, cfg: dict | None = None) -> dict:
    """A finished run of the cell as its trainer leaves it: the resolved config (config.yaml) and results.json."""
    cfg = cell.resolved_config() if cfg is None else cfg
    cell.run_dir.mkdir(parents=True, exist_ok=True)
    (cell.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    fake_results(cell, 0.5, 3.0)
    return cfg


def test_staleness_judges_the_resolved_config_by_the_resume_guards_rule(tmp_path, monkeypatch):
    """A finished cell is compared on its run's config.yaml with what the current code would run: an edited
    setting is stale, naming the key and both values; a comment, an override restating a value, or a key a
    resume may change is not; --allow-stale accepts a key. The resume guard decides with the same function:
    making train.lr resumable changes both answers at once."""
    import magclip.config
    from magclip.training.checkpoints import ResumeConfigError, check_resume_config

    base = tmp_path / "recipe.yaml"
    base.write_text((ROOT / "configs/clip/default.yaml").read_text())
    cell = load_grid(grid_dict(tmp_path, base=str(base))).cells()[0]
    ran = _ran(cell)
    assert cell.finished and cell.stale_reasons() == []
    base.write_text(base.read_text() + "\n# a comment edited: the same recipe\n")
    assert cell.stale_reasons() == []
    restated = load_grid(grid_dict(tmp_path, base=str(base)), [f"train.lr={ran['train']['lr']}"]).cells()[0]
    assert restated.stale_reasons() == []                    # another spec, the same experiment
    assert load_grid(grid_dict(tmp_path, base=str(base)), ["train.log_every=3"]).cells()[0].stale_reasons() == []
    longer = load_grid(grid_dict(tmp_path, base=str(base)), ["train.max_steps=7"]).cells()[0]
    assert longer.stale_reasons() == ["train.max_steps: None when it ran, 7 now"]   # a finished run's length counts
    edited = load_grid(grid_dict(tmp_path, base=str(base)), ["train.lr=0.01"]).cells()[0]
    assert edited.stale_reasons() == [f"train.lr: {ran['train']['lr']!r} when it ran, 0.01 now"]
    allowed = load_grid(grid_dict(tmp_path, base=str(base)), ["train.lr=0.01"], allow_stale=["train.lr"]).cells()[0]
    assert allowed.stale_reasons() == []
    step = tmp_path / "step_00000001"
    step.mkdir()
    (step / "config.yaml").write_text(yaml.safe_dump(ran))
    with pytest.raises(ResumeConfigError, match="train.lr"):
        check_resume_config(edited.resolved_config(), step)
    monkeypatch.setattr(magclip.config, "RESUMABLE_KEYS", (*magclip.config.RESUMABLE_KEYS, "train.lr"))
    assert edited.stale_reasons() == []
    check_resume_config(edited.resolved_config(), step)      # one decision: both accept it now
    base.unlink()
    assert cell.stale_reasons()[0].startswith("its config no longer resolves: config file not found")


def set_code_default(monkeypatch, schema: type, name: str, value) -> None:
    """Change a config field's default as an edit of magclip/config.py would (the generated __init__'s defaults)."""
    import dataclasses

    with_default = [f.name for f in dataclasses.fields(schema)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
    defaults = list(schema.__init__.__defaults__)
    defaults[with_default.index(name)] = value
    monkeypatch.setattr(schema.__init__, "__defaults__", tuple(defaults))


# ----------------------------------------------------------------------------- table maths


def test_table_from_known_results(tmp_path):
    grid = load_grid(grid_dict(tmp_path, columns=[
        "val.image_to_text_R@1", {"key": "val.text_to_image_median_rank", "better": "min", "scale": 1, "digits": 1},
        "val.missing_metric"]))
    c0, q0, c1, _ = grid.cells()
    fake_results(c0, 0.40, 3.0)
    fake_results(c1, 0.50, 5.0)
    fake_results(q0, 0.30, 2.0)          # q1 unfinished
    written = write_report(grid)
    rows = summarize(grid)
    assert [r.labels for r in rows] == [{"loss": "cosine"}, {"loss": "i2t_qnorm"}]
    cos, qn = (r.stats for r in rows)
    assert cos["val.image_to_text_R@1"].mean == pytest.approx(0.45)
    assert cos["val.image_to_text_R@1"].std == pytest.approx(statistics.stdev([0.40, 0.50]))
    assert qn["val.image_to_text_R@1"].n == 1 and qn["val.image_to_text_R@1"].std is None
    assert [r.finished for r in rows] == [2, 1]
    assert rows[0].best["val.image_to_text_R@1"] and not rows[1].best["val.image_to_text_R@1"]
    assert rows[1].best["val.text_to_image_median_rank"]          # lower is better: 2.0 < 4.0
    table = written["table"]
    assert "| cosine | 2/2 | **45.00 ± 7.07** | 4.0 ± 1.4 | – |" in table
    assert "| i2t_qnorm | 1/2 | 30.00 | **2.0** | – |" in table
    md = (tmp_path / "compare.md").read_text()
    assert "Not finished: `loss=i2t_qnorm,seed=1`" in md and "Column `val.missing_metric` has no number" in md
    with open(tmp_path / "compare.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == 2 and float(csv_rows[0]["val i→t R@1 mean"]) == pytest.approx(45.0)
    assert csv_rows[0]["val i→t R@1 best"] == "1" and csv_rows[1]["val i→t R@1 n"] == "1"
    with open(tmp_path / "cells.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert {p.name for p in written["plots"]} >= {"overview.png", "val_i2t_Rat1.png"}
    assert all(p.stat().st_size > 1000 for p in written["plots"])


def test_cells_that_resolved_auto_precision_differently_are_named(tmp_path):
    """`train.precision: auto` is one config value on every machine, so staleness cannot see a grid resumed
    on a machine that resolves it otherwise: the report names the cells per resolved precision. A pinned
    precision (no "auto:" in the record) is the grid's own setting and is not flagged."""
    grid = load_grid(grid_dict(tmp_path))
    c0, q0, c1, q1 = grid.cells()
    def record(cell, precision: str) -> None:
        results = json.loads((cell.run_dir / "results.json").read_text())
        (cell.run_dir / "results.json").write_text(json.dumps({**results, "speed_levers": {"precision": precision}}))

    for cell in (c0, q0, c1, q1):
        fake_results(cell, 0.4, 3.0)
    record(c0, "bf16 (auto: this CPU has AVX512-BF16 and AMX)")
    record(q0, "bf16 (auto: CUDA device supports bf16)")
    record(c1, "fp32 (auto: this CPU has neither AVX512-BF16 nor AMX ...)")    # q1: no record (an older run)
    write_report(grid)
    md = (tmp_path / "compare.md").read_text()
    assert ("Trained in different precisions (`train.precision: auto` resolves per machine; pin it in the grid "
            "to compare like with like): bf16 `loss=cosine,seed=0`, `loss=i2t_qnorm,seed=0`; "
            "fp32 `loss=cosine,seed=1`.") in md
    record(c1, "fp32 (as configured)")     # pinned: the grid's own setting, which staleness judges
    write_report(grid)
    assert "Trained in different precisions" not in (tmp_path / "compare.md").read_text()


def test_report_file_carries_its_own_overview_plot(tmp_path):
    grid = load_grid(grid_dict(tmp_path / "out"))
    fake_results(grid.cells()[0], 0.4, 3.0)
    write_report(grid, report=tmp_path / "docs" / "results.md")
    text = (tmp_path / "docs" / "results.md").read_text()
    # docs are committed, run folders are not: the report links its own copy of the overview
    assert "](results_overview.png)" in text and "../out/plots" not in text and text.startswith("## tiny\n")
    assert (tmp_path / "docs" / "results_overview.png").stat().st_size > 1000
    # the rows beside the report feed docs/results.md's placeholders
    from magclip.experiments.results_page import render

    rows = json.loads((tmp_path / "docs" / "results.json").read_text())["rows"]
    label = ",".join(f"{k}={v}" for k, v in rows[0]["labels"].items())
    column = next(iter(rows[0]["stats"]))
    mean = rows[0]["stats"][column]["mean"]
    assert render(f"{{{{grid docs/results.json {label} {column} .4}}}}", tmp_path) == f"{mean:.4f}"


# ----------------------------------------------------------------------------- generic launcher


def test_custom_launcher_steps_and_result_sources(tmp_path):
    """A cell = any list of commands + the files they create; columns read several result files."""
    write = ("import json, sys; from pathlib import Path; p = Path(sys.argv[1]); p.parent.mkdir(parents=True, "
             "exist_ok=True); p.write_text(json.dumps({'metrics': {'score': float(sys.argv[2])}}))")
    grid = load_grid({
        "name": "custom", "output_dir": str(tmp_path),
        "launcher": {"name": "custom",
                     "steps": [{"command": ["python", "-c", write, "{run_dir}/train.json", "{x}.5"],
                                "creates": "{run_dir}/train.json"},
                               {"command": ["python", "-c", write, "{run_dir}/eval.json", "0.25"],
                                "creates": "{run_dir}/eval.json"}],
                     "results": {"train": "{run_dir}/train.json", "eval": "{run_dir}/eval.json"}},
        "axes": {"x": [{"name": "1"}, {"name": "2"}]},
        "aggregate": [], "columns": ["train:metrics.score", "eval:val.score"]})
    assert [c.name for c in grid.cells()] == ["x=1", "x=2"]
    cell = grid.cells()[0]
    (cell.run_dir).mkdir(parents=True)
    # the second step is pending on its own: only it runs for cell x=1
    (cell.run_dir / "train.json").write_text(json.dumps({"metrics": {"score": 9.0}}))
    out = run_grid(grid, echo=lambda s: None)
    assert out == {"ran": ["x=1", "x=2"], "failed": [], "skipped": []}
    starts = [e for e in ran_log(tmp_path) if e["event"] == "start"]
    assert [(e["cell"], e["command"][3].rsplit("/", 1)[-1]) for e in starts] == \
        [("x=1", "eval.json"), ("x=2", "train.json"), ("x=2", "eval.json")]
    rows = summarize(grid)
    assert [r.stats["train:metrics.score"].mean for r in rows] == [9.0, 2.5]
    assert [r.stats["eval:val.score"].mean for r in rows] == [0.25, 0.25]
    assert grid_commands(grid) == []                                   # all finished


def test_failing_cell_is_reported_and_the_grid_goes_on(tmp_path):
    grid = load_grid({
        "output_dir": str(tmp_path), "aggregate": [], "columns": ["a"],
        "launcher": {"name": "custom", "steps": [{"command": "python -c 'import sys; sys.exit({code})'",
                                                  "creates": "{run_dir}/r.json"}]},
        "axes": {"code": [{"name": "3"}, {"name": "0"}]}})
    out = run_grid(grid, echo=lambda s: None)
    assert out["failed"] == ["code=3", "code=0"]           # exit 0 without writing r.json is a failure too
    assert [e["rc"] for e in ran_log(tmp_path) if e["event"] == "end"] == [3, 0]


def test_parallel_cells_overlap_and_report_like_sequential_ones(tmp_path):
    """--jobs N: N cells at a time (e.g. several small runs sharing one accelerator); the outcome and
    ran.jsonl are those of a sequential run, in the grid's order."""
    write = ("import json, sys, time; from pathlib import Path; time.sleep(1.0); code = int(sys.argv[2]); "
             "p = Path(sys.argv[1]); p.parent.mkdir(parents=True, exist_ok=True); "
             "code or p.write_text(json.dumps({'a': 1.0})); sys.exit(code)")
    grid = load_grid({
        "output_dir": str(tmp_path), "aggregate": [], "columns": ["a"],
        "launcher": {"name": "custom", "steps": [{"command": ["python", "-c", write, "{run_dir}/r.json", "{code}"],
                                                  "creates": "{run_dir}/r.json"}]},
        "axes": {"code": [{"name": "0"}, {"name": "3"}, {"name": "00"}, {"name": "000"}]}})
    start = time.perf_counter()
    out = run_grid(grid, echo=lambda s: None, jobs=4)
    assert time.perf_counter() - start < 3.5            # four 1-second cells side by side, not one after another
    assert out == {"ran": ["code=0", "code=00", "code=000"], "failed": ["code=3"], "skipped": []}
    events = ran_log(tmp_path)
    assert sorted(e["cell"] for e in events if e["event"] == "end") == ["code=0", "code=00", "code=000", "code=3"]
    assert all(line.endswith("}") for line in (tmp_path / "ran.jsonl").read_text().splitlines())
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        run_grid(grid, jobs=0)


# ----------------------------------------------------------------------------- shipped grids


@pytest.mark.parametrize("name, cells, launcher", [("synthetic", 16, "clip"), ("clip_emoji", 12, "clip"),
                                                   ("clip_emoji_seeds", 20, "clip"), ("clip_emoji_gpu", 60, "clip"),
                                                   ("text_beir", 5, "text"), ("siglip_synthetic", 18, "clip"),
                                                   ("siglip_emoji", 25, "clip"), ("text_squad", 15, "text"),
                                                   ("text_squad_gpu", 15, "text")])
def test_shipped_grids_load_validate_and_print(name, cells, launcher, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = f"configs/compare/{name}.yaml"
    grid = load_grid(path, output_dir=tmp_path)
    validate_cells(grid)
    assert len(grid.cells()) == cells
    assert _cli()(["--grid", path, "--output-dir", str(tmp_path), "--print-commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    prefix = f"python -m magclip.cli.train_{launcher} --config configs/{launcher}/"
    assert len(lines) == cells and all(line.startswith(prefix) for line in lines)


# ----------------------------------------------------------------------------- end to end


def test_synthetic_grid_end_to_end_kill_and_resume(tmp_path, capsys, monkeypatch):
    """2 loss settings x 2 seeds of 2-step runs: --print-commands, --max-cells 2, a real kill -9 of the
    runner as it launches the third cell, then a re-run that runs only the two missing cells."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "grid"
    spec = grid_dict(out, env={"OMP_NUM_THREADS": "1"}, overrides={
        "model.name": "tiny-resnet", "data.synthetic.root": str(tmp_path / "synthetic"),
        "data.synthetic.num_train": 256, "data.synthetic.num_val": 100, "data.workers": 0,
        "train.max_steps": 2, "train.batch_size": 32, "train.warmup_steps": 1, "train.log_every": 1})
    grid_path = tmp_path / "grid.yaml"
    grid_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    main = _cli()

    assert main(["--grid", str(grid_path), "--print-commands"]) == 0
    commands = capsys.readouterr().out.strip().splitlines()
    assert len(commands) == 4 and all("-m magclip.cli.train_clip" in c and "overwrite=true" in c for c in commands)

    # a grid stopped after two cells
    assert main(["--grid", str(grid_path), "--max-cells", "2", "--no-plots"]) == 0
    assert [e["cell"] for e in ran_log(out) if e["event"] == "start"] == ["loss=cosine,seed=0", "loss=i2t_qnorm,seed=0"]
    assert "| cosine | 1/2 |" in (out / "compare.md").read_text()
    capsys.readouterr()
    assert main(["--grid", str(grid_path), "--print-commands"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 2

    # a real kill -9 of the runner's process group just as it launches the third cell
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--grid", str(grid_path), "--no-plots"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(ran_log(out)) < 5 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ran_log(out)[-1]["event"] == "start", "the runner never launched the third cell"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finished_before = {p.parent.name: p.stat().st_mtime_ns for p in out.glob("runs/*/results.json")}
    assert set(finished_before) == {"loss=cosine,seed=0", "loss=i2t_qnorm,seed=0"}
    # and a half-written run directory, as a trainer killed mid-run leaves it: it must be replaced
    partial = out / "runs" / "loss=i2t_qnorm,seed=1"
    partial.mkdir(parents=True)
    (partial / "config.yaml").write_text("name: killed\n")
    (partial / "metrics.jsonl").write_text('{"step": 1, "loss": 4.2}\n')
    n_log = len(ran_log(out))

    assert main(["--grid", str(grid_path)]) == 0
    rerun = [e for e in ran_log(out)[n_log:] if e["event"] == "start"]
    assert [e["cell"] for e in rerun] == ["loss=cosine,seed=1", "loss=i2t_qnorm,seed=1"]   # only the missing cells
    assert all(e["command"][-1] == "overwrite=true" for e in rerun)
    assert {p.parent.name: p.stat().st_mtime_ns for p in out.glob("runs/*/results.json")
            if p.parent.name in finished_before} == finished_before    # finished cells untouched
    assert not (partial / "metrics.jsonl").read_text().startswith('{"step": 1, "loss": 4.2}')

    # one row per loss setting, seeds aggregated; every number comes from the runs' results.json
    with open(out / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["loss"] for r in rows] == ["cosine", "i2t_qnorm"] and all(r["runs_finished"] == "2" for r in rows)
    for row in rows:
        r1 = [json.loads((out / "runs" / f"loss={row['loss']},seed={s}" / "results.json").read_text())
              ["metrics"]["image_to_text_R@1"] for s in (0, 1)]
        assert float(row["val i→t R@1 mean"]) == pytest.approx(100 * statistics.fmean(r1))
        assert float(row["val i→t R@1 std"]) == pytest.approx(100 * statistics.stdev(r1))
    assert any(r["val i→t R@1 best"] == "1" for r in rows) and all(r["wall time s best"] == "0" for r in rows)
    with open(out / "cells.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    md = (out / "compare.md").read_text()
    assert md.count("\n| cosine | 2/2 |") == 1 and md.count("\n| i2t_qnorm | 2/2 |") == 1 and "**" in md
    assert (out / "plots" / "overview.png").stat().st_size > 1000

    # a code default changed since the cells ran (train.precision, which no override sets): every finished
    # cell is stale, the report and the runner name the key with both values, nothing is re-run
    from magclip.config import ClipTrainConfig

    ran = yaml.safe_load((out / "runs" / "loss=cosine,seed=0" / "config.yaml").read_text())["train"]["precision"]
    now = "bf16" if ran != "bf16" else "fp32"
    set_code_default(monkeypatch, ClipTrainConfig, "precision", now)
    assert load_config().train.precision == now
    reason = f"train.precision: {ran!r} when it ran, {now!r} now"
    assert all(c.stale_reasons() == [reason] for c in load_grid(grid_path).cells())
    n_log = len(ran_log(out))
    capsys.readouterr()
    assert main(["--grid", str(grid_path), "--no-plots"]) == 0
    assert len(ran_log(out)) == n_log and "is stale (train.precision: " in capsys.readouterr().out
    md = (out / "compare.md").read_text()
    assert "Stale (finished, but not the experiment the grid runs now" in md and md.count(reason) == 4  # once per cell
    assert main(["--grid", str(grid_path), "--only-report", "--no-plots", "--allow-stale", "train.precision"]) == 0
    assert "Stale" not in (out / "compare.md").read_text()
