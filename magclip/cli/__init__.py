"""Console entry points; train/, eval/ and tools/ hold the same commands as scripts of a checkout.

`as_command(main)` is what a command runs: an expected failure (bad input, a refused file, a run that
had to stop) prints one line naming what went wrong and exits non-zero, without a traceback;
`--debug` shows the traceback. Calling `main(argv)` directly (tests, notebooks) raises as usual.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEBUG_FLAG = "--debug"
BAD_INPUT_EXIT = 2  # like argparse's usage errors
RUN_FAILED_EXIT = 1
# where a stopped run says so (a batch script requeues the job when the file exists): torchrun exits 1
# whatever its processes' code, so their STOPPED_EXIT does not reach the script (configs/slurm/)
STOPPED_FILE_ENV = "MAGCLIP_STOPPED_FILE"


def check_paths(args, *flags: str) -> None:
    """A FileNotFoundError naming the first path given to one of these flags (a value or a list) that is not
    there: every command checks its local inputs this way before torch or a model is loaded."""
    for flag in flags:
        value = getattr(args, flag)
        for path in [value] if isinstance(value, str) else value or []:
            if not Path(path).exists():
                raise FileNotFoundError(f"--{flag.replace('_', '-')} {path}: not found")


def check_inputs(cfg: Any) -> None:
    """Every local input a run config names exists: what a command checks before it imports torch or builds
    anything. Not part of `validate`: a config that names data of another machine still loads."""
    from magclip.config import RunConfig
    from magclip.data.eval_sets import TRAINING_HINT, resolve_retrieval_set
    from magclip.data.shard_start import check_shard_captions
    from magclip.data.urls import check_pipes_start, check_sources_exist
    from magclip.io import looks_like_path

    check_writable(cfg.run_dir, "output_dir")
    if isinstance(cfg, RunConfig):
        if cfg.data.train is not None:
            check_sources_exist(cfg.data.train, "data.train")
            check_pipes_start(cfg.data.train, "data.train")
        eval_sets = {"data.val": cfg.data.val, **{f"data.eval_sets.{k}": v for k, v in cfg.data.eval_sets.items()}}
        for key, path in eval_sets.items():  # shards, a CLIP_benchmark folder or a Karpathy file: recognised and checked
            if path is not None:
                es = resolve_retrieval_set(key, path, hint=TRAINING_HINT, matching=cfg.eval.matching,
                                           caption_key=cfg.data.caption_key, where=key)
                if es.urls is not None:
                    check_pipes_start(es.urls, key)
                if es.layout == "shards":  # read with data.caption_key: found wrong here, not after training
                    check_shard_captions(es.urls, es.caption_key, key)
        pretrained = cfg.model.pretrained
        if pretrained and looks_like_path(pretrained) and not Path(pretrained).expanduser().exists():
            raise FileNotFoundError(f"model.pretrained: not found: {pretrained}")
        return
    paths = {"data.beir": cfg.data.beir, **{f"eval.{kind}.{k}": v for kind in ("beir", "sts", "rag")
                                            for k, v in getattr(cfg.eval, kind).items()}}
    if cfg.data.train is not None and not any(c in cfg.data.train for c in "{:"):
        paths["data.train"] = cfg.data.train  # a plain file or folder; shard patterns are checked by the reader
    for key, value in paths.items():
        if value is not None and not Path(value).exists():
            raise FileNotFoundError(f"{key}: not found: {value}")


def check_writable(folder: Path, key: str) -> None:
    """A PermissionError naming `folder` where its nearest existing parent cannot be written to (a
    read-only mount, another user's folder): said before a model is built, not at the first write."""
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"{key}: {existing} is a file, not a folder (the run would write to {folder})")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == folder else f" ({existing}, where {folder} would be created)"
        raise PermissionError(f"{key}: cannot write to {folder}{where}: a read-only file system or no write "
                              "permission; pass output_dir=<a writable folder>")


class UsageError(ValueError):
    """Command-line arguments that cannot be used together; reported like any bad input (one line, exit 2)."""


def check_scorer_flags(modes: str | list[str] | None, gamma_q: float | None, gamma_d: float | None) -> None:
    """--mode / --gamma-q / --gamma-d, checked alike by every evaluation command before anything loads:
    `modes.resolve_specs`' evaluation rule (fixed and learnable need both exponents; exponents need a
    mode that uses them)."""
    from magclip.modes import resolve_specs

    if modes:
        resolve_specs([modes] if isinstance(modes, str) else modes, gamma_q, gamma_d, evaluation=True, where="--mode")
    elif gamma_q is not None or gamma_d is not None:
        raise UsageError("--gamma-q/--gamma-d go with --mode fixed or learnable (without --mode the model's own "
                         "scorers are used)")


def _expected(exn: BaseException) -> int | None:
    """The exit code of an expected failure, None for a bug."""
    if isinstance(exn, (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                        PermissionError)):
        return BAD_INPUT_EXIT
    if "magclip.training.engine" in sys.modules:  # only a run that trained can fail this way
        from magclip.distributed import PeerLostError
        from magclip.training.engine import NonFiniteLossError, RunWriteError

        if isinstance(exn, (NonFiniteLossError, RunWriteError, PeerLostError)):
            return RUN_FAILED_EXIT
    return None


def as_command(main: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        debug = DEBUG_FLAG in sys.argv
        if debug:
            sys.argv.remove(DEBUG_FLAG)
        try:
            main()
        except BaseException as exn:  # a stop (training/preemption.py) is a BaseException, as KeyboardInterrupt is
            if _stopped(exn) or not isinstance(exn, Exception):  # _stopped exits 75 where exn is or wraps a stop
                raise
            code = _expected(exn)
            if code is None or debug:
                raise
            _fail(code, f"error: {_where()}{exn} ({type(exn).__name__}; {DEBUG_FLAG} shows the traceback)")
    return run


def _stopped(exn: BaseException) -> bool:
    """A run stopped on a signal or its time limit (training/preemption.py): every rank stopped at the same
    step and exits with STOPPED_EXIT at once (a scheduler's kill may follow soon); the first process of
    each node says where the run was saved."""
    if "magclip.training.preemption" not in sys.modules:
        return False
    from magclip.training.preemption import STOPPED_EXIT, TrainingStopped

    exn = _stop_within(exn, TrainingStopped)
    if exn is None:
        return False
    if _reports_errors():
        print(f"{_where()}{exn}", file=sys.stderr)
        marker = os.environ.get(STOPPED_FILE_ENV)
        if marker:  # a launcher (torchrun) hides the exit code: a batch script reads this file instead
            try:
                Path(marker).write_text(f"{exn}\n")
            except OSError as err:
                print(f"could not write {STOPPED_FILE_ENV}={marker}: {err}", file=sys.stderr)
    if _in_process_group():
        _exit_now(STOPPED_EXIT)
    raise SystemExit(STOPPED_EXIT) from None


def _stop_within(exn: BaseException, stopped: type) -> BaseException | None:
    """The stop `exn` is or wraps: a signal during the start raises TrainingStopped wherever the interpreter is, and
    the code it lands in may catch it and raise its own error from it (an import or loading wrapper that names
    what failed); the run must still end as a stop (exit 75), not as a failure."""
    seen: set[int] = set()
    while exn is not None and id(exn) not in seen:
        if isinstance(exn, stopped):
            return exn
        seen.add(id(exn))
        exn = exn.__cause__ or exn.__context__
    return None


REPORT_GRACE_S = 10.0  # how long a silent process waits for its node's first process to say why


def _fail(code: int, line: str) -> None:
    """Say why and exit with `code`. Under a launcher every process of a node checks the same input and
    fails alike: the node's first process says so at once; the others wait up to REPORT_GRACE_S for it
    (the launcher stops them when it exits, and they exit with the same code) and say it themselves
    only when they outlive the wait: then the failure was theirs alone (another config, a lost peer).
    Exiting at once would let the launcher stop the first process before its line is written."""
    if not _reports_errors():
        _wait_for_the_reporting_process(code)
        line = f"rank {os.environ.get('RANK', '?')}: {line}"
    print(line, file=sys.stderr)
    if _in_process_group():
        _exit_now(code)
    raise SystemExit(code) from None


def _wait_for_the_reporting_process(code: int) -> None:
    import signal
    import time

    _stop_heartbeat()  # peers must not take this process for a live one while it waits
    signal.signal(signal.SIGTERM, lambda signum, frame: _exit_now(code))
    time.sleep(REPORT_GRACE_S)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _in_process_group() -> bool:
    """A process group is up. Never imports anything: a stop signal can interrupt the command inside
    `import torch`, and importing the half-initialised package again would fail on its own."""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except AttributeError:  # torch.distributed only half imported: no group can be up yet
        return False


def _exit_now(code: int) -> None:
    """Leave without running destructors: at interpreter exit gloo's threads can still be joinable while
    a process group is torn down, and the process then dies of SIGABRT ("terminate called without an
    active exception") instead of exiting with `code`. Every stream is flushed first; the peers see
    the connection close."""
    import logging

    _stop_heartbeat()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or full stream: nothing more can be said
            pass
    os._exit(code)


def _stop_heartbeat() -> None:
    """magclip.distributed's heartbeat, where this command loaded torch.distributed at all."""
    if "torch.distributed" in sys.modules:
        from magclip.distributed import stop_heartbeat

        stop_heartbeat()


def _reports_errors() -> bool:
    """The first process of each node, or a process started without a launcher."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _where() -> str:
    """'node N: ' in a multi-node run (torchrun's GROUP_RANK), so each node's one line can be told apart."""
    nodes = os.environ.get("GROUP_WORLD_SIZE", "1")
    return f"node {os.environ.get('GROUP_RANK', '?')}: " if nodes.isdigit() and int(nodes) > 1 else ""
