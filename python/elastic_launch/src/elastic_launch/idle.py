"""Idle CPU (SCHED_IDLE) for work that must never slow the workers that train: a hot spare's
setup, the zygote's heir learning imports. Only where the policy can be left again: since
Linux 2.6.39 a thread without CAP_SYS_NICE leaves SCHED_IDLE only when its nice value is within
what RLIMIT_NICE allows (its default, 0, allows none), and a worker forked from, or becoming, a
process left on idle CPU would train there for good. Where it cannot be left, the work runs at
the normal policy."""

from __future__ import annotations

import contextlib
import os
import resource


def can_leave() -> bool:
    """Whether this process could leave SCHED_IDLE once in it (root, or RLIMIT_NICE allows
    its nice value)."""
    if os.geteuid() == 0:
        return True
    try:
        soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
        nice = os.getpriority(os.PRIO_PROCESS, 0)
    except (OSError, AttributeError, ValueError):
        return False
    return soft == resource.RLIM_INFINITY or nice >= 20 - soft


def enter() -> bool:
    """This thread to SCHED_IDLE, if it can be left again; whether it went."""
    if not can_leave():
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        return False
    return True


def leave() -> None:
    """Every thread of this process back to the normal policy (those it started while idle
    inherited SCHED_IDLE)."""
    with contextlib.suppress(OSError, AttributeError):
        if os.sched_getscheduler(0) != os.SCHED_IDLE:
            return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))


@contextlib.contextmanager
def on_idle_cpu(wanted: bool = True):  # type: ignore[no-untyped-def]
    """The body on idle CPU (when `wanted` and it can be left), then back."""
    went = wanted and enter()
    try:
        yield went
    finally:
        if went:
            leave()
