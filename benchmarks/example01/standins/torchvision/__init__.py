"""The parts of torchvision torchelastic 0.1's imagenet example uses (see ../../README.md)."""
