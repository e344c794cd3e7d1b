"""Replace one worker of a running group, the way elasticrun's agent would, and time it: SIGKILL
of worker 1 -> its replacement's first line of user code, while worker 0 runs on untouched.

    python _replace_driver.py OUT TRIALS [--preload torch]

Prints one JSON object: {"seconds": [...], "survivor_untouched": bool}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import elastic_core
from elastic_launch.agent.context import NodeContext
from elastic_launch.agent.decide import Happening
from elastic_launch.agent.watch import Monitors
from elastic_launch.agent.workers import WorkerGroup
from elastic_launch.api import LaunchConfig
from elastic_launch.processes.entrypoint import Entrypoint, Kind
from elastic_launch.processes.logs import LogLayout
from elastic_launch.processes.preload import PreloadPlan
from elastic_launch.processes.spawn import FreshInterpreter, ZygoteFork
from elastic_launch.rendezvous.api import RendezvousInfo

HERE = Path(__file__).resolve().parent


def wait_file(path: Path, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never appeared")
        time.sleep(0.0005)
    return [int(x) for x in path.read_text().split()]


def main() -> None:
    out, trials = Path(sys.argv[1]), int(sys.argv[2])
    preload = sys.argv[4:5] if sys.argv[3:4] == ["--preload"] else []
    os.environ["BENCH_OUT"] = str(out)
    config = LaunchConfig(nproc_per_node=2, preload=preload, shutdown_timeout=5.0)
    ep = Entrypoint(Kind.SCRIPT, str(HERE / "_replace_worker.py"))
    fresh = FreshInterpreter(ep)
    spawner = ZygoteFork(PreloadPlan(preload, zygote=True), fresh) if preload else fresh
    info = RendezvousInfo(0, 0, 1, 2, 0, "127.0.0.1", elastic_core.now_ns() % 20000 + 30000)
    table = elastic_core.HeartbeatTable.create(f"/dev/shm/bench-replace-{os.getpid()}", 2)
    with LogLayout(os.devnull, "bench") as layout, elastic_core.Watchdog() as watchdog:
        context = NodeContext(config, "bench", ep, layout)
        group = WorkerGroup(context, Monitors(table, None, watchdog), spawner)
        try:
            group.start_all(info, attempt=0, restarts=0)
            for r in (0, 1):
                wait_file(out / f"{r}-0.first")
            survivor = group.get(0).pid
            seconds = []
            for generation in range(1, trials + 1):
                victim = group.get(1)
                t_kill = time.monotonic_ns()
                os.kill(victim.pid, signal.SIGKILL)
                while True:  # the agent's loop: the death is seen, then the replacement
                    event = group.next_event(5.0)
                    if event is not None and event.happening in (
                        Happening.EXITED_OK,
                        Happening.FAILED,
                    ):
                        break
                group.replace(1)
                t_first, _ = wait_file(out / f"1-{generation}.first")
                seconds.append((t_first - t_kill) / 1e9)
            untouched = group.get(0).pid == survivor and not group.get(0).exited
            print(json.dumps({"seconds": seconds, "survivor_untouched": untouched}))
        finally:
            group.close()
            spawner.close()
            table.close()


if __name__ == "__main__":
    main()
