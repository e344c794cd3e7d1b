"""ElasticDistributedSampler: torch's DistributedSampler that can resume mid-epoch, on any
number of replicas, without repeating or skipping a sample.

The epoch's samples form one global order (torch's shuffle of ``seed + epoch``, or a Feistel
permutation). With R replicas, torch's sampler gives rank r the positions r, r+R, r+2R, ... of
that order, so after S synchronous steps of B samples per rank the job has consumed exactly the
first S*B*R positions. The state is that count. Resuming with R' replicas, the remaining
positions are dealt out the same way: padding (``drop_last=False``) repeats the first remaining
samples, ``drop_last=True`` leaves out the last few, exactly as torch does for a whole epoch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from elastic_sampler.api import SamplerStateError
from elastic_sampler.permutation import PERMUTATIONS, make_permutation

_CHUNK = 1 << 14  # indices computed at a time: bounds memory, amortises torch calls


class ElasticDistributedSampler(DistributedSampler[int]):
    """A ``DistributedSampler`` that starts at `start_index` (samples of the epoch already
    consumed by the whole job) and whose state survives a change of world size.

    ``permutation="torch"`` reproduces torch's order exactly (O(n) memory); ``"feistel"`` is a
    constant-memory permutation for very large datasets.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        start_index: int = 0,
        permutation: str = "torch",
    ) -> None:
        if num_replicas is None and not dist.is_available():
            raise RuntimeError("torch.distributed is unavailable: give num_replicas and rank")
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        if permutation not in PERMUTATIONS:
            raise ValueError(
                f"permutation={permutation!r} is not one of {', '.join(PERMUTATIONS)}: 'torch' "
                "matches torch's order, 'feistel' needs constant memory"
            )
        self.permutation = permutation
        self.dataset_size = len(dataset)  # type: ignore[arg-type]
        self._set_start(start_index)
        # The epoch of `start_index` is the one the first set_epoch names: keep the start.
        self._start_pending = start_index > 0

    # ---- the remaining positions -------------------------------------------------------------

    def _set_start(self, start_index: int) -> None:
        n = self.dataset_size
        if not 0 <= start_index <= n:
            raise ValueError(
                f"start_index={start_index} is outside the epoch: the dataset has {n} samples"
            )
        self.start_index = start_index
        self._handed_out = 0
        self._pass_done = False  # the iterator ran to the end of the epoch
        remaining = n - start_index
        if self.drop_last:
            self.num_samples = remaining // self.num_replicas
        else:
            self.num_samples = math.ceil(remaining / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        if self._pass_done:  # iterated again without set_epoch: the whole epoch, as torch's
            self._set_start(0)
        self._start_pending = False
        n, start, replicas = self.dataset_size, self.start_index, self.num_replicas
        remaining = n - start
        perm = make_permutation(self.permutation, n, self.seed, self.epoch, self.shuffle)
        self._handed_out = 0
        for first in range(0, self.num_samples, _CHUNK):
            k = min(_CHUNK, self.num_samples - first)
            q = self.rank + (first + torch.arange(k, dtype=torch.int64)) * replicas
            positions = start + (q % remaining if remaining else q)
            for index in perm.map(positions).tolist():
                self._handed_out += 1
                yield index
        self._pass_done = True

    def set_epoch(self, epoch: int) -> None:
        """Like torch's; a new epoch starts from its first sample (except the first call after
        constructing with `start_index`, which names the epoch that index belongs to)."""
        if epoch != self.epoch and not self._start_pending:
            self._set_start(0)
        self._start_pending = False
        super().set_epoch(epoch)

    # ---- state -------------------------------------------------------------------------------

    def consumed(self, steps: int | None = None, batch_size: int | None = None) -> int:
        """Samples of this epoch the whole job has consumed: `steps` completed steps of
        `batch_size` samples per rank since this sampler started iterating, or else what this
        rank's iterator has handed out (over-counts what a DataLoader with prefetching has
        trained on: pass steps when you can)."""
        if (steps is None) != (batch_size is None):
            raise ValueError("give both steps and batch_size, or neither")
        per_rank = (
            steps * batch_size if steps is not None and batch_size is not None else self._handed_out
        )
        return min(self.dataset_size, self.start_index + per_rank * self.num_replicas)

    def state_dict(self, steps: int | None = None, batch_size: int | None = None) -> dict[str, Any]:
        """The epoch and the samples the job consumed in it (see `consumed`), and what the
        order depends on, to check a later load against."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed(steps, batch_size),
            "dataset_size": self.dataset_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "permutation": self.permutation,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where `state` says, with this sampler's replicas and rank."""
        for key in ("dataset_size", "seed", "shuffle", "permutation"):
            mine = self.dataset_size if key == "dataset_size" else getattr(self, key)
            if key in state and state[key] != mine:
                raise SamplerStateError(
                    f"the sampler state was saved with {key}={state[key]!r}, this sampler has "
                    f"{key}={mine!r}: the remaining samples cannot be told apart; use the same "
                    f"{key}, or start the epoch over"
                )
        self.epoch = int(state["epoch"])
        self._set_start(int(state["consumed"]))
        self._start_pending = False
