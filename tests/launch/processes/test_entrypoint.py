"""Entrypoints from the command line and from launch(), checked before anything starts."""

from __future__ import annotations

import sys

import pytest
from elastic_launch.api import ConfigError
from elastic_launch.processes.entrypoint import Entrypoint, Kind


def test_from_the_command_line(tmp_path):
    assert Entrypoint.from_command_line("t.py", ["--", "a"], False, False, False) == Entrypoint(
        Kind.SCRIPT, "t.py", ["a"]
    )
    assert Entrypoint.from_command_line("pkg.mod", [], True, False, False).kind == Kind.MODULE
    assert Entrypoint.from_command_line("./run.sh", [], False, True, False).kind == Kind.BINARY
    assert Entrypoint.from_command_line("t.py", [], False, True, True).kind == Kind.SCRIPT
    with pytest.raises(ConfigError, match="'--no-python' flag and the '--module' flag"):
        Entrypoint.from_command_line("x", [], True, True, False)


def test_torchs_launch_convention():
    assert Entrypoint.for_launch(print, (1,)).kind == Kind.FUNCTION
    ep = Entrypoint.for_launch(sys.executable, ("-u", "-W", "ignore", "-m", "pkg.main", "x"))
    assert (ep.kind, ep.target, ep.args) == (Kind.MODULE, "pkg.main", ["x"])
    ep = Entrypoint.for_launch(sys.executable, ("-u", "train.py", "--lr", 1))
    assert (ep.kind, ep.target, ep.args) == (Kind.SCRIPT, "train.py", ["--lr", "1"])
    assert Entrypoint.for_launch("train.py", ()).kind == Kind.SCRIPT
    assert Entrypoint.for_launch("/bin/echo", ("hi",)).kind == Kind.BINARY


def test_checks_name_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"training script '.*nope.py' does not exist"):
        Entrypoint(Kind.SCRIPT, str(tmp_path / "nope.py")).check()
    with pytest.raises(ConfigError, match="module 'no_such_mod' cannot be found"):
        Entrypoint(Kind.MODULE, "no_such_mod").check()
    with pytest.raises(ConfigError, match="program 'no-such-program' is not an executable"):
        Entrypoint(Kind.BINARY, "no-such-program").check()
    Entrypoint(Kind.BINARY, "true").check()


def test_worker_arguments_and_commands():
    script = Entrypoint(Kind.SCRIPT, "t.py", ["--dev", "${local_rank}"])
    assert script.worker_argv(2) == ["--", "t.py", "--dev", "2"]
    command = script.command(script.worker_argv(0))
    assert command[1:4] == ["-u", "-m", "elastic_launch.processes.worker_main"]
    binary = Entrypoint(Kind.BINARY, "/bin/echo", ["${local_rank}"])
    assert binary.command(binary.worker_argv(1)) == ["/bin/echo", "1"]
    function = Entrypoint(Kind.FUNCTION, print)
    assert function.worker_argv(0, "/spec") == ["--function", "/spec"]
    assert function.name == "print"
