"""The elastic backends: which store each one uses.

- ``embedded`` (alias ``c10d``): the agent whose address is ``--rdzv-endpoint`` hosts the
  service (the first agent there to bind the port, which is bound exclusively; ``is_host``
  forces the choice); a single-node job needs no service at all (:mod:`.local`). With one
  endpoint, the agents choose a successor that keeps a copy (:mod:`.succession`). Beyond
  loopback it needs a token (or ``allow_unauthenticated``); with ``cert``/``key``/``cacert`` it
  speaks mutual TLS.
- ``etcd``: etcd's v3 API (etcd 3.4 to 3.6+), with TLS and user/password options.
- ``etcd-v2``: etcd's v2 API through python-etcd.

Their ``--rdzv-conf`` keys are in :mod:`.conf`.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastic_launch.cancel import NEVER, CancelToken
from elastic_launch.net import (
    ephemeral_range,
    host_port,
    is_local_host,
    is_loopback,
    listener_owners,
    parse_endpoint,
    resolve_error,
)
from elastic_launch.rendezvous.api import (
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from elastic_launch.rendezvous.conf import RendezvousConf, parse_conf
from elastic_launch.rendezvous.embedded.succession import Succession
from elastic_launch.rendezvous.round.elastic import ElasticRendezvous
from elastic_launch.rendezvous.store import endpoints
from elastic_launch.rendezvous.store.api import Store, StoreAccess, StoreError, Tls
from elastic_launch.rendezvous.store.endpoints import (
    DEFAULT_EMBEDDED_PORT,
    DEFAULT_ETCD_PORT,
    StoreMember,
)

if TYPE_CHECKING:
    from elastic_launch.rendezvous.embedded.server import EmbeddedServer
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

logger = logging.getLogger(__name__)

HOST_LINGER_S = 300.0  # torchrun's exit barrier waits as long
HOST_BIND_GRACE = 30.0  # seconds a held port may take to serve or come free (as a start)
# Nodes the embedded service is measured to serve through a node loss (docs/rendezvous_scale.md:
# at 1,024 on 2 cores the new round is final 18 s after the loss is seen; larger, not measured).
EMBEDDED_MAX_NODES = 1024
#: How long an agent that does not host waits for the embedded service to answer at all, when
#: its join timeout is shorter: agents started together wait for their host as torch's wait
#: for their store (its read timeout: 60 s); the join timeout counts from the first answer.
HOST_WAIT = 60.0
#: A successor's index is past the listed endpoints by this much and a random part: each one
#: the agents choose is another member of the job's services.
SUCCESSOR_BASE = 1 << 16
#: The nodes of a job begin to follow the successor key at moments spread over N / RATE s,
#: SPREAD s at most (1,024 nodes beginning at once starved their own leases: 41 s to a round).
SUCCESSION_RATE = 200.0
SUCCESSION_SPREAD = 5.0


class EmbeddedRendezvous(ElasticRendezvous):
    """The elastic rendezvous over the embedded service; the agents that serve it run it too.
    With several endpoints, each node that can serve one does (the first it can bind), one of
    them hosts and the others stand by to take over (:mod:`.roles`). With one, the
    agents choose a successor that stands by (:mod:`.succession`)."""

    def __init__(self, params: RendezvousParameters) -> None:
        conf = parse_conf(params.backend, params.config)
        members = _embedded_members(params, conf)
        self._members = members
        self._succession: Succession | None = None
        self.server: EmbeddedServer | None = None
        self._another_serves = False  # a port of this host was served by another process
        self._serve_one(members, conf)
        from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

        where = endpoints.written(members)
        access = StoreAccess(
            f"the rendezvous service at {where}",
            token=conf.token,
            tls=_tls(conf),
            retry_for=conf.join_timeout,
            read_timeout=conf.read_timeout,
            trusted_network=conf.allow_unauthenticated,
        )
        # It replays a watch's past at once (etcd: every 100 ms).
        store = EtcdV3Store(members, access, watch_from_now=False)
        self._v3: EtcdV3Store = store  # its leases tell the host who is still here
        try:
            super().__init__(params, store, conf, members[0].host)
            if self.server is None or not self.server.hosting:
                self.first_contact = HOST_WAIT
            if len(members) == 1 and params.max_nodes > 1:
                stand_by = self._stand_by if self._may_stand_by() else None
                self._succession = Succession(store, self.node, stand_by)
        except StoreError as e:
            store.close()
            self._stop_serving()
            if self._another_serves and str(e).startswith("invalid rendezvous token"):
                # Not this job's service, most likely: say so before the token's own advice.
                raise StoreError(
                    f"another process serves {where}, where this agent would have hosted the "
                    f"job's rendezvous (another job's service, or a node of this job with "
                    f"another token): {e}; give this job another --rdzv-endpoint port if it "
                    "is another job's"
                ) from None
            raise
        except BaseException:
            store.close()
            self._stop_serving()
            raise

    def _serve_one(self, members: list[StoreMember], conf: RendezvousConf) -> None:
        """Serve the first endpoint this agent can: one of this host (or any, with
        ``is_host=true``; none with ``is_host=false``) that no other agent serves."""
        if conf.is_host is False:
            for m in members:
                if is_loopback(m.host):
                    _refuse_another_users(m.host, m.port, conf)
            return
        mine = [i for i, m in enumerate(members) if conf.is_host or is_local_host(m.host)]
        for i in mine:
            if self._serve_if_free(members, i, conf):
                return
        if conf.is_host and len(members) > 1:
            raise RendezvousConfigError(
                f"--rdzv-endpoint {endpoints.written(members)}: cannot host the rendezvous: "
                "other agents serve every endpoint; leave is_host out"
            )

    def _serve_if_free(self, members: list[StoreMember], i: int, conf: RendezvousConf) -> bool:
        """Serve endpoint `i` if this agent is the first on its host to bind its port (bound
        exclusively, no SO_REUSEPORT: the lock that picks one agent among those of a host,
        which no other user can hold for us); False if another agent of this host serves it.
        A port held by anything but another agent's service is an error at once, on every
        agent of this host: no one waits for a service that will not come."""
        from elastic_launch.rendezvous.embedded.server import EmbeddedServer

        host, port = members[i].host, members[i].port
        _warn_if_ephemeral(port)
        give_up = time.monotonic() + HOST_BIND_GRACE
        while True:
            try:
                self.server = EmbeddedServer(host, port, conf.token, _tls(conf), members, i)
                logger.info("serving the rendezvous service on %s", host_port(host, port))
                return True
            except OSError as e:
                error = e
            if conf.is_host and len(members) == 1:
                raise RendezvousConfigError(
                    f"--rdzv-endpoint {host_port(host, port)}: cannot host the rendezvous "
                    f"({error}); free the port, or leave is_host out"
                ) from None
            _refuse_another_users(host, port, conf)
            holder = who_serves(host, port, _tls(conf))
            if holder == SERVICE:
                logger.info("another agent of this host serves the rendezvous: %s", error)
                self._another_serves = True
                return False
            if holder == OTHER or time.monotonic() > give_up:
                raise RendezvousConnectionError(
                    f"cannot host the rendezvous service on {host_port(host, port)} ({error}): "
                    + (
                        "the port is held by a program that is not a rendezvous service"
                        if holder == OTHER
                        else f"the port stayed taken for {HOST_BIND_GRACE:g} s, and nothing "
                        "answered there as a rendezvous service"
                    )
                    + "; free it or give every node another --rdzv-endpoint port"
                ) from None
            time.sleep(0.1)  # an outgoing connection's port, or a service starting: again

    def _may_stand_by(self) -> bool:
        """Whether this agent may be the successor: it serves no endpoint and may serve (not
        ``is_host=false``; a certificate for TLS; beyond loopback, the token or
        ``allow_unauthenticated``, as for the host)."""
        conf = self.conf
        if conf.is_host is False or self.server is not None:
            return False
        if conf.tls and not (conf.cert and conf.key):
            return False
        return conf.token is not None or conf.allow_unauthenticated or is_loopback(self.addr)

    def _stand_by(self) -> EmbeddedServer | None:
        """This agent's service as the successor: on its address, a port the kernel picks,
        the job's token, TLS and bounds; None if it cannot start (said). It looks for the
        host among every member this agent's client knows: the endpoint, and the successors
        named before (one of them may host now)."""
        from elastic_launch.rendezvous.embedded.server import EmbeddedServer

        known = [c.member for c in self._v3.client.connections]
        index = len(known) + SUCCESSOR_BASE + secrets.randbelow(1 << 30)
        conf = self.conf
        try:
            return EmbeddedServer(self.addr, 0, conf.token, _tls(conf), known, index)
        except OSError as e:
            logger.warning("this node cannot stand by for the rendezvous service: %s", e)
            return None

    def _joined(self) -> None:
        """In the job: follow the successor key from now on (not before: the first round's
        requests go first), and stand by if no other node does. The nodes of a large job
        begin at moments spread over a time that grows with its size (5 s at most): not all
        at once, as the round they all entered was final."""
        if self._succession is not None:
            spread = min(SUCCESSION_SPREAD, self.params.max_nodes / SUCCESSION_RATE)
            self._succession.start(delay=secrets.randbelow(1000) / 1000 * spread)
            self._succession.may_stand_by()

    @property
    def hosting(self) -> bool:
        """Whether this agent's service hosts the job now (its endpoint's, or the one it
        started as the successor)."""
        return self._hosting_server() is not None

    def _hosting_server(self) -> EmbeddedServer | None:
        succession = self._succession
        for server in (self.server, succession.server if succession else None):
            if server is not None and server.hosting:
                return server
        return None

    def _stop_serving(self, grace: float = 1.0) -> None:
        succession = self._succession
        if succession is not None and succession.server is not None:
            succession.server.close(grace)
            succession.server = None
        if self.server is not None:
            self.server.close(grace)
            self.server = None

    def shutdown(self, cancel: CancelToken = NEVER) -> None:
        succession = self._succession
        if succession is not None:
            succession.stop()
            standing_by = succession.server
            if standing_by is not None and not standing_by.hosting:
                standing_by.close(0.0)  # a copy no one needs now: the host drops it
                succession.server = None
        server = self._hosting_server()
        if server is not None and not cancel.cancelled and self.ended_here():
            # The others' last requests (done, closing the job, reading how it ended) go
            # through this service: keep it up until they have left (their leases ended), as
            # torchrun's exit barrier does. A stopped launcher does not wait.
            logger.info(
                "waiting up to %.0f s for the other nodes to leave (this node hosts the "
                "rendezvous service)",
                HOST_LINGER_S,
            )
            if not server.wait_for_clients(self._v3.leases, HOST_LINGER_S, cancel):
                logger.warning(
                    "other nodes still hold the rendezvous service after %.0f s: stopping it",
                    HOST_LINGER_S,
                )
        super().shutdown(cancel)
        if succession is not None:
            succession.join()
        self._stop_serving(0.0 if cancel.cancelled else 1.0)  # a stopped launcher does not wait


SERVICE, OTHER, NOBODY = "service", "other", "nobody"


def who_serves(host: str, port: int, tls: Any) -> str:
    """What listens at host:port: an embedded rendezvous service (even one that refuses this
    node's credentials), another program, or nothing that answers yet."""
    import grpc

    from elastic_launch.rendezvous.etcd import v3 as etcd_v3
    from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc
    from elastic_launch.rendezvous.store.wire import EMBEDDED_VERSION

    if tls is None:
        http2 = _speaks_http2(host, port)
        if http2 is None:
            return NOBODY
        if not http2:
            return OTHER
    stub: Any = rpc_pb2_grpc.MaintenanceStub  # generated code, untyped
    with etcd_v3.channel(host_port(host, port), tls) as probe:
        try:
            reply = stub(probe).Status(rpc_pb2.StatusRequest(), timeout=2.0)
            return SERVICE if reply.version == EMBEDDED_VERSION else OTHER  # another version: etcd
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if code == grpc.StatusCode.UNAUTHENTICATED and "rendezvous token" in details:
                return SERVICE  # ours, refusing this probe's missing credential
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return NOBODY  # a busy host that did not answer in time: ask again
            return OTHER  # a gRPC server without etcd's Maintenance service


_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _speaks_http2(host: str, port: int) -> bool | None:
    """Whether what listens at host:port answers HTTP/2's connection preface with its SETTINGS
    frame, as every gRPC server does at once; None if nothing listens or it says nothing."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as s:
            s.settimeout(2.0)
            s.sendall(_HTTP2_HELLO)
            head = b""
            while len(head) < 9:
                chunk = s.recv(9 - len(head))
                if not chunk:
                    return False  # closed without a word of HTTP/2
                head += chunk
    except TimeoutError:
        return None
    except OSError as e:
        return None if e.errno in (errno.ECONNREFUSED, None) else False
    return head[3] == 0x04  # a SETTINGS frame


def check_parameters(params: RendezvousParameters) -> None:
    """Parse a built-in backend's --rdzv-conf, endpoint and files without connecting or
    binding anything: a bad setting is a RendezvousConfigError before the launcher opens its
    first resource. (Outside backends check theirs when they are created.)"""
    conf = parse_conf(params.backend, params.config)
    _check_files(conf)
    if params.backend in ("etcd", "etcd-v2"):
        _etcd_members(params, conf)
    elif params.backend in ("embedded", "c10d"):
        if params.max_nodes > 1:
            _embedded_members(params, conf, warn=False)
        elif params.endpoint:
            parse_endpoint(params.endpoint, "--rdzv-endpoint", DEFAULT_EMBEDDED_PORT)


def _tls(conf: RendezvousConf) -> tuple[str | None, str | None, str | None] | None:
    return (conf.cacert, conf.cert, conf.key) if conf.tls else None


def _embedded_members(
    params: RendezvousParameters, conf: RendezvousConf, warn: bool = True
) -> list[StoreMember]:
    """Where the embedded service is (required, the same on every node): its endpoints, the
    first listed hosting first. Beyond loopback it never runs open: every node refuses to
    start without a token, unless told it may."""
    if not params.endpoint.strip():
        raise RendezvousConfigError(
            f"--rdzv-backend {params.backend} with --nnodes {params.min_nodes}:"
            f"{params.max_nodes} needs --rdzv-endpoint HOST:PORT, the address of the node "
            "that hosts the rendezvous (the same on every node; several, comma-separated, "
            "let another take over when the host is lost)"
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
    listed = endpoints.split(params.endpoint, "--rdzv-endpoint", DEFAULT_EMBEDDED_PORT)
    members = [StoreMember(host, port) for host, port in listed]  # a name is one node's
    for m in members:
        _open_only_on_loopback(m, conf)
    return members


def _open_only_on_loopback(member: StoreMember, conf: RendezvousConf) -> None:
    host, port = member.host, member.port
    if conf.token is None and not conf.allow_unauthenticated and not is_loopback(host):
        unresolved = resolve_error(host)
        if unresolved is not None:
            raise RendezvousConfigError(
                f"--rdzv-endpoint {host_port(host, port)}: cannot resolve {host!r} "
                f"({unresolved}); check the name, or give the host's address"
            )
        raise RendezvousConfigError(
            f"--rdzv-endpoint {host_port(host, port)} is beyond loopback, and the rendezvous "
            "service there would let anyone who reaches the port read the job, join it or end "
            "it: give every node the same token (export ELASTICRUN_RDZV_TOKEN=$(openssl rand "
            "-hex 16), or --rdzv-conf token_file=PATH), or, on a network you trust, "
            "--rdzv-conf allow_unauthenticated=true (docs/security.md)"
        )


def _warn_if_ephemeral(port: int) -> None:
    low, high = ephemeral_range()
    if low <= port <= high:
        logger.warning(
            "--rdzv-endpoint port %d is in this host's ephemeral range (%d-%d): the kernel "
            "may give it to any outgoing connection before the service binds it; choose a "
            "port below %d (the default is %d)",
            port,
            low,
            high,
            low,
            DEFAULT_EMBEDDED_PORT,
        )


def _refuse_another_users(host: str, port: int, conf: RendezvousConf) -> None:
    """Without a token, nothing proves that the service on this host's port is the job's: one
    that another user runs there would read and write every key. So a listener of another
    user is refused (with a token, the service proves it holds it, or the agent stops)."""
    if conf.token is not None:
        return
    others = sorted(listener_owners(port) - {os.getuid()})
    if not others:
        return
    import pwd

    names = []
    for uid in others:
        try:
            names.append(f"{pwd.getpwuid(uid).pw_name} (uid {uid})")
        except KeyError:
            names.append(f"uid {uid}")
    raise RendezvousConfigError(
        f"--rdzv-endpoint {host_port(host, port)}: the port is held by another user, "
        f"{', '.join(names)}, not by this one (uid {os.getuid()}): without a token its program "
        "would read and write this job's keys; free the port or choose another, or give every "
        "node the same token (export ELASTICRUN_RDZV_TOKEN=$(openssl rand -hex 16))"
    )


def _etcd_members(
    params: RendezvousParameters, conf: RendezvousConf
) -> tuple[str, list[StoreMember]]:
    """The scheme and every member of the etcd cluster that ``--rdzv-endpoint`` names."""
    if not params.endpoint.strip():
        raise RendezvousConfigError(
            f"--rdzv-backend {params.backend} needs --rdzv-endpoint HOST:PORT of etcd "
            "(for example etcd0:2379, or every member: etcd0:2379,etcd1:2379,etcd2:2379)"
        )
    schemes = set()
    items = []
    for written in params.endpoint.split(","):
        text = written.strip()
        for scheme in ("http://", "https://"):
            if text.startswith(scheme):
                schemes.add(scheme[:-3])
                text = text[len(scheme) :]
        items.append(text.rstrip("/"))
    if len(schemes) > 1:
        raise RendezvousConfigError(
            f"--rdzv-endpoint {params.endpoint} mixes http:// and https://: every member of a "
            "cluster is reached the same way; write one scheme (or none)"
        )
    protocol = schemes.pop() if schemes else conf.protocol
    if protocol == "http" and conf.tls:
        raise RendezvousConfigError(
            f"--rdzv-endpoint {params.endpoint} says http, but TLS options (cacert, cert, key) "
            "are given: TLS is used whenever one is; write https:// (or no scheme)"
        )
    protocol = "https" if conf.tls else protocol or "http"
    if protocol == "http" and conf.user is not None and not conf.allow_insecure_auth:
        raise RendezvousConfigError(
            f"--rdzv-conf user={conf.user}: etcd at {params.endpoint} is reached without TLS, "
            "so the password would cross the network in clear; give cacert=PATH (and https), "
            "or, on a network you trust, allow_insecure_auth=true"
        )
    listed = endpoints.split(",".join(items), "--rdzv-endpoint", DEFAULT_ETCD_PORT)
    return protocol, endpoints.resolve(listed)


def _etcd_access(conf: RendezvousConf, members: list[StoreMember], tls: Tls | None) -> StoreAccess:
    return StoreAccess(
        f"etcd at {endpoints.written(members)}",
        user=conf.user,
        password=conf.password,
        tls=tls,
        retry_for=conf.join_timeout,
        read_timeout=conf.read_timeout,
    )


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
    if (conf.cert is None) != (conf.key is None):
        raise RendezvousConfigError(
            "--rdzv-conf: give cert=PATH and key=PATH together (a certificate and its key)"
        )


def create_etcd(params: RendezvousParameters) -> RendezvousHandler:
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

    conf = parse_conf(params.backend, params.config)
    protocol, members = _etcd_members(params, conf)
    _check_files(conf)
    tls = (conf.cacert, conf.cert, conf.key) if protocol == "https" else None
    store = EtcdV3Store(members, _etcd_access(conf, members, tls))
    _one_cluster(store, store.client.check_one_cluster)
    return _over(params, store, conf, members[0].host)


def create_etcd_v2(params: RendezvousParameters) -> RendezvousHandler:
    from elastic_launch.rendezvous.etcd.v2 import EtcdV2Store

    conf = parse_conf(params.backend, params.config)
    protocol, members = _etcd_members(params, conf)
    _check_files(conf)
    access = _etcd_access(conf, members, (conf.cacert, conf.cert, conf.key))
    store = EtcdV2Store(members, access, protocol)
    _one_cluster(store, store.check_one_cluster)
    return _over(params, store, conf, members[0].host)


def _one_cluster(store: Store, check: Callable[[], None]) -> None:
    """`check` that the listed members belong to one cluster; `store` closed if not."""
    try:
        check()
    except BaseException:
        store.close()
        raise
