"""A process without the job's token that took a standby's endpoint, as an attacker writes it:
it passes every login it gets on to the real host (as it came, or with the host's address
put in), tries every credential it was sent on the host, answers a status probe with the
host's own answer to the same call where it can get one (else with one it makes up), claims a
newer term as the host, and announces that term to the host with every credential it holds.

Run in a thread of a test (:class:`Impostor`), or as a process of its own
(``python relay_impostor.py PORT HOST_TARGET [--as-nobody]``: it binds after dropping to
user nobody, so its port is another user's; it prints "listening" once it listens).
"""

from __future__ import annotations

import sys
import threading
from concurrent import futures
from typing import Any

import grpc
from elastic_launch.rendezvous.etcdpb import replica_pb2, replica_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.store import challenge
from elastic_launch.rendezvous.store.wire import EMBEDDED_VERSION

CLAIMED_TERM = 99
MEMBER_ID = 2


class Impostor(
    rpc_pb2_grpc.AuthServicer,
    rpc_pb2_grpc.KVServicer,
    rpc_pb2_grpc.MaintenanceServicer,
    replica_pb2_grpc.ReplicaServicer,
):
    """Listens on 127.0.0.1:`port` and relays to the service at `host_target`; `rewrite`: put
    the host's address into every login it passes on (else as it came)."""

    def __init__(self, port: int, host_target: str, rewrite: bool = False) -> None:
        self.host_target = host_target
        self.rewrite = rewrite
        self.lock = threading.Lock()
        self.logins = 0  # logins passed on to the host
        self.host_answered = 0  # of those, answered with a proof by the host
        self.credentials: set[str] = set()  # every credential a caller sent it
        self.accepted = 0  # calls the host answered with a credential it relayed
        self.refused: list[str] = []  # why the host refused them
        self._host = grpc.insecure_channel(host_target)
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        rpc_pb2_grpc.add_AuthServicer_to_server(self, self.server)
        rpc_pb2_grpc.add_KVServicer_to_server(self, self.server)
        rpc_pb2_grpc.add_MaintenanceServicer_to_server(self, self.server)
        replica_pb2_grpc.add_ReplicaServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    # ---- what it does with what it is sent ---------------------------------------------------

    def _caught(self, context: Any) -> list[tuple[str, str]]:
        sent = {k: v for k, v in (context.invocation_metadata() or ())}
        credential = sent.get("token", "")
        if credential:
            with self.lock:
                self.credentials.add(credential)
        return [("token", credential)] if credential else []

    def try_credentials(self) -> None:
        """Every credential caught so far, tried on the host: a write, and an announcement
        of a newer term."""
        with self.lock:
            caught = list(self.credentials)
        kv = rpc_pb2_grpc.KVStub(self._host)
        replica = replica_pb2_grpc.ReplicaStub(self._host)
        announcement = replica_pb2.Announcement(
            term=CLAIMED_TERM, index=1, address=f"127.0.0.1:{self.port}"
        )
        put = rpc_pb2.PutRequest(key=b"/impostor", value=b"x")
        for credential in caught:
            metadata = [("token", credential)]
            for method, request in ((kv.Put, put), (replica.Announce, announcement)):
                try:
                    method(request, metadata=metadata, timeout=5)
                    with self.lock:
                        self.accepted += 1
                except grpc.RpcError as e:
                    with self.lock:
                        self.refused.append(f"{e.code().name}: {e.details()}")

    # ---- handlers -----------------------------------------------------------------------------

    def Authenticate(self, request: Any, context: Any) -> Any:  # noqa: N802
        password = request.password
        asked = challenge.parse_ask(password)
        if self.rewrite and asked is not None:
            password = challenge.Ask(asked.nonce, self.host_target, asked.asker).password
        with self.lock:
            self.logins += 1
        try:
            reply = rpc_pb2_grpc.AuthStub(self._host).Authenticate(
                rpc_pb2.AuthenticateRequest(name=request.name, password=password), timeout=5
            )
        except grpc.RpcError as e:
            context.abort(e.code(), e.details() or "")
        with self.lock:
            self.host_answered += 1
        return reply

    def Status(self, request: Any, context: Any) -> Any:  # noqa: N802
        metadata = self._caught(context)
        sent = dict(context.invocation_metadata() or ())
        nonce = sent.get(challenge.NONCE_KEY)
        if nonce:
            metadata.append((challenge.NONCE_KEY, nonce))
        try:  # the host's own answer to this very call, and its proof, where it gives one
            answer, call = rpc_pb2_grpc.MaintenanceStub(self._host).Status.with_call(
                request, metadata=metadata, timeout=5
            )
            context.send_initial_metadata(tuple(call.initial_metadata() or ()))
            answer.raftTerm = CLAIMED_TERM
            answer.leader = answer.header.member_id = MEMBER_ID
            return answer
        except grpc.RpcError:
            pass
        return rpc_pb2.StatusResponse(
            header=rpc_pb2.ResponseHeader(member_id=MEMBER_ID, revision=10**6, cluster_id=7),
            version=EMBEDDED_VERSION,
            leader=MEMBER_ID,
            raftTerm=CLAIMED_TERM,
            isLearner=False,
        )

    def Follow(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        """A made-up state of a newer term, for a service that would follow it."""
        self._caught(context)
        context.send_initial_metadata(())
        snapshot = replica_pb2.Snapshot(revision=10**6, cluster_id=7, term=CLAIMED_TERM, done=True)
        yield replica_pb2.Update(seq=1, snapshot=snapshot)
        for _ in request_iterator:
            yield replica_pb2.Update(seq=2, heartbeat=True)

    def Range(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._caught(context)
        return rpc_pb2.RangeResponse(
            header=rpc_pb2.ResponseHeader(member_id=MEMBER_ID, revision=10**6, cluster_id=7)
        )

    def Put(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._caught(context)
        return rpc_pb2.PutResponse(
            header=rpc_pb2.ResponseHeader(member_id=MEMBER_ID, revision=10**6, cluster_id=7)
        )

    def close(self) -> None:
        self.server.stop(0).wait(5)
        self._host.close()


def main() -> None:
    port, host_target = int(sys.argv[1]), sys.argv[2]
    if "--as-nobody" in sys.argv:  # this user's files may be closed to nobody: import first
        import concurrent.futures.thread  # noqa: F401
        import os

        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    impostor = Impostor(port, host_target)
    print("listening", flush=True)
    impostor.server.wait_for_termination(120)


if __name__ == "__main__":
    main()
