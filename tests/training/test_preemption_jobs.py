"""Preemption of whole jobs: the time limit (train.time_limit) saves and stops before its deadline, a
SIGTERM to a grid reaches its running cell, and the SLURM recipe requeues a job stopped by its warning
signal. The signal tests of one run are in test_preemption.py (whose helpers these share); the two
files split the work between the suite's workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from builders import free_port, tiny_run
from test_preemption import SCRIPT, STOPPED, assert_loadable, env, latest, train_steps, wait_for

ROOT = Path(__file__).resolve().parents[2]


# 8 steps each, 192 in all: ~25 s of ~0.125 s steps after a start of ~5 s, well past the time limit's stop (~15 s
# after the start) even on a machine twice as fast
EPOCHS = 24


def test_the_time_limit_stops_before_the_deadline_and_the_resume_completes_the_run(tmp_path):
    synth = tmp_path / "synthetic"
    out = tmp_path / "runs"
    args = tiny_run(out, synth, "limited", f"train.epochs={EPOCHS}", "train.checkpoint_every=1000", train=256)
    reference = subprocess.run([sys.executable, str(SCRIPT), *tiny_run(out, synth, "whole", f"train.epochs={EPOCHS}",
                                                                       "train.checkpoint_every=1000", train=256)],
                               env=env(tmp_path), capture_output=True, text=True, timeout=600, check=False)
    assert reference.returncode == 0, reference.stderr[-3000:]
    limit = 25.0   # it stops ~10 s (EXIT_S) + a step and a checkpoint before this
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, str(SCRIPT), *args, f"train.time_limit={limit}s"], env=env(tmp_path),
                         capture_output=True, text=True, timeout=600, check=False)
    elapsed = time.monotonic() - t0
    assert run.returncode == STOPPED, run.stderr[-3000:]
    assert elapsed < limit, f"the run ended {elapsed:.1f} s after its start, past its {limit} s limit"
    assert "time limit:" in run.stderr and "stopped on time limit after step" in run.stderr
    step = train_steps(out / "limited")[-1]
    assert 1 <= step < 8 * EPOCHS and latest(out / "limited") == f"step_{step:08d}"
    assert_loadable(out / "limited" / "checkpoints" / f"step_{step:08d}", step)
    resumed = subprocess.run([sys.executable, str(SCRIPT), *args, "train.resume=auto"], env=env(tmp_path),
                             capture_output=True, text=True, timeout=600, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    results = {n: json.loads((out / n / "results.json").read_text()) for n in ("whole", "limited")}
    assert results["limited"]["weights_sha256_by_rank"] == results["whole"]["weights_sha256_by_rank"]
    assert train_steps(out / "limited") == list(range(1, 8 * EPOCHS + 1))


def test_sigterm_to_a_grid_reaches_its_running_cell_and_the_next_invocation_continues_it(tmp_path):
    import yaml

    from magclip.experiments.runner import ran_log

    out = tmp_path / "grid"
    grid = {"name": "stop", "output_dir": str(out), "base": str(ROOT / "configs" / "clip" / "default.yaml"),
            "env": {"OMP_NUM_THREADS": "1"}, "columns": ["val.image_to_text_R@1"], "axes": {"seed": [0]},
            "overrides": {"data.synthetic.root": str(tmp_path / "synthetic"), "data.synthetic.num_train": 256,
                          "data.synthetic.num_val": 32, "data.workers": 0, "train.batch_size": 32,
                          "train.epochs": 8, "train.log_every": 1, "train.checkpoint_every": 1000}}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    command = [sys.executable, str(ROOT / "eval" / "compare.py"), "--grid", str(path), "--no-plots"]
    run_dir = out / "runs" / "seed=0"
    runner = subprocess.Popen(command, cwd=ROOT, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    wait_for(lambda: len(train_steps(run_dir)) >= 3, 240, "the cell's third step")
    os.kill(runner.pid, signal.SIGTERM)            # the runner only: it passes the signal on to its cell
    output = runner.communicate(timeout=300)[0]
    assert runner.returncode == 128 + signal.SIGTERM, output[-3000:]
    steps = train_steps(run_dir)
    assert latest(run_dir) == f"step_{steps[-1]:08d}" and steps == list(range(1, steps[-1] + 1))
    assert [e.get("rc") for e in ran_log(out) if e["event"] == "end"] == [STOPPED]
    again = subprocess.run(command, cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stdout[-3000:]
    starts = [e["command"] for e in ran_log(out) if e["event"] == "start"]
    assert starts[-1][-1] == "train.resume=latest"   # continued, not started over
    assert train_steps(run_dir) == list(range(1, json.loads((run_dir / "results.json").read_text())["steps"] + 1))


def test_the_slurm_recipe_requeues_a_job_stopped_by_its_warning_signal(tmp_path):
    """configs/slurm/multi_node.sbatch run by bash with stand-ins for srun (runs the job step here) and
    scontrol (names this host; records a requeue): SLURM's USR1 to the script stops the run at a step it
    saves, the script requeues the job, and the requeued start resumes and finishes the run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    requeued = tmp_path / "requeued.txt"
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\ncase "$1" in show) echo 127.0.0.1 ;; '
                                      f'requeue) echo "$2" >> {requeued} ;; esac\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    out = tmp_path / "runs"
    args = tiny_run(out, tmp_path / "synthetic", "slurm", "train.epochs=4", "train.checkpoint_every=1000", train=512)
    job = env(tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node0",
              SLURM_NNODES="1", SLURM_NODEID="0", SLURM_CPUS_PER_TASK="1", GPUS_PER_NODE="1",
              MASTER_PORT=str(free_port()), MAGCLIP_STOPPED_FILE=str(tmp_path / "stopped"))
    script = [str(ROOT / "configs" / "slurm" / "multi_node.sbatch"), *args]
    first = subprocess.Popen(["bash", *script], cwd=ROOT, env=job, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        wait_for(lambda: len(train_steps(out / "slurm")) >= 3, 240, "the job's third step")
        os.kill(first.pid, signal.SIGUSR1)        # --signal=B:USR1@180: to the batch script only
        output = first.communicate(timeout=300)[0]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, output[-3000:]
    assert "requeueing job 4242" in output and requeued.read_text() == "4242\n"
    steps = train_steps(out / "slurm")
    assert latest(out / "slurm") == f"step_{steps[-1]:08d}" and not (out / "slurm" / "results.json").exists()
    again = subprocess.run(["bash", *script], cwd=ROOT, env=job, capture_output=True, text=True, timeout=600,
                           check=False)
    assert again.returncode == 0 and requeued.read_text() == "4242\n", again.stdout[-3000:]
    done = json.loads((out / "slurm" / "results.json").read_text())
    assert train_steps(out / "slurm") == list(range(1, done["steps"] + 1))
