"""The agent: crashes and hangs are restarted, exhausted restarts are reported, nothing is left."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from launcher_util import (
    HERE,
    alive,
    finish,
    kill_all,
    run,
    start,
    wait_for,
    wait_gone,
    worker_args,
)

BASE = ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05"]


def all_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in out.glob("*.pid")]


@pytest.mark.parametrize("how", ["raise", "exit", "sigkill"])
def test_crash_is_restarted_and_the_run_completes(out, how):
    result = run(
        [
            *BASE,
            "--max-restarts",
            "2",
            *worker_args(out, "--fail-rank", "1", "--fail-until", "1", "--how", how),
        ],
        out,
    )
    assert result.returncode == 0, result.stderr
    pids = result.pids()
    assert {"0-1", "1-0", "1-1"} <= set(pids), "attempt 0 failed, attempt 1 ran"
    assert not any(tag.startswith("2-") for tag in pids), "no third attempt"
    assert result.env("1-1")["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert result.env("0-1")["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert "restarting the workers (restart 1 of 2)" in result.stderr
    assert wait_gone(list(pids.values())) == []


ATTACK = HERE / "scripts" / "heartbeat_attack.py"
#: What the launcher reads after the attack is intact (the worker's mapping still reaches it):
#: nothing to report of rank 0, and rank 1's hang is what ends the attempt.
UNSEEN = {"grow", "unlink", "replace"}


@pytest.mark.parametrize(
    "attack",
    ["truncate", "grow", "zeros", "ones", "random", "unlink", "replace", "future", "timeout"],
)
def test_a_worker_breaking_its_heartbeat_file_fails_alone_and_hangs_are_still_seen(out, attack):
    # Rank 0 attacks its own heartbeat file, rank 1 hangs. The launcher must live (a cut file
    # once gave it SIGBUS, rc 135), name rank 0 with what it did, or (for what leaves the
    # launcher's view intact) still catch rank 1's hang; then restart with good files.
    proc = start(
        [*BASE, "--max-restarts", "1", "--hang-timeout", "2", str(ATTACK), "--attack", attack]
    )
    code, _, err = finish(proc, 120)
    assert code == 0, err[-3000:]
    assert "restarting the workers (restart 1 of 1)" in err, err[-3000:]
    first = next(line for line in err.splitlines() if "restarting the workers" in line)
    if attack in UNSEEN:
        assert "after: rank 1 hung" in first, first
    elif attack == "truncate":  # rank 0's own next beat through its mapping: SIGBUS in rank 0
        assert "after: rank 0 " in first and ("SIGBUS" in first or "truncated" in first), first
    else:
        said = {"future": "in the future", "timeout": "longer than the 604800000 ms"}
        assert "after: rank 0 broke its heartbeat" in first, first
        assert said.get(attack, "was overwritten") in first, first
    assert glob.glob(f"/dev/shm/elasticrun-{proc.pid}-*") == [], "the tables were removed"


def test_exhausted_restarts_print_the_root_cause(out):
    result = run(
        [
            *BASE,
            "--max-restarts",
            "1",
            *worker_args(
                out, "--fail-rank", "1", "--fail-until", "9", "--how", "raise", "--sleep", "30"
            ),
        ],
        out,
    )
    assert result.returncode == 1
    err = result.stderr
    assert "worker.py FAILED" in err
    assert "after 2 attempt(s), 1 restart(s)" in err
    root = err.split("Root cause (first failure):", 1)[1]
    assert "rank       : 1 (local rank 1" in root
    assert "attempt    : 1" in root
    assert "failure    : exit code 1" in root
    assert "error      : RuntimeError: injected failure on rank 1 at restart 1" in root
    assert 'File "' in root and "in fail" in root, "the worker's traceback"
    assert "worker_main.py" not in root, "the launcher's own frames are not shown"
    assert "rank 0 (local rank 0): stopped by elasticrun after the root cause (SIGTERM; " in err
    assert wait_gone(all_pids(out)) == []


def test_exit_code_and_signal_are_named(out):
    result = run(
        [
            *BASE,
            *worker_args(
                out,
                "--fail-rank",
                "0",
                "--fail-until",
                "1",
                "--how",
                "exit",
                "--exit-code",
                "7",
                "--sleep",
                "30",
            ),
        ],
        out,
    )
    assert result.returncode == 1
    assert "failure    : exit code 7" in result.stderr
    result = run(
        [
            *BASE,
            *worker_args(
                out, "--fail-rank", "1", "--fail-until", "1", "--how", "sigkill", "--sleep", "30"
            ),
        ],
        out,
    )
    assert result.returncode == 1
    assert "failure    : killed by SIGKILL (signal 9)" in result.stderr


@pytest.mark.timeout(180)
def test_hang_is_detected_its_stack_logged_and_the_group_restarted(out, tmp_path):
    logs = tmp_path / "logs"
    result = run(
        [
            *BASE,
            "--max-restarts",
            "1",
            "--hang-timeout",
            "1.5",
            "--log-dir",
            str(logs),
            "--redirects",
            "3",
            *worker_args(
                out,
                "--fail-rank",
                "1",
                "--fail-until",
                "1",
                "--how",
                "hang",
                "--steps",
                "40",
                "--fail-at-step",
                "5",
            ),
        ],
        out,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr
    assert "rank 1 hung" in result.stderr
    (run_dir,) = [d for d in logs.iterdir() if d.is_dir()]  # beside it: the learned imports
    stderr0 = (run_dir / "attempt_0" / "1" / "stderr.log").read_text()
    assert "Python stacks of rank 1" in stderr0
    assert "stuck_in_the_data_loader" in stderr0
    assert (run_dir / "attempt_1" / "1" / "stdout.log").exists(), "the group restarted"
    assert wait_gone(all_pids(out)) == []


@pytest.mark.timeout(180)
def test_automatic_hang_timeout_learns_from_the_steps(out):
    # Steps of ~10 ms: factor 10 x p99 is far below the floor, so the floor (1 s) applies; the
    # hung worker sleeps, so it shows no CPU time or I/O either.
    result = run(
        [
            *BASE,
            "--hang-timeout",
            "auto",
            "--hang-timeout-floor",
            "1",
            *worker_args(
                out,
                "--fail-rank",
                "0",
                "--fail-until",
                "1",
                "--how",
                "hang",
                "--steps",
                "60",
                "--fail-at-step",
                "30",
            ),
        ],
        out,
        timeout=150,
    )
    assert result.returncode == 1
    assert "failure    : hung: no progress for" in result.stderr
    # What it learned depends on the machine's speed; that it applied it does not.
    said = re.search(
        r"the limit is (\d+) s under --hang-timeout auto: "
        r"max\(--hang-timeout-floor 1 s, 10 x p99 step interval ([\d.]+) s\)",
        result.stderr,
    )
    assert said, result.stderr[-3000:]
    limit, p99 = int(said[1]), float(said[2])
    assert abs(limit - max(1.0, 10 * p99)) <= 0.6, "the limit is max(floor, factor x p99)"
    assert "stuck_in_the_data_loader" in result.stderr, "the stack is in the summary"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_to_the_launcher_stops_everything(out, sig):
    proc = start([*BASE, "--shutdown-timeout", "2", *worker_args(out, "--sleep", "120")])
    try:
        assert wait_for(lambda: len(list(out.glob("*.pid"))) == 2), "workers did not start"
        pids = all_pids(out)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, err
        assert f"stopped by signal {int(sig)}" in err
        assert wait_gone(pids) == [], "a worker survived its launcher"
        assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"elasticrun-{proc.pid}-")]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period(out, tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(
        "import os, signal, sys, time\n"
        f"open(os.path.join({str(out)!r}, os.environ['RANK'] + '.pid'), 'w')"
        ".write(str(os.getpid()))\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(0.5); sys.exit(4)\n"
        "time.sleep(120)\n"
    )
    start_t = time.monotonic()
    result = run([*BASE, "--shutdown-timeout", "1", str(script)], out)
    assert result.returncode == 1
    assert time.monotonic() - start_t < 60
    assert (
        "stopped by elasticrun after the root cause (SIGTERM, then SIGKILL; killed by SIGKILL"
        in result.stderr
    )
    assert wait_gone(all_pids(out)) == []


def test_children_of_workers_are_stopped_too(out, tmp_path):
    script = tmp_path / "forker.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open(os.path.join({str(out)!r}, 'child-' + os.environ['RANK'] + '.pid'), 'w')"
        ".write(str(child.pid))\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(0.3); sys.exit(1)\n"
        "time.sleep(120)\n"
    )
    result = run([*BASE, str(script)], out)
    assert result.returncode == 1
    children = all_pids(out)
    assert len(children) == 2
    assert wait_gone(children) == [], "a worker's child was left behind (an orphan)"
    assert not any(alive(p) for p in children)


@pytest.mark.timeout(180)
def test_two_jobs_on_one_host_do_not_collide(tmp_path):
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = []
    for out in outs:
        out.mkdir()
        procs.append(
            start(
                [
                    *BASE,
                    "--max-restarts",
                    "1",
                    *worker_args(
                        out, "--dist", "--fail-rank", "0", "--fail-until", "1", "--how", "exit"
                    ),
                ]
            )
        )
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for out in outs:
            kill_all(all_pids(out))
    ports = {json.loads((o / "1-0.env.json").read_text())["MASTER_PORT"] for o in outs}
    assert len(ports) == 2, "each job got its own port"


FILE_ATTACK = HERE / "scripts" / "file_attack.py"


@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("what", ["error", "loop", "stack", "log"])
def test_what_a_worker_leaves_at_a_launchers_path_never_blocks_it(out, what, kind):
    """Rank 0 replaces its error, loop or stack file, or its stderr log, with a FIFO nobody
    writes or a directory, then fails or hangs. The launcher reads and appends without
    blocking (it hung in open() before), names rank 0, and restarts."""
    logs = ["--log-dir", str(out / "logs"), "--redirects", "2"] if what == "log" else []
    args = [*BASE, "--max-restarts", "1", "--hang-timeout", "2", *logs]
    proc = start([*args, str(FILE_ATTACK), "--what", what, "--kind", kind])
    code, _, err = finish(proc, 120)
    assert code == 0, err[-3000:]
    first = next(line for line in err.splitlines() if "restarting the workers" in line)
    assert "after: rank 0 " in first, first


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
@pytest.mark.parametrize("what", ["next-attempt", "next-log", "memory"])
def test_what_a_worker_leaves_where_the_launcher_makes_or_removes_is_moved_aside(out, what, kind):
    """Rank 0 leaves a FIFO, or a link to a directory of the user's, where the launcher will
    make the next attempt's directory or its stderr log, or in place of the node's memory-tier
    directory, then fails. The launcher moves it aside (it crashed at the restart, or blocked
    in open(), before), restarts, and at its end removes the memory tier's path without
    following the link."""
    elsewhere = out / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("mine")
    logs = ["--log-dir", str(out / "logs"), "--redirects", "2"]
    args = [*BASE, "--max-restarts", "1", *logs]
    command = [*args, str(FILE_ATTACK), "--what", what, "--kind", kind]
    proc = start(command, env={"ELSEWHERE": str(elsewhere)})
    code, said, err = finish(proc, 120)
    assert code == 0, err[-3000:]
    planted = next(line for line in said.splitlines() if "rank 0 left a" in line).split(" at ")[1]
    if what == "memory":
        assert not os.path.lexists(planted), "the memory tier's path is removed"
    else:
        assert (
            f"a worker left a {'FIFO' if kind == 'fifo' else 'symbolic link'} at {planted}" in err
        )
        assert os.path.isdir(os.path.dirname(planted))
    assert sorted(os.listdir(elsewhere)) == ["keep"], "the link was never followed"


DAEMON = HERE / "scripts" / "daemon.py"


@pytest.mark.parametrize("end", ["exit", "SIGTERM", "SIGKILL"])
def test_a_daemon_a_worker_starts_ends_with_the_job(out, end):
    """A daemon (setsid, double fork) left the worker's process group and session; it is in
    the workers' cgroup, which the launcher kills as it ends (the guardian, when the launcher
    is SIGKILLed). Without a cgroup v2 subtree to make, the launcher says so and this is
    skipped (the process groups are all it can end)."""
    from elastic_launch.processes.cgroup import Container

    probe = Container.make()
    if probe.path is None:
        pytest.skip(probe.why)
    probe.kill()
    pid_file = out / "daemon.pid"
    go = out / "go"  # the workers exit once it exists
    proc = start([*BASE, str(DAEMON), str(pid_file), str(go)])
    try:
        assert wait_for(pid_file.exists, 60), "the daemon never started"
        daemon = int(pid_file.read_text())
        assert alive(daemon)
        if end == "exit":
            go.touch()
        else:
            os.kill(proc.pid, getattr(signal, end))
        proc.wait(60)
        assert wait_gone([daemon], 10) == [], f"the daemon outlived the launcher ({end})"
    finally:
        kill_all([proc.pid])
        if pid_file.exists():
            kill_all([int(pid_file.read_text())])
