"""A resume continues the same experiment or is refused: every key that changes the experiment is
compared with the checkpoint's config.yaml and named with both values, before anything is written;
the keys a resume may change are accepted and logged; `train.resume=auto` starts afresh where there
is no checkpoint; `train_loss_recent` is part of the checkpoint."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from magclip.config import RESUMABLE_KEYS, load_config, experiment_differences, to_dict
from magclip.training.checkpoints import CONFIG_FILE, ResumeConfigError
from magclip.training.clip import train_clip
from builders import copy_run_at, tiny_run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def synth_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("synthetic")


def args(out: Path, synth: Path, name: str, *extra: str) -> list[str]:
    return tiny_run(out, synth, name, *extra)


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run folder with its bytes: a refused resume must leave all of them as they were."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def qnorm_run(tmp_path_factory, synth_root) -> Path:
    """A finished qnorm/qnorm run of 3 steps (the issue's first command)."""
    out = tmp_path_factory.mktemp("runs")
    train_clip(load_config(None, args(out, synth_root, "x", "loss.i2t=qnorm", "loss.t2i=qnorm", "train.max_steps=3")))
    return out / "x"


def test_each_checkpoint_keeps_the_config_it_was_trained_with(qnorm_run):
    saved = yaml.safe_load((qnorm_run / "checkpoints" / "step_00000003" / CONFIG_FILE).read_text())
    assert saved["loss"]["i2t"] == "qnorm" and saved["train"]["max_steps"] == 3


def test_a_resume_that_changes_the_loss_is_refused_naming_every_key(qnorm_run, synth_root):
    before = snapshot(qnorm_run)
    cfg = load_config(None, args(qnorm_run.parent, synth_root, "x", "loss.i2t=cosine", "loss.t2i=dot",
                                 "train.max_steps=5", "train.lr=0.01", "train.resume=latest"))
    with pytest.raises(ResumeConfigError) as err:
        train_clip(cfg)
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("loss.i2t = 'qnorm' in the checkpoint, 'cosine' now", "loss.t2i = 'qnorm' in the checkpoint, 'dot' now",
                 "train.lr = 0.002 in the checkpoint, 0.01 now"):
        assert part in msg, msg
    assert "train.max_steps" not in msg.split("a resume may change only")[0]  # allowed, so not a difference
    assert snapshot(qnorm_run) == before  # config.yaml, checkpoints, results.json, metrics: untouched


def test_the_command_refuses_in_one_line_with_exit_2(qnorm_run, synth_root):
    before = snapshot(qnorm_run)
    proc = subprocess.run([sys.executable, str(ROOT / "train" / "clip.py"),
                           *args(qnorm_run.parent, synth_root, "x", "loss.i2t=qnorm", "loss.t2i=qnorm",
                                 "train.batch_size=16", "train.resume=latest")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train.batch_size = 32 in the checkpoint, 16 now" in errors[0], proc.stderr[-2000:]
    assert snapshot(qnorm_run) == before


def test_keys_a_resume_may_change_are_accepted_and_logged(tmp_path, synth_root, caplog):
    train_clip(load_config(None, args(tmp_path, synth_root, "part", "train.max_steps=3")))
    with caplog.at_level(logging.INFO, logger="magclip.training.checkpoints"):
        resumed = train_clip(load_config(None, args(tmp_path, synth_root, "part", "train.max_steps=6",
                                                    "train.log_every=2", "train.resume=latest")))
    assert "train.max_steps 3 -> 6 (the learning-rate schedule is recomputed" in caplog.text
    assert "train.log_every 1 -> 2" in caplog.text
    assert resumed["steps"] == 6
    state = torch.load(tmp_path / "part" / "checkpoints" / "step_00000003" / "state.pt", weights_only=True)
    assert len(state["loop"]["recent_losses"]) == 3


def test_train_loss_recent_after_a_resume_equals_the_unbroken_run(tmp_path, synth_root):
    """From the unbroken run's own step-4 checkpoint: the same weights and the same train_loss_recent."""
    whole = train_clip(load_config(None, args(tmp_path, synth_root, "whole", "train.checkpoint_every=4")))
    copy_run_at(tmp_path / "whole", tmp_path / "part", "step_00000004")
    resumed = train_clip(load_config(None, args(tmp_path, synth_root, "part", "train.checkpoint_every=4",
                                                "train.resume=latest")))
    assert resumed["weights_sha256_by_rank"] == whole["weights_sha256_by_rank"]
    assert resumed["train_loss_recent"] == whole["train_loss_recent"]


def test_wall_time_of_a_resumed_run_counts_the_time_before_the_resume(tmp_path, synth_root):
    """results.json's wall_time_s is the run's, not the last process's: the checkpoint keeps the time
    spent up to it, and the resumed process adds its own."""
    train_clip(load_config(None, args(tmp_path, synth_root, "whole", "train.checkpoint_every=4")))
    part = copy_run_at(tmp_path / "whole", tmp_path / "part", "step_00000004")
    earlier = torch.load(part / "checkpoints" / "step_00000004" / "state.pt", weights_only=True)["loop"]["wall_s"]
    resumed = train_clip(load_config(None, args(tmp_path, synth_root, "part", "train.checkpoint_every=4",
                                                "train.resume=latest")))
    assert earlier > 0
    assert resumed["wall_time_earlier_s"] == round(earlier, 2)
    assert resumed["wall_time_s"] > earlier


def test_resume_auto_starts_afresh_then_continues(tmp_path, synth_root, caplog):
    first = train_clip(load_config(None, args(tmp_path, synth_root, "auto", "train.max_steps=2", "train.resume=auto")))
    assert first["steps"] == 2
    with caplog.at_level(logging.INFO):
        second = train_clip(load_config(None, args(tmp_path, synth_root, "auto", "train.max_steps=4",
                                                   "train.resume=auto")))
    assert "resumed from" in caplog.text and "at step 2" in caplog.text
    assert second["steps"] == 4
    saved = yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())
    assert saved["train"]["resume"].endswith("step_00000002")  # the step folder it started from


def test_resume_auto_replaces_an_attempt_that_left_no_checkpoint(tmp_path, synth_root):
    run_dir = tmp_path / "crashed"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # what an attempt killed before its first checkpoint leaves
    assert train_clip(load_config(None, args(tmp_path, synth_root, "crashed", "train.max_steps=1",
                                             "train.resume=auto")))["steps"] == 1
    with pytest.raises(FileNotFoundError, match="train.resume=auto starts afresh"):
        train_clip(load_config(None, args(tmp_path, synth_root, "other", "train.resume=latest")))


def test_experiment_differences_compares_only_experiment_keys():
    base = to_dict(load_config(None, []))
    changed = to_dict(load_config(None, ["train.max_steps=9", "data.workers=4", "loss.i2t=dnorm"]))
    refused, allowed = experiment_differences(base, changed)
    assert refused == {"loss.i2t": ("cosine", "dnorm")}
    assert allowed == {"train.max_steps": (None, 9), "data.workers": ("auto", 4)}
    assert set(allowed) <= set(RESUMABLE_KEYS)
