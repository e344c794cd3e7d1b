"""Running a job: the Python API behind ``elasticrun`` (:func:`launch`, :func:`run`).

:func:`run` is the one owner of everything a launch opens. Each resource is entered into an exit
stack the moment it exists, so that whichever step fails (a busy port, an unwritable directory, a
rendezvous error, a zygote that cannot start) and however the run ends (success, failure, a
signal, an exception), everything opened so far is released in reverse order: servers closed,
workers and the zygote ended, the rendezvous left, the heartbeat file and temporary directories
removed. Should the launcher itself be SIGKILLed, its guardian does the same.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from elastic_launch import compat
from elastic_launch.agent import fencing, learning, shm
from elastic_launch.agent.agent import ElasticAgent
from elastic_launch.agent.context import NodeContext
from elastic_launch.agent.events import Events
from elastic_launch.agent.health import HealthServer
from elastic_launch.agent.memory_tier import memory_tier
from elastic_launch.agent.summary import format_summary
from elastic_launch.agent.watch import watch
from elastic_launch.agent.workers import WorkerGroup
from elastic_launch.api import (
    AgentState,
    LaunchConfig,
    LauncherStopped,
    RunResult,
    WorkerFailedError,
)
from elastic_launch.cancel import CancelToken, SignalRelay
from elastic_launch.launcher.config import plan_launch, warm_spares
from elastic_launch.launcher.parse import random_id
from elastic_launch.processes import preload
from elastic_launch.processes.cgroup import Container
from elastic_launch.processes.entrypoint import Entrypoint
from elastic_launch.processes.guardian import Guardian
from elastic_launch.processes.logs import LogLayout
from elastic_launch.processes.spawn import FunctionFork, spawner_for
from elastic_launch.rendezvous import create_handler
from elastic_launch.rendezvous.api import RendezvousHandler
from elastic_launch.rendezvous.team import TEAM_ENV, serve_team

logger = logging.getLogger(__name__)


def run(
    config: LaunchConfig,
    entrypoint: Entrypoint,
    on_agent: Callable[[ElasticAgent], Any] | None = None,
    rdzv: RendezvousHandler | None = None,
) -> RunResult:
    """Run `entrypoint` on this node under `config` until the job succeeds, fails or is
    stopped. Raises ConfigError for bad settings before starting anything, and the rendezvous'
    errors (LaunchError) when the job cannot be formed. `on_agent` sees the agent before it
    runs (tests, embedding). `rdzv`, a handler the caller made (the agent API's spec), is used
    instead of one built from `config`, and the caller shuts it down, as with torch's agent."""
    plan = plan_launch(config, entrypoint, own_rendezvous=rdzv is None)
    c, run_id = plan.config, plan.run_id
    with contextlib.ExitStack() as stack:
        cancel = CancelToken()
        stack.enter_context(SignalRelay(cancel, plan.signals))
        guardian = stack.enter_context(Guardian())
        layout = stack.enter_context(LogLayout(c.log_dir, run_id, plan.logs_requested))
        if layout.temporary and not layout.kept:
            guardian.remove_path(layout.temporary)
        events = stack.enter_context(
            Events.open(run_id, c.event_log_handler, c.events_file, plan.metrics)
        )
        shm.sweep()  # what launchers SIGKILLed with their guardian left
        container = contained(stack, guardian)
        slots = c.nproc_per_node + c.hot_spares
        node = stack.enter_context(watch(slots, c.gpu_check_interval, guardian))
        memory_env = stack.enter_context(memory_tier(guardian, c.memory_checkpoint_limit))
        context = NodeContext(c, run_id, entrypoint, layout)
        chosen = preload.plan(c.preload, entrypoint, learning.kept_path(context))
        spares = warm_spares(c)
        spawner = spawner_for(chosen, c.start_method, entrypoint, cancel, guardian, spares)
        stack.callback(spawner.close)
        timer_env = stack.enter_context(compat.file_timer(layout.run_dir, run_id, random_id()))
        can_serve = not isinstance(spawner, FunctionFork)
        team = stack.enter_context(serve_team(c, run_id, layout.run_dir, can_serve=can_serve))
        if rdzv is None:
            rdzv = create_handler(plan.rendezvous)
            stack.callback(rdzv.shutdown, cancel)
        fence = stack.enter_context(fencing.fence(guardian))
        env = {**timer_env, **memory_env, TEAM_ENV: team.team.to_env(), **plan.worker_env}
        env.update({**container.env(), **fence.env()})
        group = stack.enter_context(WorkerGroup(context, node, spawner, guardian, env, fence))
        fence.start(fencing.held_until_of(rdzv), fencing.waker(group))
        agent = ElasticAgent(group, rdzv, events, cancel, team)
        if plan.health is not None:
            stack.enter_context(HealthServer(*plan.health, agent.health))
        if on_agent is not None:
            on_agent(agent)
        return agent.run()
    raise AssertionError("unreachable")  # pragma: no cover - the with block returns


def contained(stack: contextlib.ExitStack, guardian: Guardian) -> Container:
    """The workers' cgroup (or why there is none): what it holds is killed when the launch
    ends (after the workers are stopped: the callback is registered first), and by the
    guardian should the launcher be SIGKILLed."""
    container = Container.make()
    (logger.info if container.path else logger.debug)("%s", container.describe())
    if container.path:
        guardian.kill_cgroup(container.path)
    stack.callback(container.kill)
    return container


def launch(
    config: LaunchConfig, entrypoint: str | Callable[..., Any], *args: Any
) -> dict[int, Any]:
    """Launch `entrypoint` on ``config.nproc_per_node`` workers, like torch's ``elastic_launch``.

    `entrypoint` is a function (called with `args` in each worker; it must be importable by
    reference unless ``start_method='fork'``) or a program (``sys.executable`` with a script,
    a ``.py`` path, or any binary) run with `args`. Returns the return values by global rank
    (None for programs). Raises WorkerFailedError when the job fails and LauncherStopped when a
    signal stopped it.
    """
    ep = Entrypoint.for_launch(entrypoint, args)
    result = run(config, ep)
    if result.state == AgentState.SUCCEEDED:
        return result.return_values
    if result.state == AgentState.STOPPED:
        raise LauncherStopped(result.signal or 0)
    raise WorkerFailedError(format_summary(ep.name, result), result)
