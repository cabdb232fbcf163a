"""Console entry points; train/, eval/ and tools/ hold the same commands as scripts of a checkout.

`as_command(main)` is what a command runs: an expected failure (bad input, a refused file, a run that
had to stop) prints one line naming what went wrong and exits non-zero, without a traceback;
`--debug` shows the traceback. Calling `main(argv)` directly (tests, notebooks) raises as usual.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

DEBUG_FLAG = "--debug"
BAD_INPUT_EXIT = 2  # like argparse's usage errors
RUN_FAILED_EXIT = 1


def _expected(exn: BaseException) -> int | None:
    """The exit code of an expected failure, None for a bug."""
    from magclip.training.engine import CheckpointWriteError, NonFiniteLossError

    if isinstance(exn, (NonFiniteLossError, CheckpointWriteError)):
        return RUN_FAILED_EXIT
    if isinstance(exn, (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                        PermissionError)):
        return BAD_INPUT_EXIT
    return None


def as_command(main: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        debug = DEBUG_FLAG in sys.argv
        if debug:
            sys.argv.remove(DEBUG_FLAG)
        try:
            main()
        except Exception as exn:
            code = _expected(exn)
            if code is None or debug:
                raise
            print(f"error: {exn} ({type(exn).__name__}; {DEBUG_FLAG} shows the traceback)", file=sys.stderr)
            raise SystemExit(code) from None
    return run
