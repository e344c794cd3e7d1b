"""torch's SimpleElasticAgent as the base of an agent of one's own, on elasticrun's rendezvous:
each test follows one of torch 2.13's ``agent/server/test/api_test.py`` SimpleElasticAgentTest
tests with a scripted subclass (upstream's ``TestAgent``) and a fake rendezvous."""

from __future__ import annotations

import signal
from typing import Any

import pytest
from elastic_launch import api
from elastic_launch.launcher.agent_api import (
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from elastic_launch.rendezvous.api import CloseReason, RendezvousClosedError, RestartReason
from launch_fakes import FakeRendezvous


class ScriptedAgent(SimpleElasticAgent):
    """Workers that report the states of `script`, one per monitoring pass (the last one
    repeats); records what the base class asked of it."""

    def __init__(self, spec: WorkerSpec, script: list[Any]) -> None:
        super().__init__(spec, exit_barrier_timeout=1)
        self.script = list(script)
        self.started: list[list[tuple[int, int, int]]] = []
        self.stopped: list[bool] = []
        self.shutdowns: list[tuple[signal.Signals, bool]] = []

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.started.append(
            [(w.local_rank, w.global_rank, w.role_rank) for w in worker_group.workers]
        )
        return {
            w.local_rank: f"pid-{len(self.started)}-{w.local_rank}" for w in worker_group.workers
        }

    def _stop_workers(self, worker_group: WorkerGroup, is_restart: bool = False) -> None:
        self.stopped.append(is_restart)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, BaseException):
            raise step
        if isinstance(step, FakeRendezvous):  # a node arrives while this one is healthy
            step.changed = True
            return RunResult(WorkerState.HEALTHY)
        return RunResult(step, {0: "out"} if step == WorkerState.SUCCEEDED else {})

    def _shutdown(
        self, death_sig: signal.Signals = signal.SIGTERM, is_restart: bool = False
    ) -> None:
        self.shutdowns.append((death_sig, is_restart))


def agent(
    script: list[Any], max_restarts: int = 0, nodes: int = 2
) -> tuple[ScriptedAgent, FakeRendezvous]:
    rdzv = FakeRendezvous(nodes=nodes, group_rank=1, lws=2, max_restarts=max_restarts)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        rdzv_handler=rdzv,
        entrypoint="/bin/true",
        max_restarts=max_restarts,
        monitor_interval=0.001,
    )
    return ScriptedAgent(spec, script), rdzv


def test_run_success_starts_once_ranks_the_workers_and_passes_the_exit_barrier():
    """upstream: test_run_happy_path, test_rendezvous (ranks from the round), test_get_ranks"""
    a, rdzv = agent([WorkerState.HEALTHY, WorkerState.SUCCEEDED])
    result = a.run()
    assert result.state == WorkerState.SUCCEEDED and result.return_values == {0: "out"}
    assert a.started == [[(0, 2, 2), (1, 3, 3)]], "group rank 1 of 2 nodes of 2 workers"
    group = a.get_worker_group()
    assert (group.group_rank, group.group_world_size, group.master_addr) == (1, 2, "10.0.0.1")
    assert [w.id for w in group.workers] == ["pid-1-0", "pid-1-1"]
    assert [w.world_size for w in group.workers] == [4, 4]
    assert rdzv.done == 1, "the exit barrier"
    assert a.shutdowns == [(signal.SIGTERM, False)] and a._total_execution_time >= 0


def test_run_failure_restarts_within_the_budget_then_fails():
    """upstream: test_run_max_retries_exceed, test_run_failure (_remaining_restarts)"""
    a, rdzv = agent([WorkerState.FAILED], max_restarts=2)
    result = a.run()
    assert result.state == WorkerState.FAILED and a.get_worker_group().state == WorkerState.FAILED
    assert a._remaining_restarts == 0
    assert len(a.started) == 3 and a.stopped == [True, True, False]
    assert [r for r, _ in rdzv.calls] == [RestartReason.START, *[RestartReason.FAILURE] * 2]
    assert rdzv.closed() is not None and rdzv.done == 0
    assert a.shutdowns == [(signal.SIGTERM, False)]


def test_run_unhealthy_counts_as_a_failure():
    """upstream: test_run_unhealthy (UNHEALTHY restarts as FAILED does)"""
    a, _ = agent([WorkerState.UNHEALTHY, WorkerState.SUCCEEDED], max_restarts=1)
    assert a.run().state == WorkerState.SUCCEEDED
    assert a._remaining_restarts == 0 and len(a.started) == 2


def test_run_membership_change_restarts_without_spending_a_restart():
    """upstream: test_run_membership_change (num_nodes_waiting > 0: a new round)"""
    a, rdzv = agent([WorkerState.HEALTHY], max_restarts=0)
    a.script = [WorkerState.HEALTHY, rdzv, WorkerState.SUCCEEDED]
    assert a.run().state == WorkerState.SUCCEEDED
    assert [r for r, _ in rdzv.calls] == [RestartReason.START, RestartReason.MEMBERSHIP]
    assert a._remaining_restarts == 0 and a.stopped == [True]


def test_run_unknown_state_is_an_error_and_still_shuts_down():
    """upstream: test_run_unknown_state"""
    a, _ = agent([WorkerState.UNKNOWN])
    with pytest.raises(RuntimeError, match="UNKNOWN state"):
        a.run()
    assert a.shutdowns == [(signal.SIGTERM, False)]


def test_a_signal_shuts_down_with_its_number_and_is_raised():
    """upstream: test_agent_process_signal_exception (SignalException: _shutdown(sigval))"""
    a, _ = agent([WorkerState.HEALTHY, api.LauncherStopped(signal.SIGINT)])
    with pytest.raises(api.LauncherStopped):
        a.run()
    assert a.shutdowns == [(signal.SIGINT, False)]


def test_a_closed_rendezvous_ends_the_run_with_its_error():
    """upstream: test_rendezvous_closed (the rendezvous' error reaches the caller)"""
    a, rdzv = agent([WorkerState.SUCCEEDED])
    rdzv.set_closed(CloseReason.FAILED, "closed elsewhere")
    with pytest.raises(RendezvousClosedError):
        a.run()
    assert a.started == [] and a.shutdowns == [(signal.SIGTERM, False)]


def test_the_subclass_must_implement_the_worker_life():
    with pytest.raises(TypeError, match="abstract"):
        SimpleElasticAgent(agent([WorkerState.SUCCEEDED])[0].get_worker_group().spec)  # type: ignore[abstract]
