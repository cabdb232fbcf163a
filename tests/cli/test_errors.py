"""Expected failures of a command end with one line naming the key or file and a distinct exit
code, without a traceback; --debug shows the traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from builders import ROOT


def run(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["train/clip.py", "train.lr=.nan"], "error: config key 'train.lr' must be a finite number, got nan"),
    (["train/clip.py", "--config", "configs/clip/emoji.yaml", "data.train="],
     "error: override 'data.train' has an empty value"),
    (["eval/zeroshot.py", "--checkpoint", "no/such/run", "--data", "x.tar", "--out", "r.json"],
     "error: checkpoint not found: no/such/run"),
])
def test_expected_errors_are_one_line_with_exit_code_2(args, message, tmp_path):
    proc = run(*[str(ROOT / a) if a.endswith((".py", ".yaml")) else a for a in args], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]


def test_debug_shows_the_traceback(tmp_path):
    proc = run(str(ROOT / "train" / "clip.py"), "--debug", "train.lr=.nan", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr
