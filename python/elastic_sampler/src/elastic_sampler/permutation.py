"""Permutations of [0, n) for the sampler.

- ``"torch"``: ``torch.randperm(n)`` seeded with ``seed + epoch`` -- the very order torch's
  ``DistributedSampler`` uses (O(n) memory: 8 bytes per sample).
- ``"feistel"``: a keyed Feistel network over the smallest even power of two >= n, with cycle
  walking (values >= n are permuted again until they fall inside [0, n)): a true permutation,
  deterministic from (seed, epoch), whose i-th element is computed on demand, so memory does
  not grow with n. Evaluated in vectorised chunks with torch integer ops.
"""

from __future__ import annotations

import torch

PERMUTATIONS = ("torch", "feistel")
_ROUNDS = 6
_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-mixed 64-bit value from an integer (Python ints)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class FeistelPermutation:
    """A bijection on [0, n) from a key, computed element by element (vectorised)."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 0:
            raise ValueError(f"permutation size {n} is negative")
        self.n = n
        bits = max(2, (n - 1).bit_length() if n > 1 else 1)
        bits += bits % 2  # even: two equal halves
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        base = _mix64(_mix64(seed & _M64) ^ (epoch & _M64))
        # Round keys kept below 2**31 so that products stay inside int64 before masking.
        self.keys = [_mix64(base + r) & 0x7FFFFFFF for r in range(_ROUNDS)]

    def _round(self, right: torch.Tensor, key: int) -> torch.Tensor:
        # A cheap integer hash of (right, key), masked to `half` bits; int64 arithmetic wraps
        # identically everywhere, so the permutation is the same on every machine.
        x = right * 0x2545F491 + key
        x = x ^ (x >> 13)
        x = (x & 0xFFFFFFFF) * 0x5BD1E995
        x = x ^ (x >> 15)
        return x & self.mask

    def _encrypt(self, x: torch.Tensor) -> torch.Tensor:
        left = x >> self.half
        right = x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def map(self, positions: torch.Tensor) -> torch.Tensor:
        """The permuted values at `positions` (int64, each in [0, n))."""
        out = self._encrypt(positions)
        outside = out >= self.n
        while bool(outside.any()):  # cycle walking: at most a few rounds on average
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out


class TorchPermutation:
    """torch's own order: ``randperm(n)`` with a generator seeded ``seed + epoch``."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        self.order = torch.randperm(n, generator=g)

    def map(self, positions: torch.Tensor) -> torch.Tensor:
        return self.order[positions]


class IdentityPermutation:
    """No shuffling: position i holds sample i."""

    def map(self, positions: torch.Tensor) -> torch.Tensor:
        return positions


def make_permutation(
    kind: str, n: int, seed: int, epoch: int, shuffle: bool
) -> IdentityPermutation | TorchPermutation | FeistelPermutation:
    if not shuffle:
        return IdentityPermutation()
    if kind == "feistel":
        return FeistelPermutation(n, seed, epoch)
    if kind == "torch":
        return TorchPermutation(n, seed, epoch)
    raise ValueError(f"permutation={kind!r} is not one of {', '.join(PERMUTATIONS)}")
