"""The tests' etcd (tests/conftest.py): a client port taken between being picked and being
bound (another test's connection, a Slurm daemon) costs a retry on new ports, not a failure."""

from __future__ import annotations

import socket

import pytest

pytestmark = pytest.mark.slow


def test_a_taken_port_is_retried_on_new_ports(tmp_path, etcd_class):
    server = etcd_class(tmp_path / "etcd-data", enable_v2=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", server.port))
        taken.listen()
        first = server.port
        server.start()
        try:
            assert server.port != first
            assert "address already in use" in (tmp_path / f"etcd-{first}.log").read_text()
        finally:
            server.stop()
