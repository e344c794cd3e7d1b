"""Parsing of launcher values: what is accepted, and the errors for what is not."""

from __future__ import annotations

import signal

import pytest
from elastic_launch.api import ConfigError, Std, std_for
from elastic_launch.launcher.parse import (
    parse_hang_timeout,
    parse_list,
    parse_nnodes,
    parse_nproc_per_node,
    parse_preload,
    parse_ranks_filter,
    parse_rdzv_conf,
    parse_signals,
    parse_std,
)
from elastic_launch.net import parse_bind, parse_endpoint


def test_nnodes():
    assert parse_nnodes("2") == (2, 2)
    assert parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "3:1", "a", "1:2:3", ""):
        with pytest.raises(ConfigError, match=f"'{bad}'"):
            parse_nnodes(bad)


def test_nproc_per_node(monkeypatch):
    monkeypatch.setenv("ELASTIC_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert parse_nproc_per_node("3") == 3
    assert parse_nproc_per_node("cpu") >= 1
    assert parse_nproc_per_node("auto") == parse_nproc_per_node("cpu")  # no GPU here
    with pytest.raises(ConfigError, match="no GPU found"):
        parse_nproc_per_node("gpu")
    with pytest.raises(ConfigError, match="need at least 1"):
        parse_nproc_per_node("0")


def test_gpu_count_through_nvml(monkeypatch, fake_nvml, nvml_script):
    monkeypatch.setenv("ELASTIC_NVML_LIBRARY", str(fake_nvml))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml_script.write_text("devices 4\n")
    assert parse_nproc_per_node("gpu") == 4
    assert parse_nproc_per_node("auto") == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert parse_nproc_per_node("gpu") == 2


def test_nproc_gpu_reports_an_entry_that_names_no_device(
    monkeypatch, fake_nvml, nvml_script, caplog
):
    monkeypatch.setenv("ELASTIC_NVML_LIBRARY", str(fake_nvml))
    nvml_script.write_text("devices 2\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,5,1")
    with caplog.at_level("WARNING", logger="elasticrun"):
        assert parse_nproc_per_node("gpu") == 1
    assert "entry '5' names no device (NVML sees 2 GPU(s)" in caplog.text
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    with pytest.raises(ConfigError, match=r"no GPU found .*entry '4' names no device"):
        parse_nproc_per_node("gpu")
    assert parse_nproc_per_node("auto") >= 1, "auto counts CPUs then"
    monkeypatch.setenv("ELASTIC_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError, match="no GPU found"):
        parse_nproc_per_node("gpu")  # the variable alone is not a GPU


def test_std():
    assert parse_std("3", "-r") == Std.ALL
    assert parse_std("0:1,12:2", "-r") == {0: Std.OUT, 12: Std.ERR}
    assert std_for({0: Std.OUT}, 1) == Std.NONE
    with pytest.raises(ConfigError, match="-t '4'"):
        parse_std("4", "-t")


def test_lists_filters_signals():
    assert parse_list("a,,b,c") == ["a,b", "c"]
    assert parse_list("") == []
    assert parse_ranks_filter("") is None
    assert parse_ranks_filter("0,2") == {0, 2}
    assert parse_signals("SIGTERM, USR1") == [signal.SIGTERM, signal.SIGUSR1]
    assert parse_preload(["torch,numpy", "json"]) == ["auto", "torch", "numpy", "json"]
    assert parse_preload([]) == ["auto"] and parse_preload(["auto"]) == ["auto"]
    assert parse_preload(["none"]) == [] and parse_preload(["auto", "none"]) == []


def test_rdzv_conf_and_endpoints():
    assert parse_rdzv_conf(" a=1, b = x ") == {"a": "1", "b": "x"}
    with pytest.raises(ConfigError, match="option 'a' needs a value"):
        parse_rdzv_conf("a=")
    assert parse_endpoint("node0:29400", "--rdzv-endpoint") == ("node0", 29400)
    assert parse_endpoint("[::1]:5", "--rdzv-endpoint") == ("::1", 5)
    assert parse_endpoint("node0", "--rdzv-endpoint", default_port=29400) == ("node0", 29400)
    with pytest.raises(ConfigError, match="has no port"):
        parse_endpoint("node0", "--rdzv-endpoint")
    assert parse_bind("8080", "--health-port") == ("127.0.0.1", 8080)
    assert parse_bind("0.0.0.0:8080", "--health-port") == ("0.0.0.0", 8080)


def test_hang_timeout():
    assert parse_hang_timeout("auto") is None
    assert parse_hang_timeout("off") == float("inf")
    assert parse_hang_timeout("2.5") == 2.5
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(ConfigError, match="--hang-timeout"):
            parse_hang_timeout(bad)
