"""Which store an answer comes from. Every answer's header names its cluster (and its revision):
a client holds the cluster it first reached, what each member last answered with, and judges
every new answer against both (:func:`judge`, pure):

- ours, from a member whose revision did not go back: the same store;
- ours, from a member whose revision went back (a read, which is linearizable): that member
  lost its data. etcd started again empty has the same cluster id (etcd derives it from its
  configuration), so the revision tells it;
- another cluster, from a member that answered for ours before: that member changed. It was
  started again empty at its address (the embedded service, a new process), or it now follows
  another host (its refusal names the cluster it follows);
- another cluster, from a member that never answered for ours: two clusters named in one list,
  an error (a member the client learned from the store itself is only left for the next).

A member that changed is the store *replaced* only if no other member still serves ours (the
client asks them); otherwise it is a stranger for now, left for one that serves ours.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    FIRST = "first"  # the first answer: its cluster is ours from now on
    SAME = "same"
    CHANGED = "changed"  # this member lost its data or changed cluster
    FOREIGN = "foreign"  # a member of another cluster


@dataclass(frozen=True)
class Answered:
    """What a member answered with last: its cluster id and the highest revision of its reads."""

    cluster: int
    revision: int = 0


def judge(ours: int | None, before: Answered | None, cluster: int, revision: int | None) -> Verdict:
    """An answer of `cluster` (a read's `revision`, or None for an answer that is not a read)
    from a member that answered `before` (None: never), when the client's cluster is `ours`."""
    if ours is None:
        return Verdict.FIRST
    if cluster == ours:
        if before is not None and before.cluster == ours and revision is not None:
            return Verdict.CHANGED if revision < before.revision else Verdict.SAME
        return Verdict.SAME
    if before is not None and before.cluster == ours:
        return Verdict.CHANGED
    return Verdict.FOREIGN


def seen(before: Answered | None, cluster: int, revision: int | None) -> Answered:
    """What a member is known to have answered with, after this answer."""
    if before is None or before.cluster != cluster:
        return Answered(cluster, revision or 0)
    return Answered(cluster, max(before.revision, revision or 0))
