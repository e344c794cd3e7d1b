"""The launcher's benchmarks: elasticrun beside torchrun on the same worker script:

- launch to the first completed collective, and the overhead over spawning the workers by hand;
- a worker crash to the restarted group's first collective (elasticrun by default, forked from
  the zygote, and with --preload none; torchrun --standalone), over several trials, counting
  the recoveries;
- a hang to the restarted group's first collective (elasticrun --hang-timeout, torchrun with its
  file timer and expires(), torchrun without: not detected).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import Row, end_job, free_port, start_job

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_launch_worker.py"
START_WORKER = HERE / "_start_worker.py"
NPROC = 2
ELASTICRUN = [sys.executable, "-m", "elastic_launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _read(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _wait_files(paths: list[Path], timeout: float) -> list[int] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        values = [_read(p) for p in paths]
        if all(v is not None for v in values):
            return values  # type: ignore[return-value]
        time.sleep(0.005)
    return None


def launch_time(launcher: list[str] | None, trials: int = 3, start_only: bool = False) -> float:
    """Seconds from starting the launcher (or the workers, by hand) to the first collective,
    or (`start_only`) to every worker running its first line."""
    samples = []
    for _ in range(trials):
        out = Path(tempfile.mkdtemp(prefix="bench-launch-"))
        args = [str(START_WORKER), str(out)] if start_only else [str(WORKER), "--out", str(out)]
        t0 = time.monotonic_ns()
        if launcher is None:
            port = free_port()
            procs = [
                start_job(
                    [sys.executable, "-u", *args],
                    {
                        "RANK": str(r),
                        "LOCAL_RANK": str(r),
                        "WORLD_SIZE": str(NPROC),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port),
                        "OMP_NUM_THREADS": "1",
                    },
                )
                for r in range(NPROC)
            ]
        else:
            procs = [start_job([*launcher, "--standalone", "--nproc-per-node", str(NPROC), *args])]
        marks = [out / (f"{r}.start" if start_only else f"0-{r}.first") for r in range(NPROC)]
        firsts = _wait_files(marks, 120)
        for p in procs:
            p.wait(timeout=60)
            end_job(p, out)
        shutil.rmtree(out, ignore_errors=True)
        if firsts is None:
            raise RuntimeError("no first collective within 120 s")
        samples.append((max(firsts) - t0) / 1e9)
    return statistics.median(samples)


def recovery(
    cmd: list[str],
    mode: str,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    extra: list[str] | None = None,
    events: Path | None = None,
) -> float | None:
    """Seconds from the injected failure to the restarted group's first collective."""
    out = Path(tempfile.mkdtemp(prefix=f"bench-{mode}-"))
    if events is not None:
        cmd = [*cmd, "--events-file", str(events)]
    proc = start_job([*cmd, str(WORKER), "--out", str(out), "--mode", mode, *(extra or [])], env)
    try:
        marks = _wait_files([out / f"{mode}.t"], 120)
        if marks is None:
            return None
        firsts = _wait_files([out / f"1-{r}.first" for r in range(NPROC)], timeout)
        return None if firsts is None else (max(firsts) - marks[0]) / 1e9
    finally:
        end_job(proc, out)
        shutil.rmtree(out, ignore_errors=True)


def _summary(values: list[float | None]) -> tuple[float | None, str]:
    ok = [v for v in values if v is not None]
    note = f"{len(ok)}/{len(values)} recovered"
    return (statistics.median(ok) if ok else None), note


def _precompile() -> None:
    """Byte-compile the launcher as pip would on install: this machine sets
    PYTHONDONTWRITEBYTECODE, and an editable tree would otherwise be compiled at every start."""
    import compileall

    for pkg in ("elastic_launch", "elastic_core"):
        compileall.compile_dir(str(HERE.parent / "python" / pkg / "src"), quiet=1)


def _overshoot_ms(events: Path, timeout: float) -> list[float]:
    """From elasticrun's events: how long after the timeout each hang was detected."""
    out = []
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "worker_failed" and e["kind"] == "hung":
            out.append((e["detection_seconds"] - timeout) * 1000)
    return out


def run(cpp_build: Path) -> list[Row]:
    _precompile()
    base = ["--standalone", "--nproc-per-node", str(NPROC), "--max-restarts", "1"]
    return [*_launch_rows(), *_crash_rows(base), *_hang_rows(base)]


def _launch_rows() -> list[Row]:
    rows: list[Row] = []
    by_hand = launch_time(None)
    ours = launch_time(ELASTICRUN)
    fresh = launch_time([*ELASTICRUN, "--preload", "none"])
    theirs = launch_time(TORCHRUN)
    rows.append(
        Row(
            "launch",
            "launch to first collective (default: --preload auto)",
            ours,
            theirs,
            "torchrun",
            "s",
            f"by hand {by_hand:.2f} s",
        )
    )
    rows.append(
        Row(
            "launch",
            "the same, --preload none (fresh interpreters)",
            fresh,
            theirs,
            "torchrun",
            "s",
        )
    )
    # The overhead alone: to every worker running its first line (no torch import, whose
    # seconds of noise on 2 cores would swamp it), median of 10, minus the same by hand.
    hand_start = launch_time(None, trials=10, start_only=True)
    rows.append(
        Row(
            "launch",
            "launch overhead over spawning by hand (to every worker running, median of 10)",
            (launch_time(ELASTICRUN, trials=10, start_only=True) - hand_start) * 1000,
            (launch_time(TORCHRUN, trials=10, start_only=True) - hand_start) * 1000,
            "torchrun",
            "ms",
        )
    )
    return rows


def _crash_rows(base: list[str]) -> list[Row]:
    trials = int(os.environ.get("BENCH_CRASH_TRIALS", "5"))
    torch_crash = [recovery([*TORCHRUN, *base], "crash") for _ in range(trials)]
    our_crash = [recovery([*ELASTICRUN, *base], "crash") for _ in range(trials)]
    fresh_crash = [
        recovery([*ELASTICRUN, *base, "--preload", "none"], "crash") for _ in range(trials)
    ]
    t_med, t_note = _summary(torch_crash)
    rows = []
    for label, values in (
        ("crash to restarted first collective (default: --preload auto)", our_crash),
        ("the same, --preload none (fresh interpreters)", fresh_crash),
    ):
        med, note = _summary(values)
        rows.append(
            Row(
                "crash",
                label,
                med if med is not None else float("nan"),
                t_med,
                "torchrun --standalone",
                "s",
                f"elasticrun {note}, torchrun {t_note}",
            )
        )
    return rows


def _hang_runs(base: list[str], hang: float) -> tuple[list, list, list[float], list, Any]:
    """elasticrun's hang recoveries (default and --preload none), how long after the timeout
    each was detected, torchrun's with its file timer, and torchrun's without (20 s at most)."""
    events = Path(tempfile.mkdtemp(prefix="bench-events-")) / "events.jsonl"
    ours_h = [
        recovery([*ELASTICRUN, *base, "--hang-timeout", str(hang)], "hang", events=events)
        for _ in range(3)
    ]
    pre_h = [
        recovery([*ELASTICRUN, *base, "--hang-timeout", str(hang), "--preload", "none"], "hang")
        for _ in range(3)
    ]
    overshoot = _overshoot_ms(events, hang)
    timer_h = [
        recovery(
            [*TORCHRUN, *base],
            "hang",
            {"TORCHELASTIC_ENABLE_FILE_TIMER": "1"},
            extra=["--file-timer", "--hang-timeout", str(hang)],
        )
        for _ in range(3)
    ]
    plain = recovery([*TORCHRUN, *base], "hang", timeout=20.0)
    return ours_h, pre_h, overshoot, timer_h, plain


def _hang_rows(base: list[str]) -> list[Row]:
    hang = 2.0
    ours_h, pre_h, overshoot, timer_h, plain = _hang_runs(base, hang)
    o_med, o_note = _summary(ours_h)
    p_med, p_note = _summary(pre_h)
    f_med, f_note = _summary(timer_h)
    timer_note = f"torchrun + file timer {f_note}" + (
        " (the expiry kills the launcher itself)" if f_med is None else ""
    )
    nan = float("nan")
    timer = "torchrun + file timer expires()"
    return [
        Row(
            "hang",
            f"hang to restarted first collective (timeout {hang:g} s)",
            o_med if o_med is not None else nan,
            f_med,
            timer,
            "s",
            f"elasticrun {o_note}; {timer_note}",
        ),
        Row(
            "hang",
            "the same, --preload none (fresh interpreters)",
            p_med if p_med is not None else nan,
            f_med,
            timer,
            "s",
            f"elasticrun {p_note}",
        ),
        Row(
            "hang",
            "hang detected after the timeout (worst)",
            max(overshoot) if overshoot else nan,
            None,
            "torchrun without a timer",
            "ms",
            "torchrun: not detected within 20 s"
            if plain is None
            else f"torchrun recovered in {plain:.1f} s",
        ),
    ]


if __name__ == "__main__":
    print(json.dumps([r.__dict__ for r in run(Path("build/cpp"))], indent=1))
