"""A configurable worker for the launcher's integration tests.

Records its pid (so tests can check nothing is left running) and its environment, then trains
(with torch, so optimizer steps beat: worker_torch.py) or idles, and fails the way the flags say
on the attempts they name. It does not import torch itself.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
from typing import Any


def write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def stuck_in_the_data_loader() -> None:
    """A recognisable name for the hang-stack test."""
    time.sleep(3600)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="directory for pid and env files")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-until", type=int, default=0, help="fail while restart count < this")
    p.add_argument(
        "--how",
        default="raise",
        choices=[
            "raise",
            "exit",
            "sigkill",
            "hang",
        ],
    )
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (imports torch)")
    p.add_argument("--step-time", type=float, default=0.01)
    p.add_argument("--fail-at-step", type=int, default=0)
    p.add_argument("--dist", action="store_true", help="init_process_group + all_reduce")
    p.add_argument("--sleep", type=float, default=0.0, help="idle this long at the end")
    p.add_argument(
        "--wait-file", help="at the end, wait until this file exists (300 s at most): a test's gate"
    )
    p.add_argument("--print", default="", help="a line to print to stdout and stderr")
    p.add_argument(
        "--hold-round",
        type=int,
        default=0,
        help="in this rendezvous round, wait (until stopped) after the collective",
    )
    return p.parse_args()


def record(args: argparse.Namespace, rank: int) -> str:
    """This worker's pid and environment, in files named by attempt and rank; the tag."""
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    attempt = os.environ.get("ELASTICRUN_ATTEMPT", str(restarts))
    tag = f"{attempt}-{rank}"
    env = {k: v for k, v in os.environ.items()}
    env["argv"] = json.dumps(sys.argv)
    # Each file appears whole (written aside, then renamed): tests read them as they appear.
    write(os.path.join(args.out, f"{tag}.env.json"), json.dumps(env))
    write(os.path.join(args.out, f"{tag}.pid"), str(os.getpid()))
    return tag


def fail(args: argparse.Namespace, rank: int, restarts: int) -> None:
    if args.how == "raise":
        raise RuntimeError(f"injected failure on rank {rank} at restart {restarts}")
    if args.how == "exit":
        sys.exit(args.exit_code)
    if args.how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    stuck_in_the_data_loader()


def torch_parts() -> Any:
    """worker_torch, imported by name when a flag needs it: `--preload auto` reads the
    script's imports (and its own directory's modules'), and would import torch in every
    launch's zygote for the many tests that never use it."""
    return importlib.import_module("worker_torch")


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    int(os.environ["LOCAL_RANK"])
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    tag = record(args, rank)
    if args.print:
        print(f"{args.print} rank {rank}", flush=True)
        print(f"{args.print} err rank {rank}", file=sys.stderr, flush=True)
    failing = rank == args.fail_rank and restarts < args.fail_until
    if args.dist:
        torch_parts().all_reduce(args, tag)
    if args.steps:
        torch_parts().train(args, failing, rank, restarts, fail)
    elif failing:
        fail(args, rank, restarts)
    if args.hold_round and os.environ.get("ELASTICRUN_ROUND") == str(args.hold_round):
        time.sleep(300)
    if args.dist:
        torch_parts().end(args)
    time.sleep(args.sleep)
    deadline = time.monotonic() + 300
    while args.wait_file and not os.path.exists(args.wait_file) and time.monotonic() < deadline:
        time.sleep(0.02)


if __name__ == "__main__":
    main()
