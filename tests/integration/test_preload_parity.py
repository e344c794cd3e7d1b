"""A worker forked from the zygote (--preload auto, the default) sees what a fresh interpreter would: the
same probe (scripts/parity_probe.py) runs under both, and what it records must match, once
the values that differ from run to run (ports, run ids, temporary paths) are set aside.
The differences that remain by design are asserted as such: torch is imported already, and the
worker's parent is the zygote. And a script edited between attempts runs its new text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launcher_util import HERE, run

PROBE = HERE / "scripts" / "parity_probe.py"
# Environment values of one run: its id, ports, temporary files, where the probe writes.
PER_RUN = {
    "TORCHELASTIC_RUN_ID",
    "MASTER_PORT",
    "PROBE_OUT",
    "ELASTICRUN_LOOP_FILE",
    "ELASTICRUN_IMPORTS_FILE",
    "ELASTICRUN_TEAM",
    "ELASTIC_HEARTBEAT_FILE",
    "ELASTIC_STACK_FILE",
    "TORCHELASTIC_ERROR_FILE",
    "ELASTICRUN_PARENT_PID",
    "ELASTICRUN_EVENTS_FILE",
    "ELASTICRUN_MEMORY_DIR",
    "ELASTICRUN_CGROUP",
    "ELASTICRUN_FENCE_FILE",
}


def probe(tmp_path: Path, name: str, *flags: str) -> dict[int, dict]:
    out = tmp_path / name
    out.mkdir()
    env = {"PROBE_OUT": str(out), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}
    events = tmp_path / f"{name}.events"
    result = run(
        [
            *("--standalone", "--nproc-per-node", "2", "--events-file", str(events), *flags),
            *(str(PROBE), "an arg", "--flag=x"),
        ],
        out,
        timeout=150,
        env=env,
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    (started,) = [
        e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "group_started"
    ]
    forked = "none" not in flags  # --preload auto, the default, forks them
    assert started["forked"] == forked, "the workers were not started as asked"
    return {rank: json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.timeout(300)
def test_a_forked_worker_sees_what_a_fresh_one_sees(tmp_path):
    fresh = probe(tmp_path, "fresh", "--preload", "none")
    forked = probe(tmp_path, "forked")  # the default: --preload auto (the probe imports torch)
    for rank in (0, 1):
        a, b = fresh[rank], forked[rank]
        # By design: the forked worker's parent is the zygote, which dies with the agent.
        assert a["env"]["ELASTICRUN_PARENT_PID"] != b["env"]["ELASTICRUN_PARENT_PID"]
        for seen in (a, b):
            # /proc/self/environ shows the environment the process started with, as os.environ
            assert sorted(f"{k}={v}" for k, v in seen["env"].items()) == seen.pop("proc_environ")
            seen["env"] = {k: v for k, v in seen["env"].items() if k not in PER_RUN}
        env = {k for k in a["env"].keys() | b["env"].keys() if a["env"].get(k) != b["env"].get(k)}
        assert not env, {k: (a["env"].get(k), b["env"].get(k)) for k in env}
        assert a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
        # And what they see is what a script expects, not only the same wrong thing twice:
        assert a["name"] == "__main__" and a["pickled_main"] == "__main__"
        assert a["argv"] == [str(PROBE), "an arg", "--flag=x"]
        assert a["path"][0] == str(PROBE.parent) and a["cwd"] == str(tmp_path)
        assert a["torch_threads"] == 1 and a["env"]["OMP_NUM_THREADS"] == "1"  # torch: 2 here
        assert a["spawn"] == [9] and a["fork"] == [16] and a["loader"] == [6, 22]
        assert a["own_pgrp"] is True
        assert a["proc_cmdline"][-3:] == [str(PROBE), "an arg", "--flag=x"]  # ps, pgrep -f
        assert any("FutureWarning" in f for f in a["warnings"])


@pytest.mark.timeout(200)
def test_an_edited_script_runs_its_new_text_after_a_restart(tmp_path, out):
    script = tmp_path / "edited.py"
    # Attempt 0 rewrites the script, then fails; the restarted (forked) worker must run the
    # new text, not a copy the zygote kept.
    version2 = "import os\nprint('version 2, attempt', os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
    script.write_text(
        "import pathlib, sys\n"
        f"pathlib.Path(__file__).write_text({version2!r})\n"
        "print('version 1')\n"
        "sys.exit(3)\n"
    )
    events = tmp_path / "events"
    result = run(
        [
            *("--standalone", "--max-restarts", "1"),
            *("--events-file", str(events), str(script)),
        ],
        out,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr
    started = [
        e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "group_started"
    ]
    assert [e["forked"] for e in started] == [True, True]
    assert "version 1" in result.stdout
    assert "version 2, attempt 1" in result.stdout, result.stdout
