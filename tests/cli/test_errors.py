"""Expected failures of a command end with one line naming the key or file and a distinct exit
code, without a traceback; --debug shows the traceback."""

from __future__ import annotations

import os
import re
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
     "error: --checkpoint no/such/run: not found"),
    (["eval/zeroshot.py", "--out", "r.json"], "error: give exactly one of --checkpoint or --model"),
    (["train/clip.py", "data.train=/no/such/shard-{000000..000003}.tar"],
     "error: data.train: shard not found: /no/such/shard-000000.tar"),
    (["eval/beir.py", "--data", "no_such_dir", "--out", "r.json"], "error: BEIR folder not found: no_such_dir"),
    (["eval/sts.py", "--data", "no_such.tsv", "--out", "r.json"], "error: --data no_such.tsv: not found"),
    (["eval/length_mix.py", "--data", "no_such_dir", "--variants", "v"], "error: --data no_such_dir: not found"),
    (["train/text.py", "data.beir=no_such_dir", "data.train=null"], "error: data.beir: not found: no_such_dir"),
    (["train/clip.py", "data.train=pipe:false", "data.num_samples=16"],  # issue row 9.14
     "error: data.train: pipe:false: the command exited with status 1 before sending any data"),
])
def test_expected_errors_are_one_line_with_exit_code_2(args, message, tmp_path):
    proc = run(*[str(ROOT / a) if a.endswith((".py", ".yaml")) else a for a in args], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]


def test_debug_shows_the_traceback(tmp_path):
    proc = run(str(ROOT / "train" / "clip.py"), "--debug", "train.lr=.nan", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


HEAVY = ("torch", "open_clip", "transformers", "webdataset", "accelerate")


@pytest.mark.parametrize("command, argv", [
    ("train_clip", ["--help"]),
    ("train_clip", ["loss.i2t=qnrom"]),
    ("train_clip", ["data.train=/no/such/shard-{0..3}.tar"]),
    ("train_text", ["data.beir=/no/such/dir", "data.train=null"]),
    ("beir", ["--data", "/no/such/dir", "--out", "r.json"]),
    ("sts", ["--data", "/no/such.tsv", "--out", "r.json"]),
    ("rag", ["--data", "/no/such/dir", "--out", "r.json"]),
    ("zeroshot", ["--checkpoint", "/no/such/run", "--data", "x.tar", "--out", "r.json"]),
    ("compare", ["--help"]),
    ("diagnose", ["--checkpoint", "/no/such/run", "--out", "d"]),
    ("diagnose", ["--help"]),
])
def test_bad_input_and_help_come_before_any_heavy_import(command, argv, tmp_path):
    """What makes an error fast is that torch, open_clip and the model are not imported before it:
    asserted on the modules loaded, not on a time (benchmarks/bench_cli.py has the timings)."""
    code = (f"import sys\nfrom magclip.cli import {command}\n"
            f"try:\n    {command}.main({argv!r})\nexcept (Exception, SystemExit) as e:\n    print(type(e).__name__)\n"
            f"print('heavy:', sorted(m for m in {HEAVY!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "heavy: []", proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--mode", "learnable"], "--mode: mode 'learnable' needs both gamma_q and gamma_d for evaluation"),
    (["--mode", "fixed", "--gamma-q", "0.3"], "--mode: mode 'fixed' needs both gamma_q and gamma_d for evaluation"),
    (["--mode", "qnorm", "--gamma-q", "0.3"], "--mode: gamma_q is set but no mode has free exponents (qnorm)"),
    (["--gamma-d", "0.3"], "--gamma-q/--gamma-d go with --mode fixed or learnable"),
])
@pytest.mark.parametrize("command", ["beir", "zeroshot", "diagnose"])
def test_scoring_flags_mean_the_same_in_every_command(command, flags, message, tmp_path):
    """One rule (modes.resolve_specs, evaluation): beir once scored `--mode learnable` silently at (0.5, 0.5)
    and ignored `--mode qnorm --gamma-q 0.3`, which zeroshot refused."""
    import importlib

    main = importlib.import_module(f"magclip.cli.{command}").main
    inputs = {"beir": ["--data", str(tmp_path), "--out", "r.json"],
              "zeroshot": ["--model", "tiny-resnet", "--data", "x.tar", "--out", "r.json"],
              "diagnose": ["--model", "tiny-resnet", "--out", str(tmp_path / "d")]}[command]
    with pytest.raises(ValueError) as err:
        main([*inputs, *flags])
    assert message in str(err.value)


@pytest.mark.parametrize("overrides", [["model.name=hf-hub:timm/ViT-B-16-SigLIP"],
                                       ["model.name=ViT-B-32", "model.pretrained=laion2b_s34b_b79k"]])
def test_an_unreachable_hub_name_is_one_line_naming_the_cache(overrides, tmp_path):
    """Offline (HF_HUB_OFFLINE=1, an empty HF_HOME: nothing is contacted), a hub model or pretrained tag
    is one line that names it, the cache folder and the way to pass local weights; exit 2. (How fast:
    benchmarks/bench_cli.py.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, str(ROOT / "train" / "clip.py"), *overrides, f"output_dir={tmp_path}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "is not in the local hub cache" in last and str(tmp_path / "hf") in last and "model.pretrained=" in last
    assert "HubUnavailableError" in last



def test_a_refusal_inside_a_process_group_exits_2_every_time_with_one_line(tmp_path):
    """Issue row 7.04: ranks that refuse their input after the gloo group is up used to die of SIGABRT
    in about half the launches ("terminate called without an active exception" while the group was
    torn down at exit). 3 torchrun launches of 2 ranks at once (7 of 8 catch a 50 % abort); torchrun's
    report gives each failed rank's exit code, and every one must be 2. The line that says why comes
    once, from the node's first process (the second used to exit first and have it stopped before it
    wrote), and from the second rank itself when it alone refused (a 4th launch)."""
    from builders import free_port

    script = ROOT / "tests" / "cli" / "refuse_in_group.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def launch(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master_port", str(free_port()), str(script), *args], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # (launch, its line, the exit codes torchrun may report per rank: the rank that trains on is stopped, -15; so
    # is a refusing rank 1 that a loaded machine had not yet scheduled into its wait when rank 0 had said why and left)
    launches = [(launch(), "error: refused on rank 0 (ValueError", {"0": {"2"}, "1": {"2", "-15"}}) for _ in range(3)]
    launches.append((launch("--only-rank", "1"), "rank 1: error: refused on rank 1 (ValueError",
                     {"0": {"-15"}, "1": {"2"}}))
    for proc, line, allowed in launches:
        out, _ = proc.communicate(timeout=120)
        codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?exitcode\s*:\s*(-?\d+)", out, flags=re.S))
        errors = [x for x in out.splitlines() if "error: refused" in x]
        assert "terminate called" not in out, out[-3000:]
        assert "2" in codes.values() and all(c in allowed[r] for r, c in codes.items()), (codes, out[-3000:])
        assert len(errors) == 1 and errors[0].startswith(line), out[-3000:]


@pytest.fixture
def read_only_folder(tmp_path):
    """A read-only tmpfs mount (root only); skipped where mounting is impossible."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("script", ["train/clip.py", "train/text.py"])
def test_output_dir_on_a_read_only_mount_is_one_line_before_anything_is_built(read_only_folder, script, tmp_path):
    """Issue row 3.08: an output_dir on a read-only mount ended in a traceback (Errno 30) at the first write."""
    proc = run(str(ROOT / script), f"output_dir={read_only_folder / 'runs'}", "name=x", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: output_dir: cannot write to {read_only_folder / 'runs' / 'x'} ({read_only_folder}, ")


def test_diagnostics_refuse_a_classification_folder_before_any_model(tmp_path):
    """A CLIP_benchmark classification folder has no captions: once read to the end and refused as "no sample"."""
    from builders import png, write_tar

    from magclip.cli import diagnose

    write_tar(tmp_path / "cls" / "test" / "0.tar", [("s0.png", png(1)), ("s0.cls", b"0")])
    (tmp_path / "cls" / "test" / "nshards.txt").write_text("1\n")
    (tmp_path / "cls" / "classnames.txt").write_text("cat\n")
    with pytest.raises(ValueError, match=r"--data: .*cls is a CLIP_benchmark folder \(no captions\).*the diagnostics "
                                         r"read image-caption pairs"):
        diagnose.main(["--model", "tiny-resnet", "--data", str(tmp_path / "cls"), "--out", str(tmp_path / "d")])
