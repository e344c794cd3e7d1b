"""Replicas of per-rank states on a peer node (`replicas=1`) and the per-rank restore."""

from __future__ import annotations

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
    # A copy damaged on its way is sealed with the sender's checksum, and never returned.
    index = replica.receive(
        sent.size, lambda region: region.__setitem__(slice(None), bytes(sent.size))
    )
    replica.seal(index, 8, sent.size, sent.crc, 3, 4)
    assert replica.latest_step() == 7
    assert [c.step for c in replica.held()] == [7]


def test_a_copy_whose_bytes_name_another_rank_is_refused_with_a_warning(tmp_path):
    """A replica slot sealed as rank 1's but holding rank 0's bytes (a mix-up on the way, or a
    descriptor rewritten): its checksum verifies, the owner inside the bytes does not."""
    sender = MemorySlot(tmp_path / "a", "run", owner=0, world=2)
    sender.put({"rank": 0, "w": torch.zeros(4)}, 5)
    sent = sender.last()
    assert sent is not None
    replica = MemorySlot(tmp_path / "b", "run", owner=1, world=2)
    with sender.view(sent) as source:
        index = replica.receive(sent.size, lambda region: region.__setitem__(slice(None), source))
    replica.seal(index, 5, sent.size, sent.crc, 1, 2)  # sealed as rank 1's
    with pytest.warns(
        UserWarning,
        match="is sealed as rank 1's state of step 5 in a world of "
        "2 but holds rank 0's state of step 5 in a world of 2",
    ):
        assert replica.load() is None
    assert replica.held() == [], "listed nowhere: a restore takes the next source"
    # sealed as the right rank but another step: refused too
    index = replica.receive(
        sent.size,
        lambda region: region.__setitem__(slice(None), bytes(sender.read_copy(sent) or b"")),
    )
    replica.seal(index, 6, sent.size, sent.crc, 0, 2)
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
