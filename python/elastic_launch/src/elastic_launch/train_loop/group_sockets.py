"""The connections of a gloo process group, so that leaving a round wakes its peers at once.

Gloo closes a group's connections only when the group object is freed, and neither
``destroy_process_group`` nor ``abort`` frees it while something else holds it: a
``DistributedDataParallel`` model in the State holds its group until ``sync`` replaces it, which
comes after the next rendezvous. A peer still inside a collective with this rank (say, in the
bucket rebuild of DDP's second step) would then wait out the group's timeout, and the next round
cannot form without it. Measured with torch 2.13: after ``_abort_process_group()`` a peer
blocked in ``recv`` waited the full timeout; after the sockets below were shut down it raised
"Connection closed by peer" within milliseconds.

The sockets are the ones the group opened (those that appeared while it was created); each is
shut down (``SHUT_RDWR`` through a duplicate of its descriptor), never closed, so gloo still owns
and later closes its descriptors. Listening sockets are left alone: gloo's accept loop treats a
shut-down listener as fatal. Linux only (``/proc/self/fd``); elsewhere nothing is recorded.
"""

from __future__ import annotations

import contextlib
import os
import socket

Sockets = frozenset[tuple[int, str]]  # (descriptor, "socket:[inode]")

_FD_DIR = "/proc/self/fd"


def open_sockets() -> Sockets:
    """The sockets this process has open now."""
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return frozenset()
    found = set()
    for fd in fds:
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(os.path.join(_FD_DIR, fd))
            if target.startswith("socket:"):
                found.add((int(fd), target))
    return frozenset(found)


def shut_down(sockets: Sockets) -> int:
    """Shut down each connected socket of `sockets` still open under the same descriptor (a
    descriptor reused for another socket is left alone). Returns how many were shut down."""
    done = 0
    for fd, target in sockets:
        try:
            if os.readlink(os.path.join(_FD_DIR, str(fd))) != target:
                continue
            dup = os.dup(fd)
        except OSError:
            continue
        with socket.socket(fileno=dup) as s:  # closes the duplicate only
            try:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                s.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:
                pass  # not connected, or already gone
    return done
