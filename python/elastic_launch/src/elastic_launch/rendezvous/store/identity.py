"""Which store an answer comes from. Every answer's header names its cluster (and its revision):
a client holds the cluster it first reached, what each member last answered with, and judges
every new answer against both (:func:`judge`, pure):

- ours, from a member whose revision did not go back: the same store;
- ours, from a member whose revision went back: that member lost its data. etcd started again
  empty has the same cluster id (etcd derives it from its configuration), so the revision
  tells it. Only a read sent after the member had shown a revision counts (the `floor`): a
  read is linearizable, so it cannot be older than what was seen before it was sent, while
  answers to calls under way together may come back in any order;
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
from typing import Any

from elastic_launch.rendezvous.store.wire import EMBEDDED_VERSION


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


def judge(
    ours: int | None,
    before: Answered | None,
    cluster: int,
    revision: int | None,
    floor: int = 0,
) -> Verdict:
    """An answer of `cluster` (a read's `revision`, or None for an answer that is not a read)
    from a member that answered `before` (None: never), when the client's cluster is `ours`;
    `floor`: the revision the member had shown when the read was sent."""
    if ours is None:
        return Verdict.FIRST
    if cluster == ours:
        went_back = revision is not None and revision < floor
        return Verdict.CHANGED if went_back and before is not None else Verdict.SAME
    if before is not None and before.cluster == ours:
        return Verdict.CHANGED
    return Verdict.FOREIGN


def seen(before: Answered | None, cluster: int, revision: int | None) -> Answered:
    """What a member is known to have answered with, after this answer."""
    if before is None or before.cluster != cluster:
        return Answered(cluster, revision or 0)
    return Answered(cluster, max(before.revision, revision or 0))


def serves(status: Any | None, ours: int, revision: int) -> bool:
    """Whether a member's `status` says it serves cluster `ours` at `revision` at least (as
    its host, for the embedded service)."""
    if status is None:
        return False
    header = status.header
    hosts = status.version != EMBEDDED_VERSION or status.leader == header.member_id
    return bool(hosts and header.cluster_id == ours and header.revision >= revision)


def lacks(status: Any | None, revision: int) -> bool:
    """Whether a host's `status` says its copy lacks `revision`: an embedded service that took
    over ends its copy of the host before it at its fork (``raftIndex``), and a standby
    dropped for falling behind has a copy short of what the host answered since."""
    if status is None or status.version != EMBEDDED_VERSION or status.isLearner:
        return False
    fork = int(status.raftIndex)
    return bool(fork) and fork < revision


def two_clusters(target: str, first: str, other: str, ids: tuple[str, str]) -> str:
    """The error for members `first` and `other` of the list `target` that answer for two
    clusters (`ids`, as the store writes them)."""
    return (
        f"--rdzv-endpoint {target}: {first} and {other} belong to two different clusters "
        f"(cluster ids {ids[0]} and {ids[1]}); give the members of one cluster only"
    )


def mixed(target: str, answers: list[tuple[str, str]]) -> str | None:
    """The error if the listed members that answered (`answers`: member, cluster id, in the
    list's order) belong to more than one cluster; None if they belong to one. Whatever the
    order of the list, the same two clusters are named."""
    if not answers:
        return None
    first, cluster = answers[0]
    other = next(((m, c) for m, c in answers if c != cluster), None)
    if other is None:
        return None
    ids = tuple(sorted((cluster, other[1])))
    return two_clusters(target, first, other[0], (ids[0], ids[1]))
