"""Real processes as the ranks of a job, for the sampler's multi-process tests."""

from __future__ import annotations

import subprocess
import sys


def run_ranks(script: str, world: int, *args: str, timeout: float = 120) -> list[str]:
    """`world` processes running `script` (argv: rank, a free port, `args`); their outputs
    (stdout and stderr), in rank order. Every process is ended here, by its id."""
    from elastic_launch.net import free_port

    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), port, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
