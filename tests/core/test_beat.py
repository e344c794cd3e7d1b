"""elastic_core.beat(): found from the environment the launcher sets, a no-op outside it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import elastic_core as ec


def run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_HEARTBEAT")}
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_beat_is_a_noop_outside_the_launcher():
    result = run(
        """
        import elastic_core
        for _ in range(1000):
            elastic_core.beat()
        elastic_core.beat(step=5)
        elastic_core.set_hang_timeout(3)
        print(elastic_core.heartbeat_slot())
        """,
        {},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


def test_beat_finds_its_slot_from_the_environment(shm_path):
    path = shm_path("env")
    with ec.HeartbeatTable.create(path, 3) as table:
        result = run(
            """
            import elastic_core
            elastic_core.beat()
            elastic_core.beat()
            elastic_core.beat(step=10)
            elastic_core.beat()
            elastic_core.set_hang_timeout(2.5)
            print(elastic_core.heartbeat_slot())
            """,
            {ec.HEARTBEAT_FILE_ENV: path, ec.HEARTBEAT_SLOT_ENV: "2"},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "2"
        info = table.read(2)
        assert info.step == 11
        assert info.timeout_ms == 2500
        assert info.state == ec.SlotState.DETACHED, "a clean exit detaches"


def test_forked_child_does_not_beat_its_parents_slot(shm_path):
    path = shm_path("fork")
    with ec.HeartbeatTable.create(path, 2) as table:
        result = run(
            """
            import os, elastic_core
            elastic_core.beat(step=1)
            pid = os.fork()
            if pid == 0:
                os.environ["ELASTIC_HEARTBEAT_SLOT"] = "1"
                elastic_core.beat(step=99)   # resolves again: slot 1
                os._exit(0)
            os.waitpid(pid, 0)
            """,
            {ec.HEARTBEAT_FILE_ENV: path, ec.HEARTBEAT_SLOT_ENV: "0"},
        )
        assert result.returncode == 0, result.stderr
        assert table.read(0).step == 1
        assert table.read(1).step == 99


def test_bad_environment_is_a_clear_error(shm_path):
    result = run(
        "import elastic_core; elastic_core.beat()",
        {ec.HEARTBEAT_FILE_ENV: shm_path("gone"), ec.HEARTBEAT_SLOT_ENV: "0"},
    )
    assert result.returncode != 0
    assert "BadFileError" in result.stderr
    assert "does not exist" in result.stderr

    path = shm_path("slot")
    with ec.HeartbeatTable.create(path, 1):
        result = run(
            "import elastic_core; elastic_core.beat()",
            {ec.HEARTBEAT_FILE_ENV: path, ec.HEARTBEAT_SLOT_ENV: "zero"},
        )
    assert result.returncode != 0
    assert "ELASTIC_HEARTBEAT_SLOT='zero' is not a slot index" in result.stderr


def test_bad_step_is_a_clear_error(shm_path):
    path = shm_path("step")
    with ec.HeartbeatTable.create(path, 1):
        result = run(
            """
            import elastic_core
            for bad in (-1, "x", 2**64):
                try:
                    elastic_core.beat(bad)
                except (ValueError, TypeError) as e:
                    print(type(e).__name__, e)
            try:
                elastic_core.beat(1, 2)
            except TypeError as e:
                print("TypeError", e)
            """,
            {ec.HEARTBEAT_FILE_ENV: path, ec.HEARTBEAT_SLOT_ENV: "0"},
        )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "ValueError beat(step=-1): step must be an int from 0 to 2**64-1"
    assert lines[1].startswith("ValueError beat(step='x')")
    assert lines[2].startswith("ValueError beat(step=18446744073709551616)")
    assert "takes one optional argument" in lines[3]


def test_quiet_sets_a_limit_for_the_phase_and_restores_the_previous_one(shm_path):
    path = shm_path("quiet")
    with ec.HeartbeatTable.create(path, 1) as table:
        result = run(
            """
            import elastic_core as ec
            for _ in range(4):
                ec.beat()
            ec.set_hang_timeout(30)
            with ec.quiet(900):
                print(ec.hang_timeout(), ec.current_step())
                with ec.quiet():
                    print(ec.hang_timeout())
                print(ec.hang_timeout())
            print(ec.hang_timeout(), ec.current_step())
            try:
                ec.quiet(0).__enter__()
            except ValueError as e:
                print(e)
            """,
            {ec.HEARTBEAT_FILE_ENV: path, ec.HEARTBEAT_SLOT_ENV: "0"},
        )
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == "900.0 4", "the phase has its own limit; the step does not move"
        assert lines[1] == "604800.0", "quiet() without seconds: the longest a worker may set"
        assert lines[2] == "900.0" and lines[3] == "30.0 4", "nested blocks restore in turn"
        assert "quiet(seconds=0): give seconds greater than 0" in lines[4]
        info = table.read(0)
        assert info.step == 4 and info.timeout_ms == 30_000


def test_quiet_is_a_noop_outside_the_launcher():
    result = run("import elastic_core as ec\nwith ec.quiet(5):\n    print(ec.hang_timeout())\n", {})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0.0"


def test_a_timeout_longer_than_seven_days_is_refused(shm_path):
    """The watchdog takes a slot asking for more than 7 days for one the worker's library did
    not write (a scribble), so the library never writes one."""
    path = shm_path("long")
    with ec.HeartbeatTable.create(path, 1) as table:
        result = run(
            """
            import elastic_core as ec
            ec.beat()
            for seconds in (604800, 604801, 1e9):
                try:
                    ec.set_hang_timeout(seconds)
                    print("set", seconds)
                except ValueError as e:
                    print(e)
            """,
            {ec.HEARTBEAT_FILE_ENV: path, ec.HEARTBEAT_SLOT_ENV: "0"},
        )
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == "set 604800"
        assert lines[1].startswith("seconds=604801.0 is longer than the 604800 s (7 days)")
        assert "seconds=1000000000.0 is longer" in lines[2]
        assert table.read(0).timeout_ms == 604_800_000
