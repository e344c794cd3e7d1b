"""The train loop's coordinators and the team they meet in, without processes: the classic URL,
the launcher's environment, the step at which the ranks re-form, and what the agent is told."""

from __future__ import annotations

import json
import socket

import pytest
from elastic_launch.api import ConfigError, LaunchConfig
from elastic_launch.rendezvous.api import (
    CloseReason,
    JobClosed,
    RendezvousClosedError,
    RendezvousCounters,
    RendezvousHandler,
    RendezvousInfo,
    RestartReason,
    RunIdInUseError,
)
from elastic_launch.rendezvous.conf import RendezvousConf, parse_conf
from elastic_launch.rendezvous.team import (
    FATAL,
    LOOP_FILE_ENV,
    RUNNING,
    TEAM_ENV,
    WAITING,
    Team,
    read_loop_file,
    resolve,
    serve_team,
)
from elastic_launch.train_loop import (
    CoordinatorP2P,
    ElasticCoordinator,
    NonRetryableException,
    StopException,
    from_environment,
    parse_init_method,
)
from elastic_launch.train_loop.coordinator import REFORM_MARGIN, REFORM_NOTE, team_parameters

# ---- the classic URL ------------------------------------------------------------------------


def test_the_classic_url_names_backend_endpoint_run_and_range():
    p = parse_init_method("etcd://etcd0:2379/job7?min_workers=2&max_workers=4&last_call_timeout=5")
    assert (p.backend, p.endpoint, p.run_id) == ("etcd", "etcd0:2379", "job7")
    assert (p.min_nodes, p.max_nodes, p.local_world_size) == (2, 4, 1)
    assert p.config == {"last_call_timeout": "5"}
    assert parse_init_method("etcd-v2://h:1/r?min_workers=3").max_nodes == 3
    tls = parse_init_method("etcd://h:1/r?min_workers=1&protocol=https&cacert=/ca&timeout=9")
    assert tls.config == {"timeout": "9", "protocol": "https", "cacert": "/ca"}
    conf = parse_conf(tls.backend, tls.config)
    assert conf.join_timeout == 9.0, "torch's and 0.1's name for join_timeout"
    assert conf.last_call_timeout == RendezvousConf.defaults().last_call_timeout, "one default"
    plain = parse_init_method("embedded://h:1/r?min_workers=1&protocol=https")
    assert plain.config == {}, "TLS is etcd's: the embedded service takes none of it"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("tcp://h:1/r?min_workers=1", "the scheme must be one of"),
        ("etcd://h:1/?min_workers=1", "give HOST:PORT and a run id"),
        ("etcd:///r?min_workers=1", "give HOST:PORT and a run id"),
        ("etcd://h:1/r", "min_workers=N is required"),
        ("etcd://h:1/r?min_workers=0", "min_workers='0' must be a whole number"),
        ("etcd://h:1/r?min_workers=two", "min_workers='two'"),
        ("etcd://h:1/r?min_workers=3&max_workers=2", "max_workers=2 is less than min_workers=3"),
        ("etcd://h:1/r?min_workers=1&max_worker=2", "unknown parameter(s) max_worker"),
    ],
)
def test_a_bad_classic_url_is_a_clear_error(url, says):
    with pytest.raises(ConfigError) as e:
        parse_init_method(url)
    assert says in str(e.value) and url in str(e.value)


# ---- the launcher's environment ---------------------------------------------------------------


TEAM = Team("embedded", "127.0.0.1:5000", "job.workers", 4, 8, {"is_host": "false"})


def test_the_team_range_can_be_narrowed_by_the_script_within_the_job():
    p = team_parameters(TEAM)
    assert (p.backend, p.endpoint, p.run_id, p.min_nodes, p.max_nodes) == (
        "embedded",
        "127.0.0.1:5000",
        "job.workers",
        4,
        8,
    )
    assert team_parameters(TEAM, min_workers=2).min_nodes == 2
    with pytest.raises(ConfigError, match="the job runs between 4 and 8 workers"):
        team_parameters(TEAM, max_workers=9)
    with pytest.raises(ConfigError, match="cannot run in this job: no service"):
        team_parameters(Team("", "", "j.workers", 0, 0, unavailable="no service"))


def test_from_environment_outside_elasticrun_says_how_to_run(monkeypatch):
    monkeypatch.delenv(TEAM_ENV, raising=False)
    with pytest.raises(
        ConfigError, match="run the script with elasticrun, or build CoordinatorP2P"
    ):
        from_environment("gloo")
    monkeypatch.setenv(TEAM_ENV, "{not json")
    with pytest.raises(ConfigError, match="is not what elasticrun sets"):
        from_environment("gloo")


def test_the_classic_constructor_follows_elasticrun_not_its_url(monkeypatch, tmp_path):
    made = []
    monkeypatch.setattr(
        "elastic_launch.train_loop.coordinator.create_handler",
        lambda params: made.append(params) or FakeTeam(),
    )
    monkeypatch.setenv(TEAM_ENV, TEAM.to_env())
    monkeypatch.setenv(LOOP_FILE_ENV, str(tmp_path / "loop"))
    c = CoordinatorP2P("gloo", "etcd://elsewhere:2379/other?min_workers=1", 16, 60000)
    assert (made[0].endpoint, made[0].run_id, made[0].min_nodes) == (
        "127.0.0.1:5000",
        "job.workers",
        4,
    )
    assert c.timeout.total_seconds() == 60 and c.max_num_trainers == 16
    assert (tmp_path / "loop").read_text() == RUNNING, "the agent is told at once"
    monkeypatch.delenv(TEAM_ENV)
    CoordinatorP2P("gloo", "etcd://elsewhere:2379/other?min_workers=1", 16)
    assert (made[1].endpoint, made[1].run_id) == ("elsewhere:2379", "other")
    with pytest.raises(ConfigError, match="are milliseconds"):
        CoordinatorP2P("gloo", "etcd://h:1/r?min_workers=1", 4, process_group_timeout=0)


def test_max_num_trainers_may_be_an_int_like_str_as_0_1_took_it(monkeypatch):
    """The classic imagenet example reads it from the environment and passes the str."""
    monkeypatch.setattr(
        "elastic_launch.train_loop.coordinator.create_handler", lambda params: FakeTeam()
    )
    url = "etcd://h:1/r?min_workers=1"
    assert CoordinatorP2P("gloo", url, "4").max_num_trainers == 4
    assert CoordinatorP2P("gloo", url, " 8 ").max_num_trainers == 8
    for bad in ("four", "0", 2.5, True):
        with pytest.raises(ConfigError, match=f"max_num_trainers={bad!r}: give a whole number"):
            CoordinatorP2P("gloo", url, bad)


# ---- rounds, growth, the end ----------------------------------------------------------------


class FakeTeam(RendezvousHandler):
    """A workers' rendezvous whose answers the test sets."""

    def __init__(self) -> None:
        self.waiting = 0
        self.notes: dict[str, str] = {}
        self.posted: list[tuple[str, str]] = []
        self.raise_next: BaseException | None = None
        self.calls: list[tuple[RestartReason, str]] = []
        self._closed: JobClosed | None = None

    def get_backend(self) -> str:
        return "fake"

    def get_run_id(self) -> str:
        return "fake"

    def next_rendezvous(self, reason=RestartReason.START, *, cancel=None, failure=""):
        self.calls.append((reason, failure))
        if self.raise_next is not None:
            raise self.raise_next
        return RendezvousInfo(1, 0, 1, 1, 0, "127.0.0.1", 0)

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def post_note(self, name: str, value: str) -> None:
        self.posted.append((name, value))

    def note(self, name: str) -> str | None:
        return self.notes.get(name)

    def mark_done(self) -> bool:
        return True

    def set_closed(self, reason: CloseReason, detail: str = "") -> None:
        self._closed = JobClosed(reason, detail)

    def closed(self) -> JobClosed | None:
        return self._closed

    def counters(self) -> RendezvousCounters:
        return RendezvousCounters()


def coordinator(rank: int, world: int, team: FakeTeam, **kw) -> ElasticCoordinator:
    """A coordinator in a formed round, whose steps take one second each."""
    c = ElasticCoordinator(team, **kw)
    c.rank, c.world_size = rank, world
    ticks = iter(range(1_000_000))
    c._clock = lambda: float(next(ticks))
    return c


def test_rank_zero_sets_the_step_ahead_when_a_worker_waits_and_everyone_leaves_there():
    team = FakeTeam()
    lead, other = coordinator(0, 2, team), coordinator(1, 2, team)
    assert [lead.should_rendezvous(None), other.should_rendezvous(None)] == [False, False]
    team.waiting = 1
    assert lead.should_rendezvous(None) is False  # step 2: decides re-forming after step 4
    assert team.posted == [(REFORM_NOTE, str(2 + REFORM_MARGIN))]
    assert other.should_rendezvous(None) is False, "no note seen yet"
    team.notes[REFORM_NOTE] = team.posted[0][1]
    assert [lead.should_rendezvous(None), other.should_rendezvous(None)] == [False, False]
    assert [lead.should_rendezvous(None), other.should_rendezvous(None)] == [True, True]
    assert len(team.posted) == 1, "decided once"


def test_a_full_world_does_not_grow():
    team = FakeTeam()
    team.waiting = 3
    lead = coordinator(0, 4, team, max_num_trainers=4)
    assert not any(lead.should_rendezvous(None) for _ in range(5)) and team.posted == []


def test_a_retryable_failure_is_told_to_the_next_round_and_a_fatal_one_to_the_agent(tmp_path):
    team, loop = FakeTeam(), tmp_path / "loop"
    c = coordinator(1, 2, team, loop_file=str(loop))
    assert loop.read_text() == RUNNING
    c.on_error(RuntimeError("Connection reset by peer"))
    team.raise_next = RendezvousClosedError("done", JobClosed(CloseReason.SUCCEEDED))
    with pytest.raises(StopException):
        c.rendezvous_barrier()
    assert team.calls[-1] == (
        RestartReason.FAILURE,
        "rank 1: RuntimeError: Connection reset by peer",
    )
    assert c.should_stop_training() and loop.read_text() == WAITING, "it joined no round"
    c.on_error(ValueError("a bug"))
    assert loop.read_text() == FATAL, "the agent must not replace it"


def test_the_loop_file_says_waiting_while_the_worker_waits_for_a_round(tmp_path):
    """What the agent tells hot spares by: waiting in the rendezvous, running once a round
    took the worker; the failure budget travels with both."""
    team, loop = FakeTeam(), tmp_path / "loop"
    c = ElasticCoordinator(team, loop_file=str(loop))
    c.set_failure_budget(5)
    seen = []
    answer = team.next_rendezvous

    def next_rendezvous(*args, **kw):
        seen.append(loop.read_text())
        return answer(*args, **kw)

    team.next_rendezvous = next_rendezvous
    try:
        c.rendezvous_barrier()
        assert seen == ["waiting 5"] and loop.read_text() == "running 5"
        assert read_loop_file(loop.read_text()) == (RUNNING, 5)
    finally:
        c.close()


def test_the_loops_failure_budget_reaches_the_agent_through_the_loop_file(tmp_path):
    """The agent replaces up to the loop's max_failures workers: the loop tells it."""
    from elastic_launch.agent.worker import Worker
    from elastic_launch.train_loop import State, train

    class Nothing(State):
        def sync(self, world_size, rank):
            pass

        def capture_snapshot(self):
            return None

        def apply_snapshot(self, capture_snapshot):
            pass

    team, loop = FakeTeam(), tmp_path / "loop"
    c = coordinator(0, 1, team, loop_file=str(loop))
    team.raise_next = RendezvousClosedError("done", JobClosed(CloseReason.SUCCEEDED))
    train(c, lambda state: state, Nothing(), max_failures=7)
    assert loop.read_text() == "waiting 7", "the job closed before a round took it"
    worker = Worker.__new__(Worker)
    worker.loop_file = str(loop)
    assert worker.loop_budget() == 7 and worker.train_loop().value == "waiting"
    c.on_error(ValueError("a bug"))
    assert worker.loop_budget() == 0 and worker.train_loop().value == "fatal"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("running", ("running", 0)),
        ("running 12\n", ("running", 12)),
        ("fatal", ("fatal", 0)),
        ("running 99999999999", ("running", 0)),  # out of range: not said
        ("running \u00b2", ("running", 0)),  # a Unicode digit is no number
        ("running -3", ("running", 0)),
        ("waiting 4", ("waiting", 4)),
        ("walking 3", ("", 0)),
        ("", ("", 0)),
    ],
)
def test_what_a_worker_writes_to_its_loop_file_is_read_defensively(text, said):

    assert read_loop_file(text) == said


def test_a_job_that_failed_ends_the_worker_as_non_retryable(tmp_path):
    team = FakeTeam()
    c = coordinator(0, 2, team, loop_file=str(tmp_path / "loop"))
    team.raise_next = RendezvousClosedError("over", JobClosed(CloseReason.FAILED, "rank 3 died"))
    with pytest.raises(NonRetryableException, match="over"):
        c.rendezvous_barrier()
    assert (tmp_path / "loop").read_text() == FATAL


def test_a_replacement_that_comes_after_the_end_stops_cleanly(tmp_path):
    team = FakeTeam()
    team._closed = JobClosed(CloseReason.SUCCEEDED)
    team.raise_next = RunIdInUseError("the run id names a job that has already ended")
    late = coordinator(-1, 0, team, loop_file=str(tmp_path / "loop"))
    with pytest.raises(StopException, match="finished before this worker could join"):
        late.rendezvous_barrier()
    standalone = coordinator(-1, 0, team)  # not under elasticrun: a reused run id
    with pytest.raises(NonRetryableException, match="already ended"):
        standalone.rendezvous_barrier()


# ---- the team a launch serves -----------------------------------------------------------------


def test_one_node_serves_its_workers_a_rendezvous_when_one_runs_the_loop(tmp_path):
    config = LaunchConfig(nproc_per_node=3, rdzv_backend="embedded", rdzv_endpoint="localhost:0")
    with serve_team(config, "r1", str(tmp_path)) as service:
        team = Team.from_env(service.team.to_env())
        assert (team.backend, team.run_id, team.min_workers, team.max_workers) == (
            "embedded",
            "r1.workers",
            3,
            3,
        )
        assert team.endpoint == "" and team.file and service.pending, "nothing started yet"
        assert "the agent did not start" in resolve(team, timeout=0.05).unavailable
        service.ensure()
        found = resolve(team)
        host, port = found.endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and found.config["is_host"] == "false"
        assert found.config["token"] and not service.pending
        socket.create_connection((host, int(port)), timeout=1).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=1).close()


def test_several_nodes_share_the_jobs_own_service_and_static_has_none():
    etcd = LaunchConfig(
        min_nodes=2,
        max_nodes=4,
        nproc_per_node=2,
        rdzv_backend="etcd",
        rdzv_endpoint="etcd0:2379",
        rdzv_configs={"join_timeout": "60", "protocol": "https"},
        min_workers=3,
    )
    with serve_team(etcd, "j") as service:
        team = service.team
        assert (team.backend, team.endpoint, team.min_workers, team.max_workers) == (
            "etcd",
            "etcd0:2379",
            3,
            8,
        )
        assert team.config == {"protocol": "https", "last_call_timeout": "1"}
        assert not service.pending and resolve(team) is team
    embedded = LaunchConfig(max_nodes=2, rdzv_backend="c10d", rdzv_endpoint="n0:29400")
    with serve_team(embedded, "j") as service:
        assert service.team.backend == "embedded" and service.team.config["is_host"] == "false"
    static = LaunchConfig(min_nodes=2, max_nodes=2, rdzv_backend="static")
    with serve_team(static, "j") as service:
        assert "run with --rdzv-backend embedded or etcd" in service.team.unavailable
    with serve_team(LaunchConfig(), "j", can_serve=False) as service:
        assert "start_method='fork'" in service.team.unavailable
    assert json.loads(service.team.to_env())["unavailable"] == service.team.unavailable


def test_a_rank_that_learned_of_the_re_formation_late_is_not_counted_as_a_failure():
    team = FakeTeam()
    late = coordinator(1, 2, team)
    for _ in range(3):
        late.should_rendezvous(None)
    team.notes[REFORM_NOTE] = "3"  # rank 0 left after step 3; this rank is in step 4
    error = RuntimeError("Connection closed by peer")
    assert late.expected_failure(error)
    late.on_error(error)
    team.raise_next = RendezvousClosedError("done", JobClosed(CloseReason.SUCCEEDED))
    with pytest.raises(StopException):
        late.rendezvous_barrier()
    assert team.calls[-1] == (RestartReason.MEMBERSHIP, ""), "a re-formation, not a failure"
    early = coordinator(1, 2, FakeTeam())
    assert not early.expected_failure(error), "no plan: a failure"


def test_fast_steps_set_the_re_formation_far_enough_ahead_for_the_note():
    team = FakeTeam()
    lead = coordinator(0, 2, team)
    ticks = iter(range(1_000_000))
    lead._clock = lambda: next(ticks) / 1000  # 1 ms steps: the note needs 0.1 s of them
    lead.should_rendezvous(None)
    lead.should_rendezvous(None)
    team.waiting = 1
    lead.should_rendezvous(None)
    assert team.posted == [(REFORM_NOTE, str(3 + 100))]


def test_a_note_that_cannot_be_posted_is_tried_again_at_the_next_step():
    team = FakeTeam()
    failures = iter([True, False])

    def post(name: str, value: str) -> None:
        if next(failures):
            raise ConnectionError("the store is away")
        team.posted.append((name, value))

    team.post_note = post  # type: ignore[method-assign]
    team.waiting = 1
    lead = coordinator(0, 2, team)
    assert lead.should_rendezvous(None) is False and lead._reform_at is None
    lead.should_rendezvous(None)
    assert team.posted == [(REFORM_NOTE, str(2 + REFORM_MARGIN))]


def test_a_worker_that_cannot_take_part_tells_the_agent_it_failed_for_good(monkeypatch, tmp_path):
    unavailable = Team("", "", "j.workers", 0, 0, unavailable="no service the workers share")
    monkeypatch.setenv(TEAM_ENV, unavailable.to_env())
    monkeypatch.setenv(LOOP_FILE_ENV, str(tmp_path / "loop"))
    with pytest.raises(ConfigError, match="no service the workers share"):
        CoordinatorP2P("gloo", "etcd://h:1/r?min_workers=1", 4)
    assert (tmp_path / "loop").read_text() == FATAL, "not replaced again and again"


def test_a_failed_init_process_group_does_not_rename_the_next_group():
    """torch counts groups to name them and the count rises even when init_process_group
    fails; a rank whose init failed (a peer gone mid-handshake) must name its next group as
    its peers do, or every later init waits for keys nobody writes."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    c = coordinator(0, 2, FakeTeam())
    short = datetime.timedelta(milliseconds=200)
    with pytest.raises(RuntimeError):  # rank 1 never comes
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2, timeout=short)
    assert not dist.is_initialized()
    c._destroy_process_group()
    c.store = dist.HashStore()
    c.rank, c.world_size, c.timeout = 0, 1, short
    c.init_process_group()
    try:
        assert distributed_c10d._get_default_group().group_name == "0", "as its peers name it"
    finally:
        c._destroy_process_group()
        assert not dist.is_initialized()


def test_on_nccl_a_broken_round_aborts_the_communicators_and_a_new_round_stops_that(monkeypatch):
    """NCCL does not see a dead peer's closed connection as gloo does: a collective may block
    for good. Once the rendezvous says the round is broken, the communicators are aborted
    (torch's _abort_process_group), so that the collective raises and the loop re-forms; the
    next round's teardown stops the watch, and a broken round is aborted once."""
    import threading

    import torch.distributed.distributed_c10d as c10d

    aborted = threading.Semaphore(0)
    monkeypatch.setattr(c10d, "_abort_process_group", lambda *a: aborted.release(), raising=False)
    broken = threading.Event()
    team = FakeTeam()
    team.round_broken = broken.is_set  # type: ignore[method-assign]
    c = coordinator(0, 2, team, backend="nccl")
    c._watch_for_abort()
    assert not aborted.acquire(timeout=0.2), "no abort while the round holds"
    broken.set()
    assert aborted.acquire(timeout=30), "the broken round's communicators were not aborted"
    assert not aborted.acquire(timeout=0.2), "aborted once"
    broken.clear()
    c._watch_for_abort()  # the next round
    c._destroy_process_group()  # and its end: the watch stops
    broken.set()
    assert not aborted.acquire(timeout=0.2), "a round already torn down is not aborted"
