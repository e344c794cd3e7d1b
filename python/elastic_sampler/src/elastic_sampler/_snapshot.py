"""A copy of a training state that training can no longer change (a background save writes
it while the next steps run)."""

from __future__ import annotations

import copy
from typing import Any

import torch


def _reusable(buffer: Any, tensor: torch.Tensor) -> bool:
    return (
        type(buffer) is torch.Tensor
        and type(tensor) is torch.Tensor  # not a subclass (a DTensor's shape is global)
        and buffer.device.type == "cpu"
        and buffer.shape == tensor.shape
        and buffer.dtype == tensor.dtype
        and buffer.layout == tensor.layout == torch.strided
        and not tensor.is_quantized
    )


def snapshot(state: Any, reuse: Any = None) -> Any:
    """A copy of `state` that training can no longer change: tensors are copied to the CPU,
    containers rebuilt, anything else deep-copied.

    `reuse` is an earlier snapshot nobody uses any more (it is taken apart): its tensors that
    match in place, shape and dtype are copied into rather than allocated anew (fresh memory
    costs a page fault per 4 KiB, which makes a copy about 3x slower); the others are let go
    before their replacement is allocated."""
    if isinstance(state, torch.Tensor):
        source = state.detach()
        if _reusable(reuse, source):
            return reuse.copy_(source)
        del reuse  # free the mismatched buffer first: peak memory stays one copy
        return source.to("cpu", copy=True)
    if isinstance(state, dict):
        old = reuse if isinstance(reuse, dict) else {}
        del reuse
        items = [(k, snapshot(v, old.pop(k, None))) for k, v in state.items()]
        old.clear()
        try:
            return type(state)(items)  # dict, OrderedDict (state_dict's type)
        except TypeError:
            return dict(items)
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        old_items: list[Any] = (
            reuse if isinstance(reuse, list) else list(reuse) if isinstance(reuse, tuple) else []
        )
        del reuse
        copied = []
        for i, v in enumerate(state):
            r = None
            if i < len(old_items):
                r, old_items[i] = old_items[i], None
            copied.append(snapshot(v, r))
        old_items.clear()
        return copied if isinstance(state, list) else tuple(copied)
    return copy.deepcopy(state)
