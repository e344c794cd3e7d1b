"""Joins the group through the init method given, then an all_reduce of one-hot ranks; writes
what it got to OUT/rank<N>.txt."""

import argparse
import os

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--init-method", required=True)
p.add_argument("--out", required=True)
args = p.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=world)
t = torch.zeros(world)
t[rank] = 1
dist.all_reduce(t)
with open(os.path.join(args.out, f"rank{rank}.txt"), "w") as f:
    f.write(repr(t.tolist()))
dist.destroy_process_group()
