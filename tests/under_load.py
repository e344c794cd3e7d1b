"""Run pytest beside CPU-bound processes: the suite's verdicts must not depend on how fast the
machine is (``make test-loaded`` runs the slow tests so, beside two).

    python tests/under_load.py [--burners N] [pytest arguments...]

The burners are plain Python loops at the same priority as the tests; they are ended by pid
whatever pytest does, and pytest's exit status is this script's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    burners = 2
    if argv[:1] == ["--burners"]:
        burners, argv = int(argv[1]), argv[2:]
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        return subprocess.call([sys.executable, "-m", "pytest", *argv])
    finally:
        for p in loops:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
