"""The gloo connections a leaving rank shuts down (train_loop.group_sockets), on real sockets."""

from __future__ import annotations

import os
import socket

from elastic_launch.train_loop import group_sockets


def _connected_pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    return client, server


def test_the_sockets_a_group_opened_are_shut_down_and_its_peer_sees_it_at_once():
    with socket.create_server(("127.0.0.1", 0)) as outside:
        before = group_sockets.open_sockets()
        listener = socket.create_server(("127.0.0.1", 0))  # as gloo's own listener
        client, server = _connected_pair(listener)
        opened = group_sockets.open_sockets() - before
        assert {fd for fd, _ in opened} == {listener.fileno(), client.fileno(), server.fileno()}
        other, peer = _connected_pair(outside)  # not the group's: left alone
        try:
            assert group_sockets.shut_down(opened) == 2, "both ends; never the listener"
            server.settimeout(5)
            assert server.recv(1) == b"", "the peer sees the connection closed at once"
            assert client.fileno() >= 0, "shut down, not closed: gloo still owns it"
            late, _ = _connected_pair(listener)  # the listener still accepts
            late.close()
            other.sendall(b"x")
            assert peer.recv(1) == b"x"
        finally:
            for s in (client, server, listener, other, peer):
                s.close()


def test_a_descriptor_reused_for_another_socket_is_left_alone():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        before = group_sockets.open_sockets()
        client, server = _connected_pair(listener)
        opened = group_sockets.open_sockets() - before
        server.close()
        a, b = socket.socketpair()
        os.dup2(a.fileno(), client.fileno())  # the group's number, now another socket's
        try:
            assert group_sockets.shut_down(opened) == 0
            b.sendall(b"y")
            assert a.recv(1) == b"y"
        finally:
            for s in (client, a, b):
                s.close()


def test_without_proc_nothing_is_recorded(monkeypatch):
    monkeypatch.setattr(group_sockets, "_FD_DIR", os.path.join(os.sep, "nonexistent"))
    assert group_sockets.open_sockets() == frozenset()
    assert group_sockets.shut_down(frozenset({(0, "socket:[1]")})) == 0
