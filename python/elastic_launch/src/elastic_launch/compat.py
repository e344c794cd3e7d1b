"""torchrun compatibility, in one place: the ``PET_*`` defaults of the flags, the ``TORCHELASTIC_*``
and other torch variables the launcher reads, and the environment every worker gets.

Workers see what torchrun (torch 2.13) gives its workers, so that ``init_process_group()``,
``dist.is_torchelastic_launched()`` and ``@record`` work unchanged. One deliberate difference:
``TORCHELASTIC_USE_AGENT_STORE=False``, so rank 0 hosts the store on ``MASTER_PORT``, a fresh port
each attempt: a restarted group never meets the previous group's keys.

Kept lean: workers import this module.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from string import Template

from elastic_launch.api import ConfigError
from elastic_launch.errors import ERROR_FILE_ENV

PET_PREFIX = "PET_"
SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
LOG_LINE_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
FILE_TIMER_ENABLE_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
FILE_TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
PYTHON_EXEC_ENV = "PYTHON_EXEC"
OMP_ENV = "OMP_NUM_THREADS"
DEFAULT_SHUTDOWN_TIMEOUT = 30.0

OMP_WARNING = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
    "your system being overloaded, please further tune the variable for optimal performance in "
    "your application as needed. \n*****************************************"
)


#: Older names of PET_ variables that operators still set: Kubeflow's training operator before
#: 1.7 wrote elasticPolicy.nProcPerNode to PET_N_PROC_PER_NODE, which torchrun never read.
PET_ALIASES = {"PET_NPROC_PER_NODE": "PET_N_PROC_PER_NODE"}


def pet_name(dest: str) -> str:
    """The variable a flag's default comes from: ``nproc-per-node`` -> ``PET_NPROC_PER_NODE``
    (or the older name it is still set under, see :data:`PET_ALIASES`)."""
    name = PET_PREFIX + dest.replace("-", "_").upper()
    alias = PET_ALIASES.get(name)
    if name not in os.environ and alias is not None and alias in os.environ:
        return alias
    return name


def pet_value(dest: str) -> str | None:
    return os.environ.get(pet_name(dest))


def pet_flag(dest: str) -> bool | None:
    """A boolean flag's ``PET_*`` default (1/0/true/false/yes/no), None when unset. Set but
    empty is true: Kubeflow's training operator turns ``standalone`` on with
    ``PET_STANDALONE=""`` (torchrun fails on it)."""
    value = pet_value(dest)
    if value is None:
        return None
    text = value.strip().lower()
    if text not in ("", "1", "0", "true", "false", "yes", "no"):
        raise ConfigError(f"{pet_name(dest)}='{value}' is not a boolean: use 1 or 0")
    return text in ("", "1", "true", "yes")


def shutdown_timeout() -> float:
    """torchrun's default grace period: ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or 30 s."""
    raw = os.environ.get(SHUTDOWN_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_SHUTDOWN_TIMEOUT
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(
            f"{SHUTDOWN_TIMEOUT_ENV}='{raw}' is not a number of seconds; unset it or give "
            "seconds, for example 30"
        ) from None


def set_omp_default(nproc_per_node: int) -> bool:
    """torchrun sets ``OMP_NUM_THREADS=1`` (with a warning) when unset and several workers share
    the node; True if it did."""
    if OMP_ENV in os.environ or nproc_per_node <= 1:
        return False
    os.environ[OMP_ENV] = "1"
    return True


def python_executable(default: str) -> str:
    """The interpreter workers run: ``$PYTHON_EXEC`` as torchrun honours it."""
    return os.environ.get(PYTHON_EXEC_ENV, default)


def log_line_prefix(role: str, rank: int, local_rank: int, host: str) -> str:
    """The ``--tee`` console prefix: ``$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` or torchrun's."""
    template = os.environ.get(LOG_LINE_PREFIX_ENV)
    if template:
        return Template(template).safe_substitute(
            role_name=role, rank=rank, local_rank=local_rank, host=host
        )
    return f"[{host}:{role}{local_rank}]:"


@contextlib.contextmanager
def file_timer(run_dir: str, run_id: str, random_id: str) -> Iterator[dict[str, str]]:
    """torch's file timer (``TORCHELASTIC_ENABLE_FILE_TIMER=1``), for scripts that use
    ``expires()``; it is the only thing that makes the launcher import torch. Yields the
    workers' extra environment."""
    if os.environ.get(FILE_TIMER_ENABLE_ENV) != "1":
        yield {}
        return
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerServer

    default = os.path.join(run_dir, f"watchdog_timer_{random_id}")
    path = os.environ.get(FILE_TIMER_FILE_ENV) or default
    server = FileTimerServer(path, run_id, max_interval=0.1, daemon=True)
    server.start()
    try:
        yield {FILE_TIMER_FILE_ENV: path}
    finally:
        server.stop()


def substitute_local_rank(args: list[str], local_rank: int) -> list[str]:
    """torchrun's macro: ``${local_rank}`` (and ``$local_rank``) in any argument."""
    return [Template(a).safe_substitute(local_rank=str(local_rank)) for a in args]


@dataclass(frozen=True)
class WorkerPlace:
    """Where one worker stands in the job: torchrun's ranks and sizes. The role's rank and
    size default to the global ones (every node runs one role)."""

    local_rank: int
    rank: int
    group_rank: int
    local_world_size: int
    world_size: int
    group_world_size: int
    role: str = "default"
    role_rank: int | None = None
    role_world_size: int | None = None


@dataclass(frozen=True)
class GroupVars:
    """What every worker of the group shares: where its group meets, the restarts so far, the
    job's run id and the signals torchrun's workers handle."""

    master_addr: str
    master_port: int
    restarts: int
    max_restarts: int
    run_id: str
    signals_to_handle: str


def worker_env(
    place: WorkerPlace, shared: GroupVars, error_file: str, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables torchrun sets in each worker (`environ`: the launcher's own, whose NCCL
    setting is kept)."""
    env = os.environ if environ is None else environ
    p, r = place, shared
    return {
        "LOCAL_RANK": str(p.local_rank),
        "RANK": str(p.rank),
        "GROUP_RANK": str(p.group_rank),
        "ROLE_RANK": str(p.rank if p.role_rank is None else p.role_rank),
        "ROLE_NAME": p.role,
        "LOCAL_WORLD_SIZE": str(p.local_world_size),
        "WORLD_SIZE": str(p.world_size),
        "GROUP_WORLD_SIZE": str(p.group_world_size),
        "ROLE_WORLD_SIZE": str(p.world_size if p.role_world_size is None else p.role_world_size),
        "MASTER_ADDR": r.master_addr,
        "MASTER_PORT": str(r.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(r.restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(r.max_restarts),
        "TORCHELASTIC_RUN_ID": r.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        SIGNALS_TO_HANDLE_ENV: r.signals_to_handle,
        ERROR_FILE_ENV: error_file,
    }
