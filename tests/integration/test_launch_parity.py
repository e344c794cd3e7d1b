"""elasticrun beside torchrun: the same flags, the same worker environment."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from elastic_launch.launcher.cli import config_from_args, get_args_parser
from launcher_util import run, worker_args

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def torchrun_parser():
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def option_table(parser) -> dict[str, object]:
    return {
        s: a.default for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")
    }


def test_every_torchrun_flag_is_accepted_with_its_default():
    theirs = option_table(torchrun_parser())
    ours = option_table(get_args_parser())
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"torchrun flags elasticrun lacks: {missing}"
    for flag, default in theirs.items():
        if flag in ("--logs-specs", "--logs_specs", "--numa-binding", "--numa_binding"):
            continue  # accepted; using them is an error that says they are not supported
        assert ours[flag] == default, f"{flag}: torchrun default {default!r}, ours {ours[flag]!r}"


def test_both_spellings_and_pet_environment(monkeypatch):
    parser = get_args_parser()
    a = parser.parse_args(["--nproc_per_node", "3", "--max-restarts", "2", "x.py"])
    config = config_from_args(a)[0]
    assert (config.nproc_per_node, config.max_restarts) == (3, 2)
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_MAX_RESTARTS", "5")
    monkeypatch.setenv("PET_STANDALONE", "1")
    a = get_args_parser().parse_args(["x.py", "--lr", "1"])
    config = config_from_args(a)[0]
    assert (config.nproc_per_node, config.max_restarts, a.standalone) == (4, 5, True)
    assert config.rdzv_backend == "embedded", "PET_STANDALONE=1 is --standalone"
    assert a.training_script_args == ["--lr", "1"]


ENV_KEYS = [
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
]
SAME_VALUE = [
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
]


@pytest.mark.timeout(240)
def test_same_script_same_environment_under_both_launchers(tmp_path: Path):
    outs = {}
    for name, launcher in (("torchrun", TORCHRUN), ("elasticrun", None)):
        out = tmp_path / name
        out.mkdir()
        result = run(
            [
                "--standalone",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "1",
                *worker_args(out, "--dist"),
            ],
            out,
            launcher=launcher,
            timeout=180,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        outs[name] = result
    for rank in (0, 1):
        theirs = outs["torchrun"].env(f"0-{rank}")
        ours = outs["elasticrun"].env(f"0-{rank}")
        for key in ENV_KEYS:
            assert key in theirs, f"torchrun did not set {key}?"
            assert key in ours, f"elasticrun does not set {key}"
        for key in SAME_VALUE:
            assert ours[key] == theirs[key], f"{key}: torchrun {theirs[key]!r}, ours {ours[key]!r}"
        # Same meaning, different value: rank 0 hosts the store on a fresh port each attempt.
        assert theirs["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert ours["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{rank}/error.json")
        for name in ("torchrun", "elasticrun"):
            dist = outs[name].out / f"0-{rank}.dist.json"
            import json

            d = json.loads(dist.read_text())
            assert d == {"sum": 2.0, "launched": True, "world": 2, "rank": rank}, name


@pytest.mark.parametrize("form", ["directory", "zip"])
def test_a_directory_or_zip_application_runs_as_python_runs_it(tmp_path, form):
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text(
        "import sys\nprint('ran', __name__, sys.argv[1:], sys.path[0])\n"
    )
    target = app
    if form == "zip":
        target = tmp_path / "app.pyz"
        with zipfile.ZipFile(target, "w") as z:
            z.write(app / "__main__.py", "__main__.py")
    theirs = subprocess.run(
        [sys.executable, str(target), "a", "b"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    ours = run(["--standalone", str(target), "a", "b"], tmp_path)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout.strip() == theirs.stdout.strip() == f"ran __main__ ['a', 'b'] {target}"


def test_a_directory_without_main_is_a_usage_error(tmp_path):
    result = run(["--standalone", str(tmp_path)], tmp_path)
    assert result.returncode == 2
    assert f"training script '{tmp_path}' is a directory without a __main__.py" in result.stderr


def test_a_scripts_flags_are_its_own_where_torchrun_takes_them_for_its_own(tmp_path):
    """`train.py --log out.jsonl`: torchrun's argparse reads --log as an abbreviation of its
    --log-dir and exits 2 (torch 2.13); elasticrun hands the script everything after its name."""
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('argv', sys.argv[1:])\n")
    argv = ["--standalone", "--nproc-per-node", "1", str(script), "--log", "out.jsonl", "-h"]
    theirs = run(argv, tmp_path, launcher=TORCHRUN)
    assert theirs.returncode == 2 and "--log-dir" in theirs.stderr, "torchrun's behaviour"
    ours = run(argv, tmp_path)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout.strip() == "argv ['--log', 'out.jsonl', '-h']"
