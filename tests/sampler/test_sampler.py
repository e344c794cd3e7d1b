"""ElasticDistributedSampler: torch's order at the start, every remaining sample exactly once
after a resize, in both permutation modes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from elastic_sampler import ElasticDistributedSampler, FeistelPermutation, SamplerStateError
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("n", [1, 7, 10, 64, 101])
@pytest.mark.parametrize("replicas", [1, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_same_indices_as_torch(n, replicas, shuffle, drop_last):
    data = Data(n)
    for epoch in (0, 3):
        for rank in range(replicas):
            kw = dict(
                num_replicas=replicas, rank=rank, shuffle=shuffle, seed=11, drop_last=drop_last
            )
            theirs = DistributedSampler(data, **kw)
            ours = ElasticDistributedSampler(data, **kw)
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def test_works_under_a_dataloader_with_workers():
    data = Data(50)
    sampler = ElasticDistributedSampler(data, num_replicas=2, rank=1, seed=3)
    sampler.set_epoch(2)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    got = [int(i) for batch in loader for i in batch]
    expected = DistributedSampler(data, num_replicas=2, rank=1, seed=3)
    expected.set_epoch(2)
    assert got == list(expected)


def consume(n, replicas, steps, batch, shuffle, drop_last, seed, epoch, permutation):
    """Run `steps` synchronous steps on `replicas` ranks; returns (consumed ids, state)."""
    data = Data(n)
    samplers = [
        ElasticDistributedSampler(
            data, replicas, r, shuffle, seed, drop_last, permutation=permutation
        )
        for r in range(replicas)
    ]
    consumed = []
    for s in samplers:
        s.set_epoch(epoch)
        consumed += list(s)[: steps * batch]
    return consumed, samplers[0].state_dict(steps=steps, batch_size=batch)


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 400),
    before=st.integers(1, 16),
    after=st.integers(1, 16),
    batch=st.integers(1, 8),
    steps=st.integers(0, 40),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    permutation=st.sampled_from(["torch", "feistel"]),
    seed=st.integers(0, 2**31),
)
def test_resize_yields_the_rest_of_the_epoch_exactly_once(
    n, before, after, batch, steps, shuffle, drop_last, permutation, seed
):
    epoch = 5
    # A resize happens mid-epoch: what was consumed lies within the epoch's real samples (the
    # padding at its very end is consumed only when the epoch is over).
    steps = min(steps, n // (batch * before))
    consumed, state = consume(n, before, steps, batch, shuffle, drop_last, seed, epoch, permutation)
    assert len(consumed) == state["consumed"] == steps * batch * before
    assert len(set(consumed)) == len(consumed), "no sample twice before the resize"
    data = Data(n)
    rest = []
    lengths = set()
    for r in range(after):
        s = ElasticDistributedSampler(
            data, after, r, shuffle, seed, drop_last, permutation=permutation
        )
        s.load_state_dict(state)
        s.set_epoch(epoch)  # the loop calls it again: the position is kept
        got = list(s)
        assert len(got) == len(s)
        lengths.add(len(got))
        rest += got
    assert len(lengths) <= 1, "every rank gets as many samples"
    remaining = set(range(n)) - set(consumed)
    counts = Counter(rest)
    assert not set(counts) & set(consumed), "nothing consumed before comes again"
    m = n - len(consumed)
    if drop_last:
        assert len(rest) == (m // after) * after
        assert max(counts.values(), default=1) == 1, "none twice"
        assert len(remaining - set(counts)) == m % after, "only the tail is left out"
    else:
        assert set(counts) == remaining, "none skipped"
        extra = sum(c - 1 for c in counts.values())
        assert extra == len(rest) - m < after, "only torch's padding repeats"


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097, 65536, 100003])
@pytest.mark.parametrize("seed", [0, 1, 123456789])
def test_feistel_is_a_permutation(n, seed):
    perm = FeistelPermutation(n, seed, epoch=2)
    values = perm.map(torch.arange(n, dtype=torch.int64))
    assert sorted(values.tolist()) == list(range(n))


def test_feistel_is_deterministic_and_depends_on_seed_and_epoch():
    pos = torch.arange(1000, dtype=torch.int64)
    a = FeistelPermutation(1000, 7, 0).map(pos)
    assert torch.equal(a, FeistelPermutation(1000, 7, 0).map(pos))
    assert not torch.equal(a, FeistelPermutation(1000, 8, 0).map(pos))
    assert not torch.equal(a, FeistelPermutation(1000, 7, 1).map(pos))
    assert not torch.equal(a, pos), "it shuffles"


def test_feistel_handles_a_billion_samples_lazily():
    data = Data(10**9)
    sampler = ElasticDistributedSampler(data, 8, 3, permutation="feistel", seed=1)
    it = iter(sampler)
    first = [next(it) for _ in range(1000)]
    assert len(set(first)) == 1000 and all(0 <= i < 10**9 for i in first)
    assert len(sampler) == 10**9 // 8


def test_bad_arguments_and_states():
    data = Data(10)
    with pytest.raises(ValueError, match="permutation='fast' is not one of torch, feistel"):
        ElasticDistributedSampler(data, 2, 0, permutation="fast")
    with pytest.raises(ValueError, match="start_index=11 is outside the epoch"):
        ElasticDistributedSampler(data, 2, 0, start_index=11)
    s = ElasticDistributedSampler(data, 2, 0, seed=1)
    state = s.state_dict(steps=2, batch_size=2)
    other = ElasticDistributedSampler(Data(12), 2, 0, seed=1)
    with pytest.raises(
        SamplerStateError, match="dataset_size=10, this sampler has dataset_size=12"
    ):
        other.load_state_dict(state)
    with pytest.raises(SamplerStateError, match="seed=1"):
        ElasticDistributedSampler(data, 2, 0, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="give both steps and batch_size"):
        s.state_dict(steps=3)
    with pytest.raises(ValueError, match="Invalid rank 5"):  # torch's own check
        ElasticDistributedSampler(data, 2, 5)


def test_counts_what_it_handed_out_without_steps():
    data = Data(20)
    s = ElasticDistributedSampler(data, 2, 0, shuffle=False)
    it = iter(s)
    [next(it) for _ in range(3)]
    assert s.state_dict()["consumed"] == 6
    s.set_epoch(1)
    assert s.start_index == 0, "a new epoch starts from its beginning"


def test_a_constructor_start_index_belongs_to_the_first_epoch_set():
    data = Data(20)
    s = ElasticDistributedSampler(data, 2, 0, shuffle=False, start_index=10)
    s.set_epoch(3)  # a loop resuming in epoch 3 names it first: the start stays
    assert list(s) == [10, 12, 14, 16, 18]
    s.set_epoch(4)
    assert s.start_index == 0 and len(list(s)) == 10


def test_iterating_again_without_set_epoch_gives_the_whole_epoch():
    data = Data(20)
    s = ElasticDistributedSampler(data, 2, 1, shuffle=False, start_index=16)
    assert list(s) == [17, 19]
    assert s.state_dict()["consumed"] == 20, "the epoch is complete"
    assert list(s) == list(range(1, 20, 2)), "a second pass is a full epoch, as torch's"


def test_takes_torchs_arguments_in_torchs_order():
    import inspect

    theirs = list(inspect.signature(DistributedSampler.__init__).parameters.values())
    ours = list(inspect.signature(ElasticDistributedSampler.__init__).parameters.values())
    assert [(p.name, p.default, p.kind) for p in ours[: len(theirs)]] == [
        (p.name, p.default, p.kind) for p in theirs
    ]
    from elastic_sampler.sampler import SamplerOptions

    # Ours beyond torch's six are keywords only (**options), exactly these two.
    assert [p.kind for p in ours[len(theirs) :]] == [inspect.Parameter.VAR_KEYWORD]
    assert set(SamplerOptions.__annotations__) == {"start_index", "permutation"}
    with pytest.raises(TypeError, match="unexpected keyword argument 'start'"):
        ElasticDistributedSampler(Data(4), 1, 0, start=2)
    data = Data(23)
    args = (data, 3, 2, True, 7, True)  # all six positionally
    theirs_sampler, ours_sampler = DistributedSampler(*args), ElasticDistributedSampler(*args)
    for s in (theirs_sampler, ours_sampler):
        s.set_epoch(2)
    assert list(ours_sampler) == list(theirs_sampler)
    with pytest.raises(TypeError, match="positional"):
        ElasticDistributedSampler(data, 3, 2, True, 7, True, 5)  # start_index is keyword-only


def test_a_classic_positional_start_index_is_an_error_not_a_shuffle_flag():
    # torchelastic's sampler: (dataset, num_replicas, rank, start_index)
    with pytest.raises(TypeError, match=r"shuffle=100: give True or False.*start_index=100"):
        ElasticDistributedSampler(Data(200), 2, 0, 100)
    with pytest.raises(TypeError, match="shuffle=0"):
        ElasticDistributedSampler(Data(200), 2, 0, 0)
    with pytest.raises(TypeError, match="start_index='5'"):
        ElasticDistributedSampler(Data(200), 2, 0, start_index="5")


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (None, r"load_state_dict\(None\): expected the dict .* got NoneType \(no state was saved"),
        ({}, "lacks epoch, consumed"),
        ({"epoch": 1}, "lacks consumed"),
        ([1, 2], "got list"),
        ({"epoch": "1", "consumed": 0}, "epoch='1' is not a count"),
        ({"epoch": 0, "consumed": -4}, "consumed=-4 is not a count"),
        ({"epoch": 0, "consumed": 2.5}, "consumed=2.5 is not a count"),
        ({"epoch": 0, "consumed": 11}, "11 samples of the epoch were consumed, but the dataset"),
    ],
)
def test_a_missing_or_malformed_state_is_a_clear_error(state, message):
    s = ElasticDistributedSampler(Data(10), 2, 0, seed=1)
    s.set_epoch(3)
    with pytest.raises(SamplerStateError, match=message):
        s.load_state_dict(state)
    assert s.epoch == 3 and s.start_index == 0, "a refused state changes nothing"


@pytest.mark.parametrize(
    ("steps", "batch_size", "message"),
    [(-1, 4, "steps=-1"), (2, 0, "batch_size=0"), (2, -3, "batch_size=-3"), (1.5, 2, "steps=1.5")],
)
def test_negative_or_fractional_step_counts_are_refused(steps, batch_size, message):
    s = ElasticDistributedSampler(Data(10), 2, 0)
    with pytest.raises(ValueError, match=message):
        s.state_dict(steps=steps, batch_size=batch_size)


def test_steps_counted_from_the_epochs_start_after_a_resume_are_an_error_not_a_skip():
    """After a resume the sampler starts where the job was; `steps` counts from there. Steps
    counted from the epoch's start would skip samples: more than the iterator handed out is
    refused, saying why."""
    data = Data(100)
    first = ElasticDistributedSampler(data, 2, 0, shuffle=False)
    it = iter(first)
    for _ in range(20):  # 10 steps of 2 samples on this rank
        next(it)
    resumed = ElasticDistributedSampler(data, 2, 0, shuffle=False)
    resumed.load_state_dict(first.state_dict(steps=10, batch_size=2))  # 40 of 100 consumed
    it = iter(resumed)
    for _ in range(4):  # 2 more steps
        next(it)
    assert resumed.state_dict(steps=2, batch_size=2)["consumed"] == 48
    with pytest.raises(ValueError, match="count the steps since then, not since the epoch"):
        resumed.state_dict(steps=12, batch_size=2)  # the epoch's 12 steps: 20 samples skipped
