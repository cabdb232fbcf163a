"""A stop signal during the start raises TrainingStopped wherever the interpreter is; a library may re-raise it as
its own error from it (an import or loading wrapper naming what failed). The command still ends as a stop (exit 75),
and a plain error still ends as a failure."""

import pytest

from magclip.cli import as_command
from magclip.training.preemption import STOPPED_EXIT, TrainingStopped


def _wrapped_stop() -> None:
    try:
        raise TrainingStopped("SIGTERM")
    except Exception as exn:  # a wrapper that names what failed
        raise RuntimeError("failed to import a module of the model") from exn


def test_a_stop_a_library_wrapped_still_exits_as_a_stop(capsys):
    with pytest.raises(SystemExit) as info:
        as_command(_wrapped_stop)()
    assert info.value.code == STOPPED_EXIT
    assert "stopped on SIGTERM" in capsys.readouterr().err


def test_an_error_without_a_stop_inside_is_not_one():
    def fails() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        as_command(fails)()
