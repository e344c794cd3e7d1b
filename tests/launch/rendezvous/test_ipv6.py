"""Bracketed IPv6 endpoints ([::1]:PORT) for every backend: the embedded service and etcd (v3
and v2) form rounds on the IPv6 loopback, and the workers are told an IPv6 master address."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from elastic_launch.api import ConfigError
from elastic_launch.net import host_port, is_local_host, local_address, parse_endpoint
from elastic_launch.rendezvous.api import RendezvousParameters
from elastic_launch.rendezvous.registry import create_handler


def free_v6_port() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return int(s.getsockname()[1])


def form(backend: str, endpoint: str, n: int = 2):
    run_id = f"v6-{backend}-{time.monotonic_ns()}"
    params = [
        RendezvousParameters(
            backend,
            endpoint,
            run_id,
            n,
            n,
            1,
            config={"last_call_timeout": "1", "join_timeout": "30"},
        )
        for _ in range(n)
    ]
    handlers = [create_handler(p) for p in params]
    try:
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda h: h.next_rendezvous(), handlers, timeout=60))
    finally:
        for h in handlers:
            h.shutdown()


def test_ipv6_helpers():
    assert host_port("::1", 29400) == "[::1]:29400" and host_port("h", 1) == "h:1"
    assert parse_endpoint("[::1]:29400", "--rdzv-endpoint") == ("::1", 29400)
    assert local_address("::1") == "::1"
    assert is_local_host("::1")


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("[::1:29400", "an IPv6 address needs a closing ']'"),
        ("[::1]29400", "is not host:port"),
        ("::1:29400", "write an IPv6 address in brackets, [::1]:29400"),
        ("[::1]:port", "port 'port' is not a number"),
        ("[]:29400", "has no host"),
    ],
)
def test_a_malformed_endpoint_is_a_clear_error(endpoint, message):
    with pytest.raises(ConfigError) as e:
        parse_endpoint(endpoint, "--rdzv-endpoint")
    assert message in str(e.value) and endpoint in str(e.value)


def test_the_embedded_service_on_ipv6():
    infos = form("c10d", f"[::1]:{free_v6_port()}")
    assert sorted(i.group_rank for i in infos) == [0, 1]
    assert {i.master_addr for i in infos} == {"::1"}, "the workers meet on IPv6 too"


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_etcd_on_ipv6(etcd_v6, backend):
    assert etcd_v6.endpoint.startswith("[::1]:")
    infos = form(backend, etcd_v6.endpoint)
    assert sorted(i.group_rank for i in infos) == [0, 1]
    assert {i.master_addr for i in infos} == {"::1"}
