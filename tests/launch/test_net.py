"""Network helpers: free ports, the host lock without a file, and presence probes."""

from __future__ import annotations

import socket
import time

import pytest
from elastic_launch.net import (
    REFUSED,
    SILENT,
    UP,
    PresencePort,
    free_port,
    is_local_host,
    is_loopback,
    probe,
)


def test_free_ports_are_free():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises if it was not
        s.listen()
        with socket.socket() as again, pytest.raises(OSError, match="in use"):
            again.bind(("127.0.0.1", port))
    assert free_port("192.0.2.1") > 0, "an address not on this host: any interface"


def test_local_hosts():
    assert is_local_host("localhost") and is_local_host("127.0.0.1")
    assert is_local_host(socket.gethostname())
    assert not is_local_host("192.0.2.1")


def test_loopback_hosts():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.8.9.10")
    assert not is_loopback("192.0.2.1") and not is_loopback("0.0.0.0")
    assert not is_loopback("no-such-host.invalid"), "unknown: not known to be loopback"


def test_a_presence_port_answers_while_it_exists_and_refuses_after():
    presence = PresencePort("127.0.0.1")
    target = {"n": ("127.0.0.1", presence.port)}
    for _ in range(70):  # more than its backlog: connections are accepted and closed
        assert probe(target, 2.0) == {"n": UP}
    presence.close()
    t0 = time.monotonic()
    assert probe(target, 2.0) == {"n": REFUSED}
    assert time.monotonic() - t0 < 0.5, "a refused port is seen at once"
    assert probe({}, 1.0) == {}


def test_a_host_that_does_not_answer_is_silent_not_refused():
    # A listening socket whose backlog is full drops new connections: no answer at all.
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        held = []
        try:
            for _ in range(8):  # fill the accept queue (nobody accepts)
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))
                held.append(c)
            assert probe({"n": ("127.0.0.1", port)}, 0.3) == {"n": SILENT}
        finally:
            for c in held:
                c.close()


def test_await_listening_returns_once_a_server_listens_and_gives_up_when_told():
    """What the train loop's ranks do before their TCPStore client: a client that finds no
    server backs off for up to a second, one that waits for the listen connects at once."""
    from elastic_launch.net import await_listening, free_port

    port = free_port()
    server = socket.socket()
    asked: list[int] = []

    def listen_after_a_refusal() -> bool:  # called after each refused attempt
        asked.append(1)
        if len(asked) == 2:
            server.bind(("127.0.0.1", port))
            server.listen()
        return False

    try:
        assert await_listening("127.0.0.1", port, 30, listen_after_a_refusal)
        assert len(asked) == 2, "refused once, then it listened"
    finally:
        server.close()
    calls: list[int] = []
    gone = free_port()
    assert not await_listening("127.0.0.1", gone, 30, lambda: calls.append(1) or len(calls) > 3)
    assert not await_listening("127.0.0.1", gone, 0)


def test_waiting_for_a_listener_resolves_its_host_once_not_at_every_try(monkeypatch):
    """A try every 2 ms: a lookup each time would reach the resolver hundreds of times a
    second from every rank."""
    import socket as socket_module

    from elastic_launch.net import await_listening

    lookups = []
    real = socket_module.getaddrinfo

    def counted(*args, **kwargs):
        lookups.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(socket_module, "getaddrinfo", counted)
    with socket_module.socket() as s:  # bound, never listening: refused at every try
        s.bind(("127.0.0.1", 0))
        tries = []
        assert not await_listening(
            "localhost", s.getsockname()[1], 30, lambda: len(tries) > 20 or tries.append(1)
        )
    assert len(tries) > 20 and lookups == ["localhost"]
