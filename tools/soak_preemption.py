#!/usr/bin/env python3
"""Preemption soak: a training run interrupted many times at random points, each time restarted with
`train.resume=auto` as a requeued job would be, then checked against an unbroken run.

    python tools/soak_preemption.py --interruptions 15 --out runs/soak          # the main job, 120 steps
    python tools/soak_preemption.py --interruptions 15 --out runs/soak --seed 1 --kill-share 0.5
    python tools/soak_preemption.py --out /tmp/soak -- data.synthetic.num_train=512 train.epochs=3

Each interruption is a SIGKILL (a node lost: nothing is saved) or a SIGTERM (a preemption: the run
saves the step it reached and exits 75, training/preemption.py), drawn at random, sent after a random
delay drawn up to a third of the unbroken run's time scaled by the share of its steps still to train,
counted from the moment the trainer catches SIGTERM (so some land in the start-up, most in the
training, some in the final evaluation), until the wanted number of interruptions has happened; then
the run is let finish (a start that finishes before its signal is not counted; the checks say how
many interruptions happened of how many were wanted). Then the checks of the preemption issue, as a JSON report (--out/soak.json):

- the final weights equal the unbroken run's (results.json's weights_sha256_by_rank);
- every SIGTERM exits 75, and one during training saved the step it had reached: no step record of
  metrics.jsonl lies past the latest checkpoint when it exits (a SIGTERM in the start-up of a resume
  can come before the rewind of a SIGKILLed attempt's steps: those are that kill's loss, reported as
  steps_rerun_after of the attempts);
- metrics.jsonl holds each training step once (and each evaluation record once); tensorboard's
  events, read with tensorboard's own reader, hold each step of the loss once;
- nothing is left behind: no process of the run (none outlives its trainer: a loader worker that
  does is listed, then killed), no lock, no temporary checkpoint folder.

Exit status 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = ["train.max_steps=120", "train.checkpoint_every=10"]  # the soak of the main job
STOPPED_EXIT = 75
MIN_DELAY_S = 0.2   # after the command listens (a signal before that has its default action, README)
LISTEN_TIMEOUT_S = 120
RUN_TIMEOUT_S = 3600   # one start of the run, on a loaded machine
LEFTOVER_WAIT_S = 30   # for the output once the trainer has exited


def _command(out: Path, name: str, extra: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train" / "clip.py"), f"output_dir={out}", f"name={name}",
            "train.resume=auto", *extra, "train.log_every=1"]   # a record per step: each must be there once


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def run_unbroken(out: Path, extra: list[str], threads: int = 1) -> tuple[dict[str, Any], float]:
    """The reference: the same run without interruption; its results and its wall time."""
    t0 = time.perf_counter()
    subprocess.run(_command(out, "unbroken", extra), env=_env(threads), check=True, capture_output=True, text=True)
    return json.loads((out / "unbroken" / "results.json").read_text()), time.perf_counter() - t0


def _output_and_leftovers(proc: subprocess.Popen) -> tuple[str, list[str]]:
    """The exited trainer's output, and the processes of its session that outlived it (a loader worker
    holding its stdout open): those are listed, then killed, so that the soak goes on and fails."""
    try:
        return proc.communicate(timeout=LEFTOVER_WAIT_S)[0], []
    except subprocess.TimeoutExpired:
        ps = subprocess.run(["ps", "-o", "pid=,comm=", "-s", str(proc.pid)], capture_output=True, text=True,
                            check=False)
        outlived = [" ".join(line.split()) for line in ps.stdout.splitlines()]
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate(timeout=LEFTOVER_WAIT_S)[0], outlived


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (the SigCgt mask of /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (sig - 1) & 1)


def _wait_listening(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Until the trainer catches `sig`: the interpreter's start and the config checks take a variable
    time on a loaded machine, and a signal before them is not the preemption path under test."""
    deadline = time.monotonic() + LISTEN_TIMEOUT_S
    while not _catches(proc.pid, sig) and proc.poll() is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the trainer (pid {proc.pid}) did not catch {sig.name} within {LISTEN_TIMEOUT_S} s")
        time.sleep(0.02)


def _superseded_since(run_dir: Path, seen: int) -> tuple[int, int]:
    """(step records superseded by resumes after the first `seen` lines of metrics.superseded.jsonl, lines now)."""
    path = run_dir / "metrics.superseded.jsonl"
    if not path.is_file():
        return 0, 0
    lines = path.read_text().splitlines()
    steps = 0
    for line in lines[seen:]:
        try:
            record = json.loads(line)
        except ValueError:
            steps += 1          # a torn line: a record the kill cut in half
            continue
        steps += "loss" in record
    return steps, len(lines)


def soak(out: Path, extra: list[str], interruptions: int, seed: int = 0, kill_share: float = 0.5,
         threads: int = 1, max_delay_s: float | None = None) -> dict[str, Any]:
    """Interrupt `interruptions` times, then let the run finish; returns every attempt and the checks."""
    out.mkdir(parents=True, exist_ok=True)
    reference, unbroken_s = run_unbroken(out, extra, threads)
    rng = random.Random(seed)
    run_dir = out / "soak"
    attempts: list[dict[str, Any]] = []
    total_steps = int(reference["steps"])
    superseded_lines = 0
    while True:
        interrupt = len([a for a in attempts if a["signal"]]) < interruptions
        proc = subprocess.Popen(_command(out, "soak", extra), env=_env(threads), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        sig, delay = None, None
        if interrupt:
            sig = signal.SIGKILL if rng.random() < kill_share else signal.SIGTERM
            # up to a third of what is left of the run (its start-up, steps and evaluation): a fixed bound
            # let the last starts finish before their signal, and the soak end short of its interruptions
            left = 1 - _saved_step(run_dir) / max(total_steps, 1)
            delay_top = max_delay_s or unbroken_s / 3 * max(left, 0.05)
            delay = rng.uniform(MIN_DELAY_S, max(delay_top, MIN_DELAY_S + 1))
            _wait_listening(proc, signal.SIGTERM)   # a SIGKILL waits too, so both draw from one clock
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, sig)      # the trainer itself; its loader workers ignore the stop signals
        proc.wait(timeout=RUN_TIMEOUT_S)
        output, outlived = _output_and_leftovers(proc)
        if sig is not None and proc.returncode == 0:
            sig = None                      # it finished before the signal
        stopped_line = next((x for x in output.splitlines() if x.startswith("stopped on")), None)
        attempts.append({"signal": sig.name if sig else None, "delay_s": delay, "exit": proc.returncode,
                         "stopped": stopped_line})
        if outlived:
            attempts[-1]["outlived_trainer"] = outlived
        if proc.returncode not in (0, STOPPED_EXIT, -signal.SIGKILL):
            attempts[-1]["output_tail"] = output.splitlines()[-25:]   # what an unexpected exit said
        attempts[-1]["unsaved_steps"] = _unsaved_steps(run_dir)
        rerun, superseded_lines = _superseded_since(run_dir, superseded_lines)
        if len(attempts) > 1:
            attempts[-2]["steps_rerun_after"] = rerun   # what the resume after that attempt took back
        if proc.returncode == 0:
            break
        if len(attempts) > 3 * interruptions + 10:
            raise RuntimeError(f"the run did not finish after {len(attempts)} starts: {attempts[-3:]}")
    return {"unbroken_s": unbroken_s, "attempts": attempts,
            "checks": {"interruptions_wanted": interruptions, **check_run(run_dir, reference, attempts)}}


def _saved_step(run_dir: Path) -> int:
    """The step of the latest complete checkpoint (0: none)."""
    return max((int(d.name.split("_")[1]) for d in (run_dir / "checkpoints").glob("step_*") if d.is_dir()),
               default=0)


def _unsaved_steps(run_dir: Path) -> int:
    """Step records in metrics.jsonl past the latest complete checkpoint: what a resume would train again."""
    saved = _saved_step(run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue            # a torn last line
        if "loss" in record:
            steps.append(record["step"])
    return sum(step > saved for step in steps)


def _tensorboard_steps(tb_dir: Path, tag: str) -> list[int]:
    """The folder read as tensorboard reads a run: all event files in order, purges applied."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def check_run(run_dir: Path, reference: dict[str, Any], attempts: list[dict[str, Any]]) -> dict[str, Any]:
    results = json.loads((run_dir / "results.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    evals = [r["step"] for r in records if any(k.startswith("val/") for k in r)]
    tb_steps = _tensorboard_steps(run_dir / "tensorboard", "loss")
    terms = [a for a in attempts if a["signal"] == "SIGTERM"]
    in_training = [a for a in terms if a["stopped"] and " after step " in a["stopped"]]
    leftovers = [str(p) for p in run_dir.rglob("*") if p.name.startswith((".tmp", ".magclip.lock"))
                 or p.name.endswith(".tmp") or p.name.startswith(".step_")]
    alive = subprocess.run(["pgrep", "-f", f"output_dir={run_dir.parent} "], capture_output=True,
                           text=True, check=False).stdout.split()
    return {
        "interruptions": sum(1 for a in attempts if a["signal"]),
        "sigkill": sum(1 for a in attempts if a["signal"] == "SIGKILL"), "sigterm": len(terms),
        "sigterm_in_training": len(in_training),
        "weights_equal_unbroken": results["weights_sha256_by_rank"] == reference["weights_sha256_by_rank"],
        "every_sigterm_exit_75": all(a["exit"] == STOPPED_EXIT for a in terms),
        "unsaved_steps_per_sigterm_in_training": [a["unsaved_steps"] for a in in_training],
        "every_sigterm_saved_its_step": all(a["unsaved_steps"] == 0 for a in in_training),
        "metrics_steps_once": steps == list(range(1, results["steps"] + 1)),   # a record per step, in order
        "evaluation_records_once": len(evals) == len(set(evals)),
        "tensorboard_steps_once": tb_steps == sorted(set(tb_steps)) and set(tb_steps) == set(steps),
        "left_behind": leftovers + [f"process {p}" for p in alive]
                       + [f"attempt {i}: {p} outlived the trainer" for i, a in enumerate(attempts)
                          for p in a.get("outlived_trainer", [])],
    }


def passed(checks: dict[str, Any]) -> bool:
    return (checks["weights_equal_unbroken"] and checks["every_sigterm_exit_75"]
            and checks["every_sigterm_saved_its_step"] and checks["metrics_steps_once"]
            and checks["evaluation_records_once"] and checks["tensorboard_steps_once"] and not checks["left_behind"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="a folder for the two runs and soak.json")
    p.add_argument("--interruptions", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-share", type=float, default=0.5, help="share of SIGKILLs among the interruptions")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("extra", nargs="*", help="overrides of the run (default: the main job at 120 steps, "
                                           "a checkpoint every 10)")
    a = p.parse_args()
    extra = [*MAIN_JOB, *a.extra]
    report = soak(a.out, extra, a.interruptions, a.seed, a.kill_share, a.threads)
    report["overrides"] = extra
    (a.out / "soak.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report["checks"], indent=2))
    for attempt in report["attempts"]:
        print(attempt)
    checks = report["checks"]
    if checks["interruptions"] < checks["interruptions_wanted"]:
        print(f"note: {checks['interruptions']} of {checks['interruptions_wanted']} interruptions happened "
              "(the run finished before a signal); run again with another --seed for more")
    return 0 if passed(report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
