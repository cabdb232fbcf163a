"""docs/results.md is rendered, never typed: placeholders resolve from JSON files, bad ones name what
is missing, and the committed document equals the rendering of the committed template."""

import json
from pathlib import Path

import pytest

from magclip.experiments.results_page import RenderError, render

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path) -> None:
    (tmp_path / "eval.json").write_text(json.dumps({"scifact": {"modes": {"cosine": {"ndcg@10": 0.64512}}},
                                                    "bins": [{"d": -0.5}, {"d": 0.25}], "pick": "qnorm"}))
    (tmp_path / "grid.json").write_text(json.dumps({"rows": [
        {"labels": {"loss": "cosine"}, "stats": {"metrics.scifact/ndcg@10": {"mean": 0.8, "std": 0.01, "n": 2}}},
        {"labels": {"loss": "dot"}, "stats": {"metrics.scifact/ndcg@10": {"mean": 0.7, "std": None, "n": 1}}},
        {"labels": {"loss": "qnorm"}, "stats": {"metrics.scifact/ndcg@10": {"mean": 0.83, "std": 0.02, "n": 2}}}]}))
    (tmp_path / "table.md").write_text("| a |\n|---|\n| 1 |\n")
    (tmp_path / "report.md").write_text("## grid\ntext #not-a-heading\n### sub\n")


def test_placeholders_resolve(tmp_path):
    write(tmp_path)
    text = ("cosine {{num eval.json scifact.modes.cosine.ndcg@10 x100}}, grid {{grid grid.json loss=cosine "
            "metrics.scifact/ndcg@10 x100 .1 pm}} vs {{grid grid.json loss=dot metrics.scifact/ndcg@10 x100 .1 pm}}\n"
            "{{include table.md}}\nplain {braces} stay; bin {{num eval.json bins.1.d .3}} {{text eval.json pick}}")
    assert render(text, tmp_path) == ("cosine 64.51, grid 80.0 ± 1.0 vs 70.0\n| a |\n|---|\n| 1 |\n"
                                      "plain {braces} stay; bin 0.250 qnorm")


def test_signed_numbers_carry_their_sign_and_a_true_minus(tmp_path):
    write(tmp_path)
    assert render("{{num eval.json bins.0.d x100 .1 signed}} / {{num eval.json bins.1.d .2 signed}}", tmp_path) == \
        "−50.0 / +0.25"


def test_include_demotes_headings(tmp_path):
    write(tmp_path)
    assert render("{{include report.md +1}}", tmp_path) == "### grid\ntext #not-a-heading\n#### sub"


def test_diff_from_summary_rows_is_computed_unpaired(tmp_path):
    """A report JSON without precomputed comparisons (older grids): the difference of two rows with
    Welch's interval from their mean/std/n, the verdict, the MDE and the seeds a decision needs."""
    from magclip.experiments import stats

    write(tmp_path)
    expected = stats.compare_summary({"mean": 0.8, "std": 0.01, "n": 2}, {"mean": 0.83, "std": 0.02, "n": 2})
    key = "loss=qnorm:loss=cosine metrics.scifact/ndcg@10 x100 .1"
    line = render(f"{{{{diff grid.json {key}}}}}", tmp_path)
    assert line.startswith(f"+3.0 points, 95 % CI [{100 * expected.seed_low:.1f}, {100 * expected.seed_high:.1f}]"
                           .replace("-", "−") + " (2 seeds, unpaired) → no difference detected (MDE at 80 % power")
    assert f"would need {expected.seeds_for_diff} seeds" in line
    fields = {f: render(f"{{{{diff grid.json {key} {f}}}}}", tmp_path) for f in ("diff", "verdict", "mde", "seeds", "n")}
    assert fields == {"diff": "+3.0", "verdict": stats.NO_DIFFERENCE, "mde": f"{100 * expected.mde:.1f}",
                      "seeds": str(expected.seeds_for_diff), "n": "2"}
    assert render(f"{{{{diff grid.json {key} seeds@0.03}}}}", tmp_path) == str(expected.seeds_for_diff)
    assert render("{{diff grid.json loss=dot:loss=cosine metrics.scifact/ndcg@10 verdict}}", tmp_path) == stats.ONE_SEED
    # lower is better: the same difference is "worse" when decided; here still undecided
    assert render(f"{{{{diff grid.json {key} min verdict}}}}", tmp_path) == stats.NO_DIFFERENCE


def test_diff_against_a_row_of_another_grid_pairs_by_seed(tmp_path):
    """`ROW:OTHER.json@BASE`: the same recipe under another loss, paired seed by seed from both files' cells
    (a seed missing from either side is left out), equal to stats.compare on the per-seed differences."""
    from magclip.experiments import stats

    def grid(name: str, values: dict[str, list[float]]) -> None:
        cells = [{"cell": f"loss={loss},seed={s}", "loss": loss, "seed": str(s), "finished": True, "stale": False,
                  "values": {"val.R@1": v}} for loss, vs in values.items() for s, v in enumerate(vs)]
        rows = [{"labels": {"loss": loss}, "stats": {"val.R@1": {"mean": sum(vs) / len(vs), "std": 0.0, "n": len(vs)}}}
                for loss, vs in values.items()]
        (tmp_path / name).write_text(json.dumps({"rows": rows, "cells": cells}))

    grid("siglip.json", {"cosine": [0.30, 0.28, 0.33, 0.31], "qnorm": [0.25, 0.27, 0.26, 0.24]})
    grid("softmax.json", {"cosine": [0.26, 0.25, 0.27], "qnorm": [0.27, 0.26, 0.28]})
    expected = stats.compare([0.30 - 0.26, 0.28 - 0.25, 0.33 - 0.27])
    from magclip.experiments.report import interval

    key = "loss=cosine:softmax.json@loss=cosine val.R@1 x100 .2"
    assert render(f"{{{{diff siglip.json {key} ci}}}} {{{{diff siglip.json {key} n}}}}", tmp_path) == \
        f"{interval(expected.seed_low, expected.seed_high, 100, 2)} 3"
    assert render(f"{{{{diff siglip.json {key} diff}}}}", tmp_path) == f"+{100 * expected.diff:.2f}"
    with pytest.raises(RenderError, match="nope.json: no such file"):
        render("{{diff siglip.json loss=cosine:nope.json@loss=cosine val.R@1}}", tmp_path)


@pytest.mark.parametrize("bad, message", [
    ("{{diff grid.json loss=qnorm metrics.scifact/ndcg@10}}", "must be ROW:BASE"),
    ("{{diff grid.json loss=qnorm:loss=cosine metrics.scifact/ndcg@10 pm}}", "unknown option"),
    ("{{num missing.json a}}", "missing.json: no such file"),
    ("{{num eval.json scifact.modes.dot.ndcg@10}}", "not a number"),
    ("{{grid grid.json loss=mixed metrics.scifact/ndcg@10}}", "no row 'loss=mixed'"),
    ("{{grid grid.json loss=cosine metrics.med/ndcg@10}}", "no number for column"),
    ("{{num eval.json scifact.modes.cosine.ndcg@10 y3}}", "unknown option"),
    ("{{include nope.md}}", "no such file"),
    ("{{include table.md 2}}", "not \\+1..\\+5"),
    ("{{text eval.json scifact.modes}}", "not a word"),
    ("{{frobnicate}}", "cannot read placeholder"),
])
def test_bad_placeholders_name_the_problem(tmp_path, bad, message):
    write(tmp_path)
    with pytest.raises(RenderError, match=message):
        render(bad, tmp_path)


def test_committed_results_doc_is_the_rendered_template():
    template = ROOT / "docs" / "results.template.md"
    if not template.is_file():
        pytest.skip("no docs/results.template.md in this checkout")
    assert (ROOT / "docs" / "results.md").read_text() == render(template.read_text(), ROOT), \
        "docs/results.md differs from its template's rendering: run python tools/render_results.py"
