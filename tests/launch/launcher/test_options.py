"""The option table: every option declared once, and everything made from it agrees with it."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
from elastic_launch.api import ConfigError, LaunchConfig
from elastic_launch.launcher import cli, options
from elastic_launch.launcher.agent_api import WorkerSpec
from elastic_launch.launcher.api import LaunchConfig as TorchShapedLaunchConfig
from elastic_launch.launcher.config import check_config
from elastic_launch.launcher.options import OPTIONS, Option, field_default, torch_default

DOCS = Path(__file__).resolve().parents[3] / "docs" / "launcher.md"


@pytest.fixture(autouse=True)
def _no_pet(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)


def test_every_config_field_is_set_by_exactly_one_option():
    owners: dict[str, list[str]] = {}
    for o in OPTIONS:
        for f in o.config_fields:
            owners.setdefault(f, []).append(o.flag)
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    assert set(owners) == fields, f"fields without an option: {sorted(fields - set(owners))}"
    assert {f: o for f, o in owners.items() if len(o) > 1} == {}


def test_flags_are_unique_and_spelled_as_flags():
    names = [n for o in OPTIONS for n in o.names]
    assert len(names) == len(set(names))
    for o in OPTIONS:
        assert re.fullmatch(r"[a-z]+(-[a-z]+)*", o.flag), o.flag
        assert o.group in ("torchrun", "elasticrun") and o.kind in cli._ACTIONS, o.flag


def _parsed_default(o: Option) -> dict[str, object]:
    return o.take(o.cli_default(), f"--{o.flag}")


#: Options whose command-line default (torchrun's) ends elsewhere than LaunchConfig's default:
#: the rendezvous target makes a one-node static launch the embedded service under a fresh id.
ENDS_ELSEWHERE = {"rdzv-backend", "rdzv-id"}


@pytest.mark.parametrize("o", [o for o in OPTIONS if o.config_fields], ids=lambda o: o.flag)
def test_the_command_lines_default_is_the_configs_unless_it_says_why(o):
    """An option with a command-line default of its own says why; parsed, that default is
    LaunchConfig's, except for the options that say it is not."""
    parsed = _parsed_default(o)
    expected = {f: field_default(f) for f in o.config_fields}
    if o.default is not options.FROM_CONFIG:
        assert o.why, f"--{o.flag}: its own default {o.default!r} without a reason"
    if o.flag in ENDS_ELSEWHERE:
        assert parsed != expected
    else:
        assert parsed == expected


def test_an_option_whose_default_is_none_says_what_none_means():
    for o in OPTIONS:
        if o.kind != "switch" and o.cli_default() is None:
            assert o.shown, f"--{o.flag}: a default of None, shown as nothing"


def test_help_shows_each_default_once():
    text = cli.get_args_parser().format_help()
    for o in OPTIONS:
        if o.kind != "switch":
            assert o.help_text().count("(default:") == 1
    assert "(default: 0)" in cli.get_args_parser()._option_string_actions["--max-restarts"].help
    assert "--stack-dump-timeout" in text


def test_a_flag_its_variable_and_the_python_api_share_one_check(monkeypatch):
    """A number option's range is checked from the flag, from its PET_ variable (the message
    names it) and on a LaunchConfig built in Python, by the one declaration."""
    for o in OPTIONS:
        if o.bounds is None:
            continue
        bad = str(o.bounds.high * 2 + 1)
        with pytest.raises(ConfigError, match=f"--{o.flag} '{re.escape(bad)}'"):
            cli.config_from_args(cli.get_args_parser().parse_args([f"--{o.flag}", bad, "x.py"]))
        monkeypatch.setenv(o.pet, bad)
        with pytest.raises(ConfigError, match=o.pet):
            cli.config_from_args(cli.get_args_parser().parse_args(["x.py"]))
        monkeypatch.delenv(o.pet)
        field = o.config_fields[0]
        with pytest.raises(ConfigError, match=field):
            check_config(dataclasses.replace(LaunchConfig(), **{field: o.bounds.high * 2 + 1}))


def test_torch_shaped_defaults_come_from_the_table():
    config = TorchShapedLaunchConfig()
    for o in OPTIONS:
        if o.torch is not None:
            assert o.torch.why
            assert getattr(config, o.config_fields[0]) == o.torch.value
    spec = {f.name: f.default for f in dataclasses.fields(WorkerSpec)}
    assert spec["max_restarts"] == torch_default("max-restarts") == 3
    assert spec["monitor_interval"] == torch_default("monitor-interval") == 0.1


def test_torch_defaults_are_torchs():
    """What the table says torch's API defaults to is what torch's classes hold."""
    launcher_api = pytest.importorskip("torch.distributed.launcher.api")
    agent_api = pytest.importorskip("torch.distributed.elastic.agent.server.api")
    theirs = {f.name: f.default for f in dataclasses.fields(launcher_api.LaunchConfig)}
    for o in OPTIONS:
        if o.torch is not None and o.config_fields[0] in theirs:
            assert theirs[o.config_fields[0]] == o.torch.value, o.flag
    spec = {f.name: f.default for f in dataclasses.fields(agent_api.WorkerSpec)}
    for name in ("max_restarts", "monitor_interval"):
        assert spec[name] == torch_default(name.replace("_", "-")), name


def test_the_docs_table_is_the_tables():
    text = DOCS.read_text()
    m = re.search(r"<!-- options: begin -->\n(.*?)\n<!-- options: end -->", text, re.S)
    assert m, "docs/launcher.md has no options table between its markers"
    assert m.group(1) == options.markdown_table(), (
        "docs/launcher.md's flag table differs from the options: paste the output of "
        "`python -m elastic_launch.launcher.options` between its markers"
    )


def test_a_new_option_is_one_entry(monkeypatch):
    """An option added to the table is parsed, read from its variable and checked, with no
    other change (the field it sets is the one code that uses it)."""
    extra = Option("monitor-interval-copy", "x", options.SECONDS, fields=("monitor_interval",))
    base = tuple(o for o in OPTIONS if o.flag != "monitor-interval")
    monkeypatch.setattr(cli, "OPTIONS", (*base, extra))
    argv = ["--monitor-interval-copy", "7", "x.py"]
    config, _ = cli.launch_from_args(cli.get_args_parser().parse_args(argv))
    assert config.monitor_interval == 7.0
    monkeypatch.setenv("PET_MONITOR_INTERVAL_COPY", "8")
    config, _ = cli.launch_from_args(cli.get_args_parser().parse_args(["x.py"]))
    assert config.monitor_interval == 8.0
