"""Joins the group through the init method given, then an all_reduce of one-hot ranks."""

import argparse
import os

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--init-method", required=True)
args = p.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=world)
t = torch.zeros(world)
t[rank] = 1
dist.all_reduce(t)
assert t.tolist() == [1.0] * world, t
dist.destroy_process_group()
