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
