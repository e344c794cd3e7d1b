"""The node side end to end: signals in every state, a SIGKILLed launcher, a node lost
abruptly, a reused run id, nodes of different versions, and nothing left under /tmp."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
from elastic_launch.rendezvous.store.api import StoreAccess
from launcher_util import (
    HERE,
    alive,
    finish,
    free_port,
    health,
    kill_all,
    start,
    wait_for,
    worker_args,
)

COLLECTIVE = HERE / "scripts" / "collective.py"
FAMILY = HERE / "scripts" / "family.py"
FAST = "heartbeat_timeout=2,last_call_timeout=1,join_timeout=60"
WHOLE = "heartbeat_timeout=2,last_call_timeout=60,join_timeout=60"


def run_id() -> str:
    return f"test-{os.urandom(4).hex()}"


def rdzv_files() -> set[str]:
    """Files an embedded rendezvous host might leave in the temporary directory (none: the
    port itself decides who hosts)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "elasticrun-rdzv-*")))


@pytest.fixture(autouse=True)
def _rdzv_files_before() -> None:
    """What was there before the test (another run's files on a shared /tmp are not ours)."""
    global _BEFORE
    _BEFORE = rdzv_files()


_BEFORE: set[str] = set()


def leftovers(launcher_pid: int) -> list[str]:
    """What a launcher may leave: its heartbeat file, its temporary directory, lock files."""
    tmp = tempfile.gettempdir()
    return [
        *glob.glob(f"/dev/shm/elasticrun-{launcher_pid}-*"),
        *glob.glob(os.path.join(tmp, f"elasticrun_{launcher_pid}_*")),
        *sorted(rdzv_files() - _BEFORE),
    ]


def processes_of(launcher_pid: int) -> list[int]:
    """Processes the launcher started that still run (its guardian, a zygote)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == launcher_pid and fields[0] not in ("Z", "X"):
                found.append(int(entry))
    return found


@pytest.fixture
def launched():
    """Launchers started by a test; every one (and what it recorded) is ended at teardown."""
    procs: list = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


#: The launcher, able to print every thread's stack on SIGUSR2: a stop that overruns shows
#: where it waits.
DUMPING = [
    sys.executable,
    "-c",
    "import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR2, all_threads=True);"
    "sys.argv[0] = 'elasticrun'; from elastic_launch.launcher.cli import console_main; "
    "console_main()",
]


#: A signal ends the launcher within a fraction of a second on an idle machine. What this bound
#: tells apart is waiting out a timeout instead (the 30 s grace, a 120 s import, the join
#: timeout), whatever the load: a loaded machine may take seconds.
STOP_BOUND = 20.0


def stop_with(proc, sig: int, within: float) -> tuple[int, str]:
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        if proc.args[: len(DUMPING)] == DUMPING:
            proc.send_signal(signal.SIGUSR2)
        _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert took < within, f"took {took:.1f} s to stop:\n{err[-6000:]}"
    return proc.returncode, err


# ---- signals, in every state ------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_while_waiting_in_the_rendezvous_ends_the_launcher(launched, tmp_path, sig):
    port = free_port()
    proc = start(
        [
            "--nnodes",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "--rdzv-id",
            run_id(),
            "--health-port",
            str(port),
            *worker_args(tmp_path),
        ],
        launcher=DUMPING,
    )
    launched.append(proc)
    assert wait_for(lambda: health(port).get("state") == "rendezvous"), "never waited"
    code, err = stop_with(proc, sig, within=STOP_BOUND)
    assert code == 128 + sig, err
    assert f"stopped by signal {int(sig)}" in err
    assert wait_for(lambda: not processes_of(proc.pid), 5)
    assert leftovers(proc.pid) == []


def test_a_node_stopped_while_waiting_leaves_the_round_at_once(launched, tmp_path, etcd):
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

    rid = run_id()
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", rid]
    procs = [start(["--nnodes", "3", *rdzv, *worker_args(tmp_path)]) for _ in range(2)]
    launched.extend(procs)
    store = EtcdV3Store(etcd.endpoint, StoreAccess("test", retry_for=5))
    joined = lambda: store.range(f"/elasticrun/{rid}/m/v1/join/")[0]  # noqa: E731
    try:
        assert wait_for(lambda: len(joined()) == 2), "the two nodes never joined"
        code, _ = stop_with(procs[1], signal.SIGTERM, within=STOP_BOUND)
        assert code == 128 + signal.SIGTERM
        assert len(joined()) == 1, "the stopped node's key went with it, not a lease later"
        code, _ = stop_with(procs[0], signal.SIGTERM, within=STOP_BOUND)
        assert code == 128 + signal.SIGTERM
    finally:
        store.close()


def test_a_spare_stopped_by_a_signal_leaves_and_the_job_runs_on(launched, tmp_path, etcd):
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

    rid = run_id()
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", rid]
    a_out, b_out = tmp_path / "a", tmp_path / "b"
    a_out.mkdir()
    b_out.mkdir()
    port = free_port()
    member = start(["--nnodes", "1:1", *rdzv, *worker_args(a_out, "--hold-round", "1")])
    launched.append(member)
    assert wait_for(lambda: list(a_out.glob("*.pid"))), "the member never started its worker"
    spare = start(["--nnodes", "1:1", "--health-port", str(port), *rdzv, *worker_args(b_out)])
    launched.append(spare)
    store = EtcdV3Store(etcd.endpoint, StoreAccess("test", retry_for=5))
    try:
        assert wait_for(lambda: store.range(f"/elasticrun/{rid}/s/waiting/")[0]), "no spare"
        assert health(port).get("rendezvous", {}).get("phase") == "spare"
        code, _ = stop_with(spare, signal.SIGTERM, within=STOP_BOUND)
        assert code == 128 + signal.SIGTERM
        assert store.range(f"/elasticrun/{rid}/s/waiting/")[0] == []
        assert not list(b_out.glob("*.pid")), "the spare never ran a worker"
        time.sleep(0.5)
        assert member.poll() is None and len(list(a_out.glob("*.pid"))) == 1, "not restarted"
        code, _ = stop_with(member, signal.SIGTERM, within=STOP_BOUND)
        assert code == 128 + signal.SIGTERM
    finally:
        store.close()


def test_a_signal_while_the_zygote_imports_ends_the_launcher_and_the_zygote(launched, tmp_path):
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(120)\n")
    port = free_port()
    proc = start(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--preload",
            "slow_import",
            "--health-port",
            str(port),
            *worker_args(tmp_path),
        ],
        env={"PYTHONPATH": str(tmp_path)},
    )
    launched.append(proc)
    assert wait_for(lambda: health(port).get("state") == "starting"), "never waited for it"
    zygotes = processes_of(proc.pid)
    assert zygotes, "the zygote runs"
    code, err = stop_with(proc, signal.SIGTERM, within=STOP_BOUND)
    assert code == 128 + signal.SIGTERM, err
    assert wait_for(lambda: not any(alive(p) for p in zygotes), 2)
    assert not list(tmp_path.glob("*.pid")), "no worker was started"
    assert leftovers(proc.pid) == []


# ---- a SIGKILLed launcher ---------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("preload", [["--preload", "none"], []], ids=["fresh", "zygote"])
def test_a_sigkilled_launcher_leaves_nothing(launched, tmp_path, preload):
    proc = start(
        ["--standalone", "--nproc-per-node", "2", *preload, str(FAMILY), "--out", str(tmp_path)]
    )
    launched.append(proc)
    assert wait_for(lambda: len(list(tmp_path.glob("family-*.json"))) == 2, 120), "no families"
    families = [json.loads(p.read_text()) for p in tmp_path.glob("family-*.json")]
    pids = [pid for f in families for pid in (f["worker"], f["child"], *f["loaders"])]
    if "none" not in preload:
        pids += {f["parent"] for f in families}  # the zygote
    heartbeat = families[0]["heartbeat"]
    assert len(pids) >= 8 and all(alive(p) for p in pids) and os.path.exists(heartbeat)
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: it cleans up nothing itself
        proc.wait(timeout=10)
        # The guardian ends them at once (about 2 s on an idle machine); the bound here is
        # only what tells an end from a hang, whatever the load.
        gone = wait_for(lambda: not any(alive(p) for p in pids), STOP_BOUND)
        assert gone, [p for p in pids if alive(p)]
        assert wait_for(lambda: not os.path.exists(heartbeat), STOP_BOUND)
        assert leftovers(proc.pid) == []
    finally:
        kill_all(pids)


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(processes_of(p))
    return found


@pytest.mark.timeout(240)
def test_what_a_launcher_killed_with_everything_it_started_left_the_next_one_removes(
    launched, tmp_path
):
    """A cgroup's kill (Slurm's, a container's) or the OOM killer takes the guardian too (a
    kill of the launcher's process group alone spares it: its own session): the heartbeat
    tables (one per worker) and the memory-tier directory stay in shared memory until the next
    launcher of this user starts and removes them. (In a directory of the test's own: other
    tests' launchers sweep too.)"""
    out, shared = tmp_path / "first", tmp_path / "shm"
    out.mkdir()
    shared.mkdir()
    env = {"ELASTICRUN_SHM_DIR": str(shared)}
    args = ["--standalone", "--nproc-per-node", "2", str(FAMILY), "--out", str(out)]
    proc = start(args, env=env)
    launched.append(proc)
    assert wait_for(lambda: len(list(out.glob("family-*.json"))) == 2, 120), "no families"
    pids = tree(proc.pid)
    assert len(pids) >= 5, "the launcher, its guardian, its zygote and two workers"
    try:
        kill_all(pids)  # everything at once
        proc.wait(timeout=10)
        assert wait_for(lambda: not any(alive(p) for p in pids), 30), "its processes ended"
        left = glob.glob(f"{shared}/elasticrun-{proc.pid}-*")
        assert len(left) == 4, f"two tables, the memory tier and the fence stay behind: {left}"
        quick = tmp_path / "quick.py"
        quick.write_text("print('done')\n")
        code, _, err = finish(start(["--standalone", str(quick)], env=env))
        assert code == 0, err[-2000:]
        assert os.listdir(shared) == [], "the first's removed, the second's own at its end"
        assert f"removed 4 leftover(s) of elasticrun launchers that are gone from {shared}" in err
    finally:
        kill_all(pids)


# ---- a node lost abruptly ---------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_node_lost_abruptly_is_a_membership_change_not_a_failure(launched, tmp_path, etcd):
    rid = run_id()
    state = tmp_path / "steps"
    common = [
        "--nnodes",
        "1:2",
        "--max-restarts",
        "0",
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        etcd.endpoint,
        "--rdzv-id",
        rid,
        "--rdzv-conf",
        WHOLE,  # the first round has both nodes, however late the second starts
        "--monitor-interval",
        "0.05",
    ]
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = []
    for out in outs:
        out.mkdir()
        procs.append(
            start(
                [
                    *common,
                    str(COLLECTIVE),
                    "--out",
                    str(out),
                    "--state",
                    str(state),
                    "--steps",
                    "400",
                ]
            )
        )
    launched.extend(procs)
    assert wait_for(lambda: state.exists() and int(state.read_text() or 0) >= 20, 120)
    victim, victim_out = procs[1], outs[1]
    worker_pids = [int(p.read_text()) for p in victim_out.glob("*.pid")]
    os.killpg(victim.pid, signal.SIGKILL)  # the node's agent and its workers, abruptly
    kill_all(worker_pids)
    code, _, err = finish(procs[0], timeout=180)
    assert code == 0, err[-4000:]
    assert "left the job (their agent is gone)" in err
    assert int(state.read_text()) == 400, "the survivor finished the training"
    last = max(outs[0].glob("*.env.json"), key=lambda p: int(p.name.split("-")[0]))
    env = json.loads(last.read_text())
    assert env["WORLD_SIZE"] == "1" and env["TORCHELASTIC_RESTART_COUNT"] == "0"


# ---- a reused run id, different versions ------------------------------------------------------


@pytest.fixture(params=["etcd", "etcd-v2"])
def etcd_backend(request):
    server = request.getfixturevalue("etcd" if request.param == "etcd" else "etcd_v2")
    return request.param, server


@pytest.mark.timeout(120)
def test_the_run_id_of_a_finished_job_is_refused(tmp_path, etcd_backend):
    backend, server = etcd_backend
    rid = run_id()
    args = [
        "--nnodes",
        "1",
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        server.endpoint,
        "--rdzv-id",
        rid,
        "--rdzv-conf",
        FAST,
    ]
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    code, _, err = finish(start([*args, *worker_args(first)]))
    assert code == 0, err[-3000:]
    code, _, err = finish(start([*args, *worker_args(second)]))
    assert code == 1
    assert f"the run id '{rid}' names a job that has already ended (succeeded)" in err
    assert "give this job a new --rdzv-id" in err
    assert not list(second.glob("*.pid")), "nothing ran, and nothing claimed success"
    # What is left of the finished job expires: a lease of its own (v3), a TTL (v2).
    if backend == "etcd":
        from elastic_launch.rendezvous.etcdpb import rpc_pb2

        store = EtcdV3Store(server.endpoint, StoreAccess("test", retry_for=5))
        try:
            kvs, _ = store.range(f"/elasticrun/{rid}/")
            assert [kv.key for kv in kvs] == [f"/elasticrun/{rid}/state"]
            reply = store.client.call(
                "kv.Range", rpc_pb2.RangeRequest(key=f"/elasticrun/{rid}/state".encode())
            )
            ttl = store.client.call(
                "lease.LeaseTimeToLive",
                rpc_pb2.LeaseTimeToLiveRequest(ID=reply.kvs[0].lease),
            ).TTL
            assert 0 < ttl <= 600
        finally:
            store.close()
    else:
        import etcd as python_etcd

        host, port = server.endpoint.split(":")
        node = python_etcd.Client(host=host, port=int(port)).read(f"/elasticrun/{rid}/state")
        assert 0 < node.ttl <= 600


@pytest.mark.timeout(120)
def test_nodes_of_different_versions_are_refused_naming_both(launched, tmp_path, etcd):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import elastic_launch._version as v\nv.__version__ = '0.0.9'\n"
    )
    rid = run_id()
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", rid]
    current = start(["--nnodes", "2", *rdzv, *worker_args(tmp_path)])
    launched.append(current)
    from elastic_launch._version import __version__

    store = EtcdV3Store(etcd.endpoint, StoreAccess("test", retry_for=5))
    try:  # the current node created the job: its state names its release
        created = wait_for(lambda: store.get(f"/elasticrun/{rid}/state") is not None, 60)
    finally:
        store.close()
    assert created, "the first node did not create the job"
    code, _, err = finish(
        start(["--nnodes", "2", *rdzv, *worker_args(tmp_path)], env={"PYTHONPATH": str(shim)}),
        timeout=60,
    )
    assert code == 1
    assert f"the job runs elasticrun {__version__} and this node elasticrun 0.0.9" in err
    assert current.poll() is None, "the job goes on waiting for a node it can work with"
    code, _ = stop_with(current, signal.SIGTERM, within=STOP_BOUND)


# ---- nothing under /tmp ---------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_two_node_job_leaves_no_lock_or_directory(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id()]
    procs = [start(["--nnodes", "2", *rdzv, *worker_args(tmp_path, "--dist")]) for _ in range(2)]
    for proc in procs:
        code, _, err = finish(proc)
        assert code == 0, err[-3000:]
        assert leftovers(proc.pid) == []
    assert not rdzv_files() - _BEFORE
    assert Path(tmp_path).exists()
