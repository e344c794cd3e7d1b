"""A node lost on Slurm: elasticrun and torchrun under the same sbatch script, side by side.

deploy/slurm/local_cluster.py runs a real two-node cluster on this host, and
deploy/slurm/elasticrun.sbatch runs examples/train_ddp.py with one worker per node and the
embedded rendezvous (torchrun's c10d, with ELASTICRUN=torchrun). Mid-training, node n2's agent
and its worker are SIGKILLed together, as when a node is lost. (torchrun's workers would outlive a
SIGKILL of their agent alone, and go on training.) The figures are measured from that
kill:

- the surviving node's old worker gone: under both launchers its gloo connection to the lost
  worker breaks, it raises and exits, and its agent sees the exit at once;
- its restarted worker training again: the first step after it resumed from the epoch start.

Needs root and Debian's slurm-wlm and munge (`make test` installs them).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Row, free_port, median

sys.path.insert(0, str(REPO / "deploy" / "slurm"))
import local_cluster  # deploy/slurm is not a package

SBATCH = REPO / "deploy" / "slurm" / "elasticrun.sbatch"
EXAMPLE = REPO / "examples" / "train_ddp.py"
TRAIN = ["--samples", "512", "--image-size", "16", "--classes", "10", "--batch-size", "16"]
TRAIN += ["--epochs", "1", "--step-time", "0.1", "--checkpoint-every", "1000"]
POLL_S = 0.005
FRESH = "--preload none"


def _lines(samples: Path) -> list[int]:
    steps = []
    for f in sorted(samples.glob("attempt*-rank*.txt")):
        for line in f.read_text().splitlines():
            parts = line.split(" ")
            if len(parts) == 3:
                steps.append(int(parts[1]))
    return steps


def _wait(pred, timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL_S)
    return time.monotonic()


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[1])


def _workers(procs: list[tuple[int, int, list[str]]], agent: int) -> list[int]:
    """The agent's workers: its children that run the script (--preload none), or the children
    of its zygote, forked with the zygote's command line."""
    zygotes = {
        p
        for p, _, argv in procs
        if _parent(p) == agent and "elastic_launch.processes.zygote" in argv
    }
    return [
        p
        for p, _, argv in procs
        if (_parent(p) == agent and str(EXAMPLE) in argv) or _parent(p) in zygotes
    ]


def lose_a_node(
    cluster: local_cluster.LocalCluster, launcher: str, args: str = ""
) -> tuple[float, float]:
    """One job: (kill -> the survivor's old worker gone, kill -> the survivor stepping again).
    `args`: more launcher flags (ELASTICRUN_ARGS)."""
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
        work = Path(tmp)
        samples = work / "samples"
        env = {
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "ELASTICRUN": launcher,
            "ELASTICRUN_NPROC": "1",
            "ELASTICRUN_RDZV_PORT": str(free_port()),
            "ELASTICRUN_ARGS": args,
        }
        job_id = cluster.submit(
            [
                *("--nodes", "2", "--chdir", tmp, "--output", str(work / "job.out"), str(SBATCH)),
                *(str(EXAMPLE), *TRAIN, "--checkpoint-dir", str(work / "ckpt")),
                *("--record-samples", str(samples)),
            ],
            env,
        )
        try:
            return _measure(cluster, launcher, job_id, work)
        except TimeoutError as e:
            tail = (work / "job.out").read_text()[-3000:] if (work / "job.out").exists() else ""
            raise TimeoutError(f"{e}; the job's output ends:\n{tail}") from None
        finally:
            cluster.cancel(job_id)


def _measure(
    cluster: local_cluster.LocalCluster, launcher: str, job_id: int, work: Path
) -> tuple[float, float]:
    samples = work / "samples"
    if True:
        if True:
            _wait(lambda: len(_lines(samples)) >= 8, 120, f"{launcher}'s job to train")
            procs = cluster.processes(job_id)
            agents = {n: p for p, n, argv in procs if argv[1:2] and argv[1].endswith(launcher)}
            worker = _workers(procs, agents[0]) if 0 in agents else []
            assert sorted(agents) == [0, 1], procs
            assert len(worker) == 1, procs
            # The node is lost: its agent and its worker at once (torchrun's workers would
            # outlive their agent's SIGKILL and go on training).
            lost = [p for p, node, _ in procs if node == 1]
            firsts = _lines(samples).count(1)
            for pid in lost:
                os.kill(pid, 9)
            killed = time.monotonic()
            gone = _wait(lambda: not Path(f"/proc/{worker[0]}").exists(), 120, "the old worker")
            # The restarted worker starts the epoch again (no mid-epoch checkpoint): step 1.
            again = _wait(lambda: _lines(samples).count(1) > firsts, 120, "the restarted worker")
            fields = cluster.wait(job_id, 180)
            out = (work / "job.out").read_text()
            assert "(node 0, n1) exited 0" in out, f"{launcher}: {fields}\n{out[-3000:]}"
            return gone - killed, again - killed


def run(cpp_build: Path) -> list[Row]:
    reason = local_cluster.missing()
    if reason:
        print(f"slurm: skipped: {reason}")
        return []
    trials = int(os.environ.get("BENCH_SLURM_TRIALS", "3"))
    with tempfile.TemporaryDirectory(prefix="bench-slurm-cluster-") as tmp:
        cluster = local_cluster.LocalCluster(Path(tmp), nodes=2)
        cluster.start()
        try:
            theirs = [lose_a_node(cluster, "torchrun") for _ in range(trials)]
            ours = [lose_a_node(cluster, "elasticrun") for _ in range(trials)]
            fresh = [lose_a_node(cluster, "elasticrun", FRESH) for _ in range(trials)]
        finally:
            cluster.stop()
    note = f"median of {trials}, 2 nodes, 1 worker each"
    return [
        Row(
            "slurm",
            "node lost (agent and worker SIGKILLed) -> the other node's old worker stopped",
            median([g for g, _ in ours]),
            median([g for g, _ in theirs]),
            "torchrun",
            "s",
            note,
        ),
        Row(
            "slurm",
            "node lost -> the other node training again, alone (default: --preload auto)",
            median([a for _, a in ours]),
            median([a for _, a in theirs]),
            "torchrun",
            "s",
            note,
        ),
        Row(
            "slurm",
            f"the same, elasticrun {FRESH} (fresh interpreters)",
            median([a for _, a in fresh]),
            median([a for _, a in theirs]),
            "torchrun",
            "s",
            note,
        ),
    ]
