"""Replicas of per-rank states on a peer node (`replicas=1`) and the per-rank restore."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from elastic_sampler import (
    CheckpointError,
    CheckpointManager,
    _payload,
    broadcast_latest,
    restore_latest,
)
from elastic_sampler._memory import SHARED, MemorySlot
from elastic_sampler._replica import Ring, choose, ring_of
from ranks_util import run_ranks

M, D, N = 0, 1, -1  # tiers in a report, and "none"


def report(*entries: tuple[int, int, int], banned: int = N, other_world: int = 0) -> list[int]:
    """A rank's report: (owner, step, tier) entries, padded to eight."""
    flat = [banned, other_world]
    for i in range(8):
        flat.extend(entries[i] if i < len(entries) else (N, N, N))
    return flat


# ---- the ring ----------------------------------------------------------------------------------


def test_each_rank_sends_to_its_local_rank_on_the_next_node():
    places = [(0, 0), (0, 1), (1, 0), (1, 1)]  # 2 nodes x 2
    assert ring_of(places, 0) == Ring(0, partner=2, source=2)
    assert ring_of(places, 3) == Ring(3, partner=1, source=1)
    three = [(5, 0), (9, 0), (7, 0)]  # nodes by their group rank, in any order of ranks
    assert ring_of(three, 0) == Ring(0, partner=2, source=1)  # node 5 -> 7 -> 9 -> 5
    assert ring_of(three, 1) == Ring(1, partner=0, source=2)


def test_one_node_has_no_ring_and_uneven_nodes_are_a_clear_error():
    assert ring_of([(0, 0), (0, 1)], 1) is None
    with pytest.raises(CheckpointError, match=r"same local ranks.*\{0: \[0, 1\], 1: \[0\]\}"):
        ring_of([(0, 0), (0, 1), (1, 0)], 0)


# ---- agreeing on a step ------------------------------------------------------------------------


def test_every_rank_takes_its_own_newest_copy_when_all_survive():
    reports = [report((r, 7, M), (r, 6, M), ((r + 2) % 4, 7, M)) for r in range(4)]
    assert choose(reports, 4) == (7, [(0, M), (1, M), (2, M), (3, M)])


def test_after_a_node_loss_the_newcomers_get_their_state_from_the_replicas():
    # Ranks 0 and 1 are new (nothing); 2 and 3 survived, holding their own and 0/1's replicas.
    reports = [report(), report(), report((2, 7, M), (0, 7, M)), report((3, 7, M), (1, 7, M))]
    assert choose(reports, 4) == (7, [(2, M), (3, M), (2, M), (3, M)])


def test_a_node_lost_during_an_exchange_resumes_at_the_step_every_rank_has():
    # The survivors saved 8, but the lost node's replicas of step 8 never arrived.
    reports = [
        report(),
        report(),
        report((2, 8, M), (2, 7, M), (0, 7, M)),
        report((3, 8, M), (3, 7, M), (1, 7, M)),
    ]
    assert choose(reports, 4) == (7, [(2, M), (3, M), (2, M), (3, M)])


def test_disk_serves_a_rank_whose_memory_is_gone_and_a_newer_disk_step_wins():
    reports = [report((0, 5, D)), report((1, 5, M), (1, 5, D))]
    assert choose(reports, 2) == (5, [(0, D), (1, M)])
    newer = [report((0, 5, M), (0, 10, D)), report((1, 5, M), (1, 10, D))]
    assert choose(newer, 2) == (10, [(0, D), (1, D)])
    # Another rank's memory copy is preferred to none, the owner's disk to another's memory.
    both = [report((0, 5, M), (1, 5, M)), report((1, 5, D))]
    assert choose(both, 2) == (5, [(0, M), (1, D)])


def test_a_step_whose_restores_died_twice_and_older_ones_come_from_disk_only():
    reports = [report((0, 9, M), (0, 5, D), banned=9), report((1, 9, M), (1, 5, D))]
    assert choose(reports, 2) == (5, [(0, D), (1, D)])
    # The step before the banned one is in memory too: it is not restored from there (that
    # restore would count anew, forget the ban, and the loop would go on).
    older = [
        report((0, 9, M), (0, 8, M), (0, 5, D), banned=9),
        report((1, 9, M), (1, 8, M), (1, 5, D)),
    ]
    assert choose(older, 2) == (5, [(0, D), (1, D)])


def test_only_another_worlds_shards_are_a_clear_error_not_a_fresh_start():
    with pytest.raises(CheckpointError, match=r"a world of \[8\] rank\(s\), and this world has 4"):
        choose([report(other_world=8), report(), report(), report()], 4)


def test_nothing_held_is_none_and_no_common_step_is_a_clear_error():
    assert choose([report(), report()], 2) is None
    with pytest.raises(
        CheckpointError, match=r"no checkpoint step is held for every rank.*\{0: 9, 1: 4\}"
    ):
        choose([report((0, 9, M)), report((1, 4, D))], 2)
    # A report naming a rank outside the world, or a disk step of another rank, is ignored.
    assert choose([report((7, 9, M), (1, 9, D)), report()], 2) is None


def test_a_refused_copy_is_left_out_and_the_ranks_choose_the_next_source():
    # Rank 1's step 7 is held by ranks 0 and 2: rank 0's was refused, rank 2's serves; once
    # that is refused too, the disk's older step that every rank holds.
    reports = [
        report((0, 7, M), (1, 7, M), (0, 5, D)),
        report((1, 5, D)),
        report((2, 7, M), (1, 7, M), (2, 5, D)),
    ]
    assert choose(reports, 3) == (7, [(0, M), (0, M), (2, M)])
    assert choose(reports, 3, {(1, 7, 0)}) == (7, [(0, M), (2, M), (2, M)])
    assert choose(reports, 3, {(1, 7, 0), (1, 7, 2)}) == (5, [(0, D), (1, D), (2, D)])


# ---- slots hold their owner's copies -----------------------------------------------------------


def test_a_slot_returns_only_its_owners_copies_and_holds_any(tmp_path):
    mine = MemorySlot(tmp_path / "slot", "run", owner=1, world=4)
    mine.put({"w": torch.ones(3)}, 5)
    other = MemorySlot(tmp_path / "slot", "run", owner=2, world=4)
    assert other.latest_step() is None, "rank 2 never takes rank 1's state"
    resized = MemorySlot(tmp_path / "slot", "run", owner=1, world=8)
    assert resized.latest_step() is None, "a shard of a world of 4 is not one of 8"
    shared = MemorySlot(tmp_path / "slot", "run", owner=SHARED)
    assert shared.latest_step() is None
    assert [(c.owner, c.world, c.step) for c in other.held()] == [(1, 4, 5)]
    assert mine.latest_step() == 5


def test_a_received_copy_is_sealed_under_its_senders_rank(tmp_path):
    sender = MemorySlot(tmp_path / "a", "run", owner=3, world=4)
    sender.put({"w": torch.arange(10)}, 7)
    sent = sender.last()
    assert sent is not None
    replica = MemorySlot(tmp_path / "b", "run", owner=3, world=4)
    with sender.view(sent) as source:

        def fill(region: memoryview) -> None:
            region[:] = source

        index = replica.receive(sent.size, fill)
    replica.seal(index, 7, sent.size, sent.crc, 3, 4)
    state, step = replica.load() or (None, None)
    assert step == 7 and torch.equal(state["w"], torch.arange(10))
    # A copy damaged in its head on its way no longer names its owner: it is not even sealed.
    index = replica.receive(
        sent.size, lambda region: region.__setitem__(slice(None), bytes(sent.size))
    )
    with pytest.raises(_payload.ForeignCopyError, match="names no owner"):
        replica.seal(index, 8, sent.size, sent.crc, 3, 4)
    assert [c.step for c in replica.held()] == [7]
    # One damaged elsewhere is sealed with the sender's checksum, and never returned.
    sender.put({"w": torch.arange(10) + 1}, 8)
    sent = sender.last()
    assert sent is not None
    with sender.view(sent) as source:
        damaged = bytearray(source)
    damaged[-1] ^= 1
    index = replica.receive(sent.size, lambda region: region.__setitem__(slice(None), damaged))
    replica.seal(index, 8, sent.size, sent.crc, 3, 4)
    assert replica.latest_step() == 7
    assert [c.step for c in replica.held()] == [7]


def forge_owner(slot: MemorySlot, owner: int, step: int | None = None) -> None:
    """Rewrite the owner (and step) in the descriptor of `slot`'s newest copy, in its file, as
    another process of the node's user can: the checksum, of the bytes only, still verifies."""
    import struct

    c = slot.last() or slot._copies(anyone=True)[0]
    data = bytearray(slot.path.read_bytes())
    at = (64, 192)[c.index]  # seq(8) step(8) size(8) crc(4) owner(4)
    struct.pack_into("<i", data, at + 28, owner)
    struct.pack_into("<Q", data, at, c.seq + 1)  # sealed anew: a copy not seen before
    if step is not None:
        struct.pack_into("<q", data, at + 8, step)
    slot.close()
    slot.path.write_bytes(bytes(data))


def test_a_copy_whose_bytes_name_another_rank_is_neither_sealed_nor_read(tmp_path):
    """Attacks: a replica slot asked to seal rank 0's bytes as rank 1's (a mix-up on the way);
    and, in the file, a descriptor of rank 0's copy rewritten to say rank 1's (or another
    step). Each checksum verifies; the owner and step inside the bytes do not."""
    sender = MemorySlot(tmp_path / "a", "run", owner=0, world=2)
    sender.put({"rank": 0, "w": torch.zeros(4)}, 5)
    sent = sender.last()
    assert sent is not None
    replica = MemorySlot(tmp_path / "b", "run", owner=1, world=2)
    with sender.view(sent) as source:
        index = replica.receive(sent.size, lambda region: region.__setitem__(slice(None), source))
    with pytest.raises(_payload.ForeignCopyError, match="is to be sealed as rank 1's state"):
        replica.seal(index, 5, sent.size, sent.crc, 1, 2)  # never sealed as rank 1's
    assert replica._copies(anyone=True) == []
    replica.seal(index, 5, sent.size, sent.crc, 0, 2)  # rank 0's, as it says
    forge_owner(replica, 1)  # then the file is rewritten: sealed as rank 1's
    with pytest.warns(
        UserWarning,
        match="is sealed as rank 1's state of step 5 in a world of "
        "2 but holds rank 0's state of step 5 in a world of 2",
    ):
        assert replica.load() is None
    assert replica.held() == [], "listed nowhere: a restore takes the next source"
    forge_owner(replica, 0, step=6)  # sealed as the right rank but another step: refused too
    with pytest.warns(UserWarning, match="of step 6 .* but holds rank 0's state of step 5"):
        assert [c.step for c in replica.held()] == []


# ---- the manager -------------------------------------------------------------------------------


@pytest.fixture
def rank_env(tmp_path, monkeypatch):
    for name, value in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ELASTICRUN_MEMORY_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")


def test_replicas_name_files_by_rank_and_world_and_need_the_memory_tier(tmp_path, rank_env):
    m = CheckpointManager(tmp_path / "ckpt", memory=True, replicas=1)
    assert m.path(5).name == "checkpoint-rank3of4-000000000005.pt"
    with pytest.raises(ValueError, match=r"replicas=1\.0"):
        CheckpointManager(tmp_path / "ckpt", memory=True, replicas=1.0)
    with pytest.raises(ValueError, match="replicas=2"):
        CheckpointManager(tmp_path / "ckpt", memory=True, replicas=2)
    with pytest.raises(ValueError, match="pass memory=True"):
        CheckpointManager(tmp_path / "ckpt", replicas=1)
    with pytest.raises(ValueError, match="call restore_latest"):
        broadcast_latest(m)


def test_a_rank_reports_each_copy_once_the_newest_and_other_worlds(tmp_path, rank_env):
    from elastic_sampler._replica import _inventory

    m = CheckpointManager(tmp_path / "ckpt", memory=True, replicas=1)
    assert m.replica_tier is not None
    rep = m.replica_tier.replicator
    rep.own.put({"w": torch.zeros(3)}, 5)
    rep.own.put({"w": torch.ones(3)}, 5)  # saved again after a rollback: the newer counts
    rep.replica.owner, rep.replica.world = 1, 4
    rep.replica.put({"w": torch.zeros(2)}, 5)
    report_, copies = _inventory(m.replica_tier)
    assert report_[:2] == [N, 0]
    assert sorted(copies) == [(1, 5), (3, 5)]
    slot, c = copies[3, 5]
    assert slot is rep.own
    assert torch.equal(_payload.decode(slot.read_copy(c), "t")["w"], torch.ones(3))
    (tmp_path / "ckpt" / "checkpoint-rank1of8-000000000005.pt").write_bytes(b"x")
    assert _inventory(m.replica_tier)[0][1] == 8, "another world's files are reported"


def test_replicas_without_the_launchers_variables_are_a_clear_error(
    tmp_path, rank_env, monkeypatch
):
    monkeypatch.setenv("RANK", "x3")
    with pytest.raises(CheckpointError, match=r"\$RANK='x3'.*elasticrun and torchrun set"):
        CheckpointManager(tmp_path / "ckpt", memory=True, replicas=1)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(CheckpointError, match=r"\$RANK=4 is not below \$WORLD_SIZE=4"):
        CheckpointManager(tmp_path / "ckpt", memory=True, replicas=1)


def test_a_save_before_the_process_group_is_a_clear_error(tmp_path, rank_env):
    m = CheckpointManager(tmp_path / "ckpt", memory=True, replicas=1)
    with pytest.raises(CheckpointError, match=r"call torch\.distributed\.init_process_group"):
        m.save({"w": torch.ones(3)}, 1)


def test_without_replicas_restore_latest_is_load_latest(tmp_path):
    m = CheckpointManager(tmp_path)
    assert restore_latest(m) is None
    m.save({"w": torch.ones(3)}, 4)
    state, step = restore_latest(m) or (None, None)
    assert step == 4 and torch.equal(state["w"], torch.ones(3))


# ---- real processes: 2 nodes x 2 ranks, gloo ---------------------------------------------------

# argv: rank, port, root, phase, every rank's node ("a,a,b,b"). Each rank's state is its own:
# a large tensor (odd steps: copied on the copy thread) or a small one (even steps: inside
# save()).
JOB = """
import os, sys, warnings, torch, torch.distributed as dist
from elastic_sampler import CheckpointManager, restore_latest
rank, port, root, phase = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
node = sys.argv[5].split(",")[rank]
os.environ.update(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2), GROUP_RANK=str(rank // 2),
                  ELASTICRUN_MEMORY_DIR=os.path.join(root, "node" + node), TORCHELASTIC_RUN_ID="run")
os.makedirs(os.environ["ELASTICRUN_MEMORY_DIR"], exist_ok=True)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=4)
m = CheckpointManager(os.path.join(root, "ckpt"), memory=True, replicas=1, persist_every=5)

def state(step):
    n = 300_000 if step % 2 else 10
    return {"rank": rank, "w": torch.full((n,), float(1000 * rank + step))}

got = restore_latest(m)
if phase == "train":
    assert got is None, got
    for step in range(1, 8):
        m.save(state(step), step)
    m.close()
    print("TRAINED", rank, flush=True)
else:
    loaded, step = got
    ok = loaded["rank"] == rank and torch.equal(loaded["w"], state(step)["w"])
    print("RESUMED", rank, step, ok, flush=True)
dist.barrier()
dist.destroy_process_group()
print("EXIT 0", rank, flush=True)
"""


def run_job(root: Path, phase: str, nodes: list[str]) -> list[str]:
    """Four ranks of JOB; `nodes[r]`: the node (its memory) rank r runs on. The disk is
    shared, as a whole job's loss needs."""
    outs = run_ranks(JOB, 4, str(root), phase, ",".join(nodes))
    assert all(f"EXIT 0 {r}" in out for r, out in enumerate(outs)), outs
    return outs


@pytest.mark.slow  # four real processes and gloo, three times
def test_a_lost_node_costs_no_rank_its_newest_step_and_the_whole_job_the_disks(tmp_path):
    import shutil

    outs = run_job(tmp_path, "train", ["a", "a", "b", "b"])
    assert all(f"TRAINED {r}" in outs[r] for r in range(4)), outs
    # Node b is lost and replaced by node c; the ranks are dealt anew: the newcomers take
    # ranks 0 and 1, node a's workers ranks 2 and 3, so every rank's state is elsewhere.
    shutil.rmtree(tmp_path / "nodeb")
    outs = run_job(tmp_path, "resume", ["c", "c", "a", "a"])
    assert all(f"RESUMED {r} 7 True" in outs[r] for r in range(4)), outs
    # The whole job is lost: only the disk (every 5 steps) is left.
    shutil.rmtree(tmp_path / "nodea")
    shutil.rmtree(tmp_path / "nodec")
    outs = run_job(tmp_path, "resume", ["d", "d", "e", "e"])
    assert all(f"RESUMED {r} 5 True" in outs[r] for r in range(4)), outs


def swap_owners(node: Path, swap: dict[int, int]) -> int:
    """Rewrite the owner in the descriptors of `node`'s replica slots (what a mix-up of two
    peers' copies looks like: each checksum still verifies); how many were rewritten."""
    import struct

    done = 0
    for path in node.glob("*-replica*"):
        data = bytearray(path.read_bytes())
        for at in (64, 192):  # the two descriptors; owner at +28 (seq, step, size, crc, owner)
            seq, owner = (
                struct.unpack_from("<Q", data, at)[0],
                struct.unpack_from("<i", data, at + 28)[0],
            )
            if seq and owner in swap:
                struct.pack_into("<i", data, at + 28, swap[owner])
                done += 1
        path.write_bytes(bytes(data))
    return done


@pytest.mark.slow  # four real processes and gloo, twice
def test_replicas_that_name_another_rank_are_refused_and_the_disk_serves(tmp_path):
    import shutil

    outs = run_job(tmp_path, "train", ["a", "a", "b", "b"])
    assert all(f"TRAINED {r}" in outs[r] for r in range(4)), outs
    # Node b is lost; node a's replicas of ranks 2 and 3 are sealed each as the other's.
    shutil.rmtree(tmp_path / "nodeb")
    assert swap_owners(tmp_path / "nodea", {2: 3, 3: 2}) >= 2
    outs = run_job(tmp_path, "resume", ["c", "c", "a", "a"])
    # Before: rank 2 resumed from rank 3's state at step 7. Now the copies are refused, ranks 2
    # and 3 have only the disk's step 5, and every rank takes the step all of them hold.
    assert all(f"RESUMED {r} 5 True" in outs[r] for r in range(4)), outs
    assert any("is sealed as rank 3's state of step" in o and "holds rank 2's" in o for o in outs)


# ---- failures keep the ring in step, and say so ------------------------------------------------


def test_a_failed_exchange_names_both_peers_and_no_later_one_is_tried(tmp_path, monkeypatch):
    import torch.distributed as dist
    from elastic_sampler._replica import Replicator

    own = MemorySlot(tmp_path / "own", "run", owner=0, world=2)
    own.put({"w": torch.ones(3)}, 4)
    rep = Replicator(own, MemorySlot(tmp_path / "replica", "run"), 0, 2)
    rep.ring = Ring(0, partner=1, source=1)

    class Sent:
        def wait(self) -> None:
            pass

    def peer_gone(*args, **kwargs):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    monkeypatch.setattr(dist, "isend", lambda *a, **k: Sent())
    monkeypatch.setattr(dist, "recv", peer_gone)
    with pytest.raises(CheckpointError, match=r"with rank 1 \(ours\) and rank 1 \(theirs\) failed"):
        rep.send(True)
    with pytest.raises(CheckpointError, match=r"an earlier exchange failed \(Connection closed"):
        rep.send(True)


def test_a_copy_that_failed_still_tells_the_peer(tmp_path):
    from elastic_sampler._overlap import Copy

    said = []
    slot = MemorySlot(tmp_path / "slot", "run", limit=1)  # no room for anything
    copy = Copy(slot, _payload.plan({"w": torch.ones(1 << 20)}, slot.identity(1)), 1, said.append)
    assert copy.join(30)
    assert said == [False], "the peer hears that nothing new comes"
    assert isinstance(copy.error, CheckpointError)


# ---- a copy that names another owner is refused at every hop -----------------------------------

REPORT_LEN = 2 + 8 * 3  # a rank's report in `restore`: banned, other world, eight entries
#: The fields of a copy's head on the wire, by the head's length: 5 names its owner and world;
#: 2 (the way back) and 3 (the ring) are the heads from before, so that these tests show what
#: that code did with the same attack.
LAYOUTS = {
    5: ("step", "size", "crc", "owner", "world"),
    3: ("step", "size", "crc"),
    2: ("size", "crc"),
}
NOTHING = {"step": N, "size": N, "crc": 0, "owner": N, "world": N}


class Sent:
    def wait(self) -> None:
        pass


class PeerRank0:
    """Rank 0 of a world of 2, as rank 1 sees it through torch.distributed (one process): its
    report in `restore`, the heads and bytes it sends, in order, and how its part of each
    round of a restore went (`said`; then 0: well). The heads rank 1 sends are kept in
    `sent`; `listed` runs once the reports are gathered (rank 1 listed its copies)."""

    def __init__(self, report_: list[int], heads: list[dict[str, int]], data: list[bytes]):
        self.report, self.heads, self.data = report_, heads, data
        self.sent: list[list[int]] = []
        self.said: list[int] = []
        self.listed: Callable[[], None] = lambda: None

    def all_gather(self, out, tensor, group=None) -> None:
        out[1].copy_(tensor)
        if tensor.numel() == REPORT_LEN:
            out[0].copy_(torch.tensor(self.report))
            self.listed()
        else:
            out[0].fill_(self.said.pop(0) if self.said else 0)

    def recv(self, tensor, src=None, group=None, tag=None) -> None:
        from elastic_sampler._replica import _HEAD

        if tag == _HEAD:
            head = self.heads.pop(0)
            tensor.copy_(torch.tensor([head[f] for f in LAYOUTS[tensor.numel()]]))
        else:
            tensor.copy_(torch.frombuffer(bytearray(self.data.pop(0)), dtype=torch.uint8))

    def isend(self, tensor, dst=None, group=None, tag=None) -> Sent:
        from elastic_sampler._replica import _HEAD

        if tag == _HEAD:
            self.sent.append(tensor.tolist())
        return Sent()


def rank0s_copy(tmp_path, step: int) -> tuple[bytes, int]:
    """Rank 0's payload of `step` and its checksum, as rank 0's slot holds them."""
    slot = MemorySlot(tmp_path / "rank0-slot", "run-a", owner=0, world=2)
    slot.put({"rank": 0, "w": torch.zeros(4)}, step)
    c = slot.last()
    assert c is not None
    data = slot.read_copy(c)
    assert data is not None
    return bytes(data), c.crc


@pytest.fixture
def rank1(tmp_path, monkeypatch):
    """Rank 1 of 2 (nodes 0 and 1), whose disk holds its step 5; its ring is formed."""
    for name, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "GROUP_RANK": "1",
        "ELASTICRUN_MEMORY_DIR": str(tmp_path),
        "TORCHELASTIC_RUN_ID": "run-a",
    }.items():
        monkeypatch.setenv(name, value)
    m = CheckpointManager(tmp_path / "ckpt", memory=True, replicas=1)
    assert m.replica_tier is not None
    m.disk_tier.save({"rank": 1, "w": torch.ones(4)}, 5)
    rep = m.replica_tier.replicator
    rep.group, rep.ring = object(), Ring(1, partner=0, source=0)  # as ready() leaves them
    rep.replica.owner, rep.replica.world = 0, 2
    return m


def as_peer(monkeypatch, peer: PeerRank0) -> None:
    import torch.distributed as dist

    for name in ("all_gather", "recv", "isend"):
        monkeypatch.setattr(dist, name, getattr(peer, name))


@pytest.mark.parametrize("claimed", [1, 0], ids=["head-lies", "head-names-rank-0"])
def test_a_peer_that_sends_rank_0s_state_to_rank_1_is_refused_and_the_disk_serves(
    tmp_path, rank1, monkeypatch, claimed
):
    """Attack: rank 0 holds rank 1's newest step (7) in its replica slot, and on the way back
    sends rank 0's own copy of step 7 instead (a peer that controls what it sends, or a slot
    rewritten on its node between the listing and the send), with that copy's true checksum
    and a head that claims rank 1 (`head-lies`) or names rank 0. Before, rank 1 checked only
    the checksum the sender sent with it, and silently resumed from rank 0's state. Now the
    owner in the head and in the checksummed bytes must be rank 1's: the copy is refused,
    and the restore takes the next source (rank 1's disk, at the step every rank has)."""
    import warnings

    data, crc = rank0s_copy(tmp_path, 7)
    forged = {"step": 7, "size": len(data), "crc": crc, "owner": claimed, "world": 2}
    held_by_0 = report((0, 7, M), (1, 7, M), (0, 5, D))
    peer = PeerRank0(held_by_0, [forged, NOTHING], [data])  # then the ring: nothing new
    as_peer(monkeypatch, peer)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        state, step = restore_latest(rank1) or (None, None)
    assert (step, state["rank"]) == (5, 1), "rank 1 resumed from rank 0's state"
    assert torch.equal(state["w"], torch.ones(4))
    words = " ".join(str(w.message) for w in said)
    assert "refused checkpoint step 7 of rank 1 sent by rank 0" in words, words
    assert "rank 0's state" in words and "the next source" in words, words
    rep = rank1.replica_tier.replicator
    # what rank 1 keeps, and sends around the ring, is its own step 5, not rank 0's 7
    assert [(c.owner, c.step) for c in rep.own.held()] == [(1, 5)]
    assert [head[:1] + head[3:] for head in peer.sent] == [[5, 1, 2]]


def sealed(path: Path) -> list[tuple[int, int]]:
    """(owner, step) of every sealed descriptor in the slot file at `path` (read from the
    file: what any reader of it would find)."""
    import struct

    data = path.read_bytes() if path.exists() else b""
    found = []
    for at in (64, 192) if len(data) > 256 else ():
        seq, step = struct.unpack_from("<Qq", data, at)
        if seq:
            found.append((struct.unpack_from("<i", data, at + 28)[0], step))
    return found


def shared_copy(tmp_path, step: int) -> tuple[bytes, int]:
    """A payload of the ranks' shared state (owner -1) of `step`, and its checksum."""
    slot = MemorySlot(tmp_path / "shared-slot", "run-a")
    slot.put({"w": torch.zeros(4)}, step)
    c = slot.last()
    assert c is not None
    return bytes(slot.read_copy(c) or b""), c.crc


@pytest.mark.parametrize("forgery", ["head-names-shared", "head-lies", "bytes-of-rank-1"])
def test_a_copy_around_the_ring_that_names_another_than_its_sender_is_refused(
    tmp_path, rank1, monkeypatch, forgery
):
    """Attacks on the ring: rank 1 keeps rank 0's copies, and rank 0 (or whoever speaks for
    it) sends a copy that is not rank 0's: the ranks' shared state named in its head
    (owner -1); another's bytes under a head that claims rank 0's; or rank 1's own state,
    head and bytes, so that rank 1's replica slot would hold rank 1's state under rank 0's
    name. Before, the head named no owner and the copy was sealed as rank 0's, whatever its
    bytes said. Now it is refused on arrival with a warning, never sealed, and the ring goes
    on."""
    rep = rank1.replica_tier.replicator
    if forgery == "head-names-shared":
        data, crc = shared_copy(tmp_path, 9)
        owner = -1
    else:
        mine = MemorySlot(tmp_path / "rank1-elsewhere", "run-a", owner=1, world=2)
        mine.put({"rank": 1, "w": torch.ones(4)}, 9)
        c = mine.last()
        assert c is not None
        data, crc = bytes(mine.read_copy(c) or b""), c.crc
        owner = 0 if forgery == "head-lies" else 1
    forged = {"step": 9, "size": len(data), "crc": crc, "owner": owner, "world": 2}
    peer = PeerRank0(report(), [forged, NOTHING], [data])
    as_peer(monkeypatch, peer)
    rep.own.put({"rank": 1, "w": torch.ones(4)}, 9)
    with pytest.warns(UserWarning, match="refused the checkpoint copy of step 9 that rank 0 sent"):
        rep.send(True)
    assert sealed(rep.replica.path) == [], "rank 1 kept a copy that is not rank 0's"
    assert [head[3:] for head in peer.sent] == [[1, 2]], "its own copy names rank 1"
    rep.send(False)  # the ring is in step: the next exchange goes on


def test_a_holder_whose_copy_changed_since_it_was_listed_does_not_send_it(
    tmp_path, rank1, monkeypatch
):
    """Attack on the way back from the holder's side: rank 1 holds rank 0's step 7 in its
    replica slot and lists it; then, before it sends it, the slot's file is rewritten on its
    node so that the bytes name rank 1 (another process of the node's user). Before, rank 1
    sent the bytes as they were then, unchecked: rank 0 found them damaged and every rank
    failed (with the checksum forged too, rank 0 resumed from rank 1's state). Now rank 1
    checks whose they are as it sends them, sends none (and says so), and rank 0, refused,
    takes the next source: its disk."""
    rep = rank1.replica_tier.replicator
    rep.own.put({"rank": 1, "w": torch.ones(4)}, 7)
    rep.replica.put_bytes(rank0s_copy(tmp_path, 7)[0], 7)
    listed = rep.replica.last()
    assert listed is not None

    def rewrite() -> None:  # after rank 1 listed its copies, before it sends them
        with rep.replica.view(listed) as view:
            view[16:20] = (1).to_bytes(4, "little", signed=True)  # the owner in its head

    # Rank 0 lost its node: only its disk's step 5 is left.
    peer = PeerRank0(report((0, 5, D)), [NOTHING], [])
    peer.listed = rewrite
    peer.said = [1]  # rank 0's part of the first round: it refused what it got (nothing)
    as_peer(monkeypatch, peer)
    with pytest.warns(UserWarning, match="is sealed as rank 0's state") as said:
        state, step = restore_latest(rank1) or (None, None)
    assert peer.sent[0][1] < 0, "rank 1 sent rank 0 a copy that names rank 1"
    words = " ".join(str(w.message) for w in said)
    assert "is sealed as rank 0's state of step 7" in words and "holds rank 1's" in words
    assert (step, state["rank"]) == (5, 1)  # the step every rank holds: rank 1's disk too
