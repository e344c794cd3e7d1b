"""A worker for the compatibility tests: reads the variables torchrun's tests require (a missing
one fails it), then fails if asked or touches <touch-file-dir>/<RANK>."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

REQUIRED = (
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS",
    "TEST_SENTINEL_PARENT",
    "TORCHELASTIC_ERROR_FILE",
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fail", action="store_true")
    p.add_argument("--touch-file-dir", type=Path)
    args = p.parse_args()
    seen = {name: os.environ[name] for name in REQUIRED}
    print(" ".join(f"{k}={v}" for k, v in seen.items()), flush=True)
    if args.fail:
        raise RuntimeError("raising exception since --fail flag was set")
    if args.touch_file_dir is not None:
        (args.touch_file_dir / seen["RANK"]).touch()


if __name__ == "__main__":
    main()
