"""The transforms the example composes. An image here is a generator seeded by its index:
RandomResizedCrop(n) draws it at n/7 pixels a side (32 for 224: a CPU's size)."""

from __future__ import annotations

from typing import Any

import torch


class Compose:
    def __init__(self, transforms: list[Any]) -> None:
        self.transforms = transforms

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class RandomResizedCrop:
    def __init__(self, size: int) -> None:
        self.size = max(size // 7, 8)

    def __call__(self, g: torch.Generator) -> torch.Tensor:
        return torch.rand(3, self.size, self.size, generator=g)


class RandomHorizontalFlip:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1) if x.sum().item() > x.numel() / 2 else x  # the image's own "coin"


class ToTensor:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Normalize:
    def __init__(self, mean: list[float], std: list[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std
