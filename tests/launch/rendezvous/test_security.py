"""The rendezvous' credentials: where a token or password may come from, the embedded service
never open beyond loopback, a challenge in which the token never crosses the wire and the
service proves it holds it first, TLS for the embedded service, and etcd's password never in
clear."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from elastic_launch.net import free_port
from elastic_launch.rendezvous.api import RendezvousConfigError, RendezvousParameters
from elastic_launch.rendezvous.backends import EmbeddedRendezvous, _etcd_members
from elastic_launch.rendezvous.conf import parse_conf
from elastic_launch.rendezvous.embedded.server import EmbeddedServer
from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
from elastic_launch.rendezvous.registry import check_parameters
from elastic_launch.rendezvous.secrets import PASSWORD_ENV, TOKEN_ENV
from elastic_launch.rendezvous.store import challenge
from elastic_launch.rendezvous.store.api import StoreAccess, StoreError
from elastic_launch.rendezvous.store.endpoints import StoreMember


@pytest.fixture(autouse=True)
def _no_secret_env(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)


def secret(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / f"secret-{os.urandom(3).hex()}"
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


# ---- where secrets come from ---------------------------------------------------------------


def test_a_token_comes_from_its_file_or_the_environment(tmp_path, monkeypatch):
    assert (
        parse_conf("embedded", {"token_file": secret(tmp_path, "from-file")}).token == "from-file"
    )
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert parse_conf("embedded", {}).token == "from-env"
    assert parse_conf("embedded", {"token": "given"}).token == "given", "the key itself first"


def test_a_secret_file_others_can_read_is_refused(tmp_path):
    path = secret(tmp_path, "t", 0o644)
    with pytest.raises(
        RendezvousConfigError, match=f"mode 0644 lets others read it; run chmod 600 {path}"
    ):
        parse_conf("embedded", {"token_file": path})
    with pytest.raises(RendezvousConfigError, match="cannot read it"):
        parse_conf("embedded", {"token_file": str(tmp_path / "missing")})
    os.symlink(secret(tmp_path, "t"), tmp_path / "link")
    with pytest.raises(RendezvousConfigError, match="cannot read it"):
        parse_conf("embedded", {"token_file": str(tmp_path / "link")})  # no symlinks followed


@pytest.mark.parametrize("token", ["é", "two words", "tab\there", ""])
def test_a_token_that_cannot_travel_is_refused_at_configuration(token):
    with pytest.raises(RendezvousConfigError, match=r"printable ASCII|1 to 4096"):
        parse_conf("embedded", {"token": token})


def test_the_etcd_password_comes_from_its_file_or_the_environment(tmp_path, monkeypatch):
    path = secret(tmp_path, "s3cret")
    assert parse_conf("etcd", {"user": "u", "password_file": path}).password == "s3cret"
    monkeypatch.setenv(PASSWORD_ENV, "env-secret")
    assert parse_conf("etcd", {"user": "u"}).password == "env-secret"
    monkeypatch.delenv(PASSWORD_ENV)
    with pytest.raises(RendezvousConfigError, match="password_file=PATH"):
        parse_conf("etcd", {"user": "u"})


def test_a_secret_on_the_command_line_works_and_warns(caplog):
    from elastic_launch.launcher import cli

    args = cli.get_args_parser().parse_args(["--rdzv-conf", "token=abc", "train.py"])
    config, _ = cli.launch_from_args(args)
    assert config.rdzv_configs["token"] == "abc"
    assert "puts a secret on the command line" in caplog.text
    assert f"use token_file=PATH or ${TOKEN_ENV} instead" in caplog.text


# ---- never open beyond loopback -----------------------------------------------------------


def params(endpoint: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters("c10d", endpoint, "job", 2, 2, 1, config=conf)


def test_the_embedded_service_beyond_loopback_needs_a_token():
    with pytest.raises(RendezvousConfigError) as e:
        check_parameters(params("192.0.2.7:29400"))
    message = str(e.value)
    assert "192.0.2.7:29400 is beyond loopback" in message
    assert "ELASTICRUN_RDZV_TOKEN" in message and "allow_unauthenticated=true" in message
    check_parameters(params("192.0.2.7:29400", token="t"))
    check_parameters(params("192.0.2.7:29400", allow_unauthenticated="true"))
    for loopback in ("127.0.0.1:29400", "localhost:29400", "[::1]:29400"):
        check_parameters(params(loopback))


def test_an_unresolvable_host_says_so_rather_than_asking_for_a_token():
    """A name the resolver does not know is not "beyond loopback": the message names it.
    (With a token the check is left to the connection, which retries: a cluster's DNS name
    may appear after its pods start.)"""
    with pytest.raises(RendezvousConfigError) as e:
        check_parameters(params("no-such-host.invalid:29400"))
    message = str(e.value)
    assert "cannot resolve 'no-such-host.invalid'" in message and "token" not in message
    check_parameters(params("no-such-host.invalid:29400", token="t"))


# ---- the challenge ---------------------------------------------------------------------------


def _anywhere(_dialed: str) -> bool:
    return True


def test_a_proof_made_with_another_token_is_refused():
    asked = challenge.ask("127.0.0.1:1")
    with pytest.raises(ValueError, match="proof does not match"):
        challenge.respond("mine", asked, challenge.answer("theirs", asked, challenge.HOST, 0.0))
    reply = challenge.answer("job", asked, challenge.HOST, 100.0)
    credential = challenge.respond("job", asked, reply)
    assert challenge.check("job", credential, 100.0, _anywhere) is None
    assert challenge.check("other", credential, 100.0, _anywhere) == (
        "a credential made with another token"
    )
    assert challenge.check("job", credential, 100.0 + challenge.SESSION_SECONDS + 1, _anywhere) == (
        "an expired credential"
    )
    assert "job" not in credential, "the token itself is never in what is sent"


def test_a_proof_or_a_credential_is_bound_to_the_endpoint_who_asks_and_the_direction():
    asked = challenge.ask("10.0.0.2:29400")
    reply = challenge.answer("job", asked, challenge.HOST, 100.0)
    # The same reply, for a login that dialed another endpoint, or asked as a service.
    for other in (
        challenge.Ask(asked.nonce, "10.0.0.1:29400", asked.asker),
        challenge.Ask(asked.nonce, asked.dialed, challenge.SERVICE),
    ):
        with pytest.raises(ValueError, match="proof does not match"):
            challenge.respond("job", other, reply)
    # A role said in the reply is what was proven: changing it breaks the proof.
    forged = reply.replace(f":{challenge.HOST}:", f":{challenge.STANDBY}:")
    with pytest.raises(ValueError, match="proof does not match"):
        challenge.respond("job", asked, forged)
    credential = challenge.respond("job", asked, reply)
    assert challenge.check("job", credential, 100.0, lambda d: d == "10.0.0.2:29400") is None
    assert challenge.check("job", credential, 100.0, lambda d: d == "10.0.0.1:29400") == (
        "a credential for 10.0.0.2:29400, which is not this service"
    )
    # Another endpoint written into the credential breaks its MAC.
    moved = credential.replace("10.0.0.2:29400", "10.0.0.1:29400")
    assert challenge.check("job", moved, 100.0, _anywhere) == "a credential made with another token"
    # The service's proof is not a client's credential, nor the other way round.
    assert challenge.check("job", reply, 100.0, _anywhere) is not None


def test_a_service_that_does_not_hold_the_token_gets_nothing_from_the_client():
    port = free_port()
    server = EmbeddedServer("127.0.0.1", port, token="impostor")
    store = EtcdV3Store(f"127.0.0.1:{port}", StoreAccess("the service", token="job", retry_for=5))
    try:
        with pytest.raises(StoreError, match="did not prove that it holds this node's token"):
            store.get("/k")
        assert store.client.current.metadata == [], "no credential was made, so none was sent"
    finally:
        store.close()
        server.close()


def test_a_client_with_a_token_and_a_service_without_one_is_a_clear_error():
    port = free_port()
    server = EmbeddedServer("127.0.0.1", port, token=None)
    store = EtcdV3Store(f"127.0.0.1:{port}", StoreAccess("the service", token="job", retry_for=5))
    try:
        with pytest.raises(StoreError, match="runs without a token and this node has one"):
            store.get("/k")
    finally:
        store.close()
        server.close()


def test_an_expired_credential_is_renewed():
    port = free_port()
    server = EmbeddedServer("127.0.0.1", port, token="job")
    store = EtcdV3Store(f"127.0.0.1:{port}", StoreAccess("the service", token="job", retry_for=5))
    try:
        store.put("/k", b"1")
        asked = challenge.ask(f"127.0.0.1:{port}")
        reply = challenge.answer("job", asked, challenge.HOST, 0.0)  # 1970
        expired = challenge.respond("job", asked, reply)
        store.client.current.metadata = [("token", expired)]
        assert store.get("/k").value == b"1", "refused, logged in again, answered"
        assert store.client.current.metadata != [("token", expired)]
    finally:
        store.close()
        server.close()


# ---- TLS for the embedded service ------------------------------------------------------------


def tls_conf(tls_files: dict[str, Path]) -> dict[str, str]:
    return {
        "cacert": str(tls_files["ca"]),
        "cert": str(tls_files["cert"]),
        "key": str(tls_files["key"]),
    }


@contextlib.contextmanager
def two_nodes_over_tls(tls_files, endpoint: str) -> Iterator[list[EmbeddedRendezvous]]:
    """Two nodes of a job over TLS with a token, in their first round (shut down after)."""
    conf = {**tls_conf(tls_files), "token": "job", "join_timeout": "30", "last_call_timeout": "1"}
    made: list[EmbeddedRendezvous] = []
    lock = threading.Lock()

    def node(_: int) -> int:
        p = RendezvousParameters(
            "c10d", endpoint, "tls-job", 2, 2, 1, local_addr="127.0.0.1", config=conf
        )
        h = EmbeddedRendezvous(p)
        with lock:
            made.append(h)
        return h.next_rendezvous().group_rank

    pool = ThreadPoolExecutor(2)
    try:
        assert sorted(pool.map(node, range(2), timeout=60)) == [0, 1]
        yield made
    finally:
        for h in made:
            h.shutdown()
        pool.shutdown(wait=False)


@pytest.mark.slow  # openssl makes the certificates
def test_two_nodes_form_a_round_over_tls_with_a_token(tls_files):
    with two_nodes_over_tls(tls_files, f"127.0.0.1:{free_port()}") as made:
        assert sum(h.hosting for h in made) == 1


@pytest.mark.slow  # openssl makes the certificates
def test_a_standby_over_tls_with_a_token_takes_over_from_its_host(tls_files):
    # Two endpoints: each node serves one; the services prove the token to each other and
    # speak TLS, as the nodes do. The host's service stops: the other's takes over, and the
    # node left reads the job's state through it.
    endpoint = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with two_nodes_over_tls(tls_files, endpoint) as made:
        assert all(h.server is not None for h in made), "each node serves an endpoint"
        host = next(h for h in made if h.hosting)
        other = next(h for h in made if h is not host)
        host._stop_serving(0)
        deadline = time.monotonic() + 30
        while not other.hosting:
            assert time.monotonic() < deadline, "the standby did not take over"
            time.sleep(0.05)
        state, _ = other.job.read()
        assert state is not None and state.status.value == "final"


@pytest.mark.slow  # openssl makes the certificates
def test_one_endpoint_over_tls_the_successor_serves_tls_and_takes_over(tls_files):
    # One endpoint: the node that does not host is chosen as the successor; its service
    # speaks TLS and proves the token as the host's does. The host's service stops: the
    # successor's copy takes over, and the node left reads the job's state through it.
    with two_nodes_over_tls(tls_files, f"127.0.0.1:{free_port()}") as made:
        host = next(h for h in made if h.hosting)
        other = next(h for h in made if h is not host)
        deadline = time.monotonic() + 30
        while other._succession.server is None or not other._succession.server.state.term:
            assert time.monotonic() < deadline, "no successor stood by"
            time.sleep(0.05)
        assert other._succession.server._tls is not None, "it serves TLS"
        host._stop_serving(0)
        while not other.hosting:
            assert time.monotonic() < deadline, "the successor did not take over"
            time.sleep(0.05)
        state, _ = other.job.read()
        assert state is not None and state.status.value == "final"


@pytest.mark.slow  # openssl makes the certificates
def test_the_tls_service_refuses_plain_and_certificateless_clients(tls_files):
    port = free_port()
    c = tls_conf(tls_files)
    server = EmbeddedServer("127.0.0.1", port, token=None, tls=(c["cacert"], c["cert"], c["key"]))
    target = f"127.0.0.1:{port}"
    good = EtcdV3Store(
        target, StoreAccess("tls", tls=(c["cacert"], c["cert"], c["key"]), retry_for=5)
    )
    plain = EtcdV3Store(target, StoreAccess("plain", retry_for=1))
    anonymous = EtcdV3Store(
        target, StoreAccess("no client certificate", tls=(c["cacert"], None, None), retry_for=1)
    )
    try:
        good.put("/k", b"v")
        assert good.get("/k").value == b"v"
        for refused in (plain, anonymous):
            with pytest.raises(StoreError, match="unreachable"):
                refused.get("/k")
    finally:
        for s in (good, plain, anonymous):
            s.close()
        server.close()


# ---- etcd: the password never in clear -----------------------------------------------------


def etcd(endpoint: str, backend: str = "etcd", **conf: str) -> RendezvousParameters:
    return RendezvousParameters(backend, endpoint, "job", 1, 2, 1, config=conf)


@pytest.mark.slow  # openssl makes the certificates
@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_any_tls_option_means_tls(backend, tls_files):
    p = etcd("etcd0:2379", backend, cacert=str(tls_files["ca"]))
    assert _etcd_members(p, parse_conf(backend, p.config))[0] == "https"
    p = etcd("http://etcd0:2379", backend, cacert=str(tls_files["ca"]))
    with pytest.raises(RendezvousConfigError, match="says http, but TLS options"):
        check_parameters(p)


@pytest.mark.slow  # openssl makes the certificates
@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_a_password_is_never_sent_without_tls_unless_allowed(backend, tls_files, tmp_path):
    password = secret(tmp_path, "pw")
    with pytest.raises(
        RendezvousConfigError, match="the password would cross the network in clear"
    ):
        check_parameters(etcd("etcd0:2379", backend, user="u", password_file=password))
    check_parameters(
        etcd("etcd0:2379", backend, user="u", password_file=password, allow_insecure_auth="true")
    )
    check_parameters(
        etcd("etcd0:2379", backend, user="u", password_file=password, cacert=str(tls_files["ca"]))
    )


# ---- the host: chosen by the port, which no other user can hold for us ------------------------


@contextlib.contextmanager
def as_nobody(code: str, ready: str) -> Iterator[None]:
    """`code` run by another user (nobody) until the block ends, once it printed `ready`."""
    if os.getuid() != 0:
        pytest.skip("needs root, to run a process as another user")
    import shutil
    import subprocess
    import sys

    # setpriv changes the user after the exec: Popen(user=...) would fork this process, whose
    # gRPC threads' fork handlers then run in the child (it died before printing, once).
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    other = subprocess.Popen(
        [*nobody, python, "-c", code], stdout=subprocess.PIPE, text=True, cwd="/"
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == ready
        yield
    finally:
        other.kill()
        other.wait(10)


@pytest.mark.slow  # a squatter process as user nobody
def test_another_user_cannot_keep_this_agent_from_hosting():
    # The host was picked by an abstract-socket lock named after the port, which any local user
    # could bind first: the agent then never hosted and its job failed after join_timeout.
    port = free_port()
    squat = (
        "import socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        f"s.bind('\\0elasticrun-rdzv-{port}')\n"
        "s.listen(1)\n"
        "print('bound', flush=True)\n"
        "time.sleep(60)\n"
    )
    handler = None
    with as_nobody(squat, "bound"):
        p = RendezvousParameters(
            "c10d",
            f"127.0.0.1:{port}",
            "job",
            2,
            2,
            1,
            local_addr="127.0.0.1",
            config={"join_timeout": "5"},
        )
        try:
            handler = EmbeddedRendezvous(p)
            assert handler.hosting, "the agent hosts: the port decides, not a lock others can take"
        finally:
            if handler is not None:
                handler.shutdown()


@pytest.mark.slow  # a listener run as user nobody
def test_without_a_token_a_member_the_store_names_on_another_users_port_is_not_used():
    # A successor key or a standby's refusal names a port another user listens on: without
    # a token nothing proves it is the job's, so the client does not use it.
    port = free_port()
    listen = (
        "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
        f"s.bind(('127.0.0.1',{port}));s.listen();print('listening',flush=True);"
        "import time;time.sleep(60)"
    )
    server = EmbeddedServer("127.0.0.1", 0, token=None)
    store = EtcdV3Store(f"127.0.0.1:{server.port}", StoreAccess("no token", retry_for=5))
    try:
        with as_nobody(listen, "listening"):
            assert store.client.learn(StoreMember("127.0.0.1", port)) is None
        assert store.client.learn(StoreMember("10.9.9.9", 5)) is None, "beyond loopback"
        assert len(store.client.connections) == 1
        mine = EmbeddedServer("127.0.0.1", 0, token=None)
        try:
            assert store.client.learn(StoreMember("127.0.0.1", mine.port)) is not None
        finally:
            mine.close()
    finally:
        store.close()
        server.close()


@pytest.mark.slow  # a listener run as user nobody
def test_a_port_another_user_listens_on_is_refused_naming_the_owner():
    """Without a token nothing proves the service on the port is the job's: another local user
    listening there first would read every key. The agent refuses, naming the port's owner."""
    port = free_port()
    listen = (
        "import socket, time\n"
        "s = socket.socket()\n"
        f"s.bind(('127.0.0.1', {port}))\n"
        "s.listen(8)\n"
        "print('listening', flush=True)\n"
        "time.sleep(60)\n"
    )
    with as_nobody(listen, "listening"):
        for conf in ({}, {"is_host": "false"}):  # an agent that would host, one that joins
            p = RendezvousParameters(
                "c10d",
                f"127.0.0.1:{port}",
                "job",
                2,
                2,
                1,
                local_addr="127.0.0.1",
                config={"join_timeout": "5", **conf},
            )
            with pytest.raises(RendezvousConfigError) as e:
                EmbeddedRendezvous(p)
            assert f"127.0.0.1:{port}: the port is held by another user, nobody (uid 65534)" in (
                str(e.value)
            )
            assert "ELASTICRUN_RDZV_TOKEN" in str(e.value)


# ---- a host that cannot serve says so at once --------------------------------------------------


def test_free_ports_come_from_below_the_ephemeral_range():
    from elastic_launch.net import ephemeral_range

    low, _ = ephemeral_range()
    assert all(free_port() < low for _ in range(20)), "a port no bind(0) or connection takes"


class _OtherProgram:
    """A program holding a port that answers, but not in HTTP/2 (as an HTTP/1 server would)."""

    def __init__(self, port: int) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    def close(self) -> None:
        self.closed.set()
        self.thread.join(5)
        self.sock.close()


@pytest.mark.slow  # a silent listener costs the probe's 2 s
def test_what_listens_at_a_port_is_told_apart():
    import socket

    from elastic_launch.rendezvous.backends import NOBODY, OTHER, SERVICE, who_serves

    port = free_port()
    assert who_serves("127.0.0.1", port, None) == NOBODY
    other = _OtherProgram(port)
    try:
        assert who_serves("127.0.0.1", port, None) == OTHER
    finally:
        other.close()
    with socket.socket() as silent:  # bound and listening, says nothing: it may be starting
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        assert who_serves("127.0.0.1", silent.getsockname()[1], None) == NOBODY
    for token in (None, "job"):  # refusing this node's missing credential, it is still ours
        server = EmbeddedServer("127.0.0.1", 0, token=token)
        try:
            assert who_serves("127.0.0.1", server.port, None) == SERVICE
        finally:
            server.close()


def test_an_agent_that_cannot_host_says_so_at_once_naming_the_port():
    import time

    from elastic_launch.rendezvous.api import RendezvousConnectionError

    port = free_port()
    other = _OtherProgram(port)
    try:
        p = RendezvousParameters(
            "c10d",
            f"127.0.0.1:{port}",
            "job",
            2,
            2,
            1,
            local_addr="127.0.0.1",
            config={"join_timeout": "600"},
        )
        t0 = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as e:
            EmbeddedRendezvous(p)
        assert time.monotonic() - t0 < 20, "at once, not after join_timeout"
    finally:
        other.close()
    message = str(e.value)
    assert f"cannot host the rendezvous service on 127.0.0.1:{port}" in message
    assert "held by a program that is not a rendezvous service" in message


def test_a_service_of_another_job_on_this_agents_port_is_named_as_such():
    """With a token, the port this agent would host on is served by another process (another
    job's service, with its own token): the agent says another process serves the port, not
    only that a proof failed."""
    port = free_port()
    server = EmbeddedServer("127.0.0.1", port, token="another-jobs-token")
    p = RendezvousParameters(
        "c10d",
        f"127.0.0.1:{port}",
        "job",
        2,
        2,
        1,
        local_addr="127.0.0.1",
        config={"join_timeout": "5", "token": "this-jobs-token"},
    )
    try:
        with pytest.raises(StoreError) as e:
            EmbeddedRendezvous(p)  # its first request is the proof
    finally:
        server.close()
    message = str(e.value)
    assert message.startswith(f"another process serves 127.0.0.1:{port}, where this agent"), message
    assert "did not prove that it holds this node's token" in message, message
    assert "give this job another --rdzv-endpoint port if it is another job's" in message


def test_a_service_is_reached_only_where_it_listens():
    # Found by review: any address of the machine at the service's port was taken as the
    # service's, though another process may listen at another address on that port (two
    # endpoints of one machine, one port, two addresses could relay to each other).
    import asyncio

    from elastic_launch.rendezvous.embedded.reached import ReachedAt

    async def reached(bound: str, *dialed: str) -> list[bool]:
        at = ReachedAt(["node0:29400"], 29400, bound)
        return [await at.learn(d) for d in dialed]

    assert asyncio.run(
        reached("127.0.0.1", "node0:29400", "127.0.0.1:29400", "localhost:29400")
    ) == [True, True, True], "its listed name, its address, a name for its address"
    assert asyncio.run(
        reached("127.0.0.1", "127.0.0.2:29400", "127.0.0.1:29401", "no-such-host.invalid:29400")
    ) == [False, False, False], "another address of the machine, another port, no address"
    assert asyncio.run(reached("0.0.0.0", "127.0.0.2:29400")) == [True], "listening on all"
