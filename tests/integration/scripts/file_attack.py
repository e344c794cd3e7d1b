"""What a buggy or hostile worker can leave at the paths the launcher reads or writes after it:
rank 0 replaces the file ``--what`` names (its error file, its loop file, its stack file, or
the stderr log the launcher appends its stacks to) with ``--kind`` (a FIFO nobody writes, a
directory), then fails (error, loop) or beats once and hangs (stack, log: the launcher asks
for its stacks). Rank 1 waits. From the first restart on, both exit 0."""

from __future__ import annotations

import argparse
import os
import sys
import time

PATHS = {
    "error": lambda: os.environ["TORCHELASTIC_ERROR_FILE"],
    "loop": lambda: os.environ["ELASTICRUN_LOOP_FILE"],
    "stack": lambda: os.environ["ELASTIC_STACK_FILE"],
    "log": lambda: next(
        os.path.join(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"]), name)
        for name in ("stderr.log",)
    ),
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=sorted(PATHS), required=True)
    p.add_argument("--kind", choices=("fifo", "directory"), required=True)
    args = p.parse_args()
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        return 0
    if os.environ["RANK"] != "0":
        time.sleep(600)  # stopped by the launcher once rank 0 fails
        return 0
    path = PATHS[args.what]()
    if args.what == "loop":
        with open(path, "w") as f:
            f.write("running 3")  # the agent reads it once the worker ends
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path) if args.kind == "fifo" else os.mkdir(path)
    print(f"rank 0 left a {args.kind} at {path}", file=sys.stderr, flush=True)
    if args.what in ("error", "loop"):
        return 1
    import elastic_core

    elastic_core.beat()  # a worker that never beat is not judged: it beats once, then hangs
    while True:  # the launcher asks for its stacks
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
