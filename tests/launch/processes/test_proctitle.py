"""A forked worker shows its own command line and environment in /proc (ps, pgrep -f)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from elastic_launch.processes import proctitle

CHILD = """
import json, os, sys
from elastic_launch.processes.proctitle import set_title
os.environ.clear()
os.environ.update({"LONG": "x" * int(sys.argv[1]), "RANK": "3"})
wrote = set_title(["python", "-u", "train.py", "--lr", "0.1"], os.environ)
read = lambda name: [i.decode() for i in open(f"/proc/self/{name}", "rb").read().split(b"\\0") if i]
print(json.dumps({"wrote": wrote, "cmdline": read("cmdline"), "environ": read("environ"),
                  "getenv": os.environ["RANK"], "argv": sys.argv[1:]}))
"""


def run_child(long: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(long), proctitle.room_argument()],
        env={**os.environ, **proctitle.room_environment()},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_the_command_line_and_environment_are_rewritten_in_place():
    seen = run_child(10)
    assert seen["wrote"] is True
    assert seen["cmdline"] == ["python", "-u", "train.py", "--lr", "0.1"]
    assert sorted(seen["environ"]) == ["LONG=" + "x" * 10, "RANK=3"]
    assert seen["getenv"] == "3" and seen["argv"][0] == "10", "the process's own view is intact"


def test_what_does_not_fit_is_left_out_whole():
    seen = run_child(proctitle.ENV_ROOM * 4)  # more than the whole environment area
    assert seen["cmdline"][:3] == ["python", "-u", "train.py"]
    assert "RANK=3" in seen["environ"]
    assert not any(e.startswith("LONG=") for e in seen["environ"]), "no cut-off variable"
