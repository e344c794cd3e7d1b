"""What the embedded services of one job say to each other, and the refusals every handler
shares: a service's status (its role, term and revision, in etcd's fields), a standby's Follow
stream, and a host's announcement to a service that hosts an older term without knowing it.

Every call needs the job's token when it has one (:class:`Guard`), and the answers a
service's peers act on prove who gives them. A standby refuses a
client's request with the host's address and the cluster it now belongs to in the call's
trailing metadata, so that a client that knew only this service finds the host
(:mod:`.wire`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from elastic_launch.rendezvous.embedded.reached import ReachedAt
from elastic_launch.rendezvous.embedded.state import ServiceState
from elastic_launch.rendezvous.etcdpb import replica_pb2, replica_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.store import challenge
from elastic_launch.rendezvous.store.wire import CLUSTER_KEY, EMBEDDED_VERSION, HOST_KEY

if TYPE_CHECKING:
    from elastic_launch.rendezvous.embedded.replicas import Replicas
    from elastic_launch.rendezvous.embedded.roles import Roles


class RefusedError(Exception):
    """A request the service refuses: the status, message and trailing metadata it answers
    with."""

    def __init__(
        self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.metadata = metadata


async def refuse(
    context: grpc.aio.ServicerContext, e: RefusedError, guard: Guard | None = None
) -> None:
    """End the call with `e`'s status (raises, as gRPC's abort does); a refusal that names
    the host carries `guard`'s proof of it for the call's nonce."""
    metadata = e.metadata
    said = dict(metadata)
    if guard is not None and HOST_KEY in said:
        metadata += guard.attest(context, "refusal", said[HOST_KEY], said.get(CLUSTER_KEY, ""))
    await context.abort(e.code, e.details, metadata)


class Guard:
    """What a call to this service must show when the job has a `token`: a credential earned
    with it (:mod:`.challenge`) for an endpoint at which this service is reached (`reached`,
    set once it listens)."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.reached = ReachedAt((), 0)

    def check(self, context: grpc.aio.ServicerContext) -> None:
        """Refuse a call that does not carry such a credential."""
        if self.token is None:
            return
        sent = _metadata(context).get("token", "")
        problem = challenge.check(self.token, sent, time.time(), self.reached)
        if problem is not None:
            raise RefusedError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"invalid rendezvous token: the request carries {problem}; give every node "
                "the job's token (--rdzv-conf token_file=PATH, or $ELASTICRUN_RDZV_TOKEN)",
            )

    async def log_in(self, name: str, password: str, role: str) -> str:
        """The challenge's answer to a login as `name` with `password`, from this service in
        `role`; RefusedError if it is not a login, or not one to this service."""
        if self.token is None:
            raise RefusedError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this rendezvous service runs without a token and the node asking has one: "
                "give every node the same token, or none",
            )
        asked = challenge.parse_ask(password) if name == challenge.USER else None
        if asked is None:
            raise RefusedError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"log in as {challenge.USER!r} with the password NONCE|DIALED|ASKER (a nonce "
                "of 32 hex digits, the endpoint dialed, agent or service)",
            )
        if not await self.reached.learn(asked.dialed):
            raise RefusedError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this rendezvous service is reached at {self.reached}, not at "
                f"{asked.dialed}: the process at {asked.dialed} passed a login on to it, "
                "or --rdzv-endpoint names it by an address that is not its own; give "
                "every node the same --rdzv-endpoint",
            )
        return challenge.answer(self.token, asked, role, time.time())

    def attest(self, context: grpc.aio.ServicerContext, *said: str) -> tuple[tuple[str, str], ...]:
        """The metadata that proves this service gives this answer (`said`) to this call,
        when the call sent a nonce (:func:`challenge.attest`); none otherwise."""
        sent = _metadata(context)
        call_nonce, credential = sent.get(challenge.NONCE_KEY, ""), sent.get("token", "")
        if self.token is None or not challenge.valid_nonce(call_nonce):
            return ()
        proof = challenge.attest(self.token, challenge.dialed_of(credential), call_nonce, *said)
        return ((challenge.PROOF_KEY, proof),)


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {str(k): str(v) for k, v in (context.invocation_metadata() or ())}


def standby_refusal(roles: Roles | None, state: ServiceState) -> RefusedError | None:
    """Why a client's request is refused here (this service stands by), or None: it hosts."""
    if roles is None or roles.serving:
        return None
    host = roles.host_address()
    if host is None:
        return RefusedError(
            grpc.StatusCode.UNAVAILABLE,
            "this rendezvous service is a standby, and no host is known yet: ask the host",
        )
    said: tuple[tuple[str, str], ...] = ((HOST_KEY, host),)
    if state.term:  # it holds the host's copy: its cluster is the host's (not its own yet)
        said += ((CLUSTER_KEY, f"{state.cluster_id:x}"),)
    return RefusedError(
        grpc.StatusCode.UNAVAILABLE,
        f"this rendezvous service is a standby of the host at {host}: ask the host",
        said,
    )


class Peering(rpc_pb2_grpc.MaintenanceServicer, replica_pb2_grpc.ReplicaServicer):
    """Status, Follow and Announce, for the service whose state is `state`."""

    def __init__(self, state: ServiceState, guard: Guard, replicas: Replicas) -> None:
        self.s = state
        self.guard = guard
        self.replicas = replicas
        self.roles: Roles | None = None  # made on the loop (see EmbeddedServer._start)

    async def Status(  # noqa: N802 - gRPC's name
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """Served by a standby too: its role, term and revision, in etcd's fields (the other
        services decide who hosts by them; a client learns what it talks to)."""
        try:
            self.guard.check(context)
        except RefusedError as e:
            await refuse(context, e)
        roles = self.roles
        host = roles.host if roles is not None else 0
        status = rpc_pb2.StatusResponse(
            header=self.s.header(),
            version=EMBEDDED_VERSION,
            leader=host + 1 if host is not None else 0,
            raftIndex=max(self.s.fork, 0),
            raftTerm=self.s.term,
            isLearner=roles is not None and not roles.serving,
        )
        proof = self.guard.attest(context, *challenge.status_said(status))
        if proof:
            await context.send_initial_metadata(proof)
        return status

    async def Follow(  # noqa: N802 - gRPC's name
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """A standby follows this host (:mod:`.replicas`)."""
        try:
            self.guard.check(context)
            refusal = standby_refusal(self.roles, self.s)
            if refusal is not None:
                raise refusal
        except RefusedError as e:
            await refuse(context, e)
        proof = self.guard.attest(context, "follow")
        if proof:
            await context.send_initial_metadata(proof)
        async for update in self.replicas.follow(requests_of(context), context):
            yield update

    async def Announce(  # noqa: N802 - gRPC's name
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """A host of a newer term than this service's: it is looked at at once (this service
        steps down and follows it, as when two hosts find each other)."""
        try:
            self.guard.check(context)
            if self.roles is None:
                raise RefusedError(grpc.StatusCode.UNAVAILABLE, "this service is starting")
            problem = self.roles.announced(int(request.term), int(request.index), request.address)
            if problem is not None:
                raise RefusedError(grpc.StatusCode.FAILED_PRECONDITION, problem)
        except RefusedError as e:
            await refuse(context, e)
        return replica_pb2.Announced()


async def requests_of(context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    """A stream's requests, none of them held while the next is awaited (gRPC's iterator holds
    the last one until the next arrives: a megabyte a stream, on streams that go quiet)."""
    while True:
        request = await context.read()
        if request is grpc.aio.EOF:
            return
        yield request
        del request
