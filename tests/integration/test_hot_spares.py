"""Hot spares (``--hot-spares``) for real: examples/classic_train_loop.py under elasticrun, gloo
on CPU. A spare runs the script up to train() and waits in the workers' rendezvous; a dead
worker's place goes to it at the next round and a new spare starts behind it; a spare that dies
while it waits costs the workers nothing; spares with --min-workers; a spare on another node.

torchelastic 0.1 admitted a worker that waited at a step boundary (its coordinator's
``should_rendezvous``); a hot spare is such a worker, ready before it is needed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from classic_example import EXAMPLE, STEP, assert_every_sample_once
from launcher_util import alive, free_port, held, release, start, wait_for

from common import loop_state, waiting_spare

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class Live:
    """One elasticrun job whose console (a file) and events file the test reads as it runs."""

    def __init__(self, out: Path, *flags: str, script: tuple[str, ...] = ()) -> None:
        out.mkdir()
        self.out = out
        self.log, self.events_file = out / "console.log", out / "events.jsonl"
        args = [*flags, "--events-file", str(self.events_file), str(EXAMPLE)]
        args += ["--out", str(out / "final.json"), *script]
        self.proc = start(args, cwd=str(out), log=self.log)

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def steps(self) -> list[tuple[int, int, int, int]]:
        """(step, rank, world, pid) of every step taken, in the order printed."""
        return [tuple(map(int, m.groups())) for m in STEP.finditer(self.text())]  # type: ignore[misc]

    def events(self, name: str) -> list[dict]:
        if not self.events_file.exists():
            return []
        lines = self.events_file.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == name]

    def wait(self, what: str, pred, timeout: float = 120) -> None:
        assert wait_for(pred, timeout), f"{what}; the console:\n{self.text()[-3000:]}"

    def first_step_of(self, pid: int) -> int | None:
        return next((s for s, _, _, p in self.steps() if p == pid), None)

    def finish(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            raise AssertionError(
                f"the job did not end in {timeout} s:\n{self.text()[-3000:]}"
            ) from None

    def end(self) -> None:
        """Whatever happened, nothing of the job is left running."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture
def jobs():
    started: list[Live] = []
    yield started
    for job in started:
        job.end()


def spare_waiting(job: Live) -> int | None:
    """The pid of a hot spare that waits in the workers' rendezvous, once there is one."""
    return waiting_spare(job.events_file)


def every_sample_once(job: Live, epochs: int = 2) -> None:
    assert_every_sample_once(json.loads((job.out / "final.json").read_text())["history"], epochs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list:
    """Two workers, no spare, nothing injected: the weights every recovery must reproduce."""
    job = Live(tmp_path_factory.mktemp("spares") / "ref", "--standalone", "--nproc-per-node", "2")
    try:
        assert job.finish() == 0, job.text()[-3000:]
    finally:
        job.end()
    return json.loads((job.out / "final.json").read_text())["weights"]


def policies(pid: int) -> set[int]:
    """The scheduling policies of the threads of process `pid`."""
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_a_spare_takes_a_dead_workers_place_and_a_new_one_waits_behind_it(tmp_path, jobs):
    """Rank 1 is SIGKILLed at step 10: the spare, which never stepped, trains from there; the
    replacement waits behind it, and takes the place of the spare when the test kills it, even
    if it is slow to answer (SIGSTOPped, as a machine too busy to run it would leave it)."""
    gates = held(tmp_path / "gates", 10, 30)
    job = Live(
        tmp_path / "admit",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--hot-spares",
        "1",
        script=("--kill-at-step", "10", "--step-seconds", "0.05", "--epochs", "6", *gates),
    )
    jobs.append(job)
    job.wait("a spare waits", lambda: spare_waiting(job))
    spare = spare_waiting(job)
    assert spare is not None
    release(tmp_path / "gates", 10)
    job.wait("rank 1 is replaced", lambda: job.events("worker_replaced"))
    behind = int(job.events("worker_replaced")[0]["pid"])
    job.wait("the spare steps", lambda: job.first_step_of(spare) is not None)
    assert job.first_step_of(spare) > 10, "it trained only once admitted, from the state sent"
    job.wait("the new process waits behind it", lambda: loop_state(behind) == "waiting")
    assert policies(behind) == {os.SCHED_OTHER}, "prepared, it waits at the normal policy"
    at = max(s for s, *_ in job.steps())
    survivor = next(pid for s, _, _, pid in job.steps() if s == at and pid != spare)
    os.kill(behind, signal.SIGSTOP)
    os.kill(spare, signal.SIGKILL)
    release(tmp_path / "gates", 30)
    job.wait("the survivor re-forms", lambda: loop_state(survivor) == "waiting")
    time.sleep(3)  # the place is the stopped spare's: no new process takes it meanwhile
    os.kill(behind, signal.SIGCONT)
    job.wait("the one behind steps", lambda: job.first_step_of(behind) is not None)
    assert job.first_step_of(behind) > at
    assert job.finish() == 0, job.text()[-3000:]
    before = {pid for s, _, _, pid in job.steps() if s <= 10}
    assert len(before) == 2 and spare not in before and behind not in before
    last = max(s for s, *_ in job.steps())
    survivors = before & {pid for s, _, _, pid in job.steps() if s == last}
    assert len(survivors) == 1, "one of the first workers kept its process to the end"
    assert {w for *_, w, _ in job.steps()} == {2}, "the world never went on at 1"
    assert "hot spare pid" in job.text() and "takes its place at the next round" in job.text()
    replaced = job.events("worker_replaced")
    assert [e["restarts"] for e in replaced] == [1, 2], "one death, one restart: a spare's too"
    assert all(e.get("hot_spare") for e in replaced), "started behind a spare, after a step"
    assert len(job.events("hot_spare_started")) == 1
    every_sample_once(job, epochs=6)


def test_the_weights_with_a_spare_admitted_are_the_uninterrupted_ones(tmp_path, jobs, reference):
    job = Live(
        tmp_path / "exact",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--hot-spares",
        "1",
        script=("--kill-at-step", "12", "--step-seconds", "0.05", *held(tmp_path / "gates", 12)),
    )
    jobs.append(job)
    job.wait("a spare waits", lambda: spare_waiting(job))
    release(tmp_path / "gates", 12)
    assert job.finish() == 0, job.text()[-3000:]
    spares = {int(e["pid"]) for e in job.events("hot_spare_started")}
    assert spares & {pid for *_, pid in job.steps()}, "the spare was admitted"
    assert json.loads((job.out / "final.json").read_text())["weights"] == reference, "bitwise"
    every_sample_once(job)


def test_a_spare_that_dies_while_it_waits_costs_the_workers_nothing(tmp_path, jobs):
    job = Live(
        tmp_path / "spare-dies",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--hot-spares",
        "1",
        script=("--step-seconds", "0.05", *held(tmp_path / "gates", 5)),
    )
    jobs.append(job)
    job.wait("a spare waits", lambda: spare_waiting(job))
    spare = spare_waiting(job)
    assert spare is not None
    os.kill(spare, signal.SIGKILL)
    job.wait("the spare is replaced", lambda: job.events("worker_replaced"))
    behind = int(job.events("worker_replaced")[0]["pid"])
    job.wait("its replacement waits", lambda: loop_state(behind) == "waiting")
    release(tmp_path / "gates", 5)
    assert job.finish() == 0, job.text()[-3000:]
    pids = {pid for *_, pid in job.steps()}
    assert len(pids) == 2 and spare not in pids and behind not in pids, "the workers stayed"
    assert "rolled back" not in job.text(), "no step of the workers failed"
    assert "replacing a hot spare (local rank 2, pid" in job.text()
    assert not alive(behind), "the spare left with the job"
    every_sample_once(job)


def test_spares_with_min_workers_keep_the_world_whole(tmp_path, jobs):
    """With --min-workers 2 of 3 the survivors could go on at 2; the spare that waits is
    admitted in the same round, so the world comes back to 3 without a step at 2 for it."""
    job = Live(
        tmp_path / "min",
        "--standalone",
        "--nproc-per-node",
        "3",
        "--min-workers",
        "2",
        "--hot-spares",
        "1",
        script=("--kill-at-step", "10", "--step-seconds", "0.05", *held(tmp_path / "gates", 10)),
    )
    jobs.append(job)
    job.wait("a spare waits", lambda: spare_waiting(job))
    spare = spare_waiting(job)
    release(tmp_path / "gates", 10)
    assert job.finish() == 0, job.text()[-3000:]
    assert job.first_step_of(spare) > 10, "the spare was admitted after the death"
    after = [w for s, _, w, _ in job.steps() if s > 10]
    assert after and after[-1] == 3, "the world is whole again"
    every_sample_once(job)


def node(tmp_path: Path, name: str, endpoint: str, run_id: str, *flags: str, script=()) -> Live:
    """A node of a two-node job on the embedded rendezvous ("a" hosts it)."""
    conf = f"last_call_timeout=1,heartbeat_timeout=2,is_host={str(name == 'a').lower()}"
    return Live(
        tmp_path / name,
        *("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "embedded"),
        *("--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", conf),
        *flags,
        script=("--step-seconds", "0.05", "--epochs", "3", *script),
    )


def test_a_spare_on_another_node_takes_the_place_of_a_dead_worker(tmp_path, jobs):
    """Node b keeps a hot spare; node a's worker is SIGKILLed at step 10: b's spare takes its
    place, b's worker keeps its process, and a's replacement waits as the next spare."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"spares-{os.urandom(3).hex()}"
    gates = held(tmp_path / "gates", 10)
    fault = ("--kill-at-step", "10", "--fault-rank", "0,1", *gates)
    a = node(tmp_path, "a", endpoint, run_id, script=fault)
    jobs.append(a)
    b = node(tmp_path, "b", endpoint, run_id, "--hot-spares", "1", script=gates)
    jobs.append(b)
    b.wait("b's spare waits", lambda: spare_waiting(b))
    spare = spare_waiting(b)
    release(tmp_path / "gates", 10)
    assert (a.finish(), b.finish()) == (0, 0), a.text()[-2000:] + b.text()[-2000:]
    b_workers = {pid for s, _, _, pid in b.steps() if s <= 10}
    assert len(b_workers) == 1 and b_workers <= {pid for s, _, _, pid in b.steps() if s > 10}
    assert b.first_step_of(spare) > 10, "b's spare trained in a's worker's place"
    replaced = a.events("worker_replaced")
    assert len(replaced) == 1
    assert a.first_step_of(int(replaced[0]["pid"])) is None, "a's new process waited behind it"
