"""ImageFolder: a directory per class, a file per image (indexed as torchvision indexes it);
each image is made from its index, so that every run reads the same data."""

from __future__ import annotations

import os
from typing import Any

import torch


class ImageFolder(torch.utils.data.Dataset):
    def __init__(self, root: str, transform: Any = None) -> None:
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples = [
            (os.path.join(root, c, f), i)
            for i, c in enumerate(self.classes)
            for f in sorted(os.listdir(os.path.join(root, c)))
        ]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        _, target = self.samples[index]
        image = torch.Generator().manual_seed(index)  # the image, as its index makes it
        return (self.transform(image) if self.transform else image), target
