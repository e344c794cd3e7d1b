"""What a buggy or hostile worker can do to the heartbeat file it beats into.

In the first attempt, rank 0 applies ``--attack`` to its own ``$ELASTIC_HEARTBEAT_FILE`` and goes
on beating (through the mapping it holds; after a cut that is a SIGBUS in rank 0 itself; after
a beat time stamped in the future it hangs, which that stamp once hid), and rank 1 beats once
and then hangs. From the first restart on, both beat and exit 0."""

from __future__ import annotations

import argparse
import os
import struct
import sys
import time

import elastic_core

ATTACKS = ("truncate", "grow", "zeros", "ones", "random", "unlink", "replace", "future", "timeout")
SLOT = 64  # the slot's offset: one 64-byte header, then one 64-byte slot per table


def attack(how: str, path: str) -> None:
    if how == "truncate":
        os.truncate(path, 0)
    elif how == "grow":
        os.truncate(path, 1 << 20)
    elif how in ("zeros", "ones", "random"):
        size = os.path.getsize(path)
        junk = {"zeros": b"\0" * size, "ones": b"\xff" * size}.get(how) or os.urandom(size)
        with open(path, "r+b") as f:
            f.write(junk)
    elif how in ("unlink", "replace"):
        os.unlink(path)
        if how == "replace":
            with open(path, "wb") as f:
                f.write(os.urandom(4096))
    else:  # a value in the slot no beat() writes: a time an hour ahead, a timeout of ~forever
        value = elastic_core.now_ns() + 3600 * 10**9 if how == "future" else 2**64 - 1
        with open(path, "r+b") as f:
            f.seek(SLOT + (16 if how == "future" else 24))
            f.write(struct.pack("<Q", value))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--attack", choices=ATTACKS, required=True)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    elastic_core.beat()
    if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) > 0:
        for _ in range(3):
            time.sleep(0.01)
            elastic_core.beat()
        return
    if rank == 1:
        time.sleep(300)  # hung: the launcher ends it long before
        sys.exit(9)
    attack(args.attack, os.environ["ELASTIC_HEARTBEAT_FILE"])
    print(f"attacked: {args.attack}", flush=True)
    for _ in range(6000):
        if args.attack != "future":  # a beat would overwrite the stamp: it hides a hang instead
            elastic_core.beat()
        time.sleep(0.05)


if __name__ == "__main__":
    main()
