"""The classic train loop for real: examples/classic_train_loop.py under elasticrun (gloo on
CPU), with a step that fails, a worker SIGKILLed with a fixed and with an elastic world, a
worker that fails for good, the failure budgets, a node that joins and a node that dies."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from classic_example import EXAMPLE, SAMPLES, STEP, assert_every_sample_once
from launcher_util import HERE, finish, free_port, held, kill_all, release, start, wait_for

from common import step_records, waiting_spare

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EPOCHS = 2


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    out: Path

    def steps(self) -> list[tuple[int, int, int, int]]:
        """(step, rank, world, pid) of every step taken, in the order printed."""
        return [tuple(map(int, m.groups())) for m in STEP.finditer(self.stdout)]  # type: ignore[misc]

    def pids(self) -> set[int]:
        return {pid for *_, pid in self.steps()}

    def worlds(self) -> list[int]:
        """The world size of each step, in step order (runs of one size collapsed)."""
        by_step = sorted({(s, w) for s, _, w, _ in self.steps()})
        sizes: list[int] = []
        for _, w in by_step:
            if not sizes or sizes[-1] != w:
                sizes.append(w)
        return sizes

    def result(self) -> dict:
        return json.loads((self.out / "final.json").read_text())

    def assert_every_sample_once_per_epoch(self) -> None:
        assert_every_sample_once(self.result()["history"], EPOCHS, SAMPLES)


def launch(tmp_path: Path, name: str, *flags: str, script: tuple[str, ...] = ()) -> Job:
    out = tmp_path / name
    out.mkdir()
    args = [*flags, str(EXAMPLE), "--out", str(out / "final.json"), *script]
    code, stdout, stderr = finish(start(args, cwd=str(out)), timeout=240)
    return Job(code, stdout, stderr, out)


def standalone(tmp_path: Path, name: str, *flags: str, script: tuple[str, ...] = ()) -> Job:
    return launch(tmp_path, name, "--standalone", *flags, script=script)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Three workers, nothing injected: the weights every recovery must reproduce."""
    job = standalone(tmp_path_factory.mktemp("reference"), "ref", "--nproc-per-node", "3")
    assert job.returncode == 0, job.stderr[-3000:]
    return job


def test_the_loop_runs_to_the_end_of_the_data_on_every_rank(reference):
    """StopIteration from train_step ends training on every rank, cleanly."""
    assert reference.stdout.count("done: 32 steps, 2 epochs") == 3
    assert len(reference.pids()) == 3 and reference.worlds() == [3]
    reference.assert_every_sample_once_per_epoch()


def test_a_failed_step_is_rolled_back_to_exactly_its_snapshot(tmp_path, reference):
    """Rank 1's step 5 changes the weights and the data position, then raises RuntimeError:
    every rank rolls back, the group re-forms, and the result is the uninterrupted one."""
    job = standalone(tmp_path, "raise", "--nproc-per-node", "3", script=("--raise-at-step", "5"))
    assert job.returncode == 0, job.stderr[-3000:]
    assert "injected failure in train_step" in job.stderr
    assert "rolled back to its snapshot, re-forming the group" in job.stderr
    assert len(job.pids()) == 3 and "replacing" not in job.stderr, "nobody was restarted"
    assert job.result()["weights"] == reference.result()["weights"]
    job.assert_every_sample_once_per_epoch()


def test_a_sigkilled_worker_is_replaced_alone_and_the_result_is_exact(tmp_path, reference):
    """With the default restart settings (no --max-restarts): the replacements' budget is the
    loop's own max_failures (here the script's default, torchelastic.MAX_FAILURES = 100)."""
    job = standalone(
        tmp_path,
        "kill",
        "--nproc-per-node",
        "3",
        script=("--kill-at-step", "10", "--step-seconds", "0.02"),
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert "replacing rank 1 alone (restart 1 of 100) after: rank 1 killed by SIGKILL" in job.stderr
    before = {pid for step, _, _, pid in job.steps() if step <= 10}
    after = {pid for step, _, _, pid in job.steps() if step > 10}
    assert len(before) == 3 and len(after) == 3
    assert len(before & after) == 2, "the two survivors keep their processes"
    assert job.worlds() == [3], "a fixed world waits for the replacement"
    assert job.result()["weights"] == reference.result()["weights"], "bitwise"
    job.assert_every_sample_once_per_epoch()


def test_a_hung_worker_is_killed_and_replaced_alone(tmp_path, reference):
    """Rank 1 stops (SIGSTOP) at step 10; the others wait for it inside all_reduce and look
    hung too. The stopped one is judged first and replaced; the waiting ones are spared, their
    collective fails when it dies, and they roll back and go on."""
    job = standalone(
        tmp_path,
        "hang",
        "--nproc-per-node",
        "3",
        "--hang-timeout",
        "2",
        "--shutdown-timeout",
        "2",
        script=("--stop-at-step", "10", "--step-seconds", "0.02"),
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert "replacing rank 1 alone (restart 1 of 100) after: rank 1 hung" in job.stderr
    assert "is stuck in a collective: it waits for a peer, which is judged first" in job.stderr
    before = {pid for step, _, _, pid in job.steps() if step <= 10}
    after = {pid for step, _, _, pid in job.steps() if step > 10}
    assert len(before & after) == 2, "the two that waited keep their processes"
    assert job.result()["weights"] == reference.result()["weights"]


def test_an_elastic_world_goes_on_smaller_then_admits_the_replacement(tmp_path):
    """Training starts at world 3 (a late third worker is waited for) and the survivors hold
    at step 12 (at world 2) until the replacement waits to join, so the world grows back
    before the end however long the replacement takes to start."""
    gates, events = tmp_path / "gates", tmp_path / "events.jsonl"
    hold = (*held(gates, 12), "--hold-until-world", "3")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            standalone,
            tmp_path,
            "elastic",
            *("--nproc-per-node", "3", "--max-restarts", "1", "--min-workers", "2"),
            *("--preload", "torch", "--events-file", str(events)),
            script=("--kill-at-step", "10", "--step-seconds", "0.1", *hold),
        )
        try:
            joining = wait_for(lambda: waiting_spare(events, "worker_replaced"), 120)
        finally:
            release(gates, 12)
        job = running.result(timeout=300)
    assert joining, f"no replacement waited to join:\n{job.stderr[-3000:]}"
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.worlds() == [3, 2, 3], "shrink at once, grow back at a step boundary"
    assert "1 worker(s) wait to join: the group re-forms after round step" in job.stderr
    survivors = {pid for step, _, _, pid in job.steps() if step <= 10} & {
        pid for step, _, w, pid in job.steps() if w == 2
    }
    assert len(survivors) == 2
    assert {pid for *_, w, pid in job.steps() if w == 3} >= survivors, "they stayed"
    job.assert_every_sample_once_per_epoch()


def test_a_worker_that_fails_for_good_fails_the_job_at_once(tmp_path):
    job = standalone(
        tmp_path,
        "fatal",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        script=("--fatal-at-step", "4"),
    )
    assert job.returncode == 1
    assert "NonRetryableException" in job.stderr and "injected fatal error at step 4" in job.stderr
    assert "replacing" not in job.stderr and len(job.pids()) == 2, "nothing was retried"
    assert "0 restart(s)" in job.stderr


def test_the_restart_budget_bounds_the_replacements(tmp_path):
    """Without --max-restarts the replacements' budget is the loop's max_failures (1): of two
    workers killed at once, one is replaced and the job ends. What ends it is whichever the
    launcher sees first: the other death (no restart left), or the survivor, whose own loop
    gives up after its one failure (the same budget); a loaded machine can delay either."""
    job = standalone(
        tmp_path,
        "budget",
        "--nproc-per-node",
        "3",
        script=("--kill-at-step", "3", "--fault-rank", "0,1", "--max-failures", "1"),
    )
    assert job.returncode == 1
    assert job.stderr.count("elasticrun: WARNING: replacing ") == 1, "one replacement"
    assert "(restart 1 of 1) after: rank " in job.stderr
    exhausted = r"the job failed: restarts exhausted \(1\); rank [01] killed by SIGKILL"
    survivor = r"the job failed: (restarts exhausted \(1\); )?rank 2 exit code 1"
    assert re.search(exhausted, job.stderr) or (
        re.search(survivor, job.stderr) and "Exceeded max number of recoverable" in job.stderr
    ), job.stderr[-3000:]


def test_max_restarts_given_is_the_budget_whatever_the_loop_says(tmp_path):
    """--max-restarts 0 means no restart, though the loop's max_failures is 100: the first
    death ends the job (it gave 100 before)."""
    job = standalone(
        tmp_path,
        "no-restarts",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        script=("--kill-at-step", "3"),
    )
    assert job.returncode == 1
    assert "replacing" not in job.stderr
    assert re.search(r"restarts exhausted \(0\); rank 1 killed by SIGKILL", job.stderr), job.stderr[
        -2000:
    ]


def test_the_loops_failure_budget_bounds_the_rollbacks(tmp_path):
    job = standalone(
        tmp_path,
        "failures",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        script=("--raise-every", "--max-failures", "3"),
    )
    assert job.returncode == 1
    assert "Exceeded max number of recoverable failures: 3" in job.stderr
    assert "replacing" not in job.stderr, "a spent budget is final, not a crash to replace"


# ---- two nodes ------------------------------------------------------------------------------


def node(tmp_path: Path, name: str, endpoint: str, run_id: str, *script: str, epochs: int = 4):
    """A node of a 1-2 node job; the first ("a") hosts the embedded rendezvous."""
    out = tmp_path / name
    out.mkdir()
    args = [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "embedded",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        f"last_call_timeout=1,heartbeat_timeout=2,is_host={str(name == 'a').lower()}",
        "--max-restarts",
        "2",
        "--min-workers",
        "2",
        "--preload",
        "torch",  # new workers are forked from a zygote: no interpreter start on the path
        str(EXAMPLE),
        "--out",
        str(out / "final.json"),
        "--step-seconds",
        "0.1",
        "--epochs",
        str(epochs),
        *script,
    ]
    return start(args, cwd=str(out)), out


def test_a_node_that_joins_mid_training_receives_the_state(tmp_path):
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"join-{os.urandom(3).hex()}"
    hold = ("--hold-until-world", "4", "--hold-world-at-step", "20")  # b's workers join then
    first, out_a = node(tmp_path, "a", endpoint, run_id, *hold, epochs=EPOCHS)
    second = None
    try:
        seen: list[str] = []

        def stepping() -> bool:
            line = first.stdout.readline() if first.stdout else ""
            seen.append(line)
            return bool(re.match(r"step 1[0-9] ", line))

        assert wait_for(stepping, 120), "".join(seen)[-2000:]
        second, out_b = node(tmp_path, "b", endpoint, run_id, epochs=EPOCHS)
        code_b, stdout_b, stderr_b = finish(second, 240)
        code_a, rest_a, stderr_a = finish(first, 240)
    finally:
        kill_all([p.pid for p in (first, second) if p is not None and p.poll() is None])
    assert (code_a, code_b) == (0, 0), stderr_a[-2000:] + stderr_b[-2000:]
    job_a = Job(code_a, "".join(seen) + rest_a, stderr_a, out_a)
    job_b = Job(code_b, stdout_b, stderr_b, out_b)
    first_b = min(step for step, *_ in job_b.steps())
    assert first_b > 10, "the new workers started from the state they were sent, not step 0"
    assert job_b.worlds()[-1] == 4 and set(job_b.worlds()) <= {3, 4}
    assert len({pid for *_, pid in job_a.steps()}) == 2, "the first node's workers stayed"
    final = job_a if (out_a / "final.json").exists() else job_b
    assert final.result()["weights"]
    final_history = final.result()["history"]
    for epoch in range(EPOCHS):
        spans = sorted((s, n) for e, s, n in final_history if e == epoch)
        assert sum(n for _, n in spans) == SAMPLES and spans[0][0] == 0


def test_a_dead_node_costs_the_other_node_nothing(tmp_path):
    """The second node (agent and workers) is SIGKILLed: the first node's workers keep their
    processes, go on at their own size, and finish. (Training starts once all four workers
    are there, however long the second node takes to start on a busy machine.)"""
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"die-{os.urandom(3).hex()}"
    hold = ("--hold-until-world", "4")
    first, out_a = node(tmp_path, "a", endpoint, run_id, *hold)
    second, _ = node(tmp_path, "b", endpoint, run_id, *hold)
    try:
        lines: list[str] = []

        def four_wide() -> bool:
            line = second.stdout.readline() if second.stdout else ""
            lines.append(line)
            m = STEP.match(line.strip())
            return bool(m and int(m.group(3)) == 4 and int(m.group(1)) >= 8)

        assert wait_for(four_wide, 120), "".join(lines)[-2000:]
        victims = {int(m.group(4)) for m in STEP.finditer("".join(lines))}
        kill_all([second.pid, *victims])
        os.killpg(second.pid, signal.SIGKILL)
        code_a, stdout_a, stderr_a = finish(first, 240)
        finish(second, 30)
    finally:
        kill_all([p.pid for p in (first, second) if p.poll() is None])
    assert code_a == 0, stderr_a[-3000:]
    job = Job(code_a, stdout_a, stderr_a, out_a)
    pids = {pid for *_, pid in job.steps()}
    assert len(pids) == 2, "nobody on the first node restarted"
    assert job.worlds()[-1] == 2 and 4 in job.worlds()
    assert "replacing" not in stderr_a


# ---- without a launcher: the classic URL ------------------------------------------------------


@pytest.mark.parametrize(("scheme", "store"), [("etcd", "etcd"), ("etcd-v2", "etcd_v2")])
def test_plain_python_on_each_node_joins_through_the_classic_url(
    tmp_path, request, reference, scheme, store
):
    """Three `python classic_train_loop.py --init-method etcd://...` processes, as the classic
    package ran, reach the same weights as the same job under elasticrun."""
    server = request.getfixturevalue(store)
    url = f"{scheme}://{server.endpoint}/plain-{os.urandom(3).hex()}?min_workers=3&max_workers=3"
    outs = [tmp_path / f"w{i}" for i in range(3)]
    procs = []
    try:
        for out in outs:
            out.mkdir()
            procs.append(
                start(
                    [str(EXAMPLE), "--init-method", url, "--out", str(out / "final.json")],
                    launcher=[os.environ.get("PYTHON", sys.executable)],
                    env={"OMP_NUM_THREADS": "1"},
                    cwd=str(out),
                )
            )
        results = [finish(p, 180) for p in procs]
    finally:
        kill_all([p.pid for p in procs if p.poll() is None])
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    written = [out / "final.json" for out in outs if (out / "final.json").exists()]
    assert len(written) == 1, "rank 0 writes the result"
    assert json.loads(written[0].read_text())["weights"] == reference.result()["weights"]
    assert all(out.count("done: 32 steps") == 1 for _, out, _ in results)


# ---- a DDP model in the State -------------------------------------------------------------


DDP_LOOP = HERE / "scripts" / "ddp_loop.py"
KILLS = 10


def _world_since(out: Path, since_ns: int) -> dict[int, int] | None:
    """{rank: pid} of a world of 3 whose ranks have all stepped after `since_ns` (so the victim
    of an earlier kill, which stepped before it, is never among them), or None."""
    by_rank = {r[3]: r[4] for r in sorted(step_records(out)) if r[2] == 3 and r[0] > since_ns}
    return by_rank if len(by_rank) == 3 and len(set(by_rank.values())) == 3 else None


def _resumed(out: Path, survivors: set[int], kill_ns: int) -> int | None:
    """When the survivors stepped in a group formed after the kill: the earliest of their
    second steps after it (a first one may have been in flight), once each has two."""
    times: dict[int, list[int]] = {}
    for r in sorted(step_records(out)):
        if r[4] in survivors and r[0] > kill_ns:
            times.setdefault(r[4], []).append(r[0])
    if set(times) != survivors or any(len(t) < 2 for t in times.values()):
        return None
    return min(t[1] for t in times.values())


def test_a_ddp_model_in_the_state_never_stalls_the_survivors(tmp_path):
    """While a DDP object holds the round's gloo group, neither destroying nor aborting the
    group closes its connections, and a survivor still in a collective with a rank that left
    the round (DDP's bucket rebuild, say) would wait out the group's timeout while the next
    round waits for it. Ten SIGKILLs in one job with the default flags, each of a worker of a
    world of 3: every time, both survivors step again well within that timeout (the pause
    itself is measured by benchmarks/bench_train_loop.py)."""
    out = tmp_path / "steps"
    out.mkdir()
    args = ["--standalone", "--nproc-per-node", "3"]
    log = tmp_path / "launcher.log"
    proc = start([*args, str(DDP_LOOP), "--out", str(out)], env={"OMP_NUM_THREADS": "1"}, log=log)
    pauses: list[float] = []
    since = 0
    try:
        for kill in range(KILLS):
            assert wait_for(lambda t=since: _world_since(out, t), 120), (
                f"kill {kill}: no world of 3 again:\n" + log.read_text()[-3000:]
            )
            workers = _world_since(out, since)
            assert workers is not None
            victim = workers[1 + kill % 2]
            t_kill = time.monotonic_ns()
            os.kill(victim, signal.SIGKILL)
            survivors = set(workers.values()) - {victim}
            assert wait_for(lambda s=survivors, t=t_kill: _resumed(out, s, t), 60), (
                f"kill {kill}: a survivor never stepped again (pauses so far: {pauses}):\n"
                + log.read_text()[-3000:]
            )
            since = _resumed(out, survivors, t_kill) or 0
            pauses.append((since - t_kill) / 1e9)
        assert max(pauses) < 20, f"a survivor waited for the group's timeout: {pauses}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_all([int(p.stem) for p in out.glob("*.steps")])


def test_a_worker_that_writes_a_huge_budget_gets_only_the_launchers(tmp_path):
    """The loop's max_failures reaches the agent through a file the worker can write: one
    that writes "running 999999999" (as a loop with that budget would) and fails at once is
    started 1 + --loop-max-restarts times, never more (before: 77 replacements in 25 s
    under --max-restarts 0)."""
    from launcher_util import run

    script = tmp_path / "greedy.py"
    script.write_text(
        "import os, sys\n"
        "with open(os.environ['ELASTICRUN_LOOP_FILE'], 'w') as f:\n"
        "    f.write('running 999999999')\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "sys.exit(3)\n"
    )
    args = ["--standalone", "--nproc-per-node", "1", "--max-restarts", "0"]
    for cap in (0, 2):
        starts = tmp_path / f"starts-{cap}"
        cmd = [*args, "--loop-max-restarts", str(cap), str(script), str(starts)]
        result = run(cmd, tmp_path)
        assert result.returncode == 1, result.stderr[-2000:]
        assert len(starts.read_text().split()) == 1 + cap, "the first start and the cap's"
