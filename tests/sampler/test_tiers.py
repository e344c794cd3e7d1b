"""Each checkpoint tier behind the one interface (save a step, the steps held, load one), alone:
the manager's own tests cover how it composes them."""

from __future__ import annotations

import pytest
import torch
from elastic_sampler._disk import DiskTier
from elastic_sampler._memory import MemorySlot
from elastic_sampler._memory_tier import MemoryTier
from elastic_sampler._replica import ReplicaTier
from elastic_sampler.api import CheckpointError, CheckpointTier


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(step))}


def disk(tmp_path) -> DiskTier:
    return DiskTier(tmp_path / "ckpt", "checkpoint", keep_last=2)


def memory(tmp_path) -> MemoryTier:
    return MemoryTier(MemorySlot(tmp_path / "slot", "run"), overlap=False)


@pytest.mark.parametrize("make", [disk, memory], ids=["disk", "memory"])
def test_a_tier_keeps_what_it_saves_and_loads_it_back(tmp_path, make):
    tier = make(tmp_path)
    assert isinstance(tier, CheckpointTier)
    assert tier.steps() == []
    tier.save(state(3), 3)
    tier.save(state(5), 5)
    assert tier.steps()[-1] == 5
    assert torch.equal(tier.load(5)["w"], state(5)["w"])
    with pytest.raises(CheckpointError):
        tier.load(4)


def test_the_disk_tier_keeps_the_last_k_and_verifies_as_it_loads(tmp_path):
    tier = disk(tmp_path)
    for step in (1, 2, 3):
        tier.save(state(step), step)
    assert tier.steps() == [2, 3]
    tier.path(3).write_bytes(b"torn")
    assert tier.verified(2) == [2], "the torn step does not verify"
    with pytest.raises(CheckpointError, match="torn"):
        tier.load(3)


def test_the_memory_tier_stops_restoring_a_step_that_killed_its_reader_twice(tmp_path):
    tier = memory(tmp_path)
    tier.save(state(7), 7)
    for _ in range(2):  # two workers restored step 7 and died before saving a newer one
        MemoryTier(MemorySlot(tmp_path / "slot", "run")).restored(7)
    with pytest.warns(UserWarning, match="restored 2 times"):
        assert tier.steps() == []
    assert tier.banned() == 7


def test_the_replica_tier_holds_this_ranks_steps_from_either_slot(tmp_path):
    own = MemoryTier(MemorySlot(tmp_path / "own", "run", owner=1, world=2), overlap=False)
    replica = MemorySlot(tmp_path / "replica", "run", owner=0, world=2)
    tier = ReplicaTier(own, replica, disk(tmp_path), (1, 2), "checkpoint")
    assert isinstance(tier, CheckpointTier)
    own.save(state(4), 4)
    replica.put(state(9), 9)  # rank 0's copy, held for it: not this rank's state
    assert tier.steps() == [4]
    assert torch.equal(tier.load(4)["w"], state(4)["w"])
    with pytest.raises(CheckpointError, match="not held here"):
        tier.load(9)
