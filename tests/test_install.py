"""A real install: build the wheel, install it into a fresh venv, run the installed main job from a
folder outside the checkout (embedded data, a few steps), and load its checkpoint there.

The venv reaches this machine's already-installed dependencies (torch, open_clip, ...) through a
path file, not `--system-site-packages`: the checkout's editable install registers an import hook
in the system site-packages that would shadow the wheel. The test asserts that magclip is imported
from the venv.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"  # a clean copy: an in-tree build/ folder could carry stale modules into the wheel
    shutil.copytree(ROOT / "magclip", source / "magclip", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheels = tmp / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(wheels.glob("magclip-*.whl"))
    env_dir = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # dependencies from this interpreter's site-packages, appended after the venv's own
    (Path(purelib) / "deps.pth").write_text("".join(p + "\n" for p in site.getsitepackages()))
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
                              str(wheel)], capture_output=True, text=True, timeout=300)
    if install.returncode != 0 and "no such option: --python" in install.stderr:
        pytest.skip("pip too old for --python")
    assert install.returncode == 0, install.stderr[-3000:]
    return env_dir


def test_wheel_install_runs_the_main_job_from_any_folder(venv, tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update({"MAGCLIP_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"})
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import magclip; print(magclip.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(venv), f"magclip came from {where.stdout} instead of the venv"

    run = subprocess.run([str(venv / "bin" / "magclip-train-clip"), "name=wheel", "train.max_steps=3",
                          "data.synthetic.num_train=96", "data.synthetic.num_val=32", "train.batch_size=16",
                          "data.workers=0", "train.log_every=1"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| val | image→text |" in run.stdout
    results = json.loads((work / "runs" / "wheel" / "results.json").read_text())
    assert results["steps"] == 3 and results["model"] == "tiny-resnet"

    # the installed package finds its model configs and loads the checkpoint the run wrote
    check = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import sys; from magclip.evaluation.checkpoint import load_checkpoint; "
                            "m = load_checkpoint(sys.argv[1]); print(m.model_name, m.scorers['i2t'].mode)",
                            str(work / "runs" / "wheel")], cwd=work, env=env, capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.split() == ["tiny-resnet", "cosine"]


GRID = """name: one
output_dir: grid
launcher: clip
base: base.yaml
overrides: {train.max_steps: 2, data.synthetic.num_train: 96, data.synthetic.num_val: 32, train.batch_size: 16,
            data.workers: 0}
axes:
  loss: [{name: qnorm, set: {loss.i2t: qnorm, loss.t2i: qnorm}}]
columns: [{key: val.image_to_text_R@1, label: "i→t R@1"}]
"""


def test_the_installed_compare_command_runs_a_grid_outside_the_checkout(venv, tmp_path):
    """The grid runner once launched `train/clip.py` by a path relative to the working folder."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "one.yaml").write_text(GRID)
    (work / "base.yaml").write_text("model: {name: tiny-resnet}\n")  # a user's own recipe: no checkout needed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update({"MAGCLIP_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"})
    run = subprocess.run([str(venv / "bin" / "magclip-compare"), "--grid", "one.yaml"], cwd=work, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    results = json.loads((work / "grid" / "runs" / "loss=qnorm" / "results.json").read_text())
    assert results["steps"] == 2 and results["scorers"]["i2t"]["mode"] == "qnorm"
    assert "i→t R@1" in run.stdout and "qnorm" in run.stdout  # the report table
