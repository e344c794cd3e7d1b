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
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from elastic_sampler.api import SamplerStateError

if TYPE_CHECKING:
    from typing_extensions import Unpack
from elastic_sampler.permutation import PERMUTATIONS, make_permutation

_CHUNK = 1 << 14  # indices computed at a time: bounds memory, amortises torch calls


class SamplerOptions(TypedDict, total=False):
    """The keywords of ours beyond torch's six (`ElasticDistributedSampler` documents each):
    `start_index` (default 0) and `permutation` ("torch", the default, or "feistel")."""

    start_index: int
    permutation: str


class ElasticDistributedSampler(DistributedSampler[int]):
    """A ``DistributedSampler`` that can start part-way through an epoch, and whose state
    survives a change of world size.

    The positional arguments are torch's, in torch's order and with torch's meaning
    (``dataset, num_replicas, rank, shuffle, seed, drop_last``). The extra ones are
    keyword-only:

    - `start_index`: how many of the epoch's samples the whole job has consumed already (a
      position in the epoch's order, as ``state_dict()["consumed"]`` records it). The classic
      torchelastic sampler (and ``torch.distributed.elastic.utils.data``'s) took
      ``start_index`` as its fourth positional argument and meant a dataset index: it
      shuffled only the indices ``start_index .. len(dataset) - 1``. Here the order of the
      whole epoch is kept and its first `start_index` positions are skipped, which is what a
      resumed job needs; prefer ``load_state_dict``, which also checks the order matches.
    - `permutation`: ``"torch"`` reproduces torch's order exactly (O(n) memory);
      ``"feistel"`` is a constant-memory permutation for very large datasets.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        **options: Unpack[SamplerOptions],
    ) -> None:
        unknown = sorted(set(options) - set(SamplerOptions.__annotations__))
        if unknown:
            raise TypeError(
                f"ElasticDistributedSampler() got an unexpected keyword argument {unknown[0]!r}: "
                f"its own keywords are {', '.join(SamplerOptions.__annotations__)}"
            )
        start_index = options.get("start_index", 0)
        permutation = options.get("permutation", "torch")
        if isinstance(shuffle, int) and not isinstance(shuffle, bool):
            raise TypeError(
                f"shuffle={shuffle!r}: give True or False. The fourth positional argument is "
                "shuffle, as in torch's DistributedSampler; the classic torchelastic sampler "
                f"took start_index there: write start_index={shuffle} (a keyword here, counted "
                "in the epoch's order: see the class docstring)"
            )
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
        if isinstance(start_index, bool) or not isinstance(start_index, int):
            raise TypeError(f"start_index={start_index!r}: give a number of samples (an int)")
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
        self._iterated = False  # an iterator has started (steps can be checked against it)
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
        self._iterated = True
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
        trained on: pass steps when you can).

        After a resume, `steps` counts from the resume (the sampler's start already holds what
        was consumed before it), not from the epoch's start: more steps than the iterator has
        handed out batches (once it iterates) is that mistake, and a ValueError rather than
        samples skipped."""
        if (steps is None) != (batch_size is None):
            raise ValueError("give both steps and batch_size, or neither")
        if steps is not None and batch_size is not None:
            for name, value, least in (("steps", steps, 0), ("batch_size", batch_size, 1)):
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ValueError(f"{name}={value!r}: give an integer >= {least}")
            per_rank = steps * batch_size
            if self._iterated and per_rank > self._handed_out:
                raise ValueError(
                    f"steps={steps} of batch_size={batch_size} is {per_rank} samples per rank, "
                    f"but this sampler has handed out {self._handed_out} since it started "
                    f"iterating (at sample {self.start_index} of the epoch): count the steps "
                    "since then, not since the epoch began (after a resume, the steps before "
                    "it are in the sampler's start already)"
                )
        else:
            per_rank = self._handed_out
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
        """Resume where `state` (from `state_dict`) says, with this sampler's replicas and
        rank. A state that is missing, malformed or from another order is a
        `SamplerStateError` that says what is wrong; this sampler is then unchanged."""
        epoch, consumed = _check_state(state)
        for key in ("dataset_size", "seed", "shuffle", "permutation"):
            mine = self.dataset_size if key == "dataset_size" else getattr(self, key)
            if key in state and state[key] != mine:
                raise SamplerStateError(
                    f"the sampler state was saved with {key}={state[key]!r}, this sampler has "
                    f"{key}={mine!r}: the remaining samples cannot be told apart; use the same "
                    f"{key}, or start the epoch over"
                )
        if consumed > self.dataset_size:
            raise SamplerStateError(
                f"the sampler state says {consumed} samples of the epoch were consumed, but the "
                f"dataset has {self.dataset_size}: it belongs to another dataset"
            )
        self.epoch = epoch
        self._set_start(consumed)
        self._start_pending = False


def _check_state(state: Any) -> tuple[int, int]:
    """(epoch, consumed) of a sampler state, or a SamplerStateError saying what is wrong."""
    example = "ElasticDistributedSampler.state_dict()"
    if not isinstance(state, dict):
        raise SamplerStateError(
            f"load_state_dict({state!r:.80}): expected the dict {example} returned, got "
            f"{type(state).__name__}" + (" (no state was saved?)" if state is None else "")
        )
    missing = [k for k in ("epoch", "consumed") if k not in state]
    if missing:
        raise SamplerStateError(
            f"the sampler state {state!r:.200} lacks {', '.join(missing)}: pass what {example} "
            "returned"
        )
    values = []
    for key in ("epoch", "consumed"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SamplerStateError(
                f"the sampler state's {key}={value!r} is not a count: expected an integer >= 0"
            )
        values.append(value)
    return values[0], values[1]
