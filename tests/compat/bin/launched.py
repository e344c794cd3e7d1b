"""Writes whether torch sees this process as launched by a torchelastic launcher."""

import argparse

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out-file", required=True)
with open(parser.parse_args().out_file, "w") as f:
    f.write(str(dist.is_torchelastic_launched()))
