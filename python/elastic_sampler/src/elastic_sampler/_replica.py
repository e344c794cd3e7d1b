"""Replicas of each rank's memory copy on a peer node, for states that differ per rank (ZeRO or
FSDP shards, per-rank RNG): the loss of one node then loses no rank's newest step.

The nodes form a ring (`ring_of`): a rank's copy goes to the rank of the same local rank on the
next node, into that rank's replica slot, over a process group of its own (gloo) so that it
never interleaves with training's collectives. It is sent on the copy thread after the rank's
own copy, from the slot, not the state: the next optimizer step does not wait for it, the next
save does. The receiver seals the bytes with the sender's checksum once they are all in: every
reader checks it (a restore does), so checking again on arrival would only cost a pass.

Whose copy it is travels with it at every hop: its head on the wire names its step, owner and
world (`_head`), and its bytes name them and the job inside what is checksummed (`_payload`).
A copy whose head or bytes name another than the rank it is taken for is refused where it
arrives, said in a warning: it is never sealed in a slot, never sent on, never restored.

`restore` is the way back: the ranks agree on the newest step held for every rank (in any
node's memory, or on that rank's disk), and each rank receives its own state from the lowest
rank holding it. A copy refused on the way back (another's, or damaged) is not taken again:
the ranks agree anew without it, on the next source, the disk, or an older step.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import warnings
from collections.abc import Set
from dataclasses import dataclass
from typing import Any

import torch

from elastic_sampler import _payload
from elastic_sampler._disk import DiskTier
from elastic_sampler._memory import MemorySlot, _Copy
from elastic_sampler._memory_tier import MemoryTier
from elastic_sampler.api import CheckpointError

#: How long an exchange waits for a peer (a dead peer's node is restarted by the launcher well
#: before this).
TIMEOUT = datetime.timedelta(seconds=300)
_HEAD, _DATA = 1, 2  # message tags: a copy's header, then its bytes
_NONE = -1
#: A copy's head on the wire: step, size, checksum, owner, world (`_head`); a size below 0
#: sends no bytes (nothing new, or a copy its holder refused to send).
_HEAD_FIELDS = 5
_NOTHING = [_NONE, _NONE, 0, _NONE, _NONE]
#: How a rank's part of a restore went (`_agree`).
_OK, _REFUSED, _FAILED = 0, 1, 2
#: Entries a rank reports in `restore`: its two slots' copies (two each), and its disk's newest
#: steps that verify. A report is ``banned, other world, `_ENTRIES` x (owner, step, tier)``.
_MEMORY_ENTRIES, _DISK_ENTRIES = 4, 4
_ENTRIES = _MEMORY_ENTRIES + _DISK_ENTRIES
_FIELDS = 2
_MEMORY, _DISK = 0, 1


@dataclass(frozen=True)
class Ring:
    """Where rank `rank`'s copies go (`partner`) and whose copies it holds (`source`)."""

    rank: int
    partner: int
    source: int


def ring_of(places: list[tuple[int, int]], rank: int) -> Ring | None:
    """The ring for `rank`, from every rank's (node, local rank); None on a single node. The
    nodes must hold the same local ranks (0 to n-1 each)."""
    nodes: dict[int, dict[int, int]] = {}
    for r, (node, local) in enumerate(places):
        nodes.setdefault(node, {})[local] = r
    order = sorted(nodes)
    if len(order) < 2:
        return None
    size = len(nodes[order[0]])
    for node in order:
        if sorted(nodes[node]) != list(range(size)):
            shape = {n: sorted(nodes[n]) for n in order}
            raise CheckpointError(
                f"replicas need every node to run the same local ranks (0 to n-1), not "
                f"{shape} (node: local ranks): give every node the same --nproc-per-node"
            )
    node, local = places[rank]
    i = order.index(node)
    return Ring(
        rank,
        partner=nodes[order[(i + 1) % len(order)]][local],
        source=nodes[order[(i - 1) % len(order)]][local],
    )


class RefusedCopyError(CheckpointError):
    """A copy a restore does not take (another's, damaged, or not sent): the next source
    serves."""


def _head(c: _Copy | None) -> list[int]:
    """The head that goes before copy `c`'s bytes (`_NOTHING` for none)."""
    return _NOTHING if c is None else [c.step, c.size, c.crc, c.owner, c.world]


def rank_and_world() -> tuple[int, int]:
    """This worker's rank and the world's size, from the launcher's variables."""
    rank, world = _whole_number("RANK"), _whole_number("WORLD_SIZE")
    if not rank < world:
        raise CheckpointError(f"$RANK={rank} is not below $WORLD_SIZE={world}")
    return rank, world


def _whole_number(name: str) -> int:
    raw = os.environ.get(name, "")
    if not raw.isascii() or not raw.isdigit():
        raise CheckpointError(
            f"${name}={raw!r}: replicas need the launcher's rank variables (RANK, WORLD_SIZE, "
            "GROUP_RANK), as elasticrun and torchrun set them"
        )
    return int(raw)


class Replicator:
    """Sends this rank's copies to its partner and keeps its source's, for one manager."""

    def __init__(self, own: MemorySlot, replica: MemorySlot, rank: int, world: int) -> None:
        self.own, self.replica = own, replica
        self.rank, self.world = rank, world
        self.group: Any = None
        self.ring: Ring | None = None
        self._said_alone = False
        self._broken = ""  # why an exchange failed: the ring is out of step from then on

    def ready(self) -> None:
        """Form the ring (once; every rank must call it, in the same order as its other
        collectives: it makes a process group)."""
        if self.group is not None:
            return
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise CheckpointError(
                "CheckpointManager(replicas=1) sends each save to a peer node: call "
                "torch.distributed.init_process_group() before the first save"
            )
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world):
            raise CheckpointError(
                f"$RANK/$WORLD_SIZE say rank {self.rank} of {self.world}, but the process "
                f"group says rank {dist.get_rank()} of {dist.get_world_size()}"
            )
        node, local = _whole_number("GROUP_RANK"), _whole_number("LOCAL_RANK")
        group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        place = torch.tensor([node, local], dtype=torch.int64)
        places = [torch.empty(2, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(places, place, group=group)
        self.ring = ring_of([(int(p[0]), int(p[1])) for p in places], self.rank)  # or raise
        if self.ring is not None:
            self.replica.owner, self.replica.world = self.ring.source, self.world
        self.group = group

    def send(self, kept: bool, copy: _Copy | None = None) -> None:
        """Exchange the newest copies around the ring: ours to the partner (`copy`, else the
        own slot's newest; nothing new if the save was not `kept`), the source's into the
        replica slot. Every rank must call it for every save, failed or not."""
        ring = self.ring
        if ring is None:
            if not self._said_alone:
                self._said_alone = True
                warnings.warn(
                    "CheckpointManager(replicas=1) on a single node: there is no peer node to "
                    "hold a replica; each rank keeps its own copy only",
                    stacklevel=2,
                )
            return
        if self._broken:
            raise CheckpointError(
                f"no checkpoint copy is sent to a peer node any more: an earlier exchange "
                f"failed ({self._broken}); the worker must be restarted"
            )
        latest = copy if copy is not None else self.own.last() if kept else None
        view = None if latest is None else self.own.view(latest)
        try:
            self._exchange(ring, latest, view)
        except Exception as e:
            self._broken = str(e)
            if view is not None:
                self.own.pin(view)  # a send may still read it
            raise CheckpointError(
                f"the exchange of checkpoint copies with rank {ring.partner} (ours) and rank "
                f"{ring.source} (theirs) failed: {e}. Every rank must save the same steps; a "
                "rank that died is replaced when the launcher restarts the group"
            ) from e
        if view is not None:
            view.release()

    def _exchange(self, ring: Ring, latest: _Copy | None, view: memoryview | None) -> None:
        """The copies' headers, then their bytes (ours: `latest`, whose bytes are `view`)."""
        import torch.distributed as dist

        sends = _post(self.group, ring.partner, _head(latest), view)
        got = torch.empty(_HEAD_FIELDS, dtype=torch.int64)
        dist.recv(got, src=ring.source, group=self.group, tag=_HEAD)
        step, size, crc, owner, world = (int(v) for v in got)
        try:
            if size > 0:
                self._keep(ring.source, (step, size, crc), (owner, world))
        finally:
            for request in sends:
                request.wait()

    def _keep(self, source: int, copy: tuple[int, int, int], names: tuple[int, int]) -> None:
        """Take the source's copy (step, size, checksum) off the wire into the replica slot,
        and seal it there unless its head (`names`: owner, world) or its bytes name another
        than the source: that one is refused with a warning (the exchange goes on: the ring
        is still in step, and the slot keeps its newest copy)."""
        import torch.distributed as dist

        step, size, crc = copy

        def fill(region: memoryview) -> None:
            target = torch.frombuffer(region, dtype=torch.uint8)
            dist.recv(target, src=source, group=self.group, tag=_DATA)

        def drop() -> None:  # off the wire all the same, to stay in step
            dist.recv(torch.empty(size, dtype=torch.uint8), src=source, group=self.group, tag=_DATA)

        whose = f"the checkpoint copy of step {step} that rank {source} sent"
        if names != (source, self.world):
            drop()
            owner, world = names
            warnings.warn(
                f"refused {whose}: it names rank {owner}'s state in a world of {world}, not "
                f"rank {source}'s in a world of {self.world}; it is not kept",
                stacklevel=2,
            )
            return
        try:
            index = self.replica.receive(size, fill)
        except CheckpointError:  # no room for it
            drop()
            raise
        try:
            self.replica.seal(index, step, size, crc, source, self.world)
        except _payload.ForeignCopyError as e:
            warnings.warn(f"refused {whose}: {e}", stacklevel=2)


def _post(group: Any, dst: int, head: list[int], view: memoryview | None) -> list[Any]:
    """Send a copy's header and, if `view`, its bytes to rank `dst`, without waiting: the
    requests to wait for (before `view` is released)."""
    import torch.distributed as dist

    sends = [dist.isend(torch.tensor(head, dtype=torch.int64), dst=dst, group=group, tag=_HEAD)]
    if view is not None:
        data = torch.frombuffer(view, dtype=torch.uint8)
        sends.append(dist.isend(data, dst=dst, group=group, tag=_DATA))
    return sends


class ReplicaTier:
    """A peer node's memory: this rank's memory tier (`memory`), whose every copy is also sent
    around the ring, and the replica slot (`replica`) that holds the previous node's copies.
    `disk` and `family` (the manager's prefix, before the rank and world) serve the way back:
    the steps each rank holds on disk, and files of another world size. `world`: this rank
    and the world's size."""

    def __init__(
        self,
        memory: MemoryTier,
        replica: MemorySlot,
        disk: DiskTier,
        world: tuple[int, int],
        family: str,
    ) -> None:
        self.memory, self.disk, self.family = memory, disk, family
        rank, size = world
        self.replicator = Replicator(memory.slot, replica, rank, size)

    def save(self, state: Any, step: int) -> None:
        """Save `state` to the memory tier; the copy then goes to the peer (on the copy
        thread when it overlaps the next step). Every rank must save the same steps."""
        self.replicator.ready()
        self.memory.save(state, step, self.replicator.send)

    def steps(self) -> list[int]:
        """The steps of this rank's state held in this node's slots (own and replica), oldest
        first."""
        rep = self.replicator
        held = {c.step for slot in (rep.own, rep.replica) for c in slot.held() if self._mine(c)}
        return sorted(held)

    def load(self, step: int, map_location: Any = "cpu", weights_only: bool = True) -> Any:
        """This rank's state at `step`, from this node's slots."""
        rep = self.replicator
        for slot in (rep.own, rep.replica):
            for c in slot.held():
                data = slot.read_copy(c) if self._mine(c) and c.step == step else None
                if data is not None:
                    where = f"checkpoint step {step} of rank {rep.rank} ('{slot.path}')"
                    return _payload.decode(data, where, map_location, weights_only)
        raise CheckpointError(f"checkpoint step {step} of rank {rep.rank} is not held here")

    def _mine(self, c: _Copy) -> bool:
        return c.owner == self.replicator.rank and c.world == self.replicator.world

    def restore(self, map_location: Any, weights_only: bool) -> tuple[Any, int] | None:
        """The ranks agree on a step and each gets its own state: see `restore`."""
        return restore(self, map_location, weights_only)

    def other_world(self) -> int:
        """A world size other than this one that per-rank files of the family were saved in,
        or 0."""
        pattern = re.compile(rf"{re.escape(self.family)}-rank\d+of(\d+)-\d{{12,}}\.pt")
        with contextlib.suppress(OSError):
            for path in self.disk.directory.iterdir():
                m = pattern.fullmatch(path.name)
                if m is not None and int(m.group(1)) != self.replicator.world:
                    return int(m.group(1))
        return 0

    def close(self) -> None:
        self.replicator.replica.close()


# ---- the way back ---------------------------------------------------------------------------


def _inventory(
    tier: ReplicaTier,
) -> tuple[list[int], dict[tuple[int, int], tuple[MemorySlot, _Copy]]]:
    """This rank's report (see `_ENTRIES`) and the memory copies it can send."""
    rep = tier.replicator
    banned = tier.memory.banned()
    other_world = 0
    copies: dict[tuple[int, int], tuple[MemorySlot, _Copy]] = {}
    for slot in (rep.own, rep.replica):
        for c in slot.held():  # newest first: a step saved twice is its newer copy
            if c.owner < 0:
                continue
            if c.world != rep.world:
                other_world = c.world
                continue
            copies.setdefault((c.owner, c.step), (slot, c))
    entries = [(owner, step, _MEMORY) for owner, step in copies][:_MEMORY_ENTRIES]
    entries += [(rep.rank, step, _DISK) for step in tier.disk.verified(_DISK_ENTRIES)]
    other_world = other_world or tier.other_world()
    report = [_NONE if banned is None else banned, other_world]
    for i in range(_ENTRIES):
        report.extend(entries[i] if i < len(entries) else (_NONE, _NONE, _NONE))
    return report, copies


def _held(
    reports: list[list[int]], world: int, refused: Set[tuple[int, int, int]]
) -> tuple[dict[tuple[int, int], list[int]], set[tuple[int, int]]]:
    """Who holds what: (owner, step) to the ranks holding it in memory, and the (owner, step)
    on the owner's disk. A step whose restores from memory died `_restores.LIMIT` times on any
    rank, and every older one, come from disk only (as without replicas: memory, then disk).
    A memory copy in `refused` (owner, step, holder) is held by no one."""
    banned = max((r[0] for r in reports), default=_NONE)
    memory: dict[tuple[int, int], list[int]] = {}
    disk: set[tuple[int, int]] = set()
    for holder, report in enumerate(reports):
        for i in range(_ENTRIES):
            at = _FIELDS + 3 * i
            owner, step, tier = report[at : at + 3]
            if owner < 0 or owner >= world or step < 0:
                continue
            if tier == _MEMORY and step > banned and (owner, step, holder) not in refused:
                memory.setdefault((owner, step), []).append(holder)
            elif tier == _DISK and owner == holder:
                disk.add((owner, step))
    return memory, disk


def choose(
    reports: list[list[int]], world: int, refused: Set[tuple[int, int, int]] = frozenset()
) -> tuple[int, list[tuple[int, int]]] | None:
    """From every rank's report: the newest step held for every rank, and for each rank who
    gives it its state and from which tier: the rank itself from memory, else its own disk,
    else the lowest rank holding it in memory. None if no rank holds anything; a
    CheckpointError if no one step is held for every rank, or if only another world's
    per-rank states are. The memory copies `refused` (owner, step, holder) are not taken."""
    memory, disk = _held(reports, world, refused)
    others = sorted({r[1] for r in reports if r[1] > 0})
    steps = {step for _, step in memory} | {step for _, step in disk}
    if not steps and not others:
        return None
    for step in sorted(steps, reverse=True):
        plan = []
        for owner in range(world):
            holders = sorted(memory.get((owner, step), []))
            if owner in holders:
                plan.append((owner, _MEMORY))
            elif (owner, step) in disk:
                plan.append((owner, _DISK))
            elif holders:
                plan.append((holders[0], _MEMORY))
            else:
                break
        else:
            return step, plan
    if not steps:
        raise CheckpointError(
            f"the checkpoints here are per-rank states of a world of {others} rank(s), and "
            f"this world has {world}: a shard of one world is not one of another. Reshard "
            "them, or move them away to start afresh"
        )
    newest = {
        o: max([s for (w, s) in memory if w == o] + [s for (w, s) in disk if w == o], default=None)
        for o in range(world)
    }
    raise CheckpointError(
        "no checkpoint step is held for every rank (the newest each rank's state has, in "
        f"memory or on its disk: {newest}); the ranks cannot resume together. Restore a step "
        "by hand, or start from scratch"
    )


def restore(tier: ReplicaTier, map_location: Any, weights_only: bool) -> tuple[Any, int] | None:
    """(this rank's state, step) at the newest step held for every rank; None if there is
    none. Every rank must call it. A rank that fails makes every rank fail; a copy a rank
    refuses (`RefusedCopyError`) is left out, and the ranks choose again without it."""
    import torch.distributed as dist

    rep = tier.replicator
    rep.ready()
    mine, copies = _inventory(tier)
    gathered = [torch.empty(len(mine), dtype=torch.int64) for _ in range(rep.world)]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.int64), group=rep.group)
    reports = [r.tolist() for r in gathered]
    refused: set[tuple[int, int, int]] = set()
    while True:  # each round leaves out one copy more at least: it ends
        chosen = choose(reports, rep.world, refused)  # the same on every rank
        if chosen is None:
            return None
        step, plan = chosen
        got: tuple[Any, bytearray | None] | None = None
        problem: BaseException | None = None
        try:
            got = _restore_mine(tier, copies, step, plan, (map_location, weights_only))
        except RefusedCopyError as e:
            warnings.warn(f"{e}; the restore takes the next source", stacklevel=4)
        except Exception as e:
            problem = e
        status = _FAILED if problem else _OK if got else _REFUSED
        refusals = _agree(rep, step, status, problem)
        if not refusals:
            break
        refused |= {(owner, step, plan[owner][0]) for owner in refusals}
    assert got is not None
    state, raw = got
    problem, own = None, None
    try:  # only now: kept before every rank had its state, it could overwrite one to send
        own = _keep_restored(tier, copies, step, plan, (state, raw))
    except Exception as e:
        problem = e
    _agree(rep, step, _FAILED if problem else _OK, problem)
    rep.send(own is not None, own)  # the peer node holds this step again before training
    return state, step


def _agree(rep: Replicator, step: int, status: int, problem: BaseException | None) -> list[int]:
    """Tell every rank how this rank's part went (`status`); the ranks that refused a copy.
    Every rank raises if one failed (this one: `problem`)."""
    import torch.distributed as dist

    said = [torch.zeros(1, dtype=torch.int64) for _ in range(rep.world)]
    dist.all_gather(said, torch.tensor([status], dtype=torch.int64), group=rep.group)
    if problem is not None:
        raise problem
    statuses = [int(s.item()) for s in said]
    who = [r for r, s in enumerate(statuses) if s == _FAILED]
    if who:
        raise CheckpointError(
            f"rank(s) {who} could not restore checkpoint step {step} (their errors say why); "
            "no rank resumes without the others"
        )
    return [r for r, s in enumerate(statuses) if s == _REFUSED]


def _restore_mine(
    tier: ReplicaTier,
    copies: dict[tuple[int, int], tuple[MemorySlot, _Copy]],
    step: int,
    plan: list[tuple[int, int]],
    load: tuple[Any, bool],
) -> tuple[Any, bytearray | None]:
    """This rank's state at `step` (`load`: map_location, weights_only), from its memory, its
    disk or a peer's memory, and its bytes if they came from memory; the copies it gives are
    sent meanwhile. A `RefusedCopyError` if its copy is refused (another's, damaged, or not
    sent)."""
    rep = tier.replicator
    map_location, weights_only = load
    raw, holder = _take(rep, copies, step, plan)
    if raw is None:  # from this rank's disk, verified as it is loaded
        return tier.disk.load(step, map_location, weights_only), None
    where = f"checkpoint step {step} of rank {rep.rank} (from rank {holder}'s memory)"
    return _payload.decode(raw, where, map_location, weights_only), raw


def _keep_restored(
    tier: ReplicaTier,
    copies: dict[tuple[int, int], tuple[MemorySlot, _Copy]],
    step: int,
    plan: list[tuple[int, int]],
    got: tuple[Any, bytearray | None],
) -> _Copy | None:
    """Keep the restored state (`got`: it, and its bytes if from memory) in this rank's own
    slot for the next failure, unless it is there; the copy there, to send to the peer."""
    rep = tier.replicator
    state, raw = got
    if raw is None:
        rep.own.put(state, step)
        return rep.own.last()
    tier.memory.restored(step)
    slot, c = copies.get((rep.rank, step), (None, None))
    if plan[rep.rank] == (rep.rank, _MEMORY) and slot is rep.own:
        return c
    rep.own.put_bytes(raw, step)  # checked again as it is sealed
    return rep.own.last()


def _take(
    rep: Replicator,
    copies: dict[tuple[int, int], tuple[MemorySlot, _Copy]],
    step: int,
    plan: list[tuple[int, int]],
) -> tuple[bytearray | None, int]:
    """This rank's part of a restore: send the copies it gives, and get its own from its
    memory or a peer's; (its bytes, or None when its disk gives it; the rank that gave
    them). A `RefusedCopyError`, once its sends are done, if its own copy is refused."""
    me = rep.rank
    views: list[memoryview] = []
    sends: list[Any] = []
    refusal: RefusedCopyError | None = None
    raw: bytearray | None = None
    try:
        for owner, (holder, tier) in enumerate(plan):
            if holder != me or owner == me or tier != _MEMORY:
                continue
            slot, c = copies[owner, step]
            views.append(slot.view(c))
            # The bytes as they are now (a slot's file can change): never another's.
            ok = slot.names(c, views[-1])
            sends += _post(rep.group, owner, _head(c if ok else None), views[-1] if ok else None)
        holder, tier = plan[me]
        try:
            raw = None if tier == _DISK else _own_copy(rep, copies, step, holder)
        except RefusedCopyError as e:
            refusal = e  # the others' sends go on all the same
        for request in sends:
            request.wait()
    except BaseException:
        for view in views:
            rep.own.pin(view)  # a send may still read it
        raise
    for view in views:
        view.release()
    if refusal is not None:
        raise refusal
    return raw, holder


def _own_copy(
    rep: Replicator, copies: dict[tuple[int, int], tuple[MemorySlot, _Copy]], step: int, holder: int
) -> bytearray:
    """This rank's copy of `step` from `holder`'s memory (this rank's or a peer's)."""
    if holder != rep.rank:
        return _receive(rep, holder, step)
    slot, c = copies[rep.rank, step]
    raw = slot.read_copy(c)
    if raw is None:
        raise RefusedCopyError(
            f"refused checkpoint step {step} of rank {rep.rank} from its own memory: it "
            "changed since it was verified (is another job using this node's memory slots?)"
        )
    return raw


def _receive(rep: Replicator, holder: int, step: int) -> bytearray:
    """This rank's copy of `step` as `holder` sends it, checked: a `RefusedCopyError` unless
    its head and its bytes name this rank, world, step and job, and its checksum verifies."""
    import torch.distributed as dist

    head = torch.empty(_HEAD_FIELDS, dtype=torch.int64)
    dist.recv(head, src=holder, group=rep.group, tag=_HEAD)
    sent_step, size, crc, owner, world = (int(v) for v in head)
    refused = f"refused checkpoint step {step} of rank {rep.rank} sent by rank {holder}"
    if size <= 0:  # the holder refused to send it: its warning says why
        raise RefusedCopyError(
            f"checkpoint step {step} of rank {rep.rank} was not sent by rank {holder}: its "
            f"copy there no longer names rank {rep.rank}'s state"
        )
    data = bytearray(size)  # taken off the wire whatever it names, to stay in step
    dist.recv(torch.frombuffer(data, dtype=torch.uint8), src=holder, group=rep.group, tag=_DATA)
    expected = _payload.Identity(rep.rank, rep.world, step, rep.own.run)
    if (owner, world, sent_step) != (rep.rank, rep.world, step):
        named = _payload.Identity(owner, world, sent_step, expected.run)
        raise RefusedCopyError(f"{refused}: its head names {named.says()}")
    received = _payload.checksum(memoryview(data))
    if received != crc:
        raise RefusedCopyError(
            f"{refused}: it arrived damaged (checksum {received:#x}, sent {crc:#x})"
        )
    try:
        _payload.check_identity(data, expected, "the copy", "is meant to be")
    except _payload.ForeignCopyError as e:
        raise RefusedCopyError(f"{refused}: {e}") from e
    return data
