"""The classic train loop: a worker SIGKILLed mid-training, three workers, the same
~10 ms step (benchmarks/_loop_worker.py):

- to (a) the survivors stepping again and (b) the full world stepping again: the loop under
  elasticrun (a fixed world, and --min-workers 2; each with --preload none, fresh interpreters,
  and with the default --preload auto, which forks the replacement from a zygote that has
  imported torch and the loop's own modules)
  beside a group restart of the same step by
  elasticrun and by torchrun (where (a) = (b): every worker is new);
- the loop's cost per step over a plain ``for`` loop, beyond the user's own snapshot (none
  here): with steps that do nothing (the loop's own cost), and with the ~10 ms step on two
  workers (where this machine's step-to-step noise is larger than that cost).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Row, end_job, start_job, step_records, wait_until

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_loop_worker.py"
ELASTICRUN = [sys.executable, "-m", "elastic_launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
NPROC = 3
WARM_STEPS = 30  # steps every rank takes before the kill


def kill_one(
    launcher: list[str],
    mode: str,
    extra: list[str],
    script: tuple[str, ...] = (),
    restarts: tuple[str, ...] = ("--max-restarts", "1"),
) -> tuple[float | None, float | None]:
    """SIGKILL the rank-1 worker after WARM_STEPS steps: seconds to (a) a survivor's next step
    (a new process's for a group restart) and (b) a step of the full world."""
    out = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    cmd = [
        *launcher,
        "--standalone",
        "--nproc-per-node",
        str(NPROC),
        *restarts,
        *extra,
        str(WORKER),
        "--out",
        str(out),
        "--mode",
        mode,
        "--steps",
        "100000",
        *script,
    ]
    proc = start_job(cmd, {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    try:
        warm = wait_until(
            lambda: (
                {r[3]: r[4] for r in step_records(out) if r[1] >= WARM_STEPS}
                if len({r[3] for r in step_records(out) if r[1] >= WARM_STEPS}) == NPROC
                else None
            ),
            180,
        )
        if warm is None:
            return None, None
        old = set(warm.values())
        victim = warm[1]
        t_kill = time.monotonic_ns()
        os.kill(victim, signal.SIGKILL)
        after = t_kill + 2_000_000  # a step in flight at the kill is not a recovered one

        def survivors() -> int | None:
            rows = step_records(out)
            got = [r[0] for r in rows if r[0] > after and (r[4] in old or mode == "plain")]
            return min(got) if got else None

        def full() -> int | None:
            got = [r[0] for r in step_records(out) if r[0] > after and r[2] == NPROC]
            return min(got) if got else None

        a = wait_until(survivors, 60)
        b = wait_until(full, 60)
        seconds = [None if t is None else (t - t_kill) / 1e9 for t in (a, b)]
        return seconds[0], seconds[1]
    finally:
        end_job(proc, out)
        shutil.rmtree(out, ignore_errors=True)


def _med(values: list[float | None]) -> tuple[float, str]:
    ok = [v for v in values if v is not None]
    return (statistics.median(ok) if ok else float("nan")), f"{len(ok)}/{len(values)}"


def overhead(steps: int = 600, empty: bool = False) -> dict[str, float]:
    """Median step in a plain loop and through train(), alternating blocks (see the worker);
    `empty` steps do nothing (one worker), else the ~10 ms step on 2 workers."""
    out = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    try:
        subprocess.run(
            [
                *ELASTICRUN,
                "--standalone",
                "--nproc-per-node",
                "1" if empty else "2",
                str(WORKER),
                "--out",
                str(out),
                "--mode",
                "overhead",
                "--steps",
                str(steps),
                *(["--empty"] if empty else []),
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            timeout=300,
            check=True,
        )
        found = [json.loads(p.read_text()) for p in out.glob("overhead-*.json")]
        return {k: statistics.mean(f[k] for f in found) for k in ("plain_ms", "loop_ms", "steps")}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run(cpp_build: Path) -> list[Row]:
    trials = int(os.environ.get("BENCH_LOOP_TRIALS", "3"))
    torchrun = [kill_one(TORCHRUN, "plain", []) for _ in range(trials)]
    group = [kill_one(ELASTICRUN, "plain", []) for _ in range(trials)]
    t_med, t_note = _med([a for a, _ in torchrun])
    g_med, g_note = _med([a for a, _ in group])
    rows = [
        Row(
            "train loop",
            "SIGKILL to the group stepping again: elasticrun group restart",
            g_med,
            t_med,
            "torchrun group restart",
            "s",
            f"recovered {g_note}, torchrun {t_note}",
        )
    ]
    return rows + _loop_rows(trials, t_med) + _ddp_rows() + _overhead_rows()


def _ddp_rows() -> list[Row]:
    """The step most scripts have (a DDP model, a torch.optim optimizer), a fixed world of 3,
    no --max-restarts: the survivors of a SIGKILL wait for the replacement, whose first DDP
    model and optimizer import torch._dynamo unless it is preloaded (--preload
    auto,torch._dynamo). Beside torchrun's group restart of the same script."""
    trials = int(os.environ.get("BENCH_LOOP_DDP_TRIALS", "5"))
    ddp = ("--ddp",)
    torchrun = [kill_one(TORCHRUN, "plain", [], ddp)[0] for _ in range(trials)]
    dynamo = ["--preload", "auto,torch._dynamo"]
    opted = [kill_one(ELASTICRUN, "loop", dynamo, ddp, restarts=())[0] for _ in range(trials)]
    auto = [kill_one(ELASTICRUN, "loop", [], ddp, restarts=())[0] for _ in range(3)]
    t_med, t_note = _med(torchrun)
    rows = []
    for label, values in (("--preload auto,torch._dynamo", opted), ("default flags", auto)):
        value, note = _med(values)
        rows.append(
            Row(
                "train loop",
                f"SIGKILL to the survivors stepping again: loop, DDP + SGD, {label}",
                value,
                t_med,
                "torchrun group restart (DDP + SGD)",
                "s",
                f"median of {note} trials, torchrun {t_note}",
            )
        )
    return rows


def _loop_rows(trials: int, t_med: float | None) -> list[Row]:
    """A worker of the loop SIGKILLed, under each variant: until the survivors step again,
    and until the full world does."""
    rows = []
    variants = [
        ("fixed world, --preload none", ["--preload", "none"]),
        ("fixed world (default: --preload auto, torch and the loop)", []),
        ("--min-workers 2, --preload none", ["--min-workers", "2", "--preload", "none"]),
        ("--min-workers 2 (default: --preload auto)", ["--min-workers", "2"]),
    ]
    for label, extra in variants:
        results = [kill_one(ELASTICRUN, "loop", extra) for _ in range(trials)]
        a, a_note = _med([a for a, _ in results])
        b, b_note = _med([b for _, b in results])
        for what, value, note in (("survivors", a, a_note), ("full world", b, b_note)):
            rows.append(
                Row(
                    "train loop",
                    f"SIGKILL to the {what} stepping again: loop, {label}",
                    value,
                    t_med,
                    "torchrun group restart",
                    "s",
                    f"{note} trials",
                )
            )
    return rows


def _overhead_rows() -> list[Row]:
    bare = overhead(20_000, empty=True)
    cost = overhead()
    return [
        Row(
            "train loop",
            "the loop's own cost per step (steps that do nothing; real coordinator, beat, metrics)",
            (bare["loop_ms"] - bare["plain_ms"]) * 1000,
            None,
            "",
            "us",
            f"median step, {int(bare['steps'])} steps each, 1 worker, no snapshot",
        ),
        Row(
            "train loop",
            f"the loop's cost per step over a plain for loop ({cost['plain_ms']:.1f} ms steps)",
            (cost["loop_ms"] - cost["plain_ms"]) * 1000,
            None,
            "",
            "us",
            f"median step, {int(cost['steps'])} steps each in alternating blocks, 2 workers, "
            "no snapshot",
        ),
    ]


if __name__ == "__main__":
    print(json.dumps([r.__dict__ for r in run(Path("build/cpp"))], indent=1))
