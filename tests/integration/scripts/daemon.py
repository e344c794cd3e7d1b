"""A worker that starts a daemon: rank 0 double-forks a process that leaves its process group
and session (setsid) and writes its pid to OUT, then every worker sleeps SECONDS and exits 0."""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    out, seconds = sys.argv[1], float(sys.argv[2])
    if os.environ.get("RANK") == "0" and os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(out + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(out + ".tmp", out)
            time.sleep(600)
        os._exit(0)
    time.sleep(seconds)


if __name__ == "__main__":
    main()
