"""Hot spares (``--hot-spares``) prepare on idle CPU only: a spare's start and its script's
setup (imports, the model, the data) never slow the workers that train or a group that
re-forms. Set where a worker begins; left by the train loop's coordinator once the spare is
ready and waits in the workers' rendezvous, where it takes no CPU and must answer at once when
a round needs it (under SCHED_IDLE, a machine busy with data loaders would delay that answer,
and the survivors with it)."""

from __future__ import annotations

import contextlib
import os

#: ``1`` in a hot spare: a worker started ahead of need, which prepares on idle CPU only and
#: waits in the train loop's rendezvous until a round takes it.
HOT_SPARE_ENV = "ELASTICRUN_HOT_SPARE"


def idle_while_spare() -> None:
    """A hot spare prepares on idle CPU only (SCHED_IDLE): its start and the script's setup
    never slow the workers that train, or a group that re-forms."""
    if os.environ.get(HOT_SPARE_ENV) == "1":
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def leave_idle() -> None:
    """Prepared: every thread of this process back to the normal policy (the threads it
    started inherited SCHED_IDLE; leaving it needs no privilege, as the nice value stays)."""
    with contextlib.suppress(OSError, AttributeError):
        if os.sched_getscheduler(0) != os.SCHED_IDLE:
            return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
