"""make_shards again into the same folder: refused unless --overwrite, and a replacement is all or nothing
(a second run with fewer rows once left the old shards beside the new ones, and training read them all)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from builders import ROOT, png

from magclip.data import convert
from magclip.data.convert import convert_to_shards
from magclip.data.shards import count_samples

COMMAND = [sys.executable, str(ROOT / "tools" / "make_shards.py")]


@pytest.fixture
def images(tmp_path: Path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(6):
        (folder / f"img{i}.png").write_bytes(png(i))
    return folder


def table(tmp_path: Path, rows: int, name: str = "captions.csv") -> Path:
    path = tmp_path / name
    path.write_text("file,caption\n" + "".join(f"img{i}.png,caption {name} {i}\n" for i in range(rows)))
    return path


def snapshot(folder: Path) -> dict[str, str]:
    """Every file of the folder and a digest of its bytes: 'unchanged' means byte for byte."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def run(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *map(str, args)], check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_rerun_refused_in_one_line(tmp_path: Path, images: Path) -> None:
    out = tmp_path / "shards"
    assert run(images, table(tmp_path, 5), out, "--shard-size", "2").returncode == 0
    before = snapshot(out)
    proc = run(images, table(tmp_path, 2, "fewer.csv"), out, "--shard-size", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [(
        f"error: {out} is not empty (shard-000000.tar, shard-000001.tar, shard-000002.tar and 1 more): pass "
        "--overwrite to replace it with the new shards, or choose a new folder (FileExistsError; --debug "
        "shows the traceback)")]
    assert snapshot(out) == before


def test_overwrite_leaves_exactly_the_new_shards(tmp_path: Path, images: Path) -> None:
    out = tmp_path / "shards"
    convert_to_shards(images, table(tmp_path, 5), out, shard_size=1, quiet=True)
    assert len(list(out.glob("*.tar"))) == 5
    result = convert_to_shards(images, table(tmp_path, 2, "fewer.csv"), out, shard_size=1, overwrite=True,
                               quiet=True)
    assert sorted(p.name for p in out.iterdir()) == ["shard-000000.tar", "shard-000001.tar", "sizes.json"]
    assert json.loads((out / "sizes.json").read_text()) == {"shard-000000.tar": 1, "shard-000001.tar": 1}
    assert result["written"] == 2 == count_samples(str(out / "shard-{000000..000001}.tar"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left


def test_overwrite_from_the_command(tmp_path: Path, images: Path) -> None:
    out = tmp_path / "shards"
    assert run(images, table(tmp_path, 5), out, "--shard-size", "1").returncode == 0
    proc = run(images, table(tmp_path, 2, "fewer.csv"), out, "--shard-size", "1", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert "wrote 2 samples in 2 shards" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["shard-000000.tar", "shard-000001.tar", "sizes.json"]


def test_failure_mid_write_keeps_the_old_set(tmp_path: Path, images: Path, monkeypatch) -> None:
    out = tmp_path / "shards"
    convert_to_shards(images, table(tmp_path, 5), out, shard_size=1, quiet=True)
    before = snapshot(out)
    real, calls = convert._image_bytes, []

    def fails_at_the_third(path: Path, verify: bool):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk gone")
        return real(path, verify)

    monkeypatch.setattr(convert, "_image_bytes", fails_at_the_third)
    with pytest.raises(OSError, match="disk gone"):
        convert_to_shards(images, table(tmp_path, 4, "new.csv"), out, shard_size=1, overwrite=True, quiet=True)
    assert len(calls) == 3  # two new shards were already complete when it failed
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


KILLED_AT_THE_THIRD_IMAGE = """
import os, signal, sys
import magclip.data.convert as convert
real, calls = convert._image_bytes, []
def killed(path, verify):
    calls.append(path)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, verify)
convert._image_bytes = killed
from magclip.cli.make_shards import main
main(sys.argv[1:])
"""


def test_killed_mid_write_keeps_the_old_set(tmp_path: Path, images: Path) -> None:
    out = tmp_path / "shards"
    convert_to_shards(images, table(tmp_path, 5), out, shard_size=1, quiet=True)
    before = snapshot(out)
    new = table(tmp_path, 4, "new.csv")
    proc = subprocess.run([sys.executable, "-c", KILLED_AT_THE_THIRD_IMAGE, str(images), str(new), str(out),
                           "--shard-size", "1", "--overwrite"], check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert snapshot(out) == before
    staging = [p for p in tmp_path.iterdir() if p.name.startswith(".shards.")]
    assert len(staging) == 1  # what a killed run leaves; the next run names it
    proc = run(images, new, out, "--shard-size", "1", "--overwrite")
    assert proc.returncode == 0 and f"{staging[0]}: left by an interrupted" in proc.stderr
    assert json.loads((out / "sizes.json").read_text()) == {f"shard-{i:06d}.tar": 1 for i in range(4)}


def test_a_swap_killed_between_its_renames_is_undone_first(tmp_path: Path, images: Path) -> None:
    """publish_dir moves the old folder to .NAME.old before the new one in: killed between, the old set
    is put back before anything else, so a plain re-run is refused rather than writing a second set."""
    out = tmp_path / "shards"
    convert_to_shards(images, table(tmp_path, 3), out, shard_size=1, quiet=True)
    before = snapshot(out)
    out.rename(tmp_path / ".shards.old")
    with pytest.raises(FileExistsError, match="is not empty"):
        convert_to_shards(images, table(tmp_path, 2, "new.csv"), out, quiet=True)
    assert snapshot(out) == before and not (tmp_path / ".shards.old").exists()


def test_an_empty_folder_needs_no_overwrite(tmp_path: Path, images: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert convert_to_shards(images, table(tmp_path, 2), out, quiet=True)["written"] == 2


def test_overwrite_deletes_nothing_make_shards_did_not_write(tmp_path: Path, images: Path) -> None:
    out = tmp_path / "shards"
    convert_to_shards(images, table(tmp_path, 2), out, quiet=True)
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    with pytest.raises(FileExistsError, match=r"--overwrite would delete notes\.txt, which make_shards does not"):
        convert_to_shards(images, table(tmp_path, 2), out, overwrite=True, quiet=True)
    assert snapshot(out) == before


@pytest.mark.parametrize("where", ["images", "parent", "cwd"])
def test_output_folder_holding_the_inputs_is_refused(tmp_path: Path, images: Path, where: str,
                                                     monkeypatch) -> None:
    captions = table(tmp_path, 2)
    out = {"images": images, "parent": tmp_path, "cwd": tmp_path / "here"}[where]
    if where == "cwd":
        out.mkdir()
        monkeypatch.chdir(out)
    with pytest.raises(ValueError, match="is or holds"):
        convert_to_shards(images, captions, out, overwrite=True, quiet=True)
    assert sorted(p.name for p in images.iterdir()) == [f"img{i}.png" for i in range(6)]


def test_output_that_is_a_file_is_refused(tmp_path: Path, images: Path) -> None:
    (tmp_path / "out").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        convert_to_shards(images, table(tmp_path, 2), tmp_path / "out", overwrite=True, quiet=True)


def test_a_mount_point_is_refused(tmp_path: Path, images: Path, monkeypatch) -> None:
    """The new set is written beside the folder and renamed over it: a mount point cannot be renamed."""
    out = tmp_path / "mnt"
    out.mkdir()
    monkeypatch.setattr(convert.os.path, "ismount", lambda path: Path(path) == out)
    with pytest.raises(ValueError, match=f"mount point.*e.g. {out / 'shards'}"):
        convert_to_shards(images, table(tmp_path, 2), out, quiet=True)
