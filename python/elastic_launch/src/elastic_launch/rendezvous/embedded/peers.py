"""Another service of the same job, as this embedded service sees it: a channel on this
service's event loop, logged in with the job's token (the peer proves it holds the token
before anything derived from it is sent, as for any client), its status, its Follow stream
when this service follows it, and the announcement a host makes to it. With a token, a status
or a stream is believed only with the peer's proof of it (:func:`challenge.attest`): a process
that took the port of a peer once logged in to cannot make one up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from elastic_launch.rendezvous.etcd.v3_client import CHANNEL_OPTIONS, read_file
from elastic_launch.rendezvous.etcdpb import replica_pb2, replica_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.store import challenge
from elastic_launch.rendezvous.store.api import Tls
from elastic_launch.rendezvous.store.endpoints import StoreMember

logger = logging.getLogger(__name__)

#: Seconds a peer has to answer a status probe: a stopped one must not hold the others up.
PROBE_TIMEOUT = 1.0
#: Seconds a host has to start a Follow stream (its first word proves who it is).
FOLLOW_TIMEOUT = 2.0


class UnprovenError(ValueError):
    """A peer's answer that does not prove it comes from a holder of the job's token."""


class Peer:
    """The service at `member` (the `index`-th of the job's endpoints)."""

    def __init__(self, member: StoreMember, index: int, token: str | None, tls: Tls | None) -> None:
        self.member = member
        self.index = index
        self._token = token
        self._tls = tls
        self._open()

    def _open(self) -> None:
        # A channel of its own (not gRPC's process-wide pool of connections): one that another
        # channel saw refused, and that gRPC would not try again for a while, is not shared.
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        if self.member.name is not None and self._tls is not None:
            options.append(("grpc.ssl_target_name_override", self.member.name))
        if self._tls is None:
            self.channel = grpc.aio.insecure_channel(self.member.target, options=options)
        else:
            ca, cert, key = (read_file(p) if p else None for p in self._tls)
            creds = grpc.ssl_channel_credentials(ca, key, cert)
            self.channel = grpc.aio.secure_channel(self.member.target, creds, options=options)
        self._auth = rpc_pb2_grpc.AuthStub(self.channel)
        self._maintenance = rpc_pb2_grpc.MaintenanceStub(self.channel)
        self.replica = replica_pb2_grpc.ReplicaStub(self.channel)
        self.metadata: list[tuple[str, str]] = []
        self._unproven_said = False

    async def _reopen(self) -> None:
        """A new channel: the next call connects afresh (gRPC would wait out its backoff)."""
        old = self.channel
        self._open()
        with contextlib.suppress(Exception):
            await old.close(grace=0)

    async def log_in(self) -> None:
        """Log in (the challenge) if the job has a token; raises grpc.RpcError if the peer
        cannot be reached, ValueError if it does not prove it holds the token."""
        if self._token is None:
            return
        asked = challenge.ask(self.member.target, challenge.SERVICE)
        request = rpc_pb2.AuthenticateRequest(name=challenge.USER, password=asked.password)
        reply = await self._auth.Authenticate(request, timeout=PROBE_TIMEOUT)
        self.metadata = [("token", challenge.respond(self._token, asked, reply.token))]

    def _asking(self) -> tuple[str, list[tuple[str, str]]]:
        """A fresh nonce for a call whose answer must be proven, and the call's metadata."""
        return challenge.asking(self.metadata, self._token is not None)

    def _check_proof(self, sent: Any, call_nonce: str, *said: str) -> None:
        """UnprovenError unless the answer's metadata `sent` proves `said` (with a token)."""
        if self._token is None:
            return
        proof = dict((str(k), str(v)) for k, v in (sent or ())).get(challenge.PROOF_KEY, "")
        if not challenge.attested(self._token, self.member.target, call_nonce, proof, *said):
            if not self._unproven_said:
                self._unproven_said = True
                logger.warning(
                    "the rendezvous service at %s answers without proving that it holds the "
                    "job's token: it is not followed (another process may hold its port)",
                    self.member.written,
                )
            raise UnprovenError(f"{self.member.written} did not prove its answer")

    async def status(self) -> Any:
        """Its status (its role, term and revision), or None when it does not answer as a
        service of this job (gone, stopped, or without the token). A call that fails is
        tried once more on a new channel: a peer that just came back is seen."""
        for attempt in range(2):
            try:
                if not self.metadata:
                    await self.log_in()
                call_nonce, metadata = self._asking()
                call = self._maintenance.Status(
                    rpc_pb2.StatusRequest(), timeout=PROBE_TIMEOUT, metadata=metadata
                )
                status = await call
                self._check_proof(
                    await call.initial_metadata(), call_nonce, *challenge.status_said(status)
                )
                return status
            except grpc.RpcError as e:
                if attempt or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return None  # a stopped peer is waited for once, not twice
                await self._reopen()  # and logs in again: its credential may have expired
            except ValueError:
                return None
        return None

    async def follow(self, requests: AsyncIterator[Any]) -> Any:
        """A Follow stream to the peer, once its first word proves who it is; grpc.RpcError
        or ValueError (UnprovenError) if it refuses or does not prove it."""
        if not self.metadata:
            await self.log_in()
        call_nonce, metadata = self._asking()
        call = self.replica.Follow(requests, metadata=metadata)
        try:
            sent = await asyncio.wait_for(call.initial_metadata(), FOLLOW_TIMEOUT)
            if self._token is not None and not any(k == challenge.PROOF_KEY for k, _ in sent):
                await self._refused(call)  # a refusal says nothing first
            self._check_proof(sent, call_nonce, "follow")
        except BaseException:
            call.cancel()
            raise
        return call

    async def _refused(self, call: Any) -> None:
        """ValueError saying why, if `call` ended refused (within FOLLOW_TIMEOUT)."""
        with contextlib.suppress(asyncio.TimeoutError):
            code = await asyncio.wait_for(call.code(), FOLLOW_TIMEOUT)
            if code != grpc.StatusCode.OK:
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    self.metadata = []
                raise ValueError(f"{code.name}: {await call.details()}")

    async def announce(self, term: int, index: int, address: str) -> str:
        """Tell the peer that this service (the `index`-th, at `address`) hosts `term`; why
        it did not take it ("" when it did)."""
        try:
            if not self.metadata:
                await self.log_in()
            request = replica_pb2.Announcement(term=term, index=index, address=address)
            await self.replica.Announce(request, timeout=PROBE_TIMEOUT, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                self.metadata = []
            return f"{e.code().name}: {e.details()}"
        except ValueError as e:
            return str(e)
        return ""

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.channel.close(grace=0)
