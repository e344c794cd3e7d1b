"""torchrun compatibility: PET_* defaults, TORCHELASTIC_* variables, the worker environment."""

from __future__ import annotations

import os

import pytest
from elastic_launch import compat
from elastic_launch.api import ConfigError


def test_pet_names_and_booleans(monkeypatch):
    assert compat.pet_name("nproc-per-node") == "PET_NPROC_PER_NODE"
    monkeypatch.setenv("PET_STANDALONE", "yes")
    assert compat.pet_flag("standalone") is True
    monkeypatch.setenv("PET_STANDALONE", "maybe")
    with pytest.raises(ConfigError, match="PET_STANDALONE='maybe' is not a boolean"):
        compat.pet_flag("standalone")
    assert compat.pet_flag("module") is None


def test_what_kubeflows_training_operator_sets(monkeypatch):
    # PET_STANDALONE="" turns standalone on (the operator's elasticPolicy.standalone).
    monkeypatch.setenv("PET_STANDALONE", "")
    assert compat.pet_flag("standalone") is True
    # Before 1.7 it wrote nProcPerNode to PET_N_PROC_PER_NODE; the right name wins.
    monkeypatch.delenv("PET_NPROC_PER_NODE", raising=False)
    monkeypatch.setenv("PET_N_PROC_PER_NODE", "3")
    assert compat.pet_value("nproc-per-node") == "3"
    assert compat.pet_name("nproc-per-node") == "PET_N_PROC_PER_NODE"
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    assert compat.pet_value("nproc-per-node") == "2"
    assert compat.pet_name("nproc-per-node") == "PET_NPROC_PER_NODE"


def test_shutdown_timeout_from_torchs_variable(monkeypatch):
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert compat.shutdown_timeout() == 30.0
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7.5")
    assert compat.shutdown_timeout() == 7.5
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon'"):
        compat.shutdown_timeout()


def test_omp_default_only_when_unset_and_several_workers(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert not compat.set_omp_default(1)
    assert compat.set_omp_default(2) and os.environ["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert not compat.set_omp_default(4) and os.environ["OMP_NUM_THREADS"] == "8"


def test_log_line_prefix_and_local_rank_macro(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", raising=False)
    assert compat.log_line_prefix("trainer", 5, 1, "h") == "[h:trainer1]:"
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "${role_name}-${rank}@${host}|")
    assert compat.log_line_prefix("trainer", 5, 1, "h") == "trainer-5@h|"
    args = ["--gpu", "${local_rank}", "$local_rank", "$other"]
    assert compat.substitute_local_rank(args, 3) == ["--gpu", "3", "3", "$other"]


def test_the_worker_environment_is_torchruns():
    env = compat.worker_env(
        compat.WorkerPlace(
            local_rank=1,
            rank=5,
            group_rank=2,
            local_world_size=2,
            world_size=6,
            group_world_size=3,
            role="default",
        ),
        compat.GroupVars(
            master_addr="m",
            master_port=1234,
            restarts=1,
            max_restarts=3,
            run_id="r",
            signals_to_handle="SIGTERM",
        ),
        "/e.json",
        environ={},
    )
    assert env["ROLE_RANK"] == "5" and env["ROLE_WORLD_SIZE"] == "6"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCHELASTIC_ERROR_FILE"] == "/e.json"
