"""Preemptible training (magclip/training/preemption.py): a signal saves the step the run reached, the
time limit stops it before its deadline, a second signal exits at once, and after any sequence of
interruptions the resumed run ends with the unbroken run's weights and logs each step once. Every run
is a real `train/clip.py` process (or two, under torchrun) that the test signals from outside."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import open_clip
import pytest
import torch
from builders import free_port, tiny_run

from magclip.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "train" / "clip.py"
STOPPED = 75

_spec = importlib.util.spec_from_file_location("soak_preemption", ROOT / "tools" / "soak_preemption.py")
soak_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak_tool)


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "MAGCLIP_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}


def train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r["step"] for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if "loss" in r]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting {timeout:.0f} s for {what}")
        time.sleep(0.01)


def latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def assert_loadable(step_dir: Path, step: int) -> None:
    open_clip.create_model_and_transforms(f"local-dir:{step_dir}")
    assert torch.load(step_dir / "state.pt", map_location="cpu", weights_only=True)["loop"]["step"] == step


def test_the_stop_settings_are_checked_when_the_config_loads():
    cfg = load_config(None, ["train.time_limit=3h50m", "train.save_on_signal=TERM,usr1"])
    assert cfg.train.time_limit == "3h50m" and cfg.train.save_on_signal == ["TERM", "usr1"]
    assert load_config().train.save_on_signal == ["SIGTERM", "SIGUSR1"]
    for bad, message in (("train.save_on_signal=SIGKILL", "'SIGKILL' is not a signal a process can catch"),
                         ("train.save_on_signal=SIGFOO", "'SIGFOO'"),
                         ("train.time_limit=3x", "train.time_limit='3x': write a positive duration"),
                         ("train.time_limit=-5", "positive duration")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [bad])


def test_a_soak_of_kills_and_sigterms_ends_like_the_unbroken_run(tmp_path):
    """The main job (small) interrupted 6 times at random points by SIGKILL or SIGTERM, restarted with
    train.resume=auto each time: the unbroken run's weights, each SIGTERM saved its step (exit 75, nothing
    re-run after it), metrics.jsonl and tensorboard (its own reader) hold each step once, nothing left."""
    extra = [f"data.synthetic.root={tmp_path / 'synthetic'}", "data.synthetic.num_train=512",
             "data.synthetic.num_val=64", "train.batch_size=32", "train.epochs=3", "train.checkpoint_every=5",
             "data.workers=1", "train.warmup_steps=2"]
    report = soak_tool.soak(tmp_path / "soak", extra, interruptions=6, seed=3)
    checks = report["checks"]
    assert checks["interruptions"] >= 4 and checks["sigkill"] >= 1 and checks["sigterm"] >= 1, report["attempts"]
    assert soak_tool.passed(checks), (checks, report["attempts"])
    assert checks["weights_equal_unbroken"] and checks["tensorboard_steps_once"] and not checks["left_behind"]


def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path):
    """2 gloo processes under torchrun; SIGTERM reaches rank 1 only. Both ranks stop after the same step
    (one checkpoint of it, exit 75 each; rank 0 names the signal), and the resume ends bit-identical to
    the unbroken 2-process run."""
    synth = tmp_path / "synthetic"
    out = tmp_path / "runs"
    marker = tmp_path / "stopped.txt"

    def torchrun(name: str, *extra: str, **kwargs) -> subprocess.Popen:
        args = tiny_run(out, synth, name, "train.epochs=4", "train.checkpoint_every=1000", *extra, train=512)
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master_port", str(free_port()), str(SCRIPT), *args],
                                env=env(tmp_path, MAGCLIP_STOPPED_FILE=str(marker)), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs)

    def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
        try:
            return proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"torchrun did not end within {timeout} s: {proc.communicate()[0][-3000:]}")

    unbroken = finish(reference := torchrun("unbroken"))
    assert reference.returncode == 0, unbroken[-3000:]
    total = json.loads((out / "unbroken" / "results.json").read_text())["steps"]
    proc = torchrun("stopped")
    wait_for(lambda: len(train_steps(out / "stopped")) >= 5, 240, "the run's fifth step")
    rank1 = next(pid for pid in _children(proc.pid) if _environ(pid).get("RANK") == "1")
    os.kill(rank1, signal.SIGTERM)
    output = finish(proc)
    assert output.count("exitcode  : 75") == 2, output[-3000:]    # torchrun's report of both ranks
    stop_line = next(x for x in output.splitlines() if "stopped on SIGTERM (received by another rank)" in x)
    step = int(stop_line.split(" after step ")[1].split(",")[0])
    assert latest(out / "stopped") == f"step_{step:08d}" and 5 <= step < total
    assert_loadable(out / "stopped" / "checkpoints" / f"step_{step:08d}", step)
    state = torch.load(out / "stopped" / "checkpoints" / f"step_{step:08d}" / "state.pt", weights_only=True)
    assert len(state["loop"]["skipped_samples_by_rank"]) == 2           # both ranks took part in the save
    assert marker.read_text().startswith("stopped on SIGTERM")          # what a batch script requeues on
    assert train_steps(out / "stopped") == list(range(1, step + 1))    # not one step past the saved one

    resumed = torchrun("stopped", "train.resume=auto")
    assert finish(resumed) and resumed.returncode == 0
    results = {n: json.loads((out / n / "results.json").read_text()) for n in ("unbroken", "stopped")}
    assert results["stopped"]["weights_sha256_by_rank"] == results["unbroken"]["weights_sha256_by_rank"]
    assert train_steps(out / "stopped") == list(range(1, total + 1))


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout.split()
    return [int(p) for p in out]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)


WIDE_TEXT_MODEL = {  # ~60 M parameters in the text tower: a checkpoint of ~1 GB takes a while to write
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 16, "patch_size": None},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 1024, "heads": 8, "layers": 1},
}


def test_a_second_sigterm_during_the_save_exits_at_once_and_keeps_the_last_checkpoint(tmp_path):
    synth = tmp_path / "synthetic"
    out = tmp_path / "runs"
    model = tmp_path / "wide.json"
    model.write_text(json.dumps(WIDE_TEXT_MODEL))
    first = tiny_run(out, synth, "wide", f"model.name={model}", "train.batch_size=8", train=64)
    done = subprocess.run([sys.executable, str(SCRIPT), *first, "train.max_steps=2"], env=env(tmp_path),
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0 and latest(out / "wide") == "step_00000002", done.stderr[-3000:]

    proc = subprocess.Popen([sys.executable, str(SCRIPT), *first, "train.max_steps=40", "train.resume=auto"],
                            env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: max(train_steps(out / "wide"), default=0) >= 3, 300, "step 3 of the resumed run")
        os.kill(proc.pid, signal.SIGTERM)
        first_signal = time.monotonic()
        wait_for(lambda: any((out / "wide" / "checkpoints").glob(".tmp_step_*")), 120, "the save to begin")
        time.sleep(max(0.0, first_signal + 1.05 - time.monotonic()))  # past the repeat window of the first
        os.kill(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "second SIGTERM while stopping: exiting at once" in output
    assert latest(out / "wide") == "step_00000002"
    assert_loadable(out / "wide" / "checkpoints" / "step_00000002", 2)
    resumed = subprocess.run([sys.executable, str(SCRIPT), *first, "train.max_steps=4", "train.resume=auto"],
                             env=env(tmp_path), capture_output=True, text=True, timeout=600, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list((out / "wide" / "checkpoints").glob(".tmp_step_*"))   # the partial save was removed
