"""The elastic backends: which store each one uses.

- ``embedded`` (alias ``c10d``): the agent whose address is ``--rdzv-endpoint`` hosts the
  service (the first agent there to take the host lock and bind the port; ``is_host`` forces the
  choice); a single-node job needs no service at all (:mod:`.local`).
- ``etcd``: etcd's v3 API (etcd 3.4 to 3.6+), with TLS and user/password options.
- ``etcd-v2``: etcd's v2 API through python-etcd.

Their ``--rdzv-conf`` keys are in :mod:`.conf`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from elastic_launch.cancel import NEVER, CancelToken
from elastic_launch.net import HostLock, host_port, is_local_host, parse_endpoint, port_free
from elastic_launch.rendezvous.api import (
    RendezvousConfigError,
    RendezvousHandler,
    RendezvousParameters,
)
from elastic_launch.rendezvous.conf import RendezvousConf, parse_conf
from elastic_launch.rendezvous.elastic import ElasticRendezvous
from elastic_launch.rendezvous.store import Store

if TYPE_CHECKING:
    from elastic_launch.rendezvous.embedded_server import EmbeddedServer
    from elastic_launch.rendezvous.etcd_v3 import EtcdV3Store

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDED_PORT = 29400
DEFAULT_ETCD_PORT = 2379
HOST_LINGER_S = 300.0  # torchrun's exit barrier waits as long
# Nodes the embedded service is measured to serve through a node loss (docs/rendezvous_scale.md:
# at 1,024 on 2 cores the new round is final 18 s after the loss is seen; larger, not measured).
EMBEDDED_MAX_NODES = 1024


class EmbeddedRendezvous(ElasticRendezvous):
    """The elastic rendezvous over the embedded service; the hosting agent also runs it."""

    def __init__(self, params: RendezvousParameters) -> None:
        conf = parse_conf(params.backend, params.config)
        host, port = _embedded_endpoint(params)
        self.server: EmbeddedServer | None = None
        # Agents on one host race to serve: the one holding the lock serves, the others are
        # clients (as with another host's service). The lock is an abstract socket: no file.
        self._host_lock = HostLock(f"elasticrun-rdzv-{port}")
        self._serve_if_host(host, port, conf)
        from elastic_launch.rendezvous.etcd_v3 import EtcdV3Store

        store = EtcdV3Store(
            host_port(host, port),
            f"the rendezvous service at {host_port(host, port)}",
            token=conf.token,
            retry_for=conf.join_timeout,
            read_timeout=conf.read_timeout,
            watch_from_now=False,  # it replays a watch's past at once (etcd: every 100 ms)
        )
        self._v3: EtcdV3Store = store  # its leases tell the host who is still here
        try:
            super().__init__(params, store, conf, host)
        except BaseException:
            store.close()
            self._stop_serving()
            raise

    def _serve_if_host(self, host: str, port: int, conf: RendezvousConf) -> None:
        """Host the service when this node is its host: ``is_host`` says so, or the endpoint
        is this host and this agent is the first on it to take the host lock and the port."""
        wants_host = conf.is_host if conf.is_host is not None else is_local_host(host)
        if (
            wants_host
            and conf.is_host is None
            and (not self._host_lock.acquire() or not port_free(host, port))
        ):
            wants_host = False
            self._host_lock.release()
        if not wants_host:
            return
        from elastic_launch.rendezvous.embedded_server import EmbeddedServer

        try:
            self.server = EmbeddedServer(host, port, conf.token)
            logger.info("hosting the rendezvous service on %s", host_port(host, port))
        except OSError as e:
            self._host_lock.release()
            if conf.is_host:
                raise RendezvousConfigError(
                    f"--rdzv-endpoint {host_port(host, port)}: cannot host the rendezvous "
                    f"({e}); free the port, or leave is_host out"
                ) from None

    @property
    def hosting(self) -> bool:
        return self.server is not None

    def _stop_serving(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self._host_lock.release()

    def shutdown(self, cancel: CancelToken = NEVER) -> None:
        if self.server is not None and not cancel.cancelled and self.ended_here():
            # The others' last requests (done, closing the job, reading how it ended) go
            # through this service: keep it up until they have left (their leases ended), as
            # torchrun's exit barrier does. A stopped launcher does not wait.
            logger.info(
                "waiting up to %.0f s for the other nodes to leave (this node hosts the "
                "rendezvous service)",
                HOST_LINGER_S,
            )
            if not self.server.wait_for_clients(self._v3.leases, HOST_LINGER_S, cancel):
                logger.warning(
                    "other nodes still hold the rendezvous service after %.0f s: stopping it",
                    HOST_LINGER_S,
                )
        super().shutdown(cancel)
        self._stop_serving()


def check_parameters(params: RendezvousParameters) -> None:
    """Parse a built-in backend's --rdzv-conf, endpoint and files without connecting or
    binding anything: a bad setting is a RendezvousConfigError before the launcher opens its
    first resource. (Outside backends check theirs when they are created.)"""
    conf = parse_conf(params.backend, params.config)
    if params.backend in ("etcd", "etcd-v2"):
        _etcd_endpoint(params, conf)
        _check_files(conf)
    elif params.backend in ("embedded", "c10d"):
        if params.max_nodes > 1:
            _embedded_endpoint(params, warn=False)
        elif params.endpoint:
            parse_endpoint(params.endpoint, "--rdzv-endpoint", DEFAULT_EMBEDDED_PORT)


def _embedded_endpoint(params: RendezvousParameters, warn: bool = True) -> tuple[str, int]:
    """Where the embedded service is (required, the same on every node)."""
    if not params.endpoint:
        raise RendezvousConfigError(
            f"--rdzv-backend {params.backend} with --nnodes {params.min_nodes}:"
            f"{params.max_nodes} needs --rdzv-endpoint HOST:PORT, the address of the node "
            "that hosts the rendezvous (the same on every node)"
        )
    if warn and params.max_nodes > EMBEDDED_MAX_NODES:
        logger.warning(
            "--nnodes %d:%d with --rdzv-backend %s: the embedded rendezvous service is "
            "measured to serve %d nodes through a node loss, not more; for larger jobs "
            "use --rdzv-backend etcd (docs/rendezvous_scale.md)",
            params.min_nodes,
            params.max_nodes,
            params.backend,
            EMBEDDED_MAX_NODES,
        )
    return parse_endpoint(params.endpoint, "--rdzv-endpoint", DEFAULT_EMBEDDED_PORT)


def _etcd_endpoint(params: RendezvousParameters, conf: RendezvousConf) -> tuple[str, str, int]:
    text = params.endpoint.split(",")[0].strip()
    if not text:
        raise RendezvousConfigError(
            f"--rdzv-backend {params.backend} needs --rdzv-endpoint HOST:PORT of etcd "
            "(for example etcd0:2379)"
        )
    protocol = conf.protocol or "http"
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            protocol = scheme[:-3]
            text = text[len(scheme) :]
    host, port = parse_endpoint(text, "--rdzv-endpoint", DEFAULT_ETCD_PORT)
    return protocol, host, port


def _over(
    params: RendezvousParameters, store: Store, conf: RendezvousConf, host: str
) -> RendezvousHandler:
    """The elastic rendezvous over `store`, which is closed if the handler cannot be made."""
    try:
        return ElasticRendezvous(params, store, conf, host)
    except BaseException:
        store.close()
        raise


def _check_files(conf: RendezvousConf) -> None:
    for path in filter(None, (conf.cacert, conf.cert, conf.key)):
        if not os.path.isfile(path):
            raise RendezvousConfigError(f"--rdzv-conf: TLS file '{path}' does not exist")


def create_etcd(params: RendezvousParameters) -> RendezvousHandler:
    from elastic_launch.rendezvous.etcd_v3 import EtcdV3Store

    conf = parse_conf(params.backend, params.config)
    protocol, host, port = _etcd_endpoint(params, conf)
    _check_files(conf)
    tls = (
        (conf.cacert, conf.cert, conf.key)
        if protocol == "https" or conf.cacert or conf.cert
        else None
    )
    store = EtcdV3Store(
        host_port(host, port),
        f"etcd at {host_port(host, port)}",
        user=conf.user,
        password=conf.password,
        tls=tls,
        retry_for=conf.join_timeout,
        read_timeout=conf.read_timeout,
    )
    return _over(params, store, conf, host)


def create_etcd_v2(params: RendezvousParameters) -> RendezvousHandler:
    from elastic_launch.rendezvous.etcd_v2 import EtcdV2Store

    conf = parse_conf(params.backend, params.config)
    protocol, host, port = _etcd_endpoint(params, conf)
    _check_files(conf)
    store = EtcdV2Store(
        f"[{host}]" if ":" in host else host,  # python-etcd puts it in a URL as it is
        port,
        f"etcd at {host_port(host, port)}",
        protocol=protocol,
        user=conf.user,
        password=conf.password,
        ca_cert=conf.cacert,
        cert=(conf.cert, conf.key) if conf.cert and conf.key else None,
        retry_for=conf.join_timeout,
        read_timeout=conf.read_timeout,
    )
    return _over(params, store, conf, host)
