"""The image-text shard loader on tiny shards built on the fly (a few 8x8 PNGs + captions)."""

from __future__ import annotations

import io
import json
import random
import tarfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from magclip.data.shard_reader import iter_tar_samples
from magclip.data.shards import NoUsableDataError, build_clip_loader, count_samples
from magclip.data.urls import PipeFailedError, check_pipes_start, check_sources_exist
from builders import good, png, write_tar

PRE = T.Compose([T.Resize((16, 16)), T.ToTensor()])


class CharTokenizer:
    """A stand-in for open_clip's tokenizer: list[str] -> LongTensor [B, 24]."""

    def __call__(self, texts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(texts), 24, dtype=torch.long)
        for i, t in enumerate(texts):
            ids = [ord(c) % 250 + 1 for c in t[:24]]
            out[i, : len(ids)] = torch.tensor(ids)
        return out


TOK = CharTokenizer()








def make_shards(folder: Path, prefix: str, num_shards: int, per_shard: int, sizes_json: bool = True) -> str:
    """`num_shards` tars of `per_shard` good samples; keys are '{prefix}{shard}{index}'."""
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for s in range(num_shards):
        members = [m for i in range(per_shard) for m in good(f"{prefix}{s:02d}{i:03d}")]
        write_tar(folder / f"{prefix}-{s:03d}.tar", members)
        sizes[f"{prefix}-{s:03d}.tar"] = per_shard
    if sizes_json:
        (folder / "sizes.json").write_text(json.dumps(sizes))
    return str(folder / f"{prefix}-{{000..{num_shards - 1:03d}}}.tar")


def keys_of(loader) -> list[str]:
    return [k for batch in loader for k in batch["keys"]]


@pytest.fixture
def shards(tmp_path: Path) -> str:
    return make_shards(tmp_path, "a", num_shards=4, per_shard=6)


def test_one_pass_shapes_and_captions(shards: str) -> None:
    loader = build_clip_loader(shards, preprocess=PRE, tokenizer=TOK, batch_size=5, shuffle=False,
                               drop_last=False)
    batches = list(loader)
    assert len(batches) == loader.num_batches == 5  # 24 samples: 4 full batches + 4
    b = batches[0]
    assert b["images"].shape == (5, 3, 16, 16) and b["images"].dtype == torch.float32
    assert b["texts"].shape == (5, 24) and b["texts"].dtype == torch.long
    assert b["captions"] == [f"caption {k}" for k in b["keys"]]
    assert torch.equal(b["texts"], TOK(b["captions"]))
    assert b["skipped"] == {}
    keys = keys_of(loader)
    assert len(keys) == 24 and len(set(keys)) == 24  # every sample exactly once
    assert loader.num_samples == count_samples(shards) == 24


def test_shuffled_pass_sees_every_sample_once(shards: str) -> None:
    loader = build_clip_loader(shards, preprocess=PRE, tokenizer=TOK, batch_size=4, shuffle_buffer=10)
    keys = keys_of(loader)
    assert len(keys) == 24 and len(set(keys)) == 24
    assert keys != sorted(keys)


def test_count_samples_without_sizes_json(tmp_path: Path) -> None:
    urls = make_shards(tmp_path, "c", num_shards=3, per_shard=7, sizes_json=False)
    assert count_samples(urls) == 21
    loader = build_clip_loader(urls, preprocess=PRE, tokenizer=TOK, batch_size=7)
    assert loader.num_batches == 3


def test_epoch_length_is_exact_and_restarts_sources(shards: str) -> None:
    # 40 samples requested from 24: the rank starts a second pass to fill 10 batches.
    loader = build_clip_loader(shards, preprocess=PRE, tokenizer=TOK, batch_size=4, num_samples=40)
    assert loader.num_batches == len(loader) == 10
    batches = list(loader)
    assert len(batches) == 10 and all(len(b["keys"]) == 4 for b in batches)
    assert len(set(keys_of(loader))) == 24


@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_disjoint_and_equal_length(shards: str, workers: int) -> None:
    per_rank = []
    for rank in (0, 1):
        loader = build_clip_loader(shards, preprocess=PRE, tokenizer=TOK, batch_size=3, num_samples=24,
                                   rank=rank, world_size=2, workers=workers, seed=3, epoch=1)
        assert loader.num_batches == 4
        batches = list(loader)
        assert len(batches) == 4
        per_rank.append(set(keys_of(loader)))
    assert len(per_rank[0]) == len(per_rank[1]) == 12
    assert not per_rank[0] & per_rank[1]


def test_workers_one_pass_matches_in_process(shards: str) -> None:
    kw = dict(preprocess=PRE, tokenizer=TOK, batch_size=4, shuffle=False, drop_last=False)
    inproc = keys_of(build_clip_loader(shards, workers=0, **kw))
    loader = build_clip_loader(shards, workers=2, **kw)
    multi = keys_of(loader)
    assert sorted(multi) == sorted(inproc) and len(multi) == 24
    assert loader.num_batches == 6


@pytest.mark.parametrize("workers", [0, 2])
def test_deterministic_and_epoch_reseeds(shards: str, workers: int) -> None:
    kw = dict(preprocess=PRE, tokenizer=TOK, batch_size=4, num_samples=24, shuffle_buffer=8, seed=7,
              workers=workers)
    a = keys_of(build_clip_loader(shards, **kw))
    assert a == keys_of(build_clip_loader(shards, **kw))
    loader = build_clip_loader(shards, **kw)
    loader.set_epoch(1)
    b = keys_of(loader)
    assert b != a and sorted(b) == sorted(a)
    assert b == keys_of(build_clip_loader(shards, epoch=1, **kw))


def test_multi_source_weights_resampled(tmp_path: Path) -> None:
    a = make_shards(tmp_path / "a", "a", num_shards=2, per_shard=5)
    b = make_shards(tmp_path / "b", "b", num_shards=3, per_shard=5)
    kw = dict(preprocess=PRE, tokenizer=TOK, batch_size=5, num_samples=60, resampled=True)
    only_a = keys_of(build_clip_loader(f"{a}::{b}", weights="1::0", **kw))
    assert len(only_a) == 60 and all(k.startswith("a") for k in only_a)
    mixed = build_clip_loader([a, b], weights=[1.0, 1.0], workers=2, **kw)
    assert mixed.num_batches == 12
    keys = keys_of(mixed)
    assert len(keys) == 60 and {k[0] for k in keys} == {"a", "b"}
    skewed = keys_of(build_clip_loader(f"{a}::{b}", weights="1::4", **dict(kw, num_samples=400)))
    assert Counter(k[0] for k in skewed)["b"] > 300  # b: 3 shards x 4 vs a: 2 shards x 1


def test_resampled_deterministic_per_epoch_and_rank(shards: str) -> None:
    kw = dict(preprocess=PRE, tokenizer=TOK, batch_size=4, num_samples=32, resampled=True, world_size=2)
    r0 = keys_of(build_clip_loader(shards, rank=0, **kw))
    assert len(r0) == 16 and r0 == keys_of(build_clip_loader(shards, rank=0, **kw))
    assert r0 != keys_of(build_clip_loader(shards, rank=1, **kw))
    assert r0 != keys_of(build_clip_loader(shards, rank=0, epoch=1, **kw))


def test_plain_source_list_without_weights(tmp_path: Path) -> None:
    a = make_shards(tmp_path / "a", "a", num_shards=2, per_shard=3)
    b = make_shards(tmp_path / "b", "b", num_shards=1, per_shard=3)
    keys = keys_of(build_clip_loader(f"{a}::{b}", preprocess=PRE, tokenizer=TOK, batch_size=3))
    assert len(keys) == 9 and {k[0] for k in keys} == {"a", "b"}


def test_missing_shard_names_the_path(tmp_path: Path) -> None:
    make_shards(tmp_path, "m", num_shards=2, per_shard=2)
    with pytest.raises(FileNotFoundError, match="m-002.tar"):
        build_clip_loader(str(tmp_path / "m-{000..002}.tar"), preprocess=PRE, tokenizer=TOK, batch_size=2)


def test_a_git_lfs_pointer_in_a_shards_place_is_refused_naming_it(tmp_path: Path) -> None:
    """A benchmark cloned without its LFS files: the reader would skip the pointer as a corrupt tar and score the
    other shards; it is refused up front, naming the file and what to do."""
    make_shards(tmp_path, "m", num_shards=2, per_shard=2)
    (tmp_path / "m-001.tar").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:"
                                        + "0" * 64 + "\nsize 40960\n")
    with pytest.raises(ValueError, match=r"data\.val: .*m-001\.tar is a Git LFS pointer, not a tar: .*git lfs pull"):
        check_sources_exist(str(tmp_path / "m-{000..001}.tar"), "data.val")
    assert check_sources_exist(str(tmp_path / "m-000.tar"))  # a real shard passes


def test_a_missing_shard_is_not_found_rather_than_damaged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Counting samples (the epoch length) comes before the loader: it must say "not found" too."""
    with pytest.raises(FileNotFoundError, match=r"shard not found: .*shard-000000.tar"):
        count_samples(str(tmp_path / "shard-{000000..000003}.tar"))
    assert "damaged" not in caplog.text


def test_too_few_shards(shards: str, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="4 shards cannot be split over 5 ranks"):
        build_clip_loader(shards, preprocess=PRE, tokenizer=TOK, batch_size=2, num_samples=20, rank=0,
                          world_size=5)
    with caplog.at_level("WARNING", logger="magclip.data"):
        loader = build_clip_loader(shards, preprocess=PRE, tokenizer=TOK, batch_size=2, num_samples=20,
                                   rank=1, world_size=2, workers=4)
    assert loader.workers == 2 and "cannot feed 4 workers" in caplog.text
    assert len(list(loader)) == 5


def test_bad_arguments(shards: str) -> None:
    kw = dict(preprocess=PRE, tokenizer=TOK, batch_size=2)
    with pytest.raises(ValueError, match="resampled"):
        build_clip_loader(shards, weights="1", **kw)
    with pytest.raises(ValueError, match="2 weights for 1 sources"):
        build_clip_loader(shards, weights="1::2", resampled=True, num_samples=8, **kw)
    with pytest.raises(ValueError, match="num_samples"):
        build_clip_loader(shards, resampled=True, **kw)


def test_open_clip_tokenizer(shards: str) -> None:
    open_clip = pytest.importorskip("open_clip")
    tok = open_clip.get_tokenizer("RN50")  # plain CLIP BPE tokenizer, vocabulary ships with the package
    batch = next(iter(build_clip_loader(shards, preprocess=PRE, tokenizer=tok, batch_size=4)))
    assert batch["texts"].shape == (4, 77) and batch["texts"].dtype == torch.long
    assert torch.equal(batch["texts"], tok(batch["captions"]))


# ----------------------------------------------------------------------------- bad data


def truncate(path: Path, cut: int) -> None:
    path.write_bytes(path.read_bytes()[:cut])


def member_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (header offset, data offset)."""
    with tarfile.open(path) as tar:
        return {m.name: (m.offset, m.offset_data) for m in tar.getmembers()}


@pytest.fixture
def bad_shards(tmp_path: Path) -> str:
    big = io.BytesIO()
    Image.new("RGB", (40, 40), (9, 9, 9)).save(big, format="PNG")
    write_tar(tmp_path / "bad-000.tar", [
        *good("k00"),
        ("k01.png", b"\x89PNG garbage, not an image"), ("k01.txt", b"garbage image"),  # corrupt member
        ("k02.png", png(2)[:100]), ("k02.txt", b"truncated png"),  # header fine, pixel data cut
        ("k03.png", b""), ("k03.txt", b"zero-byte image"),
        *good("k04")[:1], ("k04.txt", b"  \n"),  # empty caption
        *good("k05")[:1], ("k05.txt", b"caf\xe9 latin-1"),  # not UTF-8
        *good("k06")[:1],  # no caption
        ("k07.txt", b"no image"), ("k07.json", b"{}"),
        ("k08.png", big.getvalue()), ("k08.txt", b"too many pixels"),
        *good("k09"),
        *good("k10"), ("k10.txt", b"a second caption"),  # duplicate member: dropped, sample kept
    ])
    # Cut inside the image data of the 3rd sample: 2 samples survive.
    p = write_tar(tmp_path / "bad-001.tar", [m for i in range(4) for m in good(f"m{i:02d}")])
    truncate(p, member_offsets(p)["m02.png"][1] + 10)
    # Cut exactly at a header: tarfile alone would call this a clean end; 3 samples survive.
    p = write_tar(tmp_path / "bad-002.tar", [m for i in range(4) for m in good(f"h{i:02d}")])
    truncate(p, member_offsets(p)["h03.png"][0])
    # Cut at the caption's header: sample t01 is left without caption; 1 sample survives.
    p = write_tar(tmp_path / "bad-003.tar", [m for i in range(3) for m in good(f"t{i:02d}")])
    truncate(p, member_offsets(p)["t01.txt"][0])
    (tmp_path / "bad-004.tar").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(3000)))
    make_shards(tmp_path, "ok", num_shards=1, per_shard=3, sizes_json=False)
    return str(tmp_path / "bad-{000..004}.tar") + "::" + str(tmp_path / "ok-000.tar")


EXPECTED_SKIPS = {
    "undecodable_image": 3,
    "empty_caption": 1,
    "bad_caption_encoding": 1,
    "missing_caption": 2,
    "missing_image": 1,
    "image_too_large": 1,
    "corrupt_tar": 4,
    "bad_member": 1,
}
EXPECTED_GOOD = {"k00", "k09", "k10", "m00", "m01", "h00", "h01", "h02", "t00",
                 "ok00000", "ok00001", "ok00002"}


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_data_is_skipped_and_counted(bad_shards: str, workers: int,
                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="magclip.data"):
        loader = build_clip_loader(bad_shards, preprocess=PRE, tokenizer=TOK, batch_size=2, drop_last=False,
                                   workers=workers, max_image_pixels=1000)
        batches = list(loader)
    assert {k for b in batches for k in b["keys"]} == EXPECTED_GOOD
    assert sum(len(b["keys"]) for b in batches) == len(EXPECTED_GOOD)
    assert dict(loader.skip_counts) == EXPECTED_SKIPS
    per_batch = sum((Counter(b["skipped"]) for b in batches), Counter())
    assert all(per_batch[r] <= n for r, n in EXPECTED_SKIPS.items())
    if workers == 0:  # one stream: every skip is followed by a batch that carries it
        assert dict(per_batch) == EXPECTED_SKIPS
    if workers == 0:  # caplog sees only this process
        assert "skipped bad_caption_encoding" in caplog.text and "k05" in caplog.text
        assert "bad-004.tar" in caplog.text
        duplicate = next(r.getMessage() for r in caplog.records if "skipped bad_member" in r.getMessage())
        assert "bad-000.tar" in duplicate and "shard None" not in duplicate and "k10.txt" in duplicate


def test_bad_data_fixed_epoch_still_exact(bad_shards: str) -> None:
    loader = build_clip_loader(bad_shards, preprocess=PRE, tokenizer=TOK, batch_size=3, num_samples=30,
                               max_image_pixels=1000, workers=2)
    assert len(list(loader)) == 10
    assert set(loader.skip_counts) == set(EXPECTED_SKIPS)


def test_worker_without_usable_data_raises(tmp_path: Path) -> None:
    (tmp_path / "x-000.tar").write_bytes(b"not a tar" * 100)
    with pytest.raises(NoUsableDataError, match="yielded 0 of 2 batches"):  # bad input: one line, exit 2
        list(build_clip_loader(str(tmp_path / "x-000.tar"), preprocess=PRE, tokenizer=TOK, batch_size=2,
                               num_samples=4))


def test_the_evaluation_reader_skips_and_counts_like_training(tmp_path: Path) -> None:
    """iter_tar_samples (zero-shot) uses the training reader's stages: a duplicate member keeps the
    first, a truncated tar keeps what came before the damage, a missing shard is counted."""
    write_tar(tmp_path / "a.tar", [*good("k1"), *good("k2"), ("k2.txt", b"a second caption")])
    cut = write_tar(tmp_path / "b.tar", [m for i in range(3) for m in good(f"t{i}")])
    cut.write_bytes(cut.read_bytes()[:1500])
    skipped: Counter = Counter()
    urls = [str(tmp_path / n) for n in ("a.tar", "b.tar", "missing.tar")]
    samples = [(Path(u).name, k, m) for u, k, m in iter_tar_samples(urls, skipped)]
    assert [(u, k) for u, k, _ in samples] == [("a.tar", "k1"), ("a.tar", "k2"), ("b.tar", "t0")]
    assert samples[1][2]["txt"] == b"caption k2"
    assert dict(skipped) == {"bad_member": 1, "corrupt_tar": 1, "unreadable_shard": 1}


def test_a_folder_stands_for_its_shards(tmp_path):
    """`--data DIR` / `data.train=DIR`: the .tar shards inside, in name order; a folder without any is named."""
    from magclip.data.urls import check_sources_exist

    for name in ("b-000001.tar", "b-000000.tar"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "sizes.json").write_text("{}")
    assert check_sources_exist(str(tmp_path)) == [str(tmp_path / "b-000000.tar"), str(tmp_path / "b-000001.tar")]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="is a folder without .tar shards"):
        check_sources_exist(str(empty))


def test_a_failing_pipe_command_is_named_with_its_own_error_before_the_run(tmp_path: Path) -> None:
    """Issue row 9.14: `pipe:false` ended in a traceback counted as corrupt_tar. The first pipe: shard of
    each source is started at the input check: a command that fails is named with its status and stderr."""
    with pytest.raises(PipeFailedError, match=r"^data.train: pipe:false: the command exited with status 1 before"):
        check_pipes_start("pipe:false", "data.train")
    missing = tmp_path / "none.tar"
    with pytest.raises(PipeFailedError, match=f"pipe:cat {missing}: .*status 1.*No such file or directory"):
        check_pipes_start(f"pipe:cat {missing}", "data.train")
    make_shards(tmp_path, "p", num_shards=1, per_shard=3)
    check_pipes_start(f"pipe:cat {tmp_path}/p-000.tar", "data.train")  # a working command: no error


def test_a_pipe_that_fails_during_the_run_is_counted_as_such(tmp_path: Path) -> None:
    """A pipe: shard whose command fails after the start (shard 1 is not there) is counted once as
    pipe_failed, not as a damaged tar; the other shard's samples train."""
    make_shards(tmp_path, "p", num_shards=1, per_shard=4)
    loader = build_clip_loader(f"pipe:cat {tmp_path}/p-{{000..001}}.tar", preprocess=PRE, tokenizer=TOK,
                               batch_size=2, num_samples=None, shuffle=False)
    assert sum(len(b["keys"]) for b in loader) == 4
    assert loader.skip_counts == Counter({"pipe_failed": 1})
