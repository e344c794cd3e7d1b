"""Error files: written in torch's format by ``@record`` and the worker's uncaught exceptions,
read back for the summary (torch's files too)."""

from __future__ import annotations

import json

import pytest
from elastic_launch.errors import read_error_file, record, write_error_file


def test_error_file_round_trip(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def main() -> None:
        raise KeyError("missing")

    with pytest.raises(KeyError):
        main()
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "KeyError: 'missing'"
    assert "raise KeyError" in data["message"]["extraInfo"]["py_callstack"]
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
    parsed = read_error_file(str(path))
    assert parsed is not None and parsed.monotonic_ns is not None
    assert not write_error_file(RuntimeError("second")), "the first error is kept"


def test_torch_error_files_read_too(tmp_path):
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "plain", "timestamp": "12"}))
    parsed = read_error_file(str(path))
    assert parsed is not None and parsed.message == "plain" and parsed.timestamp == 12
    path.write_text("not json")
    assert read_error_file(str(path)) is None


@pytest.mark.parametrize(
    "content",
    [
        "[1, 2]",
        '"a string"',
        '{"message": [1]}',
        '{"message": {"message": "m", "extraInfo": [1]}}',
        '{"message": {"extraInfo": {"monotonic_ns": "1e400"}}}',
        '{"message": {"extraInfo": {"monotonic_ns": "nan"}}}',
        "[" * 100_000 + "]" * 100_000,
    ],
    ids=["list", "string", "list-message", "list-extra", "huge-number", "nan", "deep"],
)
def test_an_error_file_of_any_shape_is_read_without_an_exception(tmp_path, content):
    """The worker writes its error file: the launcher reads whatever is there as data, and
    what is not of torch's shape is no error file at all (never an exception)."""
    path = tmp_path / "e.json"
    path.write_text(content)
    parsed = read_error_file(str(path))
    assert parsed is None or (parsed.monotonic_ns is None and isinstance(parsed.message, str))


def test_an_error_file_longer_than_the_limit_is_not_read(tmp_path, monkeypatch):
    from elastic_launch import errors

    monkeypatch.setattr(errors, "ERROR_FILE_LIMIT", 1000)
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "x" * 2000}))
    assert read_error_file(str(path)) is None, "not read past the limit"
    path.write_text(json.dumps({"message": "x" * 500}))
    assert read_error_file(str(path)) is not None


def test_a_childs_error_file_becomes_this_processs_with_its_exit_code(tmp_path, monkeypatch):
    """upstream: error_handler_test.py's test_dump_error_file: a launcher run by a launcher
    hands its child's error on as its own, with the child's exit code."""
    from elastic_launch.errors import dump_error_file

    child = tmp_path / "child.json"
    child.write_text(json.dumps({"message": {"message": "boom", "extraInfo": {}}}))
    mine = tmp_path / "mine.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(mine))
    dump_error_file(str(child), 3)
    assert json.loads(mine.read_text())["message"] == {
        "message": "boom",
        "extraInfo": {},
        "errorCode": 3,
    }
    child.write_text("{not json")
    mine.unlink()
    dump_error_file(str(child), 3)  # never lets error reporting hide the error itself
    assert not mine.exists()


def test_child_failed_error_formats_root_cause_and_others_as_torchs():
    """upstream: api_test.py's ChildFailedErrorTest.test_failure_format: the name, the other
    failures, then the root cause (the earliest), each with its time as torch prints it."""
    from elastic_launch.errors import ChildFailedError, ProcessFailure

    early, late = ProcessFailure(0, 10, 1, "<N/A>"), ProcessFailure(1, 11, -9, "<N/A>")
    early.timestamp, late.timestamp = 100, 200
    text = ChildFailedError("train.py", {0: early, 1: late}).format_msg()
    assert text.index("train.py FAILED") < text.index("Failures:") < text.index("Root Cause")
    root = text[text.index("Root Cause") :]
    assert "rank      : 0" in root and early.timestamp_isoformat() in root
    assert "rank      : 1" in text[: text.index("Root Cause")]


def test_an_error_whose_message_is_all_is_reported_without_its_traceback(tmp_path, monkeypatch):
    """A setting to fix (ConfigError, elastic_sampler's CheckpointDirectoryError: their
    classes say show_traceback = False) is recorded as such: the summary shows its line."""
    from elastic_launch.api import ConfigError
    from elastic_sampler import CheckpointDirectoryError

    for error, shown in (
        (ConfigError("--x 3: give 1"), False),
        (CheckpointDirectoryError("cannot write checkpoints to '/ro'"), False),
        (ValueError("a bug"), True),
    ):
        path = tmp_path / f"{type(error).__name__}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        assert write_error_file(error)
        parsed = read_error_file(str(path))
        assert parsed is not None and parsed.show_traceback is shown
        assert parsed.message.startswith(type(error).__name__)


def test_a_childs_error_file_is_read_as_untrusted(tmp_path, monkeypatch):
    """The child wrote its error file: a FIFO there must not block the launcher, a link must
    not be followed (to a file the child could not read), a file past the limit is not read."""
    import os

    from elastic_launch import errors

    mine = tmp_path / "mine.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(mine))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    errors.dump_error_file(str(fifo), 3)  # returns: no writer will ever come
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"message": {"message": "not the child's"}}))
    link = tmp_path / "link.json"
    link.symlink_to(secret)
    errors.dump_error_file(str(link), 3)
    monkeypatch.setattr(errors, "ERROR_FILE_LIMIT", 64)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"message": {"message": "x" * 100}}))
    errors.dump_error_file(str(big), 3)
    monkeypatch.setattr(errors, "ERROR_FILE_LIMIT", 4 << 20)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)  # RecursionError in json
    errors.dump_error_file(str(deep), 3)
    assert not mine.exists(), "nothing handed on from any of them"
