"""The command line's checks, in process: every out-of-range number, contradiction and bad
PET_ variable is a usage error that quotes the value and names where it came from."""

from __future__ import annotations

import dataclasses
import os
import resource

import pytest
from elastic_launch.api import ConfigError, LaunchConfig
from elastic_launch.launcher import cli
from elastic_launch.launcher.config import check_config


def config_of(*flags: str) -> LaunchConfig:
    args = cli.get_args_parser().parse_args([*flags, "train.py"])
    return cli.config_from_args(args)[0]


@pytest.fixture(autouse=True)
def _no_pet(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--monitor-interval", "inf"], "--monitor-interval 'inf' is not valid"),
        (["--monitor-interval", "nan"], "--monitor-interval 'nan' is not valid"),
        (["--monitor-interval", "-1"], "--monitor-interval '-1' is not valid"),
        (["--monitor-interval", "600"], "at most 60"),
        (["--hang-timeout", "1e10"], "--hang-timeout '1e10' is not valid"),
        (["--hang-timeout", "inf"], "--hang-timeout 'inf' is not valid"),
        (["--hang-timeout", "nan"], "--hang-timeout 'nan' is not valid"),
        (["--hang-timeout-floor", "inf"], "--hang-timeout-floor 'inf' is not valid"),
        (["--hang-timeout-factor", "0"], "--hang-timeout-factor '0' is not valid"),
        (["--shutdown-timeout", "-5"], "--shutdown-timeout '-5' is not valid"),
        (["--shutdown-timeout", "nan"], "--shutdown-timeout 'nan' is not valid"),
        (["--gpu-check-interval", "inf"], "--gpu-check-interval 'inf' is not valid"),
        (["--max-restarts", "1.5"], "--max-restarts '1.5' is not valid: give a whole number"),
        (["--max-restarts", "-1"], "--max-restarts '-1' is not valid"),
        (["--master-port", "99999"], "--master-port '99999' is not valid"),
        (["--master-port", "0"], "--master-port '0' is not valid"),
        (["--node-rank", "-1"], "--node-rank '-1' is not valid"),
        (["--nproc-per-node", "4097"], "this node can run at most"),
        (["--nnodes", "2000000"], "--nnodes '2000000'"),
        (["--standalone", "--nnodes", "2"], "--standalone runs one node, but --nnodes '2'"),
        (["--standalone", "--nnodes", "1:2"], "asks for up to 2"),
        (["--min-workers", "0"], "--min-workers '0' is not valid"),
        (["--min-workers", "two"], "--min-workers 'two' is not valid"),
        (["--warm-spares", "-1"], "--warm-spares '-1' is not valid"),
        (["--role", "r\n[host:default1]: FORGED"], "--role 'r\\n[host:default1]: FORGED': it"),
        (["--role", ""], "--role '': it is empty or too long"),
        (["--warm-spares", "70000"], "--warm-spares '70000' is not valid"),
        (["--preload", "none,numpy"], "--preload none turns preloading off, but modules are"),
        (["--preload", "torch", "--preload", "off"], "named too (torch)"),
        (["--preload", "torch,2d"], "--preload 'torch,2d': '2d' is not a module name"),
        (["--memory-checkpoint-limit", "8 gigs"], "--memory-checkpoint-limit '8 gigs' is not"),
        (["--memory-checkpoint-limit", "²GiB"], "--memory-checkpoint-limit '²GiB' is not"),
        (["--memory-checkpoint-limit", "-1"], "--memory-checkpoint-limit '-1' is not valid"),
        (["--memory-checkpoint-limit", "1KiB"], "is 1024 bytes: give at least 1MiB"),
    ],
)
def test_a_bad_value_is_a_usage_error_quoting_it(flags, message):
    with pytest.raises(ConfigError) as e:
        config_of(*flags)
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("8GiB", 8 << 30), ("512 MiB", 512 << 20), ("2GB", 2 * 10**9), ("1048576", 1 << 20)],
)
def test_the_memory_checkpoint_limit_takes_units(value, expected):
    assert config_of("--memory-checkpoint-limit", value).memory_checkpoint_limit == expected
    assert config_of().memory_checkpoint_limit is None


def test_the_nproc_limit_names_what_sets_it(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 1024))
    with pytest.raises(ConfigError) as e:
        config_of("--nproc-per-node", "200")
    assert "at most 160 workers" in str(e.value) and "ulimit -n" in str(e.value)
    assert config_of("--nproc-per-node", "160").nproc_per_node == 160


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("PET_NNODES", "0", "PET_NNODES '0'"),
        ("PET_NPROC_PER_NODE", "many", "PET_NPROC_PER_NODE 'many' is not valid"),
        ("PET_MAX_RESTARTS", "x", "PET_MAX_RESTARTS 'x' is not valid"),
        ("PET_MONITOR_INTERVAL", "inf", "PET_MONITOR_INTERVAL 'inf' is not valid"),
        ("PET_MASTER_PORT", "99999", "PET_MASTER_PORT '99999' is not valid"),
        ("PET_HANG_TIMEOUT", "-1", "PET_HANG_TIMEOUT '-1' is not valid"),
        ("PET_REDIRECTS", "9", "PET_REDIRECTS '9' is not valid"),
    ],
)
def test_a_bad_pet_variable_is_named(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as e:
        config_of()
    assert message in str(e.value)


def test_a_flag_given_overrides_and_is_named_over_its_variable(monkeypatch):
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    assert config_of().max_restarts == 2
    with pytest.raises(ConfigError, match="--max-restarts '-3'"):
        config_of("--max-restarts", "-3")


@pytest.mark.parametrize("run_id", ["a/b", "job\n2", "x\x00", "x" * 257])
def test_a_run_id_that_would_reach_into_another_jobs_keys_is_refused(run_id):
    with pytest.raises(ConfigError, match="give the job an id without '/' or control"):
        check_config(dataclasses.replace(LaunchConfig(), run_id=run_id))


def test_main_exits_2_and_starts_nothing(capsys):
    assert cli.exit_status(["--monitor-interval", "inf", "train.py"]) == 2
    assert "elasticrun: error: --monitor-interval 'inf' is not valid" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "nproc_per_node",
            "2",
            "LaunchConfig.nproc_per_node = '2' (str) is not valid: it takes int",
        ),
        ("max_restarts", 1.5, "LaunchConfig.max_restarts = 1.5 (float) is not valid: it takes int"),
        ("monitor_interval", "0.1", "it takes float"),
        ("hang_timeout", "auto", "it takes float or None"),
        ("preload", "torch", "it takes list[str]"),
        ("rdzv_configs", ["a=1"], "it takes dict[str, Any]"),
        ("virtual_local_rank", 1, "it takes bool"),
    ],
)
def test_a_launch_config_of_the_wrong_type_names_the_field(field, value, message):
    config = dataclasses.replace(LaunchConfig(), **{field: value})
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("monitor_interval", float("inf"), "monitor_interval 'inf' is not valid"),
        ("hang_timeout", 1e10, "hang_timeout '10000000000.0' is not valid"),
        ("master_port", 70000, "master_port '70000' is not valid"),
        ("nproc_per_node", 5000, "nproc_per_node '5000': this node can run at most"),
        ("preload", ["none"], "LaunchConfig.preload ['none']: 'none' is not a module name"),
    ],
)
def test_a_launch_config_out_of_range_names_the_field(field, value, message):
    with pytest.raises(ConfigError) as e:
        check_config(dataclasses.replace(LaunchConfig(), **{field: value}))
    assert message in str(e.value)


def test_min_workers_beyond_the_jobs_workers_names_both():
    config = config_of("--nnodes", "1:2", "--nproc-per-node", "2", "--min-workers", "5")
    with pytest.raises(ConfigError) as e:
        check_config(config)
    assert "--min-workers 5: the job has at most 4 workers" in str(e.value)
    check_config(dataclasses.replace(config, min_workers=4))


def test_preload_is_auto_unless_turned_off():
    assert LaunchConfig().preload == ["auto"] == config_of().preload
    assert config_of("--preload", "numpy").preload == ["auto", "numpy"]
    assert config_of("--preload", "none").preload == []
    check_config(dataclasses.replace(LaunchConfig(), preload=["json", "auto"]))


def test_a_default_launch_config_is_valid_and_check_config_changes_nothing():
    for config in (
        LaunchConfig(),
        LaunchConfig(hang_timeout=float("inf"), master_port=29500, max_restarts=3),
    ):
        before = dataclasses.replace(config)
        assert check_config(config) is None
        assert config == before


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_names_all_three_packages(capsys, flag):
    with pytest.raises(SystemExit) as e:
        cli.get_args_parser().parse_args([flag])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("elasticrun-launch", "elasticrun-core", "elasticrun-sampler", "C ABI"):
        assert name in out


# ---- torch.distributed.run's shape -------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["train.py", "--lr", "1"],
        ["-m", "pkg.train", "--lr", "1"],
        ["--no-python", "/bin/true", "a"],
        ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "train.py"],
    ],
)
def test_config_from_args_gives_torchs_command(argv, monkeypatch):
    """``config_from_args`` returns torch's triple: the config, then the command and its
    arguments as torch's own ``config_from_args`` gives them for the same command line."""
    monkeypatch.delenv("PYTHON_EXEC", raising=False)
    run = pytest.importorskip("torch.distributed.run")
    config, cmd, cmd_args = cli.config_from_args(cli.parse_args(argv))
    _, torch_cmd, torch_args = run.config_from_args(run.parse_args(argv))
    assert (cmd, cmd_args) == (torch_cmd, torch_args)
    assert (config.min_nodes, config.max_nodes) == ((1, 2) if "--nnodes" in argv else (1, 1))


def test_parse_args_reads_the_command_line_and_pet_variables(monkeypatch):
    monkeypatch.setenv("PET_MAX_RESTARTS", "4")
    args = cli.parse_args(["--nproc-per-node", "2", "x.py", "--y"])
    assert (args.nproc_per_node, args.max_restarts, args.training_script) == ("2", "4", "x.py")
    assert args.training_script_args == ["--y"]


def test_run_of_a_bad_namespace_is_a_config_error_before_anything_starts(tmp_path):
    """``run(args)`` checks every value first: a missing script is a ConfigError naming it, and
    nothing was started (no log directory under the one given)."""
    args = cli.parse_args(["--log-dir", str(tmp_path), str(tmp_path / "missing.py")])
    with pytest.raises(ConfigError, match=r"missing\.py' does not exist"):
        cli.run(args)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "env", "cap"),
    [
        ([], {}, 100),  # nothing asked: the loop's own max_failures, up to 100
        (["--max-restarts", "0"], {}, 0),  # asked for none: none, whatever the loop says
        (["--max-restarts", "3"], {}, 3),
        ([], {"PET_MAX_RESTARTS": "2"}, 2),
        (["--max-restarts", "0", "--loop-max-restarts", "5"], {}, 5),  # both: as given
        ([], {"PET_LOOP_MAX_RESTARTS": "7"}, 7),
    ],
)
def test_the_loops_budget_is_the_users_max_restarts_when_given(argv, env, cap, monkeypatch):
    for name in ("PET_MAX_RESTARTS", "PET_LOOP_MAX_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config, _ = cli.launch_from_args(cli.parse_args([*argv, "train.py"]))
    assert config.loop_max_restarts == cap


@pytest.mark.parametrize(
    ("argv", "script", "theirs"),
    [
        # torchrun (and argparse alone) takes --log for an abbreviation of --log-dir: exit 2
        (
            ["--nproc-per-node", "2", "train.py", "--log", "out.jsonl"],
            "train.py",
            ["--log", "out.jsonl"],
        ),
        (
            ["train.py", "-h", "--nnodes", "3", "--version"],
            "train.py",
            ["-h", "--nnodes", "3", "--version"],
        ),
        (["-m", "pkg.train", "--log-dir", "x"], "pkg.train", ["--log-dir", "x"]),
        (["--standalone", "--", "train.py", "--max-restarts"], "train.py", ["--max-restarts"]),
        (["-r3", "--tee=1", "train.py", "--", "x"], "train.py", ["--", "x"]),
        (["-mr", "3", "pkg.train", "-r", "1"], "pkg.train", ["-r", "1"]),  # torch's -m -r 3
        (["-mr3", "pkg.train"], "pkg.train", []),
        (
            ["--max-restarts=2", "train.py", "--max-restarts", "5"],
            "train.py",
            ["--max-restarts", "5"],
        ),
    ],
)
def test_what_follows_the_script_reaches_it_untouched(argv, script, theirs):
    args = cli.parse_args(argv)
    assert args.training_script == script and args.training_script_args == theirs


def test_the_launchers_flags_keep_their_abbreviations_before_the_script():
    args = cli.parse_args(["--max-r", "4", "--log-d", "/tmp/logs", "train.py", "--max-r", "9"])
    assert int(args.max_restarts) == 4 and args.log_dir == "/tmp/logs"
    assert args.training_script_args == ["--max-r", "9"]


def test_a_flag_missing_its_value_or_the_script_is_still_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--nproc-per-node"])
    assert e.value.code == 2 and "expected one argument" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--standalone"])
    assert e.value.code == 2 and "training_script" in capsys.readouterr().err


def test_hot_spares_count_against_what_the_node_can_run_before_anything_starts(monkeypatch):
    """check_config (plan_launch runs it before any resource is opened) counts hot spares
    with the workers: each holds a worker's descriptors in the launcher."""
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 1024))
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root: no process limit
    with pytest.raises(ConfigError) as e:
        check_config(config_of("--nproc-per-node", "100", "--hot-spares", "61"))
    assert "nproc_per_node '100' with 61 hot spare(s)" in str(e.value)
    assert "at most 160 workers" in str(e.value) and "ulimit -n" in str(e.value)
    check_config(config_of("--nproc-per-node", "100", "--hot-spares", "60"))
    check_config(config_of("--nproc-per-node", "100", "--warm-spares", "500")), "no descriptors"


def test_warm_spares_count_against_the_process_limit_and_the_default_fits_it(monkeypatch):
    """Warm spares are the zygote's processes: the user's process limit bounds them (not the
    open-file limit), and the default (one per local worker) takes what room is left."""
    from elastic_launch.launcher.config import warm_spares

    limits = {resource.RLIMIT_NOFILE: 1 << 20, resource.RLIMIT_NPROC: 300}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limits[which],) * 2)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError) as e:
        check_config(
            config_of("--nproc-per-node", "100", "--hot-spares", "10", "--warm-spares", "41")
        )
    assert "--warm-spares '41'" in str(e.value) and "give at most 40" in str(e.value)
    assert "ulimit -u" in str(e.value)
    check_config(config_of("--nproc-per-node", "100", "--hot-spares", "10", "--warm-spares", "40"))
    check_config(config_of("--nproc-per-node", "100", "--warm-spares", "900", "--preload", "none"))
    assert warm_spares(config_of("--nproc-per-node", "100", "--hot-spares", "10")) == 40
    assert warm_spares(config_of("--nproc-per-node", "4")) == 4
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert warm_spares(config_of("--nproc-per-node", "100", "--hot-spares", "10")) == 100
