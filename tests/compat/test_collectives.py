"""The classic collectives (``torchelastic.distributed``, here
``elastic_launch.train_loop.distributed``) as torchelastic v0.1.0rc1's
``test/distributed/collectives_test.py`` pins them: three ranks of a gloo group. Each test names
the upstream test it follows (written here; no code is copied)."""

from __future__ import annotations

import hashlib
import os

import pytest
from elastic_launch.net import free_port
from peers import Group, result

pytestmark = pytest.mark.slow  # real process groups


def _in_group(rank: int, world: int, port: int, fn_name: str, inputs: list) -> object:
    import torch.distributed as dist
    from elastic_launch.train_loop import distributed as edist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return OPS[fn_name](edist, inputs[rank])
    finally:
        dist.destroy_process_group()


def _checksum(data) -> str:
    return hashlib.md5(bytes(data)).hexdigest()


OPS = {
    "long": lambda edist, x: edist.broadcast_long(x, 1),
    "max": lambda edist, x: edist.all_gather_return_max_long(x),
    "bool": lambda edist, x: edist.broadcast_bool(x, 1),
    "floats": lambda edist, x: edist.broadcast_float_list(x, 1),
    "binary": lambda edist, x: _checksum(edist.broadcast_binary(x, 1)),
}


def run(fn_name: str, inputs: list) -> list:
    group, port = Group(), free_port()
    try:
        for rank in range(3):
            group.start(_in_group, rank, 3, port, fn_name, inputs)
        outcomes = group.outcomes(timeout=60)
        return [result(outcomes[r]) for r in range(3)]
    finally:
        group.end()


def test_broadcast_long():
    """upstream: test_broadcast_long"""
    assert run("long", [7, 8, 9]) == [8, 8, 8]


def test_all_gather_return_max_long():
    """upstream: test_all_gather_return_max_long"""
    assert run("max", [7, 8, 9]) == [(2, 9)] * 3


def test_broadcast_bool():
    """upstream: test_broadcast_bool"""
    assert run("bool", [True, False, True]) == [False] * 3


def test_broadcast_float_list():
    """upstream: test_broadcast_float_list"""
    got = run("floats", [[1.1, 2.2, 3.3, 4.4, 5.5], [6.6, 2.3, 3.2, 4.2, 5.1], [1, 6, 3, 4, 5]])
    for values in got:
        assert values == pytest.approx([6.6, 2.3, 3.2, 4.2, 5.1], abs=1e-6)


@pytest.mark.parametrize("size", [100, 10 * 1024 * 1024])
def test_broadcast_binary(size):
    """upstream: test_broadcast_binary, test_broadcast_binary_big (chunked)"""
    import numpy as np

    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 100, size, dtype=np.uint8) for _ in range(2)] + [None]
    assert run("binary", inputs) == [_checksum(inputs[1])] * 3


def test_outside_a_group_each_returns_its_input():
    """The classic behaviour when no group of more than one rank is formed."""
    from elastic_launch.train_loop import distributed as edist

    assert edist.broadcast_long(5, 0) == 5 and edist.all_gather_return_max_long(3) == (0, 3)
    assert edist.broadcast_float_list([1.5], 0) == [1.5] and edist.broadcast_bool(True, 0)
    assert edist.broadcast_binary(None, 0) is None and not edist.is_distributed_training_run()
