"""Any value of any flag or PET_* variable: the launcher's whole configuration step (parsing,
checking, the rendezvous settings, the ports to bind) ends in a usage error (ConfigError, or
argparse's exit 2) or a plan, never another exception, and binds or starts nothing."""

from __future__ import annotations

import argparse
import os
import threading

import pytest
from elastic_launch.api import ConfigError
from elastic_launch.launcher import cli
from elastic_launch.launcher.config import plan_launch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _value_flags() -> list[str]:
    parser = cli.get_args_parser()
    flags = []
    for action in parser._actions:
        if action.nargs == 0 or not action.option_strings or action.dest == "help":
            continue
        flags.append(max(action.option_strings, key=len))
    return sorted(flags)


FLAGS = _value_flags()
#: Values that have tripped parsers elsewhere: Unicode digits, full-width digits, signs,
#: infinities, IPv6 without brackets, huge numbers, separators, control characters.
TRAPS = [
    "²",
    "\uff11\uff12",
    "٣",
    "-0",
    "+1",
    "1_000",
    "1e400",
    "nan",
    "inf",
    "-inf",
    " 3 ",
    "0x10",
    "::1",
    "[::1]:²",
    "h:99999999",
    "h:-1",
    "a=1,b",
    "token=é",
    "1:0",
    "0:0",
    "2:1",
    "99999999999999999999",
    "\t",
    "\n",
    "",
    ",",
    "=",
    "a:b:c",
    "[",
    "]",
    "gpu",
    "auto",
]
values = st.sampled_from(TRAPS) | st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12
)
PROPERTY = settings(
    max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def configure(argv: list[str]) -> str:
    """The launcher's configuration step, as `cli.main` runs it, without running the job:
    "planned" (a plan for the script), "refused" (a ConfigError that says why) or "usage"
    (argparse's exit 2); anything else fails the test."""
    try:
        config, entrypoint = cli.launch_from_args(cli.get_args_parser().parse_args(argv))
        plan = plan_launch(config, entrypoint)
    except ConfigError as e:
        refused: BaseException = e
    except SystemExit as e:
        refused = e
    else:
        assert plan.entrypoint == entrypoint, plan
        return "planned"
    if isinstance(refused, SystemExit):
        assert refused.code == 2, f"argparse exits 2 on a usage error, not {refused.code!r}"
        return "usage"
    assert str(refused), "a refusal says why"
    return "refused"


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cli") / "train.py"
    path.write_text("pass\n")
    return str(path)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(argparse.ArgumentParser, "print_usage", lambda *a, **k: None)
    monkeypatch.setattr(argparse.ArgumentParser, "_print_message", lambda *a, **k: None)
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)


@PROPERTY
@given(st.lists(st.tuples(st.sampled_from(FLAGS), values), min_size=1, max_size=3))
def test_any_flag_value_is_a_plan_or_a_usage_error(script, flags):
    before = set(threading.enumerate())
    said = configure([*(part for flag, value in flags for part in (f"{flag}={value}",)), script])
    assert said in ("planned", "refused", "usage")
    started = set(threading.enumerate()) - before  # another test's thread may end meanwhile
    assert not started, f"configuring started {started}"


@PROPERTY
@given(st.lists(st.tuples(st.sampled_from(FLAGS), values), min_size=1, max_size=3))
def test_any_pet_variable_is_a_plan_or_a_usage_error(script, variables):
    names = {f"PET_{flag.lstrip('-').replace('-', '_').upper()}": v for flag, v in variables}
    old = {k: os.environ.get(k) for k in names}
    try:
        os.environ.update(names)
        assert configure([script]) in ("planned", "refused", "usage")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--rdzv-endpoint=h:²", "port '²' is not a number from 0 to 65535"),
        ("--health-port=²", "--health-port '²'"),
        ("--metrics-port=١٢", "--metrics-port '١٢'"),
        ("--rdzv-conf=join_timeout=x", "join_timeout"),
    ],
)
def test_traps_found_before_are_usage_errors_before_anything_starts(script, flag, message):
    backend = ["--rdzv-backend=etcd"] if "rdzv" in flag else []
    args = cli.get_args_parser().parse_args([*backend, "--nnodes=1:2", flag, script])
    with pytest.raises(ConfigError, match=message):
        plan_launch(*cli.launch_from_args(args))
