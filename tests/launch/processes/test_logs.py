"""The log layout (where each attempt's files go, and what is removed at exit) and the tee
pump (prefixed lines to the console, whole lines to the logs)."""

from __future__ import annotations

import io
import os

import pytest
from elastic_launch.api import ConfigError
from elastic_launch.processes.logs import LogLayout, OutputPump


def test_a_temporary_log_dir_is_removed_unless_it_holds_asked_for_logs():
    layout = LogLayout(None, "job/1")
    assert os.path.basename(layout.run_dir).startswith("job_1_"), "a safe name for the run id"
    assert layout.rank_dir(2, 1).endswith("attempt_2/1") and os.path.isdir(layout.rank_dir(2, 1))
    assert layout.rank_dir(2, 1, generation=3).endswith("attempt_2/1_r3")
    assert not layout.kept
    layout.close()
    assert not os.path.exists(layout.temporary)
    kept = LogLayout(None, "job", logs_requested=True)
    try:
        assert kept.kept
        kept.close()
        assert os.path.isdir(kept.run_dir)
    finally:
        import shutil

        shutil.rmtree(kept.temporary)


def test_the_users_log_dir_is_kept_and_dev_null_keeps_nothing(tmp_path):
    with LogLayout(str(tmp_path / "logs"), "r") as layout:
        assert layout.kept and layout.keep_logs
    assert os.path.isdir(layout.run_dir)
    with LogLayout(os.devnull, "r", logs_requested=True) as quiet:
        assert not quiet.keep_logs and not quiet.kept
    assert not os.path.exists(quiet.run_dir)


def test_unusable_log_dirs_are_named(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(ConfigError, match=f"--log-dir '{a_file}' is a file"):
        LogLayout(str(a_file), "r")
    with pytest.raises(ConfigError, match=f"--log-dir '{a_file}/sub' cannot be used"):
        LogLayout(str(a_file / "sub"), "r")


class Sink(io.BytesIO):
    def close(self) -> None:  # keep the contents readable after the pump is done
        pass


def test_the_pump_copies_whole_prefixed_lines_and_filters():
    pump = OutputPump()
    log, console, filtered = Sink(), Sink(), Sink()
    r, w = os.pipe()
    pump.add(r, log, console, "[h:w0]:", filtered, ["loss"])
    os.write(w, b"step 1 loss=2.0\nhalf a li")
    os.write(w, b"ne\nno newline at the end")
    os.close(w)
    assert pump.wait_drained(5.0)
    assert log.getvalue() == b"step 1 loss=2.0\nhalf a line\nno newline at the end\n"
    assert console.getvalue().splitlines() == [
        b"[h:w0]:step 1 loss=2.0",
        b"[h:w0]:half a line",
        b"[h:w0]:no newline at the end",
    ]
    assert filtered.getvalue() == b"[h:w0]:step 1 loss=2.0\n"


def test_a_broken_console_does_not_stop_the_log():
    class Broken(Sink):
        def write(self, data):
            raise BrokenPipeError

    pump = OutputPump()
    log = Sink()
    r, w = os.pipe()
    pump.add(r, log, Broken(), "")
    os.write(w, b"a\nb\n")
    os.close(w)
    assert pump.wait_drained(5.0)
    assert log.getvalue() == b"a\nb\n"


def test_a_line_without_end_is_cut_not_held_whole(monkeypatch):
    """A worker that writes megabytes without a newline: the pump holds at most one line's
    limit of it, and copies it all, in lines of the limit."""
    from elastic_launch.processes import logs

    monkeypatch.setattr(logs, "LINE_LIMIT", 1000)
    pump = OutputPump()
    log, console = Sink(), Sink()
    r, w = os.pipe()
    pump.add(r, log, console, "[w0]:")
    for _ in range(50):
        os.write(w, b"x" * 999)
    os.write(w, b"end\n")
    os.close(w)
    assert pump.wait_drained(5.0)
    lines = console.getvalue().splitlines()
    assert all(len(line) <= len(b"[w0]:") + 1000 for line in lines), [len(x) for x in lines][:5]
    assert b"".join(line.removeprefix(b"[w0]:") for line in lines) == b"x" * 49950 + b"end"
