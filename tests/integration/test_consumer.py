"""cpp/examples/consumer: a C supervisor built against the installed package (by `make test`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CONSUMER = os.environ.get("ELASTIC_CONSUMER_BIN", "")
pytestmark = pytest.mark.skipif(
    not CONSUMER,
    reason="ELASTIC_CONSUMER_BIN is set by `make test` after installing the C++ package",
)


def consumer(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CONSUMER, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def python_command(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def leftover_tables() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("elastic-consumer-")}


def test_success_first_time():
    before = leftover_tables()
    result = consumer("--", "true")
    assert result.returncode == 0, result.stderr
    assert "attempt 0: EXITED" in result.stderr
    assert leftover_tables() == before


def test_crash_is_restarted():
    code = "import os, sys; sys.exit(1 if os.environ['ELASTIC_RESTART_COUNT'] == '0' else 0)"
    result = consumer("--max-restarts", "2", "--", *python_command(code))
    assert result.returncode == 0, result.stderr
    assert "exited with code 1" in result.stderr
    assert "restarting" in result.stderr
    assert "attempt 1: EXITED" in result.stderr


def test_exhausted_restarts_return_the_exit_code():
    result = consumer("--max-restarts", "2", "--", "sh", "-c", "exit 3")
    assert result.returncode == 3
    assert result.stderr.count("exited with code 3") == 3
    assert "giving up after 2 restart(s)" in result.stderr


def test_hang_is_detected_and_restarted():
    code = (
        "import os, time, elastic_core\n"
        "elastic_core.beat()\n"
        "if os.environ['ELASTIC_RESTART_COUNT'] == '0':\n"
        "    time.sleep(120)\n"
    )
    result = consumer(
        "--hang-timeout",
        "300",
        "--max-restarts",
        "1",
        "--grace",
        "500",
        "--",
        *python_command(code),
    )
    assert result.returncode == 0, result.stderr
    assert "attempt 0: HUNG" in result.stderr
    assert "has not beaten for" in result.stderr


def test_sigterm_stops_the_command(tmp_path: Path):
    pidfile = tmp_path / "pid"
    code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    proc = subprocess.Popen(
        [CONSUMER, "--grace", "500", "--", *python_command(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        worker = int(pidfile.read_text())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, err
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-restarts", "x", "--", "true"], "--max-restarts needs a count, got 'x'"),
        (["--hang-timeout", "-5", "--", "true"], "--hang-timeout needs milliseconds, got '-5'"),
        (["--bogus", "--", "true"], "unknown or incomplete option '--bogus'"),
        (["--"], "no command after '--'"),
    ],
)
def test_usage_errors(args, message):
    result = consumer(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_missing_command_is_reported():
    result = consumer("--max-restarts", "0", "--", "/nonexistent/command")
    assert result.returncode == 127
    assert "cannot run '/nonexistent/command'" in result.stderr
