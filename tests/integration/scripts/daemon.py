"""A worker that starts a daemon: rank 0 double-forks a process that leaves its process group
and session (setsid) and writes its pid to OUT, then every worker waits until the file GO
exists (300 s at most) and exits 0."""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    out, go = sys.argv[1], sys.argv[2]
    if os.environ.get("RANK") == "0" and os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(out + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(out + ".tmp", out)
            time.sleep(600)
        os._exit(0)
    deadline = time.monotonic() + 300
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)


if __name__ == "__main__":
    main()
