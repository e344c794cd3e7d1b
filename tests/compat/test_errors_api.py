"""torch's ``@record``, ``ProcessFailure`` and ``ChildFailedError`` on elasticrun's
``elastic_launch.errors``: what torch 2.13's
``test/distributed/elastic/multiprocessing/errors/api_test.py`` pins, each test naming the
upstream test it follows (written here; no code of torch's is copied)."""

from __future__ import annotations

import json
import signal

import pytest
from elastic_launch.errors import (
    ERROR_FILE_ENV,
    NO_TRACEBACK,
    ChildFailedError,
    ProcessFailure,
    record,
    write_error_file,
)


class SentinelError(Exception):
    pass


@record
def raises() -> None:
    raise SentinelError("foobar")


@record
def exits(code: int) -> None:
    raise SystemExit(code)


@record
def returns() -> int:
    return 42


@pytest.fixture
def error_file(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    return path


def failure_with_file(path, exc: BaseException) -> ProcessFailure:
    try:
        raise exc
    except BaseException as e:
        write_error_file(e)
    return ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=str(path))


def test_failure_incorrect_reply_file(tmp_path):
    """upstream: test_failure_incorrect_reply_file"""
    bad = tmp_path / "error.json"
    bad.write_text(json.dumps({"unknown_key": "x"}))
    with pytest.raises(KeyError):
        ProcessFailure(0, 997, 1, str(bad))


@pytest.mark.parametrize("stamp", [10, "10"])
def test_process_failure_new_format(tmp_path, stamp):
    """upstream: test_process_failure_new_format, test_process_mast_error_format"""
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "test error message", "timestamp": stamp}))
    pf = ProcessFailure(0, 997, 1, str(path))
    assert pf.message == "test error message"
    assert pf.timestamp == 10


def test_process_failure(error_file):
    """upstream: test_process_failure"""
    pf = failure_with_file(error_file, SentinelError("foobar"))
    assert (pf.local_rank, pf.pid, pf.exitcode, pf.error_file) == (0, 997, 1, str(error_file))
    extra = pf.error_file_data["message"]["extraInfo"]
    assert extra["timestamp"] == str(pf.timestamp)
    assert pf.message and pf.signal_name() == "<N/A>"


def test_process_failure_signal():
    """upstream: test_process_failure_signal"""
    pf = ProcessFailure(0, 997, -signal.SIGSEGV, "ignored.json")
    assert pf.signal_name() == "SIGSEGV"
    assert pf.message == f"Signal {signal.SIGSEGV.value} (SIGSEGV) received by PID 997"


def test_process_failure_no_error_file():
    """upstream: test_process_failure_no_error_file"""
    pf = ProcessFailure(0, 997, 138, "ignored.json")
    assert pf.signal_name() == "<N/A>"
    assert pf.error_file == "<N/A>"
    assert pf.message == NO_TRACEBACK


def test_child_failed_error(error_file, tmp_path):
    """upstream: test_child_failed_error: the root cause is the first failure in time (ties:
    the first given)."""
    pf0 = failure_with_file(error_file, SentinelError("zero"))
    other = tmp_path / "other.json"
    pf1 = ProcessFailure(1, 998, 1, str(error_file))
    pf2 = ProcessFailure(2, 999, 1, str(other))
    pf2.timestamp = pf0.timestamp + 5
    err = ChildFailedError("trainer.par", {0: pf0, 1: pf1, 2: pf2})
    assert err.get_first_failure() == (0, pf0)
    assert err.name == "trainer.par" and set(err.failures) == {0, 1, 2}
    with pytest.raises(AssertionError):
        ChildFailedError("empty", {})


def test_record(error_file):
    """upstream: test_record"""
    with pytest.raises(SentinelError):
        raises()
    data = json.loads(error_file.read_text())
    assert data["message"]["message"] == "SentinelError: foobar"
    assert data["message"]["extraInfo"]["py_callstack"]
    assert data["message"]["extraInfo"]["timestamp"]


def test_record_system_exit(error_file):
    """upstream: test_record_system_exit: exit code 0 returns (None), nothing recorded"""
    assert exits(0) is None
    assert not error_file.exists()


def test_record_system_exit_error(error_file):
    """upstream: test_record_system_exit_erronr: another code goes up, unrecorded"""
    with pytest.raises(SystemExit) as e:
        exits(1)
    assert e.value.code == 1
    assert not error_file.exists()


def test_record_no_error_file(monkeypatch):
    """upstream: test_record_no_error_file"""
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    with pytest.raises(SentinelError):
        raises()


def test_record_good_fn(error_file):
    """upstream: test_record_good_fn; and the return value comes back"""
    assert returns() == 42
    assert not error_file.exists()


def test_record_child_failure(tmp_path, monkeypatch):
    """upstream: test_record_child_failure: the root cause's error file becomes the parent's,
    with its exit code"""
    child = tmp_path / "trainer" / "0" / "error.json"
    child.parent.mkdir(parents=True)
    monkeypatch.setenv(ERROR_FILE_ENV, str(child))
    pf = failure_with_file(child, SentinelError("in the child"))
    parent = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(parent))

    @record
    def launcher() -> None:
        raise ChildFailedError("trainer", {0: pf})

    with pytest.raises(ChildFailedError):
        launcher()
    data = json.loads(parent.read_text())
    assert data["message"]["message"] == "SentinelError: in the child"
    assert data["message"]["errorCode"] == 1


def test_record_child_failure_no_child_error_file(tmp_path, monkeypatch):
    """upstream: test_record_child_failure_no_child_error_file"""
    parent = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(parent))
    pf = ProcessFailure(0, 997, 1, "")
    assert pf.error_file == "<N/A>"

    @record
    def launcher() -> None:
        raise ChildFailedError("trainer", {0: pf})

    with pytest.raises(ChildFailedError):
        launcher()
    assert not parent.exists()


def test_child_failed_error_signal_name_in_message():
    """upstream: test_child_failed_error_signal_name_in_message"""
    pf = ProcessFailure(0, 997, -signal.SIGSEGV, "ignored.json")
    text = str(ChildFailedError("trainer.par", {0: pf}))
    assert "(SIGSEGV)" in text and "exitcode  : -11" in text
    assert "trainer.par FAILED" in text
