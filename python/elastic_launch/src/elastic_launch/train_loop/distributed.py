"""The classic package's collectives (``torchelastic.distributed``), which 0.1 states call in
``sync`` to agree on who holds the newest state and to hand it to the others::

    import elastic_launch.train_loop.distributed as edist

    max_rank, _ = edist.all_gather_return_max_long(self.data_start_index)
    self.model = edist.broadcast_model(max_rank, self.model)

Each is a no-op returning its input when no process group of more than one rank is formed
(the classic behaviour), so a state's ``sync`` also runs alone. On NCCL the tensors travel
through the GPU and come back to where they were.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

#: broadcast_binary sends data this large in chunks, overlapped.
CHUNKED_FROM = 8 * 1024 * 1024
CHUNKS = 8


def is_distributed_training_run() -> bool:
    """Whether a process group of more than one rank is formed."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _to_group(tensor: Any) -> tuple[Any, bool]:
    """`tensor` where the group's backend can send it, and whether it was moved there."""
    import torch.distributed as dist

    if dist.get_backend() == dist.Backend.NCCL and not tensor.is_cuda:
        return tensor.cuda(), True
    return tensor, False


def _back(tensor: Any, moved: bool) -> Any:
    return tensor.cpu() if moved else tensor


def broadcast_long(value: int, src_rank: int) -> int:
    """`src_rank`'s integer, on every rank."""
    if not is_distributed_training_run():
        return value
    import torch
    import torch.distributed as dist

    tensor, moved = _to_group(torch.tensor([int(value)], dtype=torch.long))
    dist.broadcast(tensor, src=src_rank)
    return int(_back(tensor, moved).item())


def broadcast_bool(value: bool, src_rank: int) -> bool:
    return broadcast_long(1 if value else 0, src_rank) == 1


def broadcast_float_list(float_list: list[float], src_rank: int) -> list[float]:
    """`src_rank`'s list of floats (the same length on every rank), on every rank."""
    if not is_distributed_training_run():
        return float_list
    import torch
    import torch.distributed as dist

    tensor, moved = _to_group(torch.tensor(float_list, dtype=torch.float32))
    dist.broadcast(tensor, src=src_rank)
    return [float(x) for x in _back(tensor, moved).tolist()]


def all_gather_return_max_long(value: int) -> tuple[int, int]:
    """(the rank that holds the largest `value`, that value); the lowest such rank on ties."""
    if not is_distributed_training_run():
        return 0, value
    import torch
    import torch.distributed as dist

    mine, moved = _to_group(torch.tensor([int(value)], dtype=torch.long))
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    values = [int(_back(t, moved).item()) for t in gathered]
    best = max(range(len(values)), key=lambda r: values[r])
    return best, values[best]


def broadcast_model(src_rank: int, model: Any) -> Any:
    """`src_rank`'s parameters into every rank's `model` (in place, overlapped); the model."""
    if not is_distributed_training_run():
        return model
    import torch.distributed as dist

    works = [dist.broadcast(p.data, src=src_rank, async_op=True) for p in model.parameters()]
    for work in works:
        work.wait()
    return model


def broadcast_binary(data: Any, src_rank: int) -> Any:
    """`src_rank`'s bytes (a numpy uint8 array; the others may pass None), on every rank."""
    if not is_distributed_training_run():
        return data
    import numpy
    import torch
    import torch.distributed as dist

    if data is not None and not isinstance(data, numpy.ndarray):
        raise TypeError(f"broadcast_binary takes a numpy.ndarray or None, not {type(data)}")
    size = broadcast_long(data.size if data is not None else 0, src_rank)
    if data is not None and data.size > 0:
        tensor = torch.as_tensor(numpy.ascontiguousarray(data, dtype=numpy.uint8).reshape(-1))
    else:
        tensor = torch.zeros(size, dtype=torch.uint8)
    tensor, moved = _to_group(tensor)
    if size >= CHUNKED_FROM:
        chunks = torch.chunk(tensor, CHUNKS)
        for work in [dist.broadcast(c, src=src_rank, async_op=True) for c in chunks]:
            work.wait()
        logger.info("broadcast %d bytes in %d chunks", size, len(chunks))
    else:
        dist.broadcast(tensor, src=src_rank)
    return _back(tensor, moved).numpy()
