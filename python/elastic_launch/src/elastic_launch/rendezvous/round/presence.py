"""Who of a round's members is gone: their join key expired (a lease outlived), or their
*presence port* refuses (an agent that died on a host that is up: seen at once, long before its
lease expires). Silence is no proof: a member that does not answer is gone only once its lease
expires, so a firewall never turns a failure into a free restart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastic_launch.net import REFUSED, SILENT, probe
from elastic_launch.rendezvous.round.job import Job
from elastic_launch.rendezvous.round.state import Member, RoundState
from elastic_launch.rendezvous.store.api import StoreError
from elastic_launch.rendezvous.store.session import Session

#: How long lost_members() probes the other members' agents.
PROBE_TIMEOUT = 2.0
PROBE_BATCH = 64  # presence ports probed at once (each a socket: far below the fd limit)
FEW_AWAITED = 4  # previous members awaited, below which their join keys are read singly


@dataclass
class RestGone:
    """What a reopened round's leader knows of the previous round's members: who is gone for
    good, and how many it still awaited when it last read their keys."""

    ran: int  # the previous round
    nodes: set[str] = field(default_factory=set)
    awaited_at_last_read: int = 2**62  # the first call reads

    def check(self, job: Job, prev_ranks: Mapping[str, int], joined: set[str]) -> bool:
        """Whether every member of the previous round is back (in `joined`) or provably gone,
        so that the survivors of a failure go on at once instead of waiting for the dead.

        Called as members come back, so its cost must not grow with N per call: who is known
        gone is kept (an expired key does not come back, nor does a dead process), the
        previous round's join keys are read again only once those still awaited have halved
        (so O(log N) reads of N keys in a round, not one per join), singly once a few are
        left, and presence ports are probed a few at a time, stopping at the first alive."""
        awaited = set(prev_ranks) - joined - self.nodes
        if not awaited:
            return True
        if len(awaited) > FEW_AWAITED and 2 * len(awaited) > self.awaited_at_last_read:
            return False  # most of those last read were alive: they are on their way back
        self.awaited_at_last_read = len(awaited)
        prev = job.keys.join(self.ran)
        if len(awaited) <= FEW_AWAITED:
            kvs = [kv for node in sorted(awaited) if (kv := job.store.get(prev + node))]
        else:
            kvs, _ = job.store.range(prev)  # one request for all: those absent have expired
        targets: dict[str, tuple[str, int]] = {}
        for kv in kvs:
            node = kv.key[len(prev) :]
            if node not in awaited:
                continue
            member = Member.from_json(kv.value, kv.key)
            if not member.presence:
                return False
            targets[node] = (member.addr, member.presence)
        self.nodes |= awaited - set(targets)  # their keys expired
        batch = list(targets.items())
        for start in range(0, len(batch), PROBE_BATCH):
            answers = probe(dict(batch[start : start + PROBE_BATCH]), min(PROBE_TIMEOUT, 0.25))
            self.nodes |= {node for node, a in answers.items() if a == REFUSED}
            if any(a != REFUSED for a in answers.values()):
                return False
        return True


def lost_members(job: Job, session: Session, current: RoundState, lease_ttl: float) -> list[str]:
    """Members of running round `current` (with every member) whose agent is gone. Those whose
    presence port refuses have their join keys removed, so the others see it at once too; those
    that do not answer are gone only if their key expires within a lease's TTL."""
    join_prefix = job.keys.join(current.version)
    leader_key = job.keys.leader(current.version)
    kvs, revision = job.store.range(job.keys.m)
    present = {kv.key[len(join_prefix) :] for kv in kvs if kv.key.startswith(join_prefix)}
    done = {kv.key.rsplit("/", 1)[1] for kv in kvs if kv.key.startswith(job.keys.done)}
    others = {n: m for n, m in current.nodes.items() if n != job.node and n not in done}
    gone = {n for n in others if n not in present}
    targets = {n: (m.addr, m.presence) for n, m in others.items() if n in present and m.presence}
    answers = probe(targets, min(PROBE_TIMEOUT, lease_ttl))
    refused = {n for n, a in answers.items() if a == REFUSED}
    for n in refused:
        with contextlib.suppress(StoreError):
            job.store.delete(join_prefix + n)
            if n == current.leader:  # the key the nodes that do not lead follow
                job.store.delete(leader_key)
    silent = [join_prefix + n for n, a in answers.items() if a == SILENT]
    if silent:
        expired = session.deleted_within(silent, revision, lease_ttl + 1.0)
        gone |= {key[len(join_prefix) :] for key in expired}
    return sorted(gone | refused)
