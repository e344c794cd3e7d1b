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


def test_a_worker_writes_at_its_first_step_and_at_step_100_only(tmp_path, monkeypatch):
    path = tmp_path / "imports.json"
    monkeypatch.setenv(learned.IMPORTS_FILE_ENV, str(path))
    learned.at_step(2)
    assert not path.exists()
    learned.at_step(1)
    assert path.exists()


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"modules": "torch"}', "must be a list"),
        (b'{"modules": ["torch", "os; rm -rf /"]}', "not a module name"),
        (b'{"modules": ["torch", 7]}', "not a module name"),
        (b'{"modules": [], "env_changed": {"A B": null}}', "not a variable"),
        (b'{"modules": [], "env_changed": {"A": 12}}', "not a variable"),
    ],
)
def test_a_file_that_is_not_a_workers_list_is_refused_with_why(data, why):
    with pytest.raises(ValueError, match=why):
        learned.parse(data)


def test_names_that_are_modules_pass_and_main_is_dropped():
    found = learned.parse(
        b'{"modules": ["__main__", "torch", "torch._dynamo", '
        b'"_sysconfigdata__linux_x86_64-linux-gnu"], "env_changed": {}}'
    )
    assert found.modules == ("torch", "torch._dynamo", "_sysconfigdata__linux_x86_64-linux-gnu")


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
    for key in ("RANK", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ELASTICRUN_X"):
        assert learned.differs_in_workers(key, {})
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
    "copies_env_pkg": "import os\nSNAPSHOT = dict(os.environ)\n",
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
    env = {**os.environ, "PYTHONPATH": str(site), "OFFLINE_FLAG": "0"}
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


def test_a_scripts_own_module_is_never_imported(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "own_helper.py").write_text("raise SystemExit('imported')\n")
    site = installed(tmp_path / "site", {"plain_pkg": ""})
    env_path = f"{site}{os.pathsep}{own}"
    out = subprocess.run(
        [sys.executable, "-c", TAKE, "own_helper,plain_pkg", "{}"],
        env={**os.environ, "PYTHONPATH": env_path},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout)["loaded"] == ["plain_pkg"]


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
