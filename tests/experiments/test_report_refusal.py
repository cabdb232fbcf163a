"""A report never silently replaces a richer one: `eval/compare.py --only-report --report docs/x.md`
run where the grid's run folders are missing must not turn an N-run report into "0/N runs finished"."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from magclip.cli.compare import console
from magclip.experiments.grid import load_grid
from magclip.experiments.report import write_report

ROOT = Path(__file__).resolve().parents[2]


def spec(out: Path) -> dict:
    return {"name": "refuse", "output_dir": str(out), "base": "configs/clip/default.yaml",
            "axes": {"loss": [{"name": "cosine", "set": {"loss.i2t": "cosine"}},
                              {"name": "dot", "set": {"loss.i2t": "dot"}}], "seed": [0, 1]},
            "scale": 100, "columns": ["val.image_to_text_R@1"]}


def test_report_with_fewer_finished_runs_is_refused(tmp_path, monkeypatch, capsys):
    grid = load_grid(spec(tmp_path / "out"))
    for i, cell in enumerate(grid.cells()):
        cell.run_dir.mkdir(parents=True)
        (cell.run_dir / "results.json").write_text(json.dumps({"metrics": {"image_to_text_R@1": 0.3 + 0.01 * i}}))
    report = tmp_path / "docs" / "x.md"
    write_report(grid, report=report, plots=False)
    before = {p.name: p.read_bytes() for p in report.parent.iterdir()}
    assert "4/4 runs finished" in report.read_text()
    grid_path = tmp_path / "grid.yaml"
    grid_path.write_text(json.dumps(spec(tmp_path / "elsewhere")))      # JSON is YAML; no runs there

    monkeypatch.chdir(ROOT)
    argv = ["compare", "--grid", str(grid_path), "--only-report", "--report", str(report), "--no-plots"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        console()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "records 4 finished runs" in err and "--overwrite-report" in err
    assert {p.name: p.read_bytes() for p in report.parent.iterdir()} == before   # nothing replaced
    assert not (tmp_path / "elsewhere").exists()                                 # nothing written anywhere

    # the library refuses too (ReportRefused is a ValueError); without the JSON the Markdown's line counts
    with pytest.raises(ValueError, match="records 4 finished runs"):
        write_report(load_grid(grid_path), report=report, plots=False)
    report.with_suffix(".json").unlink()
    with pytest.raises(ValueError, match="records 4 finished runs"):
        write_report(load_grid(grid_path), report=report, plots=False)

    # told to: it replaces the report
    monkeypatch.setattr(sys, "argv", [*argv, "--overwrite-report"])
    console()
    assert "0/4 runs finished" in report.read_text()
