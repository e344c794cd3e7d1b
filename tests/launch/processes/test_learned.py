"""Learning the workers' imports: the worker's file and its checks, the checked import, the
heir that takes over the spawns, and what is kept for the next run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elastic_launch import learned
from elastic_launch.learned import ImportPlan
from elastic_launch.processes.entrypoint import Entrypoint, Kind
from elastic_launch.processes.preload import PreloadPlan
from elastic_launch.processes.spawn import FreshInterpreter, SpawnRequest, ZygoteFork

# ---- the worker's file -------------------------------------------------------------------------


def test_a_worker_writes_its_modules_in_order_and_what_it_changed_as_digests(tmp_path, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "before")
    learned.remember_start()
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    monkeypatch.setenv("NEW_ONE", "x")
    path = tmp_path / "imports.json"
    learned.record(str(path))
    text = path.read_text()
    assert "hunter2" not in text, "a value is never written, only its digest"
    found = learned.read(str(path))
    assert found is not None
    assert found.modules.index("os") < found.modules.index("elastic_launch.learned")
    assert "__main__" not in found.modules
    assert found.env_changed["SECRET_TOKEN"] == learned.digest("hunter2")
    assert found.env_changed["NEW_ONE"] == learned.digest("x")


def test_a_worker_writes_after_its_first_step_and_after_step_100_only(tmp_path, monkeypatch):
    """Through the worker's own optimizer hook (the beat stubbed out)."""
    import elastic_core
    from elastic_launch.processes import worker_main

    path = tmp_path / "imports.json"
    monkeypatch.setenv(learned.IMPORTS_FILE_ENV, str(path))
    monkeypatch.setattr(elastic_core, "beat", lambda: None)
    monkeypatch.setattr(worker_main, "_steps", 0)
    written = []
    monkeypatch.setattr(learned, "record", lambda p: written.append(worker_main._steps))
    for _ in range(150):
        worker_main._beat_after_step(None, None, None)
    assert written == [1, 100]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object: '\\[1, 2\\]'"),
        (b'{"modules": "torch"}', "must be a list"),
        (b'{"modules": ["os; rm -rf /"]}', "names no module: 'os; rm -rf /'"),
    ],
)
def test_a_file_that_is_not_a_workers_list_is_refused_quoting_what_is_wrong(data, why):
    with pytest.raises(ValueError, match=why):
        learned.parse(data)


def test_what_is_not_a_module_to_import_is_dropped_and_the_rest_is_kept():
    found = learned.parse(
        b'{"modules": ["__main__", "torch", "<run_path>", "os; rm -rf /", 7, "venv.__main__", '
        b'"antigravity", "torch._dynamo", "_sysconfigdata__linux_x86_64-linux-gnu"], '
        b'"env_changed": {"A B": null, "OK": "ab", "BAD": 12}}'
    )
    assert found.modules == ("torch", "torch._dynamo", "_sysconfigdata__linux_x86_64-linux-gnu")
    assert found.env_changed == {"OK": "ab"}


def test_a_file_over_the_limit_or_not_regular_is_refused(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (learned.MAX_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="over"):
        learned.read(str(big))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="FIFO"):
        learned.read(str(fifo))  # never blocks on a FIFO without a writer
    (tmp_path / "link").symlink_to(big)
    with pytest.raises(OSError, match="symbolic link"):
        learned.read(str(tmp_path / "link"))
    assert learned.read(str(tmp_path / "none")) is None


# ---- what differs in the workers, what a fork must not carry -----------------------------------


def test_what_differs_in_the_workers(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("RANK", raising=False)
    for key in ("RANK", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ELASTICRUN_X"):
        assert learned.differs_in_workers(key, {}), "unset here, each worker's own there"
    monkeypatch.setenv("ELASTICRUN_X", "1")
    assert not learned.differs_in_workers("ELASTICRUN_X", {}), "the same here as there"
    assert learned.differs_in_workers("ELASTICRUN_X", {"ELASTICRUN_X": learned.ALWAYS})
    assert not learned.differs_in_workers("HOME", {})
    assert learned.differs_in_workers("HOME", {"HOME": learned.ALWAYS})
    assert not learned.differs_in_workers("HF_HUB_OFFLINE", {"HF_HUB_OFFLINE": learned.digest("1")})
    assert learned.differs_in_workers("HF_HUB_OFFLINE", {"HF_HUB_OFFLINE": learned.digest("0")})
    assert learned.differs_in_workers("HF_HUB_OFFLINE", {"HF_HUB_OFFLINE": None}), "unset there"


def test_the_hazards_of_an_import():
    base = learned._State(python_threads=1, devices=frozenset(), modules=10)
    same = learned.hazard(base, base, set())
    assert same is None
    thread = learned._State(2, frozenset(), 12)
    assert "thread" in (learned.hazard(base, thread, set()) or "")
    device = learned._State(1, frozenset({"/dev/nvidia0"}), 12)
    assert "/dev/nvidia0" in (learned.hazard(base, device, set()) or "")
    assert "$RANK" in (learned.hazard(base, base, {"RANK"}) or "")


# ---- importing, checked (in a fresh interpreter: imports stay) ---------------------------------


def installed(site: Path, packages: dict[str, str]) -> Path:
    """`packages` (name -> its __init__) installed in `site` as one distribution's."""
    for name, source in packages.items():
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(source)
    info = site / "learned_test_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: learned-test-dist\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("\n".join(packages) + "\n")
    return site


PACKAGES = {
    "plain_pkg": "VALUE = 1\n",
    "copies_env_pkg": "import os\nSNAPSHOT = dict(os.environ)\nCOPY = os.environ.copy()\n"
    "ITEMS = [k for k, v in os.environ.items() if k.startswith('ELASTIC')]\n",
    "threaded_pkg": "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(600,), daemon=True, name='poller').start()\n",
    "rank_pkg": "import os\nRANK = os.environ.get('RANK')\n",
    "offline_pkg": "import os\nOFFLINE = os.getenv('OFFLINE_FLAG')\n",
    "device_pkg": "import os\nFD = os.open('/dev/full', os.O_RDONLY)\n",
    "uses_threaded_pkg": "import threaded_pkg\n",
}

TAKE = """
import json, sys
from elastic_launch import learned
taken = learned.take(sys.argv[1].split(","), json.loads(sys.argv[2]))
print(json.dumps({"loaded": taken.loaded, "left_out": taken.left_out,
                  "excluded": taken.excluded, "failed": taken.failed}))
"""


def take(site: Path, names: list[str], differ: dict | None = None) -> dict:
    """`learned.take` in a fresh interpreter whose environment has what a zygote's has: the
    launcher's variables (ELASTICRUN_*), no RANK."""
    env = {**os.environ, "PYTHONPATH": str(site), "OFFLINE_FLAG": "0", "ELASTICRUN_X": "1"}
    env.pop("RANK", None)
    out = subprocess.run(
        [sys.executable, "-c", TAKE, ",".join(names), json.dumps(differ or {})],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_each_import_is_checked_and_what_a_fork_must_not_carry_is_left_out(tmp_path):
    site = installed(tmp_path / "site", PACKAGES)
    names = ["plain_pkg", "copies_env_pkg", "threaded_pkg", "rank_pkg", "device_pkg", "colorsys"]
    found = take(site, [*names, "not_installed_anywhere"])
    assert found["loaded"] == ["plain_pkg", "copies_env_pkg", "colorsys"], (
        "a copy of the whole environment reads no one variable"
    )
    left_out = found["left_out"]
    assert set(left_out) == {"threaded_pkg", "rank_pkg", "device_pkg"}
    assert "thread" in left_out["threaded_pkg"]
    assert "$RANK" in left_out["rank_pkg"]
    assert "/dev/full" in left_out["device_pkg"]


def test_a_variable_the_script_changed_leaves_out_what_reads_it_at_import(tmp_path):
    site = installed(tmp_path / "site", PACKAGES)
    as_here = take(site, ["offline_pkg"], {"OFFLINE_FLAG": learned.digest("0")})
    assert as_here["loaded"] == ["offline_pkg"], "the workers hold the value this process has"
    changed = take(site, ["offline_pkg"], {"OFFLINE_FLAG": learned.digest("1")})
    assert "$OFFLINE_FLAG" in changed["left_out"]["offline_pkg"]


def test_what_a_left_out_module_brought_is_excluded_with_it(tmp_path):
    site = installed(tmp_path / "site", PACKAGES)
    found = take(site, ["uses_threaded_pkg", "threaded_pkg"])
    assert list(found["left_out"]) == ["uses_threaded_pkg"]
    assert {"uses_threaded_pkg", "threaded_pkg"} <= set(found["excluded"])


@pytest.mark.parametrize("where", ["on the path", "in the working directory"])
def test_a_scripts_own_module_is_never_imported(tmp_path, where):
    own = tmp_path / "own"
    own.mkdir()
    marker = tmp_path / "imported"
    (own / "own_helper.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    site = installed(tmp_path / "site", {"plain_pkg": ""})
    if where == "in the working directory":  # even named by an installed distribution
        (site / "learned_test_dist-1.0.dist-info" / "top_level.txt").write_text(
            "plain_pkg\nown_helper\n"
        )
    path = f"{site}{os.pathsep}{own}" if where == "on the path" else f"{own}{os.pathsep}{site}"
    out = subprocess.run(
        [sys.executable, "-c", TAKE, "own_helper,plain_pkg", "{}"],
        env={**os.environ, "PYTHONPATH": path},
        cwd=str(own),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout)["loaded"] == ["plain_pkg"]
    assert not marker.exists(), "the script's own module was imported"


def test_a_module_that_parses_sys_argv_at_import_sees_no_zygote_argument(tmp_path):
    site = installed(tmp_path / "site", {"argv_pkg": "import sys\nARGV = list(sys.argv)\n"})
    probe = TAKE + "import argv_pkg; print(json.dumps(argv_pkg.ARGV[1:]))\n"
    out = subprocess.run(
        [sys.executable, "-c", probe, "argv_pkg", "{}", "--zygote-only"],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_packed_names_round_trip_and_a_bomb_is_refused():
    import base64
    import zlib

    names = [f"pkg_{i}.module_{i}" for i in range(20000)]
    packed = learned.pack(names)
    assert len(packed) <= learned.MAX_PACKED
    back = learned.unpack(packed)
    assert back is not None and back == names[: len(back)] and len(back) > 1000
    bomb = base64.b64encode(zlib.compress(b"a" * (64 << 20))).decode()
    assert learned.unpack(bomb) is None, "decompressed within a bound"
    assert learned.unpack("not base64 !") is None
    assert learned.unpack(base64.b64encode(zlib.compress(b"ok\nos; rm")).decode()) is None


# ---- the heir: learns, then serves ------------------------------------------------------------

PROBE = """
import sys
sys.exit(0 if "plain_pkg" in sys.modules else 3)
"""


def settled(spawner: ZygoteFork, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = spawner.settled()
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError("the heir never finished learning")


def test_an_heir_learns_then_serves_and_one_that_took_a_thread_is_given_up(tmp_path, monkeypatch):
    site = installed(tmp_path / "site", PACKAGES)
    monkeypatch.setenv("PYTHONPATH", str(site))
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    spawner = ZygoteFork(
        PreloadPlan(["json"], zygote=True),
        FreshInterpreter(Entrypoint(Kind.SCRIPT, str(script))),
    )
    try:
        assert spawner.zygote is not None and spawner.zygote.wait_ready(60)
        first = spawner.zygote.pid
        assert spawner.learn(ImportPlan(("plain_pkg", "threaded_pkg")))
        given_up = settled(spawner)
        assert not given_up.took_over and "threaded_pkg" in given_up.account["left_out"]
        assert spawner.zygote.pid == first, "the zygote serves on"
        assert spawner.learn(ImportPlan(("plain_pkg", "threaded_pkg"), skip=("threaded_pkg",)))
        heir = settled(spawner)
        assert heir.took_over and heir.account["loaded"] == ["plain_pkg"]
        assert "plain_pkg" in heir.account["holds"], "its own account of what it holds"
        assert spawner.zygote.pid == heir.pid != first
        process = spawner.spawn(SpawnRequest(0, ["--", str(script)], dict(os.environ)))
        assert process.reaped_by_agent is False, "forked"
        process.watched()
        assert process.reap(30) == (0, None), "the worker holds what the heir learned"
    finally:
        spawner.close()


# ---- kept for the next run ---------------------------------------------------------------------


def test_what_is_kept_is_read_back_for_its_entrypoint_only(tmp_path):
    path = tmp_path / "kept.json"
    plan = ImportPlan(("torch", "torch._dynamo"), {"X": learned.digest("1")}, ("threaded_pkg",))
    path.write_text(plan.to_json("script:/a/train.py"))
    assert learned.read_kept(str(path), "script:/a/train.py") == plan
    assert learned.read_kept(str(path), "script:/b/other.py") is None
    path.write_text(json.dumps({"version": 1, "entrypoint": "x", "modules": ["a b"]}))
    assert learned.read_kept(str(path)) is None, "a tampered file is not used"
    assert learned.kept_path("/logs", "script:/a/train.py") != learned.kept_path(
        "/logs", "script:/b/other.py"
    )


def test_an_heir_stopped_while_it_learns_is_given_up_and_the_zygote_serves(tmp_path, monkeypatch):
    import signal

    site = installed(tmp_path / "site", {"slow_pkg": "import time\ntime.sleep(60)\n"})
    monkeypatch.setenv("PYTHONPATH", str(site))
    script = tmp_path / "probe.py"
    script.write_text("")
    spawner = ZygoteFork(
        PreloadPlan([], zygote=True), FreshInterpreter(Entrypoint(Kind.SCRIPT, str(script)))
    )
    try:
        assert spawner.zygote is not None and spawner.zygote.wait_ready(60)
        first = spawner.zygote.pid
        assert spawner.learn(ImportPlan(("slow_pkg",)), idle_cpu=False)
        heir = spawner._heir[0]  # type: ignore[index]
        deadline = time.monotonic() + 60
        while not heir.pid and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(heir.pid, signal.SIGSTOP)
        given_up = settled(spawner)
        assert not given_up.took_over and given_up.account == {}
        assert spawner.zygote.pid == first and not spawner.learning
        process = spawner.spawn(SpawnRequest(0, ["--", str(script)], dict(os.environ)))
        process.watched()
        assert process.reap(30) == (0, None), "the zygote forks on"
    finally:
        spawner.close()


def test_giving_up_the_zygote_after_an_heir_took_over_keeps_the_workers_running(
    tmp_path, monkeypatch
):
    """The first zygote is the parent of the workers it forked: they die with it."""
    site = installed(tmp_path / "site", PACKAGES)
    monkeypatch.setenv("PYTHONPATH", str(site))
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(600)\n")
    spawner = ZygoteFork(
        PreloadPlan(["json"], zygote=True), FreshInterpreter(Entrypoint(Kind.SCRIPT, str(script)))
    )
    try:
        sleeper = spawner.spawn(SpawnRequest(0, ["--", str(script)], dict(os.environ)))
        sleeper.watched()
        assert spawner.learn(ImportPlan(("plain_pkg",)))
        assert settled(spawner).took_over
        spawner._give_up("a test gives the zygote up")
        assert spawner.zygote is None
        os.kill(sleeper.pid, 0)  # alive: its parent was kept
        assert sleeper.reap(0.2) == (None, None)
    finally:
        spawner.close()
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{sleeper.pid}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/{sleeper.pid}"), "ended with the launch"


def test_a_hot_spare_imports_what_was_learned_before_it_waits(tmp_path):
    site = installed(tmp_path / "site", PACKAGES)
    kept = tmp_path / "learned_imports.json"
    kept.write_text(ImportPlan(("plain_pkg", "rank_pkg"), skip=("rank_pkg",)).to_json("x"))
    probe = (
        "import sys\nfrom elastic_launch import spare\nspare.prepare()\n"
        "print('plain_pkg' in sys.modules, 'rank_pkg' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "ELASTICRUN_LEARNED_IMPORTS": str(kept)}
    run = lambda extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", probe],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert run({"ELASTICRUN_HOT_SPARE": "1"}) == ["True", "False"], "what was left out stays out"
    assert run({}) == ["False", "False"], "a worker that is not a spare imports nothing more"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_where_idle_cpu_cannot_be_left_a_spare_does_not_go_there():
    """Without CAP_SYS_NICE and with RLIMIT_NICE 0 (the default), SCHED_IDLE cannot be left:
    a spare, or an heir, would train there for good. (A forked child becomes nobody: the
    interpreter's files need not be readable to it.)"""
    import resource

    from elastic_launch import idle

    read, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
            os.setuid(65534)
            found = (idle.can_leave(), idle.enter(), os.sched_getscheduler(0) == os.SCHED_OTHER)
            os.write(write_end, repr(found).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read) as f:
        found = f.read()
    os.waitpid(pid, 0)
    assert found == "(False, False, True)"
    assert idle.can_leave(), "root can"
