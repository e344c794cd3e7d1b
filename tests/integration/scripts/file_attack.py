"""What a buggy or hostile worker can leave at the paths the launcher reads or writes after it:
rank 0 replaces the file ``--what`` names (its error file, its loop file, its stack file, or
the stderr log the launcher appends its stacks to) with ``--kind`` (a FIFO nobody writes, a
directory), then fails (error, loop) or beats once and hangs (stack, log: the launcher asks
for its stacks). Or it leaves ``--kind`` (a FIFO, a symbolic link to a directory) where the
launcher will make the next attempt's directory, or the next attempt's stderr log, or in place
of the node's memory-tier directory, then fails. Rank 1 waits. From the first restart on, both
exit 0."""

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


def _next_attempt() -> str:
    """Where the launcher will make the next attempt's directory: <run>/attempt_1."""
    run = os.path.dirname(os.path.dirname(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])))
    return os.path.join(run, "attempt_1")


AHEAD = {
    "next-attempt": _next_attempt,
    "next-log": lambda: os.path.join(_next_attempt(), "0", "stderr.log"),
    "memory": lambda: os.environ["ELASTICRUN_MEMORY_DIR"],
}


def _plant(path: str, kind: str) -> None:
    """Leave `kind` at `path`, where the launcher will make or remove something, and fail."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.isdir(path) and not os.path.islink(path):
        os.rmdir(path)
    if kind == "fifo":
        os.mkfifo(path)
    else:  # a link to a directory of the user's, which the launcher must not follow
        elsewhere = os.environ["ELSEWHERE"]
        os.symlink(elsewhere, path)
    print(f"rank 0 left a {kind} at {path}", flush=True)  # stdout: stderr is in a log


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=sorted([*PATHS, *AHEAD]), required=True)
    p.add_argument("--kind", choices=("fifo", "directory", "symlink"), required=True)
    args = p.parse_args()
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        return 0
    if os.environ["RANK"] != "0":
        time.sleep(600)  # stopped by the launcher once rank 0 fails
        return 0
    if args.what in AHEAD:
        _plant(AHEAD[args.what](), args.kind)
        return 1
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
