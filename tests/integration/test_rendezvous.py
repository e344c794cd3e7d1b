"""Several agents on loopback, one job: every elastic backend, scaling, lost nodes, spares,
a store that restarts, and the errors (real etcd, real gRPC, real workers)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from launcher_util import (
    alive,
    finish,
    free_port,
    health,
    kill_all,
    listening,
    start,
    wait_for,
    worker_args,
)

FAST = "heartbeat_timeout=2,last_call_timeout=1,join_timeout=60"
# For a round that must hold every node started: it freezes as soon as the most have joined,
# and waits for a late one (a slow start on a busy machine) rather than forming without it.
WHOLE = "heartbeat_timeout=2,last_call_timeout=60,join_timeout=60"


@pytest.fixture
def nodes(tmp_path: Path):
    """Starts agents ("nodes"), each with its own output directory; ends all they left."""
    started: list[tuple[object, Path]] = []

    def launch(
        name: str,
        rdzv: list[str],
        *worker: str,
        nnodes: str = "2",
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        out = tmp_path / name
        out.mkdir(exist_ok=True)
        proc = start(
            [
                "--nnodes",
                nnodes,
                "--nproc-per-node",
                "1",
                "--monitor-interval",
                "0.05",
                *rdzv,
                *(extra or []),
                *worker_args(out, *worker),
            ],
            env=env,
        )
        started.append((proc, out))
        return proc, out

    yield launch
    for proc, out in started:
        if proc.poll() is None:  # type: ignore[attr-defined]
            os.killpg(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
            proc.wait()  # type: ignore[attr-defined]
        kill_all([int(p.read_text()) for p in out.glob("*.pid") if p.read_text()])


def rdzv_args(backend: str, endpoint: str, conf: str = FAST) -> list[str]:
    run_id = f"test-{os.urandom(4).hex()}"
    return [
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        conf,
    ]


def envs(out: Path) -> list[dict[str, str]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.env.json"))]


def worlds(out: Path) -> list[int]:
    return [int(e["WORLD_SIZE"]) for e in envs(out)]


@pytest.fixture(params=["embedded", "etcd", "etcd-v2"])
def backend(request, tmp_path):
    """(name, --rdzv-* flags) of each elastic backend, with its store running."""
    if request.param == "embedded":
        yield "c10d", f"127.0.0.1:{free_port()}"
    else:
        server = request.getfixturevalue("etcd" if request.param == "etcd" else "etcd_v2")
        yield request.param, server.endpoint


@pytest.mark.timeout(180)
def test_two_node_job(nodes, backend):
    rdzv = rdzv_args(*backend)
    a = nodes("a", rdzv, "--dist")
    b = nodes("b", rdzv, "--dist")
    for proc, _ in (a, b):
        code, _, err = finish(proc)
        assert code == 0, err[-3000:]
    ranks = set()
    for _, out in (a, b):
        (d,) = [json.loads(p.read_text()) for p in out.glob("*.dist.json")]
        assert d["world"] == 2 and d["sum"] == 2.0
        ranks.add(d["rank"])
    assert ranks == {0, 1}


def test_nodes_of_several_roles_rank_their_workers_by_role(nodes):
    """ROLE_RANK and ROLE_WORLD_SIZE as torch's agent assigns them: within each role, in group
    rank order; RANK and GROUP_RANK over every node."""
    rdzv = rdzv_args("c10d", f"127.0.0.1:{free_port()}")
    jobs = [
        nodes(name, rdzv, "--dist", nnodes="3", extra=["--role", role, "--nproc-per-node", n])
        for name, role, n in (("t1", "trainer", "2"), ("ps", "ps", "1"), ("t2", "trainer", "2"))
    ]
    for proc, _ in jobs:
        code, _, err = finish(proc)
        assert code == 0, err[-3000:]
    seen = [e for _, out in jobs for e in envs(out)]
    assert sorted(int(e["RANK"]) for e in seen) == list(range(5))
    by_role: dict[str, list[dict[str, str]]] = {}
    for e in seen:
        by_role.setdefault(e["ROLE_NAME"], []).append(e)
    for role, workers in by_role.items():
        assert sorted(int(e["ROLE_RANK"]) for e in workers) == list(range(len(workers))), role
        assert {int(e["ROLE_WORLD_SIZE"]) for e in workers} == {len(workers)}, role
        # Role ranks follow the global ranks' order (group rank order, then local rank).
        workers.sort(key=lambda e: int(e["RANK"]))
        assert [int(e["ROLE_RANK"]) for e in workers] == list(range(len(workers))), role
    assert sorted(len(w) for w in by_role.values()) == [1, 4]
    for e in seen:
        local = int(e["LOCAL_RANK"])
        lower = [o for o in seen if int(o["GROUP_RANK"]) < int(e["GROUP_RANK"])]
        assert int(e["RANK"]) - local == len(lower), "RANK counts lower group ranks' workers"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("store", ["embedded", "etcd"])
def test_scale_up_while_training(nodes, store, request):
    endpoint = (
        f"127.0.0.1:{free_port()}"
        if store == "embedded"
        else request.getfixturevalue("etcd").endpoint
    )
    rdzv = rdzv_args("c10d" if store == "embedded" else "etcd", endpoint)
    a = nodes("a", rdzv, "--dist", "--hold-round", "1", nnodes="1:2")
    assert wait_for((a[1] / "0-0.dist.json").exists), "A did not start alone"
    b = nodes("b", rdzv, "--dist", "--hold-round", "1", nnodes="1:2")
    errors = []
    for proc, _ in (a, b):
        code, _, err = finish(proc)
        assert code == 0, err[-3000:]
        errors.append(err)
    assert worlds(a[1]) == [1, 2], "A ran alone, then with B"
    assert worlds(b[1]) == [2]
    assert "the job now has 2 node(s)" in errors[0]


@pytest.mark.timeout(180)
def test_scale_down_when_a_node_dies(nodes, etcd):
    rdzv = rdzv_args("etcd", etcd.endpoint, WHOLE)
    agents = [nodes(n, rdzv, "--dist", "--hold-round", "1", nnodes="2:3") for n in "abc"]
    assert wait_for(lambda: all(list(out.glob("*.dist.json")) for _, out in agents))
    victim, victim_out = agents[2]
    worker_pid = int(next(victim_out.glob("*.pid")).read_text())
    os.killpg(victim.pid, signal.SIGKILL)  # the agent dies; its worker dies with it
    assert wait_for(lambda: not alive(worker_pid), 10), "the dead agent's worker died with it"
    for proc, out in agents[:2]:
        code, _, err = finish(proc)
        assert code == 0, err[-3000:]
        assert worlds(out) == [3, 2], "trained with three, then with the two survivors"
        assert "left the job" in err


@pytest.mark.timeout(180)
def test_a_spare_takes_a_lost_nodes_place(nodes):
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv = rdzv_args("c10d", endpoint)
    a = nodes("a", rdzv, "--dist", "--hold-round", "1")
    assert wait_for(lambda: listening(endpoint)), "A hosts the rendezvous"
    b = nodes("b", rdzv, "--dist", "--hold-round", "1")
    assert wait_for(lambda: all(list(out.glob("*.dist.json")) for _, out in (a, b)))
    port = free_port()
    spare = nodes("spare", rdzv, "--dist", "--hold-round", "1", extra=["--health-port", str(port)])
    waiting = lambda: health(port).get("rendezvous", {}).get("phase") == "spare"  # noqa: E731
    assert wait_for(waiting, 60), "the spare never waited as one"
    assert not list(spare[1].glob("*.pid")), "a spare runs no worker"
    os.killpg(b[0].pid, signal.SIGKILL)
    for proc, _out in (a, spare):
        code, _, err = finish(proc)
        assert code == 0, err[-3000:]
        if proc is spare[0]:
            assert "this node waits as a spare" in err, "it says so (at once)"
    assert worlds(spare[1]) == [2]
    a_ranks = [int(e["GROUP_RANK"]) for e in envs(a[1])]
    assert a_ranks[0] == a_ranks[-1], "the survivor kept its rank"


@pytest.mark.timeout(120)
def test_losing_the_embedded_service_with_no_copy_is_a_clear_error(nodes):
    # The other node may not serve (is_host=false): no successor keeps a copy, and with the
    # host's node lost (none started in its place) the job cannot go on: it says so.
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv = rdzv_args("c10d", endpoint, "heartbeat_timeout=2,reconnect_timeout=2")
    host = nodes("host", rdzv, "--dist", "--hold-round", "1")
    assert wait_for(lambda: listening(endpoint))
    other_rdzv = [*rdzv[:-1], rdzv[-1] + ",is_host=false"]
    other = nodes("other", other_rdzv, "--dist", "--hold-round", "1")
    assert wait_for(lambda: list(other[1].glob("*.dist.json")))
    os.killpg(host[0].pid, signal.SIGKILL)
    code, _, err = finish(other[0], timeout=60)
    assert code == 1
    assert f"the rendezvous service at {endpoint} is unreachable" in err


@pytest.mark.timeout(120)
def test_the_host_outlives_the_nodes_still_running(nodes):
    # The hosting node finishes first; the other's last writes still need the service.
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv = rdzv_args("c10d", endpoint, "heartbeat_timeout=2,reconnect_timeout=2")
    host = nodes("host", rdzv, "--dist")
    assert wait_for(lambda: listening(endpoint))
    done = host[1].parent / "other-may-end"  # the other node's workers wait for it
    other = nodes("other", rdzv, "--dist", "--wait-file", str(done))
    assert wait_for(lambda: list(host[1].glob("*.dist.json")))
    pids = [int(p.read_text()) for p in host[1].glob("*.pid")]
    assert wait_for(lambda: not any(alive(pid) for pid in pids))  # the host's work is done
    assert other[0].poll() is None, "the other node still runs (its workers wait)"
    done.touch()
    # The other node's last writes need the service: it completes only if the host serves
    # until then, and the host ends after it.
    code, _, err = finish(other[0], timeout=60)
    assert code == 0, err[-3000:]
    code, _, err = finish(host[0], timeout=60)
    assert code == 0, err[-3000:]


@pytest.mark.timeout(180)
def test_etcd_restart_mid_job(nodes, etcd):
    rdzv = rdzv_args("etcd", etcd.endpoint, "heartbeat_timeout=10,last_call_timeout=1")
    a = nodes("a", rdzv, "--dist", "--sleep", "6")
    b = nodes("b", rdzv, "--dist", "--sleep", "6")
    assert wait_for(lambda: all(list(out.glob("*.dist.json")) for _, out in (a, b)))
    etcd.restart()
    for proc, out in (a, b):
        code, _, err = finish(proc)
        assert code == 0, err[-3000:]
        assert worlds(out) == [2], "the job went on without a restart"


@pytest.mark.timeout(120)
def test_min_never_reached_times_out(nodes):
    rdzv = rdzv_args("c10d", f"127.0.0.1:{free_port()}", "join_timeout=2,heartbeat_timeout=2")
    proc, out = nodes("a", rdzv)
    code, _, err = finish(proc)
    assert code == 1
    assert "timed out after 2 s: 1 node(s) joined, at least 2 needed" in err
    assert not list(out.glob("*.pid"))


@pytest.mark.timeout(120)
def test_etcd_v2_backend_against_etcd_without_v2(nodes, etcd):
    proc, _ = nodes("a", rdzv_args("etcd-v2", etcd.endpoint))
    code, _, err = finish(proc)
    assert code == 1
    assert "does not serve the etcd v2 API" in err
    assert "--rdzv-backend etcd" in err and "--enable-v2" in err


@pytest.mark.timeout(120)
def test_wrong_token_is_refused(nodes):
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = ["--rdzv-id", "tokens"]
    host = nodes(
        "host",
        [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            *run_id,
            "--rdzv-conf",
            "token=right,join_timeout=120",  # it outlives the intruder's refusal
        ],
    )
    assert wait_for(lambda: listening(endpoint), 30)
    intruder = nodes(
        "intruder",
        [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            *run_id,
            "--rdzv-conf",
            "join_timeout=3",
        ],
        env={"ELASTICRUN_RDZV_TOKEN": "wrong"},
    )
    code, _, err = finish(intruder[0])
    assert code == 1
    assert "invalid rendezvous token" in err
    assert host[0].poll() is None, "the host waits on: the intruder never joined"
    host[0].send_signal(signal.SIGTERM)  # its timing out is test_min_never_reached_times_out's
    code, _, err = finish(host[0])
    assert code == 128 + signal.SIGTERM, err[-3000:]


@pytest.mark.timeout(120)
def test_etcd_authentication(nodes, etcd, tmp_path):
    etcd.gateway("auth/user/add", {"name": "root", "password": "s3cret"})
    etcd.gateway("auth/role/add", {"name": "root"})
    etcd.gateway("auth/user/grant", {"user": "root", "role": "root"})
    etcd.gateway("auth/enable", {})
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    password.chmod(0o600)
    # Plain http: the password would cross the network in clear, so nothing is sent at all.
    clear = nodes(
        "clear", rdzv_args("etcd", etcd.endpoint, f"user=root,password_file={password}"), nnodes="1"
    )
    code, _, err = finish(clear[0])
    assert code == 2, err[-2000:]
    assert "the password would cross the network in clear" in err
    plain = "allow_insecure_auth=true"  # this test's etcd speaks http on loopback
    bad = nodes(
        "bad",
        rdzv_args("etcd", etcd.endpoint, f"user=root,{plain}"),
        nnodes="1",
        env={"ELASTICRUN_ETCD_PASSWORD": "nope"},
    )
    code, _, err = finish(bad[0])
    assert code == 1
    assert "refused user 'root'" in err and "invalid user ID or password" in err
    anonymous = nodes("anon", rdzv_args("etcd", etcd.endpoint, "join_timeout=5"), nnodes="1")
    code, _, err = finish(anonymous[0])
    assert code == 1
    assert "refused the request" in err
    good = nodes(
        "good",
        rdzv_args("etcd", etcd.endpoint, f"user=root,password_file={password},{plain}"),
        "--dist",
        nnodes="1",
    )
    code, _, err = finish(good[0])
    assert code == 0, err[-3000:]
    assert "puts a secret on the command line" not in err


@pytest.mark.timeout(120)
def test_unreachable_etcd_and_bad_endpoints(nodes):
    dead = f"127.0.0.1:{free_port()}"
    proc, _ = nodes("a", rdzv_args("etcd", dead, "join_timeout=2"))
    code, _, err = finish(proc)
    assert code == 1
    assert f"etcd at {dead} is unreachable" in err
    proc, _ = nodes("b", rdzv_args("etcd", "etcd0:port"))
    code, _, err = finish(proc)
    assert code == 2
    assert "--rdzv-endpoint 'etcd0:port': port 'port' is not a number" in err
    proc, _ = nodes("c", ["--rdzv-backend", "c10d"])
    code, _, err = finish(proc)
    assert code == 2
    assert "needs --rdzv-endpoint HOST:PORT" in err
    proc, _ = nodes("d", rdzv_args("etcd", dead, "heartbeat_timeout=1"))
    code, _, err = finish(proc)
    assert code == 2
    assert "heartbeat_timeout=1: the lease needs at least 2 seconds" in err


@pytest.mark.timeout(180)
def test_restart_budget_is_job_wide(nodes):
    rdzv = rdzv_args("c10d", f"127.0.0.1:{free_port()}")
    procs = [
        nodes(
            n,
            rdzv,
            "--fail-rank",
            "1",
            "--fail-until",
            "99",
            "--dist",
            extra=["--max-restarts", "1"],
        )
        for n in "ab"
    ]
    errs = []
    for proc, _ in procs:
        code, _, err = finish(proc)
        assert code == 1, err[-2000:]
        errs.append(err)
    text = "\n".join(errs)
    assert "restart 1 of 1" in text, text[-6000:]
    assert "restarts exhausted (1)" in text, text[-6000:]
    assert "restart 2 of" not in text, text[-6000:]


@pytest.mark.timeout(120)
def test_etcd_over_tls(nodes, etcd_tls):
    ca = etcd_tls.tls["ca"]
    good = nodes(
        "tls",
        rdzv_args("etcd", f"https://{etcd_tls.endpoint}", f"cacert={ca},join_timeout=30"),
        "--dist",
        nnodes="1",
    )
    code, _, err = finish(good[0])
    assert code == 0, err[-3000:]
    plain = nodes("plain", rdzv_args("etcd", etcd_tls.endpoint, "join_timeout=3"), nnodes="1")
    code, _, err = finish(plain[0])
    assert code == 1
    assert f"etcd at {etcd_tls.endpoint} is unreachable" in err


@pytest.mark.timeout(120)
def test_static_two_nodes(nodes):
    port = str(free_port())
    procs = [
        nodes(
            f"n{r}",
            [
                "--rdzv-backend",
                "static",
                "--node-rank",
                str(r),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
            ],
            "--dist",
        )
        for r in (0, 1)
    ]
    for proc, out in procs:
        code, _, err = finish(proc)
        assert code == 0, err[-3000:]
        (d,) = [json.loads(p.read_text()) for p in out.glob("*.dist.json")]
        assert d["world"] == 2 and d["sum"] == 2.0
