"""Hot spares (``--hot-spares``) prepare on idle CPU only: a spare's start and its script's
setup (imports, the model, the data) never slow the workers that train or a group that
re-forms. Set where a worker begins; left by the train loop's coordinator once the spare is
ready and waits in the workers' rendezvous, where it takes no CPU and must answer at once when
a round needs it (under SCHED_IDLE, a machine busy with data loaders would delay that answer,
and the survivors with it)."""

from __future__ import annotations

import contextlib
import os
import sys

from elastic_launch import idle, learned

#: ``1`` in a hot spare: a worker started ahead of need, which prepares on idle CPU only and
#: waits in the train loop's rendezvous until a round takes it.
HOT_SPARE_ENV = "ELASTICRUN_HOT_SPARE"
#: In a hot spare: the node's file of what the workers were seen to import
#: (:data:`~elastic_launch.learned.NODE_FILE`).
LEARNED_FILE_ENV = "ELASTICRUN_LEARNED_IMPORTS"
_prepared = False


def idle_while_spare() -> None:
    """A hot spare prepares on idle CPU only (SCHED_IDLE, where it can be left again:
    :mod:`elastic_launch.idle`): its start and the script's setup never slow the workers that
    train, or a group that re-forms."""
    if os.environ.get(HOT_SPARE_ENV) == "1":
        idle.enter()


def leave_idle() -> None:
    """Prepared: every thread of this process back to the normal policy."""
    idle.leave()


def prepare() -> None:
    """Before a hot spare first waits (still on idle CPU): what its first round would do
    lazily, done now. It imports what the workers were seen to import (a spare forked before
    the zygote learned it has not), as the workers' own first steps did (the same checks as
    the zygote's, where a thread or a device is fine: this is a worker), and runs autograd
    once (its engine starts on first use). The script's own hooks see none of it: no module
    and no optimizer is made."""
    global _prepared
    if _prepared or os.environ.get(HOT_SPARE_ENV) != "1":
        return
    _prepared = True
    path = os.environ.get(LEARNED_FILE_ENV)
    plan = learned.read_kept(path) if path else None
    if plan is not None:
        for name in learned.to_import(plan.modules, plan.skip):
            with contextlib.suppress(Exception):  # as the workers found it: not here
                learned.load(name)
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            w = torch.ones(4, 4, requires_grad=True)
            torch.nn.functional.linear(torch.ones(2, 4), w).sum().backward()
