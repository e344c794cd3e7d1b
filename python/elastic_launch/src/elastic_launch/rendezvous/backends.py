"""The elastic backends: which store each one uses, and the --rdzv-conf keys each accepts.

- ``embedded`` (alias ``c10d``): the agent whose address is ``--rdzv-endpoint`` hosts the
  service (the first agent there to bind the port; ``is_host`` forces the choice); a single-node
  job needs no service at all (:mod:`.local`).
- ``etcd``: etcd's v3 API (etcd 3.4 to 3.6+), with TLS and user/password options.
- ``etcd-v2``: etcd's v2 API through python-etcd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable

from elastic_launch.config import parse_endpoint
from elastic_launch.rendezvous.api import (
    RendezvousConfigError,
    RendezvousHandler,
    RendezvousParameters,
    as_bool,
    check_config_keys,
    positive_seconds,
)
from elastic_launch.rendezvous.elastic import ElasticRendezvous, Timeouts

logger = logging.getLogger(__name__)

TOKEN_ENV = "ELASTICRUN_RDZV_TOKEN"
DEFAULT_EMBEDDED_PORT = 29400
DEFAULT_ETCD_PORT = 2379
HOST_LINGER_S = 300.0  # torchrun's exit barrier waits as long

_TIMEOUT_KEYS: dict[str, Callable[[str], object]] = {
    "timeout": positive_seconds,  # torch's name for the join timeout
    "join_timeout": positive_seconds,
    "last_call_timeout": positive_seconds,
    "close_timeout": positive_seconds,
    "heartbeat_timeout": positive_seconds,
    "read_timeout": positive_seconds,
    "reconnect_timeout": positive_seconds,
    # torch c10d's liveness settings: a node is dead after interval x attempts.
    "keep_alive_interval": positive_seconds,
    "keep_alive_max_attempt": int,
}
EMBEDDED_KEYS: dict[str, Callable[[str], object]] = {
    **_TIMEOUT_KEYS,
    "is_host": as_bool,
    "token": str,
}
ETCD_KEYS: dict[str, Callable[[str], object]] = {
    **_TIMEOUT_KEYS,
    "protocol": str,
    "cacert": str,
    "cert": str,
    "key": str,
    "user": str,
    "username": str,
    "password": str,
}


def _timeouts(conf: dict[str, object]) -> Timeouts:
    merged = dict(conf)
    if "heartbeat_timeout" not in merged and "keep_alive_interval" in merged:
        attempts = int(merged.get("keep_alive_max_attempt", 3))  # type: ignore[call-overload]
        merged["heartbeat_timeout"] = float(merged["keep_alive_interval"]) * attempts  # type: ignore[arg-type]
    return Timeouts.from_config(merged)


def _is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return False
    if addr.startswith("127."):
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))  # only an address of this host can be bound
        return True
    except OSError:
        return False


def _try_lock(port: int) -> int | None:
    import fcntl
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"elasticrun-rdzv-{port}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class EmbeddedRendezvous(ElasticRendezvous):
    """The elastic rendezvous over the embedded service; the hosting agent also runs it."""

    def __init__(self, params: RendezvousParameters) -> None:
        conf = check_config_keys(params, EMBEDDED_KEYS)
        if not params.endpoint:
            raise RendezvousConfigError(
                f"--rdzv-backend {params.backend} with --nnodes {params.min_nodes}:"
                f"{params.max_nodes} needs --rdzv-endpoint HOST:PORT, the address of the node "
                "that hosts the rendezvous (the same on every node)"
            )
        host, port = parse_endpoint(params.endpoint, "--rdzv-endpoint", DEFAULT_EMBEDDED_PORT)
        token = str(conf.get("token") or os.environ.get(TOKEN_ENV) or "") or None
        timeouts = _timeouts(conf)
        self.server = None
        wants_host = conf.get("is_host")
        if wants_host is None:
            wants_host = _is_local(host)
        self._host_lock: int | None = None
        if wants_host and not conf.get("is_host"):
            # Agents on one host race to serve: the one holding the lock serves, the others
            # are clients (as with another host's service).
            self._host_lock = _try_lock(port)
            if self._host_lock is None or not _port_free(host, port):
                wants_host = False
                self._release_lock()
        if wants_host:
            from elastic_launch.rendezvous.embedded_server import EmbeddedServer

            try:
                self.server = EmbeddedServer(host, port, token)
                logger.info("hosting the rendezvous service on %s:%d", host, port)
            except OSError as e:
                if conf.get("is_host"):
                    raise RendezvousConfigError(
                        f"--rdzv-endpoint {host}:{port}: cannot host the rendezvous ({e}); free "
                        "the port, or leave is_host out"
                    ) from None
                self._release_lock()  # something else has the port: be a client
        from elastic_launch.rendezvous.etcd_v3 import EtcdV3Store

        store = EtcdV3Store(
            f"{host}:{port}",
            f"the rendezvous service at {host}:{port}",
            token=token,
            retry_for=timeouts.join,
        )
        try:
            super().__init__(params, store, timeouts, host)
        except BaseException:
            store.close()
            self._stop_serving()
            raise

    def _release_lock(self) -> None:
        if self._host_lock is not None:
            os.close(self._host_lock)
            self._host_lock = None

    def _stop_serving(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self._release_lock()

    def shutdown(self) -> bool:
        if self.server is not None and self._finished_first:
            # The others' last writes (done, the closing state) go through this service:
            # keep it up until they finish, as torchrun's exit barrier does.
            logger.info(
                "waiting up to %.0f s for the other nodes to finish (this node hosts the "
                "rendezvous service)",
                HOST_LINGER_S,
            )
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: stop waiting
                self.wait_for_others(HOST_LINGER_S)
        super().shutdown()
        self._stop_serving()
        return True


def _etcd_endpoint(params: RendezvousParameters, conf: dict[str, object]) -> tuple[str, str, int]:
    text = params.endpoint.split(",")[0].strip()
    if not text:
        raise RendezvousConfigError(
            f"--rdzv-backend {params.backend} needs --rdzv-endpoint HOST:PORT of etcd "
            "(for example etcd0:2379)"
        )
    protocol = str(conf.get("protocol", "http"))
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            protocol = scheme[:-3]
            text = text[len(scheme) :]
    if protocol not in ("http", "https"):
        raise RendezvousConfigError(f"--rdzv-conf protocol={protocol}: use http or https")
    host, port = parse_endpoint(text, "--rdzv-endpoint", DEFAULT_ETCD_PORT)
    return protocol, host, port


def _user(conf: dict[str, object]) -> tuple[str | None, str | None]:
    user = conf.get("user") or conf.get("username")
    password = conf.get("password")
    if (user is None) != (password is None):
        raise RendezvousConfigError("--rdzv-conf: give both user=... and password=..., or neither")
    return (str(user) if user else None), (str(password) if password is not None else None)


def create_etcd(params: RendezvousParameters) -> RendezvousHandler:
    from elastic_launch.rendezvous.etcd_v3 import EtcdV3Store

    conf = check_config_keys(params, ETCD_KEYS)
    protocol, host, port = _etcd_endpoint(params, conf)
    user, password = _user(conf)
    timeouts = _timeouts(conf)
    tls: tuple[str | None, str | None, str | None] | None = None
    if protocol == "https" or conf.get("cacert") or conf.get("cert"):
        ca, cert, key = (str(conf[k]) if conf.get(k) else None for k in ("cacert", "cert", "key"))
        tls = (ca, cert, key)
        for path in filter(None, tls):
            if not os.path.isfile(path):
                raise RendezvousConfigError(f"--rdzv-conf: TLS file '{path}' does not exist")
    name = f"etcd at {host}:{port}"
    store = EtcdV3Store(
        f"{host}:{port}", name, user=user, password=password, tls=tls, retry_for=timeouts.join
    )
    try:
        return ElasticRendezvous(params, store, timeouts, host)
    except BaseException:
        store.close()
        raise


def create_etcd_v2(params: RendezvousParameters) -> RendezvousHandler:
    from elastic_launch.rendezvous.etcd_v2 import EtcdV2Store

    conf = check_config_keys(params, ETCD_KEYS)
    protocol, host, port = _etcd_endpoint(params, conf)
    user, password = _user(conf)
    timeouts = _timeouts(conf)
    cert = (str(conf["cert"]), str(conf["key"])) if conf.get("cert") and conf.get("key") else None
    store = EtcdV2Store(
        host,
        port,
        f"etcd at {host}:{port}",
        protocol=protocol,
        user=user,
        password=password,
        ca_cert=str(conf["cacert"]) if conf.get("cacert") else None,
        cert=cert,
        retry_for=timeouts.join,
    )
    try:
        return ElasticRendezvous(params, store, timeouts, host)
    except BaseException:
        store.close()
        raise
