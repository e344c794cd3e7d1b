"""Recovery of a training job of the shape users run, beside torchrun in one run: the fault to
the job's next completed step, and the completed steps lost.

The job is examples/train_ddp.py (a CNN in DistributedDataParallel on gloo, AdamW and a StepLR
schedule, a DataLoader with 2 worker processes over ElasticDistributedSampler, every step kept
in the node's memory by CheckpointManager(memory=True), a disk checkpoint every 50 steps), or
for the classic train loop the same job as a State (benchmarks/_loop_job.py). Both launchers
run with default flags besides the job's shape and --max-restarts 3:

- a worker SIGKILLed, group restart: 1 node x 2 workers, the rank that saves (rank 0) or the
  other (rank 1) killed once every rank has recorded a step drawn at random;
- a worker SIGKILLed under the classic train loop (elasticrun only: torchrun has no such
  loop; its figure beside it is its group restart of the same job);
- a node SIGKILLed (its launcher and workers), two launchers of 1 worker each on the embedded
  c10d rendezvous, a replacement node started at once; with and without
  CheckpointManager(replicas=1); and, instead of a replacement, a third launcher started
  before the fault that waits as a spare (elasticrun: once it says so and its zygote is warm;
  torchrun: once its agent is connected to the store and 40 more steps were trained);
- the node hosting the rendezvous SIGKILLed (elasticrun: the embedded service on two
  endpoints, the other node's standby takes over; torchrun: its c10d store, in the lost
  agent), a replacement started at once, or a third launcher waiting as a spare;
- the same with one endpoint as torchrun users write it (elasticrun: the successor its
  agents chose takes over, once it stands by): a replacement started at once at the same
  address, --nnodes 1:2 and none started, or a third launcher waiting as a spare;
- a member of a 3-member etcd SIGKILLed (the one named first, or the leader), then a worker
  10 steps later: that kill to the next step (elasticrun: every member named; torchrun:
  etcd-v2, which takes one); a torchrun run that loses its store is watched STORE_LOST_WAIT s;
- a worker hung (it stops making progress): elasticrun with --hang-timeout 5; torchrun has
  no hang detection (one run, ended after HANG_WAIT s).

Each figure is the median of BENCH_REAL_JOB_RUNS runs (default 5); the steps lost are the
most any run lost. A step is completed once every rank has reported it, and a rank that saves
reports a step once its copy is in memory (examples/train_ddp.py).

    python benchmarks/bench_real_job.py [--runs 5] [--seed 0] [SCENARIO ...]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from _job_run import JobRun, Outcome, Shape

from common import Row, end_job, start_job, step_records, wait_until

HERE = Path(__file__).resolve().parent
LOOP_JOB = HERE / "_loop_job.py"
ONE_NODE = Shape(1, 2, ("--max-restarts", "3"), ())
TWO_NODES = Shape(2, 1, ("--max-restarts", "3"), ())
HANG = Shape(1, 2, ("--max-restarts", "3"), ("--hang-timeout", "5"))
EPOCH = ("--epochs", "1")  # 100 steps on 1 x 2 (3200 samples, 16 a batch), 2 x 1 alike
SCENARIOS = (
    "worker",
    "saver",
    "loop",
    "node",
    "node-replicas",
    "node-spare",
    "host",
    "host-spare",
    "host-one",
    "host-one-alone",
    "host-one-spare",
    "etcd-first",
    "etcd-leader",
    "hang",
)
#: A spare node is started once the job trains and must be warm before the fault: a longer job.
LONG = ("--epochs", "3")
HANG_WAIT = 60.0  # torchrun's hang: how long a run is watched before it is called lost
#: A run whose store was lost: how long torchrun's is watched before it is called lost (its
#: survivors exit or hang, the issue's own measure; ours recover in seconds).
STORE_LOST_WAIT = 60.0


@dataclass
class Runs:
    """One scenario's runs under one launcher."""

    recovery_s: list[float]
    lost: list[int]
    failed: int
    gone_s: list[float] = field(default_factory=list)  # the fault to the old workers gone
    restarts: list[int] = field(default_factory=list)  # elasticrun's, spent per run

    @property
    def median_s(self) -> float:
        return statistics.median(self.recovery_s) if self.recovery_s else float("nan")

    def note(self) -> str:
        lost = "no step lost" if not any(self.lost) else f"steps lost per run {self.lost}"
        total = len(self.lost) + self.failed
        said = f"{len(self.recovery_s)}/{total} recovered, {lost}"
        if self.gone_s:
            said += f", loss seen (old workers gone) at {statistics.median(self.gone_s):.2f} s"
        if self.restarts:
            spent = "no restart spent" if not any(self.restarts) else f"restarts {self.restarts}"
            said += f", {spent}"
        return said


def job_runs(root: Path, launcher: str, shape: Shape, fault: str, runs: int, **how: Any) -> Runs:
    """`runs` runs of the example under `launcher` with `fault`; `how`: the victim (an int),
    the job's extra arguments (a tuple, "job"), the seed, a timeout, and for a fault of the
    store its "cluster" (a fresh one per run: see :func:`etcd_cluster`)."""
    rng = random.Random(f"{how.get('seed', 0)}{fault}{how.get('victim')}{how.get('job')}")
    got = Runs([], [], 0)
    for i in range(runs):
        kill_at = rng.randint(20, 60)
        name = f"{launcher}-{fault}-{i}-{kill_at}"
        where = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
        cluster = how["cluster"](where) if "cluster" in how else contextlib.nullcontext(None)
        with cluster as store:
            outcome = one_run(where, name, launcher, shape, fault, kill_at, {**how, "store": store})
        if outcome is None:
            got.failed += 1
            continue
        if outcome.recovery_s is not None:
            got.recovery_s.append(outcome.recovery_s)
        if outcome.gone_s is not None:
            got.gone_s.append(outcome.gone_s)
        if outcome.restarts is not None:
            got.restarts.append(outcome.restarts)
        got.lost.append(outcome.lost if outcome.lost is not None else -1)
        if any(outcome.returncodes):
            print(f"{launcher}, {fault} at step {kill_at}: ended {outcome.returncodes}")
    return got


def one_run(
    where: Path,
    name: str,
    launcher: str,
    shape: Shape,
    fault: str,
    kill_at: int,
    how: dict[str, Any],
) -> Outcome | None:
    """One run; None when it did not recover (said). `how`: as job_runs's, and the "store"
    of a fault of the store (its members, and what loses one)."""
    job = (*EPOCH, *how.get("job", ()))
    store: tuple[tuple[str, ...], Callable[[], None]] | None = how.get("store")
    if store is not None:
        shape = replace(shape, store=store[0])
    run = JobRun(where, name, launcher, job, shape)
    if store is not None:
        run.store_fault = store[1]
    try:
        return run.run(fault, kill_at, float(how.get("timeout", 240)), how.get("victim"))
    except RuntimeError as e:  # reported, not raised: the other runs stand
        print(f"{launcher}, {fault} at step {kill_at}: no recovery: {str(e)[:3000]}")
        return None


@contextlib.contextmanager
def etcd_cluster(where: Path, victim: str) -> Iterator[tuple[tuple[str, ...], Callable[[], None]]]:
    """A 3-member etcd cluster (both APIs) for one run: its members, first to last, and what
    SIGKILLs the `victim` ("first": the member named first; "leader": the leader, made another
    than the first)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from etcd_servers import EtcdCluster  # the tests' clusters

    cluster = EtcdCluster(where / "etcd", 3, enable_v2=True)
    try:
        cluster.start()
        lost = 0
        if victim == "leader":
            cluster.lead(1)
            lost = 1
        yield tuple(m.endpoint for m in cluster.members), cluster.members[lost].kill
    finally:
        cluster.stop()


# ---- the classic train loop ------------------------------------------------------------------


def loop_run(kill_at: int, gpus: tuple[str, ...] = ()) -> tuple[float | None, int | None]:
    """The loop job on 2 workers; rank 1 SIGKILLed right after it reports step `kill_at`
    (before the next step's gradients reach its peer, so that no step completes without the
    new group): seconds to the next step any worker completes, and the steps lost."""
    out = Path(tempfile.mkdtemp(prefix="bench-real-loop-"))
    cmd = [
        sys.executable,
        "-m",
        "elastic_launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(LOOP_JOB),
        "--out",
        str(out),
        "--epochs",
        "1",
        *(("--backend", "nccl") if gpus else ()),
    ]
    env = {"OMP_NUM_THREADS": "1"} | ({"CUDA_VISIBLE_DEVICES": ",".join(gpus[:2])} if gpus else {})
    proc = start_job(cmd, env)
    try:
        victim = wait_until(
            lambda: next((r for r in step_records(out) if r[3] == 1 and r[1] >= kill_at), None), 180
        )
        if victim is None:
            return None, None
        os.kill(victim[4], signal.SIGKILL)  # type: ignore[index]
        t_kill = time.monotonic_ns()
        done = max(r[1] for r in step_records(out))

        def after() -> tuple[int, int, int, int, int] | None:
            new = [r for r in step_records(out) if r[0] > t_kill and r[1] > victim[1]]  # type: ignore[index]
            return min(new) if new else None

        first = wait_until(after, 120)
        if first is None:
            return None, None
        return (first[0] - t_kill) / 1e9, max(0, done - (first[1] - 1))  # type: ignore[index]
    finally:
        end_job(proc, out)
        shutil.rmtree(out, ignore_errors=True)


def loop_runs(runs: int, seed: int, gpus: tuple[str, ...] = ()) -> Runs:
    rng = random.Random(f"{seed}loop")
    got = Runs([], [], 0)
    for _ in range(runs):
        seconds, lost = loop_run(rng.randint(20, 60), gpus)
        if seconds is None or lost is None:
            got.failed += 1
            continue
        got.recovery_s.append(seconds)
        got.lost.append(lost)
    return got


# ---- the table ---------------------------------------------------------------------------


def rows_for(what: str, ours: Runs, theirs: Runs | None, baseline: str) -> list[Row]:
    """The recovery time and the steps lost of one scenario."""
    base_s = None if theirs is None or not theirs.recovery_s else theirs.median_s
    base_lost = None if theirs is None or not theirs.lost else float(max(theirs.lost))
    their_note = "" if theirs is None else f"; torchrun: {theirs.note()}"
    return [
        Row(
            "real_job",
            f"real job, {what}: the fault to the next completed step",
            ours.median_s,
            base_s,
            baseline,
            "s",
            f"median of {ours.note()}{their_note}",
        ),
        Row(
            "real_job",
            f"real job, {what}: completed steps lost (most in one run)",
            float(max(ours.lost, default=-1)),
            base_lost,
            baseline,
            "steps",
            "a disk checkpoint every 50 steps under torchrun (the job's own)",
        ),
    ]


@dataclass(frozen=True)
class Scenario:
    """One row pair: the fault, the job's shape and options for elasticrun, and where torchrun's
    differ (`their_*`: its shape, options, number of runs)."""

    label: str
    fault: str
    shape: Shape
    how: dict[str, Any] = field(default_factory=dict)
    their_shape: Shape | None = None
    their_how: dict[str, Any] = field(default_factory=dict)
    their_runs: int | None = None
    baseline: str = "torchrun"


def table(gpus: tuple[str, ...] = ()) -> dict[str, Scenario]:
    """Every scenario but the classic loop's; with `gpus` (CUDA_VISIBLE_DEVICES entries, 2 at
    least) the job runs on them over NCCL, each node on its own."""
    one_node, two_nodes, hung = (replace(s, gpus=gpus) for s in (ONE_NODE, TWO_NODES, HANG))
    return {
        "worker": Scenario(
            "1 x 2, rank 1 (not the saving rank) SIGKILLed", "worker", one_node, {"victim": 1}
        ),
        "saver": Scenario(
            "1 x 2, rank 0 (the saving rank) SIGKILLed", "worker", one_node, {"victim": 0}
        ),
        "node": Scenario("2 x 1, a node SIGKILLed", "node", two_nodes),
        "node-replicas": Scenario(
            "2 x 1, a node SIGKILLed, replicas=1", "node", two_nodes, {"job": ("--replicas",)}
        ),
        "node-spare": Scenario(
            "2 x 1 and a third node waiting as a spare, a node SIGKILLed",
            "spare",
            two_nodes,
            {"job": LONG},
        ),
        **store_losses(two_nodes),
        "hang": Scenario(
            "1 x 2, a worker hung (--hang-timeout 5)",
            "hang",
            hung,
            their_how={"timeout": HANG_WAIT},
            their_runs=1,
        ),
    }


def store_losses(two_nodes: Shape) -> dict[str, Scenario]:
    """The rendezvous's store lost: the node hosting the embedded service (elasticrun's has
    two endpoints; torchrun's c10d takes one), or a member of a 3-member etcd (torchrun's
    etcd-v2 takes one)."""
    hosting = replace(two_nodes, endpoints=2)
    on_etcd = replace(two_nodes, backend="etcd")
    lost = {"timeout": STORE_LOST_WAIT}  # torchrun's runs that lose their store
    host = "2 x 1, the node hosting the rendezvous SIGKILLed"

    def etcd(victim: str) -> Scenario:
        return Scenario(
            f"2 x 1 on a 3-member etcd, its {victim} member SIGKILLed, a worker 10 steps later",
            "member",
            on_etcd,
            {"cluster": lambda where: etcd_cluster(where, victim)},
            replace(on_etcd, backend="etcd-v2"),
            lost,
            baseline="torchrun etcd-v2",
        )

    return {
        "host": Scenario(
            f"{host}, a new one started at once",
            "host",
            hosting,
            {},
            None,
            lost,
            baseline="torchrun c10d",
        ),
        "host-spare": Scenario(
            f"{host}, a third node waiting as a spare",
            "host-spare",
            hosting,
            {"job": LONG},
            None,
            lost,
            baseline="torchrun c10d",
        ),
        **one_endpoint(two_nodes, lost),
        "etcd-first": etcd("first"),
        "etcd-leader": etcd("leader"),
    }


#: torchrun's runs of a scenario whose torchrun side another measured already (its c10d
#: takes one endpoint whatever elasticrun is given): the same runs serve both rows.
_THEIRS: dict[str, Runs] = {}


def one_endpoint(two_nodes: Shape, lost: dict[str, Any]) -> dict[str, Scenario]:
    """The node hosting the rendezvous lost when both launchers are given one endpoint, as
    torchrun users write it (elasticrun: the successor its agents chose takes over)."""
    one = "2 x 1 on one endpoint (both launchers), the node hosting the rendezvous SIGKILLed"
    return {
        "host-one": Scenario(
            f"{one}, a new one started at once at its address",
            "host",
            two_nodes,
            {},
            None,
            lost,
            baseline="torchrun c10d",
        ),
        "host-one-alone": Scenario(
            f"{one}, --nnodes 1:2 and none started",
            "host-alone",
            replace(two_nodes, min_nodes=1),
            {},
            None,
            lost,
            baseline="torchrun c10d",
        ),
        "host-one-spare": Scenario(
            f"{one}, a third node waiting as a spare",
            "host-spare",
            two_nodes,
            {"job": LONG},
            None,
            lost,
            baseline="torchrun c10d",
        ),
    }


def measure(root: Path, runs: int, seed: int, sc: Scenario) -> list[Row]:
    """One scenario under both launchers, in one run."""
    ours = job_runs(root, "elasticrun", sc.shape, sc.fault, runs, seed=seed, **sc.how)
    their_shape = replace(sc.their_shape or sc.shape, endpoints=1)
    how = {**sc.how, **sc.their_how}
    key = repr((their_shape, sc.fault, sorted(map(repr, how.items())), sc.their_runs or runs))
    if key not in _THEIRS:
        _THEIRS[key] = job_runs(
            root, "torchrun", their_shape, sc.fault, sc.their_runs or runs, seed=seed, **how
        )
    return rows_for(sc.label, ours, _THEIRS[key], sc.baseline)


def scenarios(
    root: Path, runs: int, seed: int, gpus: tuple[str, ...] = ()
) -> dict[str, Callable[[], list[Row]]]:
    """Each scenario's measurement (see :func:`table`), the classic loop's among them."""

    def loop() -> list[Row]:
        ours = loop_runs(runs, seed, gpus)
        one_node = replace(ONE_NODE, gpus=gpus)
        theirs = job_runs(root, "torchrun", one_node, "worker", runs, victim=1, seed=seed)
        label = "classic train loop, 1 x 2, rank 1 SIGKILLed"
        return rows_for(label, ours, theirs, "torchrun group restart")

    found: dict[str, Callable[[], list[Row]]] = {
        name: functools.partial(measure, root, runs, seed, sc) for name, sc in table(gpus).items()
    }
    found["loop"] = loop
    return {name: found[name] for name in SCENARIOS}


def run(
    cpp_build: Path | None = None,
    names: list[str] | None = None,
    seed: int = 0,
    gpus: tuple[str, ...] = (),
) -> list[Row]:
    """Every scenario (or `names`), BENCH_REAL_JOB_RUNS runs each; on `gpus` over NCCL."""
    runs = int(os.environ.get("BENCH_REAL_JOB_RUNS", "5"))
    root = Path(tempfile.mkdtemp(prefix="bench-real-job-"))
    try:
        table = scenarios(root, runs, seed, gpus)
        rows: list[Row] = []
        for name in names or list(table):
            rows += table[name]()
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenarios", nargs="*", help=", ".join(SCENARIOS))
    p.add_argument("--runs", type=int, default=None, help="runs per scenario (default 5)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.runs is not None:
        os.environ["BENCH_REAL_JOB_RUNS"] = str(args.runs)
    known = set(SCENARIOS)
    unknown = [s for s in args.scenarios if s not in known]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r}: choose from {sorted(known)}")
    from common import format_table

    print(format_table(run(None, args.scenarios, args.seed)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
