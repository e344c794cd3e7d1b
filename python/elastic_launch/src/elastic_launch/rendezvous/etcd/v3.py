"""The store over etcd's v3 API (gRPC, the project's own subset in :mod:`.etcdpb`): its
key-value calls, over one connection (:mod:`.v3_client`), with this node's lease
(:mod:`.v3_lease`) and watches (:mod:`.v3_watch`).

Works against etcd 3.4 to 3.6 and against the embedded rendezvous service, which serves the same
subset. Calls retry while the store is unreachable (an etcd restart), up to a deadline; the lease
is renewed in the background; watches reconnect from the last revision they delivered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from elastic_launch.cancel import NEVER, CancelToken
from elastic_launch.rendezvous.etcd.v3_client import Client, LeaseGoneError, channel
from elastic_launch.rendezvous.etcd.v3_lease import Lease
from elastic_launch.rendezvous.etcd.v3_watch import EtcdWatch, key_text, prefix_end
from elastic_launch.rendezvous.etcdpb import kv_pb2, rpc_pb2
from elastic_launch.rendezvous.store.api import (
    Inbox,
    KeyValue,
    Store,
    StoreAccess,
    StoreError,
    Watch,
)
from elastic_launch.rendezvous.store.endpoints import StoreMember
from elastic_launch.rendezvous.store.wire import EMBEDDED_VERSION

__all__ = ["EtcdV3Store", "channel", "key_text", "prefix_end"]

_T = TypeVar("_T")


def _kv(kv: kv_pb2.KeyValue) -> KeyValue:
    return KeyValue(key_text(kv.key), kv.value, kv.mod_revision, kv.create_revision)


class EtcdV3Store(Store):
    """The store at `target` (host:port, or a store's members), reached as `access` says (a
    token for the embedded service, a user and password for etcd, TLS); `cancel` abandons
    calls and retries.
    `watch_from_now`: see :class:`~.etcd_v3_watch.EtcdWatch` (etcd needs it; the embedded
    service replays its history at once, and cannot read past revisions); None asks the server
    which it is, once."""

    def __init__(
        self,
        target: str | Sequence[StoreMember],
        access: StoreAccess,
        cancel: CancelToken = NEVER,
        watch_from_now: bool | None = None,
    ) -> None:
        super().__init__(access, cancel)
        self._watch_from_now = watch_from_now
        # The read timeout with its default filled in (by Store).
        resolved = dataclasses.replace(access, read_timeout=self.read_timeout)
        self.client = Client(target, resolved, cancel, self._count)
        self.lease = Lease(self.client)
        self.client.on_replaced = self._replaced

    @property
    def replaced_at(self) -> float | None:
        return self.client.identity.replaced_at

    def _replaced(self) -> None:
        """The store was started again empty: this node's lease first (its id and TTL, so that
        nothing that names it changes), then what the rendezvous puts back (even if the lease
        could not be granted again: its keys may be written with a new one)."""
        try:
            self.lease.restore()
        finally:
            self.on_replaced()

    # ---- key-value ---------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        reply = self.client.call("kv.Range", rpc_pb2.RangeRequest(key=key.encode()))
        return _kv(reply.kvs[0]) if reply.kvs else None

    def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        p = prefix.encode()
        reply = self.client.call("kv.Range", rpc_pb2.RangeRequest(key=p, range_end=prefix_end(p)))
        return [_kv(kv) for kv in reply.kvs], reply.header.revision

    def put(self, key: str, value: bytes, ephemeral: bool = False) -> int:
        def put(lease: int) -> int:
            request = rpc_pb2.PutRequest(key=key.encode(), value=value, lease=lease)
            return int(self.client.call("kv.Put", request).header.revision)

        return self._with_lease(ephemeral, put)

    def put_get(
        self, key: str, value: bytes, get_key: str, ephemeral: bool = False
    ) -> KeyValue | None:
        def put_get(lease: int) -> Any:
            put = rpc_pb2.PutRequest(key=key.encode(), value=value, lease=lease)
            get = rpc_pb2.RangeRequest(key=get_key.encode())
            request = rpc_pb2.TxnRequest(
                success=[rpc_pb2.RequestOp(request_put=put), rpc_pb2.RequestOp(request_range=get)]
            )
            return self.client.call("kv.Txn", request)

        found = self._with_lease(ephemeral, put_get).responses[1].response_range.kvs
        return _kv(found[0]) if found else None

    def cas_with(self, key: str, value: bytes, version: int, puts: Mapping[str, bytes]) -> int:
        others = [rpc_pb2.PutRequest(key=k.encode(), value=v) for k, v in puts.items()]
        put = rpc_pb2.PutRequest(key=key.encode(), value=value)
        return self._txn(self._unchanged(key.encode(), version), *others, put)

    def _with_lease(self, ephemeral: bool, write: Callable[[int], _T]) -> _T:
        """`write(lease)`: with our lease for an ephemeral key (else none). A lease that
        expired while this node was cut off (a network partition longer than its TTL) is
        replaced, the session told, and the write made with the new one."""
        if not ephemeral:
            return write(0)
        if not self.lease.id:
            raise StoreError("an ephemeral key needs start_liveness() first")
        lease = self.lease.id
        try:
            return write(lease)
        except LeaseGoneError:
            if not self.client.same_store():
                return write(self.lease.id)  # the store was filled again, this lease with it
            self.lease.replace(lease)
            return write(self.lease.id)

    def _txn(self, compare: rpc_pb2.Compare, *puts: rpc_pb2.PutRequest) -> int:
        """The puts if `compare` holds: the revision they made, or 0."""
        request = rpc_pb2.TxnRequest(
            compare=[compare], success=[rpc_pb2.RequestOp(request_put=p) for p in puts]
        )
        response = self.client.call("kv.Txn", request)
        return int(response.header.revision) if response.succeeded else 0

    def create(self, key: str, value: bytes, ephemeral: bool = False) -> int:
        k = key.encode()
        compare = self._unchanged(k, 0)

        def create(lease: int) -> int:
            # On failure the key is read in the same transaction: a create whose answer was
            # lost (a deadline, a reset) and that was retried finds its own key, with this
            # session's lease and its value, and is the creator still.
            request = rpc_pb2.TxnRequest(
                compare=[compare],
                success=[
                    rpc_pb2.RequestOp(
                        request_put=rpc_pb2.PutRequest(key=k, value=value, lease=lease)
                    )
                ],
                failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=k))],
            )
            response = self.client.call("kv.Txn", request)
            if response.succeeded:
                return int(response.header.revision)
            found = response.responses[0].response_range.kvs if response.responses else []
            if lease and found and found[0].lease == lease and found[0].value == value:
                return int(found[0].mod_revision)
            return 0

        return self._with_lease(ephemeral, create)

    @staticmethod
    def _unchanged(k: bytes, version: int) -> rpc_pb2.Compare:
        """The cas condition: `k` still at `version` (0: absent)."""
        if version:
            return rpc_pb2.Compare(
                key=k,
                target=rpc_pb2.Compare.MOD,
                result=rpc_pb2.Compare.EQUAL,
                mod_revision=version,
            )
        return rpc_pb2.Compare(
            key=k,
            target=rpc_pb2.Compare.CREATE,
            result=rpc_pb2.Compare.EQUAL,
            create_revision=0,
        )

    def cas(self, key: str, value: bytes, version: int, ttl: float | None = None) -> int:
        k = key.encode()
        compare = self._unchanged(k, version)
        lease = 0
        if ttl is not None:  # a lease of its own, never renewed: the key goes when it expires
            reply = self.client.call("lease.LeaseGrant", rpc_pb2.LeaseGrantRequest(TTL=round(ttl)))
            lease = reply.ID
        return self._txn(compare, rpc_pb2.PutRequest(key=k, value=value, lease=lease))

    def delete(self, key: str, prefix: bool = False) -> None:
        k = key.encode()
        request = rpc_pb2.DeleteRangeRequest(key=k, range_end=prefix_end(k) if prefix else b"")
        self.client.call("kv.DeleteRange", request)

    @property
    def retry_for(self) -> float:
        return self.client.retry_for

    @retry_for.setter
    def retry_for(self, seconds: float) -> None:
        self.client.retry_for = seconds  # what every call, the lease's and watches' too, reads

    # ---- lease ---------------------------------------------------------------------------

    def start_liveness(self, ttl: float, on_lost: Callable[[], None] | None = None) -> None:
        self.lease.start(ttl, on_lost or self._on_lost)

    def request_lease(self, ttl: float) -> None:
        self.lease.request(ttl)

    def ensure_lease(self) -> None:
        self.lease.ensure()

    def lease_hold(self) -> tuple[int, float] | None:
        """(leases granted so far, until when (monotonic) the one in use is held for sure)."""
        lease = self.lease
        held_until = lease.held_until  # first: a grant between the reads then fences
        return (lease.grants, held_until) if lease.id else None

    @property
    def leases(self) -> set[int]:
        """The ids of the leases this connection holds (the one in use, one asked for early)."""
        return self.lease.held

    # ---- watch ---------------------------------------------------------------------------

    @property
    def watch_from_now(self) -> bool:
        """Whether watches start at the server's revision and fill the gap by reading (etcd),
        or start at the caller's revision (the embedded service)."""
        if self._watch_from_now is None:
            reply = self.client.call("maintenance.Status", rpc_pb2.StatusRequest())
            self._watch_from_now = reply.version != EMBEDDED_VERSION
        return self._watch_from_now

    def watch(self, prefix: str, after_revision: int, inbox: Inbox | None = None) -> Watch:
        return EtcdWatch(self.client, [prefix], after_revision, inbox, self.watch_from_now)

    def watch_many(self, prefixes: list[str], after_revision: int, inbox: Inbox) -> list[Watch]:
        # One stream for all.
        return [EtcdWatch(self.client, prefixes, after_revision, inbox, self.watch_from_now)]

    def close(self) -> None:
        if self.client.closed.is_set():
            return  # closed already
        self.client.closed.set()  # calls under way end with an error, not a retry
        self.lease.close()
        self.client.close()
