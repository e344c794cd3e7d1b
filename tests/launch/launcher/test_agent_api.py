"""torch's agent API's own types, without running an agent: the conversion of elasticrun's
result into torch's ``RunResult``, and the handler that gives a spec's master address (the
real agents are in tests/compat)."""

from __future__ import annotations

import copy

import pytest
from elastic_launch import api
from elastic_launch.api import AgentState, FailureKind, WorkerFailure
from elastic_launch.launcher.agent_api import RunResult, WorkerState
from elastic_launch.launcher.rendezvous_api import MasterOverride
from elastic_launch.rendezvous.api import CloseReason, RendezvousHandler
from launch_fakes import FakeRendezvous


def failure(rank: int, kind: FailureKind, exit_code: int, at: int) -> WorkerFailure:
    return WorkerFailure(kind, rank, rank, 1000 + rank, 0, "h", at, 1.0, exit_code=exit_code)


def test_a_run_that_succeeded_gives_its_return_values_by_global_rank():
    ours = api.RunResult(AgentState.SUCCEEDED, {0: "a", 1: "b"})
    theirs = RunResult.of(ours)
    assert theirs.state == WorkerState.SUCCEEDED and not theirs.is_failed()
    assert theirs.return_values == {0: "a", 1: "b"} and theirs.failures == {}


def test_a_run_that_failed_gives_its_failed_processes_not_those_it_stopped():
    ours = api.RunResult(
        AgentState.FAILED,
        failures=[
            failure(1, FailureKind.STOPPED, -15, at=2),  # stopped after rank 0 failed
            failure(0, FailureKind.EXIT_CODE, 3, at=1),
        ],
    )
    theirs = RunResult.of(ours)
    assert theirs.is_failed() and theirs.return_values == {}
    assert list(theirs.failures) == [0], "the process that failed, not the one stopped"
    assert theirs.failures[0].exitcode == 3


def test_a_master_override_changes_the_rounds_address_and_nothing_else():
    inner = FakeRendezvous(nodes=2, max_restarts=1)
    handler = MasterOverride(inner, "10.0.0.7", None)
    assert isinstance(handler, RendezvousHandler)
    info = handler.next_rendezvous()
    assert info.master_addr == "10.0.0.7"
    assert info.master_port == 29500 + info.round, "no port given: the round's (the fake's)"
    # Everything else is the inner handler's, the state it changes included.
    assert handler.get_run_id() == "fake-run" and handler.spend_restart(1) is not None
    assert inner.spends == [1]
    assert copy.copy(handler).next_rendezvous().master_addr == "10.0.0.7"
    handler.set_closed(CloseReason.FAILED, "both nodes failed")
    assert handler.closed() == inner.closed() and inner.closed() is not None


def test_worker_state_is_running_as_torchs():
    """upstream: api_test.py's WorkerStateTest.test_is_running: HEALTHY and UNHEALTHY run."""
    running = {s for s in WorkerState if WorkerState.is_running(s)}
    assert running == {WorkerState.HEALTHY, WorkerState.UNHEALTHY}


def test_rendezvous_parameters_read_the_backends_configuration_as_torchs():
    """upstream: rendezvous/api_test.py's RendezvousParametersTest (get, get_as_bool,
    get_as_int, the bounds of min_nodes and max_nodes)."""
    from elastic_launch.launcher.agent_api import RendezvousParameters

    p = RendezvousParameters("c10d", "h:1", "r", 1, 2, a="yes", b="0", n="7", none=None)
    assert (p.get("a"), p.get("missing", 5)) == ("yes", 5)
    assert (p.get_as_bool("a"), p.get_as_bool("b"), p.get_as_bool("missing", True)) == (
        True,
        False,
        True,
    )
    assert (p.get_as_int("n"), p.get_as_int("missing")) == (7, None)
    with pytest.raises(ValueError, match="a='maybe' is not a valid boolean"):
        RendezvousParameters("c10d", "h:1", "r", 1, 1, a="maybe").get_as_bool("a")
    with pytest.raises(ValueError, match="1 <= min_nodes <= max_nodes"):
        RendezvousParameters("c10d", "h:1", "r", 3, 2)


def test_default_logs_specs_give_their_directory_as_torchs(tmp_path):
    from elastic_launch.launcher.agent_api import DefaultLogsSpecs

    assert DefaultLogsSpecs(log_dir=str(tmp_path)).root_log_dir == str(tmp_path)
    assert DefaultLogsSpecs().root_log_dir is None
