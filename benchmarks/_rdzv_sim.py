"""Simulated agents for bench_rdzv_scale.py: one process holding `--count` real rendezvous
handlers (made as the launcher makes them), each calling next_rendezvous() in its own thread as
an agent would, with no workers. Every handler keeps its own lease, watches and writes; only the
process (and gRPC's connection pool) is shared.

The store's operations are counted here, by wrapping the gRPC stubs (etcd v3 and the embedded
service), python-etcd's client (etcd v2), the Store methods (what the rendezvous asks for) and
the JSON decoders (the work each answer costs the agent). Nothing in the package is edited: the
wrappers are installed in this process only.

Commands on stdin, one per line: ``go`` (make the handlers and start the rendezvous), ``snap``
(print the counters since the last snap, and reset them), ``quit``. Everything it reports goes to
stdout, one JSON object per line.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_out_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()
_gauges: dict[str, float] = {}  # maxima since the last snap
_keepalive_last: dict[int, float] = {}  # per lease stub: its last keep-alive
_store_index: dict[int, int] = {}  # id(store) -> handler index


def emit(**fields: Any) -> None:
    line = json.dumps(fields)
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def count(name: str, n: float = 1) -> None:
    with _lock:
        _counts[name] += n  # type: ignore[assignment]


def peak(name: str, value: float) -> None:
    with _lock:
        if value > _gauges.get(name, float("-inf")):
            _gauges[name] = value


def snapshot() -> dict[str, Any]:
    with _lock:
        counts, gauges = dict(_counts), dict(_gauges)
        _counts.clear()
        _gauges.clear()
    t = os.times()
    return {"counts": counts, "peaks": gauges, "cpu": t.user + t.system}


# ---- instrumentation ------------------------------------------------------------------------


def _key_class(key: str) -> str:
    """What a key or prefix is, in the rendezvous' layout (job.py's docstring)."""
    if key.endswith("/state"):
        return "state"
    for part in ("/join/", "/confirm/", "/waiting/", "/done/", "/note/"):
        if part in key:
            rest = key.split(part, 1)[1]
            return part.strip("/") + ("/*" if not rest else "/<node>")
    if key.endswith("/m/") or key.endswith("/m"):
        return "m/*"
    if "/m/v" in key:
        return "round/*"
    return "job/*"


class _Unary:
    """A counted unary gRPC method (called directly or with .future())."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner, self._name = inner, name

    def _sized(self, reply: Any) -> Any:
        count(f"rpc.{self._name}.reply_bytes", reply.ByteSize())
        if self._name == "Range":
            count("rpc.Range.keys", len(reply.kvs))
        return reply

    def __call__(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        count(f"rpc.{self._name}")
        return self._sized(self._inner(request, *args, **kwargs))

    def future(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        count(f"rpc.{self._name}")
        fut = self._inner.future(request, *args, **kwargs)

        def done(f: Any) -> None:
            if not f.cancelled() and f.exception() is None:
                self._sized(f.result())

        fut.add_done_callback(done)
        return fut


class _KeepAlive:
    """Counts keep-alives (each request on the lease's stream), their failures, the longest
    gap between two answers to one lease stub (a gap longer than the TTL is an expired lease)
    and the longest wait for an answer."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __call__(self, requests: Any, *args: Any, **kwargs: Any) -> Any:
        sent: list[float] = []

        def counted() -> Iterator[Any]:
            for r in requests:
                count("rpc.LeaseKeepAlive")
                sent.append(time.monotonic())
                yield r

        call = self._inner(counted(), *args, **kwargs)
        key = id(self)

        class Replies:
            def __iter__(self) -> Any:
                return self

            def __next__(self) -> Any:
                try:
                    reply = next(call)
                except StopIteration:
                    raise
                except Exception:
                    count("rpc.LeaseKeepAlive.failed")
                    raise
                now = time.monotonic()
                with _lock:
                    last = _keepalive_last.get(key)
                    _keepalive_last[key] = now
                if last is not None:
                    peak("keepalive_gap_max_s", now - last)
                if sent:
                    peak("keepalive_latency_max_s", now - sent.pop(0))
                return reply

            def __getattr__(self, name: str) -> Any:
                return getattr(call, name)

        return Replies()


class _WatchCall:
    """A watch stream's responses, counted as they arrive (events and `created` replies)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __iter__(self) -> _WatchCall:
        return self

    def __next__(self) -> Any:
        reply = next(self._inner)
        count("watch.events", len(reply.events))
        count("watch.reply_bytes", reply.ByteSize())
        return reply

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Watch:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __call__(self, requests: Iterator[Any], *args: Any, **kwargs: Any) -> Any:
        count("rpc.Watch(stream)")

        def counted() -> Iterator[Any]:
            for r in requests:
                if r.HasField("create_request"):
                    count("rpc.Watch.create")
                yield r

        return _WatchCall(self._inner(counted(), *args, **kwargs))


def _share_channels() -> None:
    """One gRPC channel (one connection, one completion-queue thread) per store address for
    the whole process, as simulated agents may share a connection; each
    handler still keeps its own lease, watch streams and writes."""
    import grpc

    channels: dict[tuple[str, str], Any] = {}
    original = grpc.insecure_channel

    class Shared:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def close(self) -> None:  # the process's: never closed by one handler
            pass

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    def insecure_channel(target: str, options: Any = None, compression: Any = None) -> Any:
        key = (target, repr(options))
        with _lock:
            if key not in channels:
                channels[key] = Shared(original(target, options=options, compression=compression))
            return channels[key]

    grpc.insecure_channel = insecure_channel


def _own_connections() -> None:
    """One connection per handler's channel, as one agent per machine has: gRPC otherwise
    shares a subchannel (one TCP connection) between the channels of a process that have the
    same target and options."""
    import grpc

    original = grpc.insecure_channel

    def insecure_channel(target: str, options: Any = None, compression: Any = None) -> Any:
        options = [*(options or []), ("grpc.use_local_subchannel_pool", 1)]
        return original(target, options=options, compression=compression)

    grpc.insecure_channel = insecure_channel


def _quiet_grpc_waits() -> None:
    """gRPC's blocking calls wake every 0.1 s while they wait (to let signal handlers run),
    though an answer wakes them anyway. In an agent's own process that is a few wake-ups a
    second; here, with hundreds of agents' streams in one process, it is thousands, each
    taking the GIL, and at N=1,024 they alone kept both cores busy (80% system time) and
    starved the lease renewals. Waking every 2 s changes nothing an agent sends or receives."""
    from grpc import _common

    _common.MAXIMUM_WAIT_TIMEOUT = 2.0


def _instrument_grpc() -> None:
    from elastic_launch.rendezvous.etcdpb import rpc_pb2_grpc as g

    def wrap(cls: Any, make: Callable[[Any], None]) -> None:
        original = cls.__init__

        def init(self: Any, channel: Any) -> None:
            original(self, channel)
            make(self)

        cls.__init__ = init

    def kv(stub: Any) -> None:
        for name in ("Range", "Put", "Txn", "DeleteRange"):
            setattr(stub, name, _Unary(getattr(stub, name), name))

    def lease(stub: Any) -> None:
        for name in ("LeaseGrant", "LeaseRevoke", "LeaseTimeToLive"):
            setattr(stub, name, _Unary(getattr(stub, name), name))
        stub.LeaseKeepAlive = _KeepAlive(stub.LeaseKeepAlive)

    def watch(stub: Any) -> None:
        stub.Watch = _Watch(stub.Watch)

    def maintenance(stub: Any) -> None:
        stub.Status = _Unary(stub.Status, "Status")

    wrap(g.KVStub, kv)
    wrap(g.LeaseStub, lease)
    wrap(g.WatchStub, watch)
    wrap(g.MaintenanceStub, maintenance)


def _instrument_v2() -> None:
    import etcd  # python-etcd

    client = etcd.Client

    def counted(name: str) -> None:
        original = getattr(client, name)

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            kind = name
            if name == "read" and kwargs.get("wait"):
                kind = "watch_poll"
            elif name == "read" and kwargs.get("recursive"):
                kind = "read_recursive"
            count(f"v2.{kind}")
            start = time.monotonic()
            try:
                result = original(self, *args, **kwargs)
            except Exception as e:
                count(f"v2.{kind}.{type(e).__name__}")
                raise
            if kind == "read_recursive":
                count("v2.read_recursive.keys", sum(1 for n in result.leaves if not n.dir))
            if kind == "refresh":
                peak("keepalive_latency_max_s", time.monotonic() - start)
            return result

        setattr(client, name, call)

    for name in ("read", "write", "delete", "refresh"):
        counted(name)


def _instrument_store() -> None:
    """The rendezvous' own requests (Store methods), by kind and key, with what came back;
    the reads that fill watches' gaps, the changes delivered and decoded, lost leases and
    commits."""
    _count_store_ops()
    _count_gap_reads()
    _count_deliveries()
    _count_leases_and_commits()


def _count_store_ops() -> None:
    classes: list[Any] = []
    try:
        from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

        classes.append(EtcdV3Store)
    except ImportError:
        pass
    try:
        from elastic_launch.rendezvous.etcd.v2 import EtcdV2Store

        classes.append(EtcdV2Store)
    except ImportError:
        pass

    ops = ("get", "range", "put", "put_get", "create", "cas", "cas_with", "delete", "watch_many")
    for cls in classes:
        for name in ops:
            if name not in cls.__dict__:
                continue  # the Store default (v2's put_get: a put and a get, counted as such)
            original = getattr(cls, name)

            def make(original: Any = original, name: str = name) -> Any:
                def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                    if name == "watch_many":
                        for p in args[0]:
                            count(f"op.watch({_key_class(p)})")
                    else:
                        count(f"op.{name}({_key_class(args[0])})")
                    result = original(self, *args, **kwargs)
                    if name == "range":
                        count(f"op.range({_key_class(args[0])}).keys", len(result[0]))
                    if name in ("get", "put_get") and result is not None:
                        count("op.get.bytes", len(result.value))
                    if name == "create" and "/join/" in args[0] and result:
                        emit(ev="joined", h=_store_index.get(id(self), -1), t=time.monotonic())
                    return result

                return call

            setattr(cls, name, make())


def _count_gap_reads() -> None:
    # etcd v3: the two reads that fill the gap between a watch's revision and the server's.
    try:
        from elastic_launch.rendezvous.etcd.v3_watch import EtcdWatch

        gap_read = EtcdWatch._read

        def counted_gap(self: Any, key: bytes, revision: int) -> Any:
            kvs = gap_read(self, key, revision)
            name = _key_class(key.decode())
            count(f"gap.range({name})")
            count(f"gap.range({name}).keys", len(kvs))
            return kvs

        EtcdWatch._read = counted_gap  # type: ignore[method-assign]
    except ImportError:
        pass


def _count_deliveries() -> None:
    from elastic_launch.rendezvous.round.state import Member, RoundState
    from elastic_launch.rendezvous.store import api as store

    # Changes delivered to the rendezvous (every watch, whatever the backend).
    put = store.Inbox.put

    def inbox_put(self: Any, item: Any) -> None:
        if isinstance(item, list):
            count("delivered.changes", len(item))
        put(self, item)

    store.Inbox.put = inbox_put  # type: ignore[method-assign]

    # JSON decoding: what each answer costs the agent's CPU.
    for cls in (RoundState, Member):
        original = cls.from_json.__func__  # type: ignore[attr-defined]

        def make_decode(original: Any = original, cls: Any = cls) -> Any:
            def decode(klass: Any, data: bytes, *key: str) -> Any:
                count(f"decode.{cls.__name__}")
                count(f"decode.{cls.__name__}.bytes", len(data))
                return original(klass, data, *key)

            return classmethod(decode)

        cls.from_json = make_decode()  # type: ignore[method-assign]


def _count_leases_and_commits() -> None:
    from elastic_launch.rendezvous.round import job
    from elastic_launch.rendezvous.store import session

    lost = session.Session._lease_lost

    def lease_lost(self: Any) -> None:
        count("lease_lost")
        emit(ev="lease_lost", t=time.monotonic())
        lost(self)

    session.Session._lease_lost = lease_lost  # type: ignore[method-assign]

    # When a round becomes final: the leader's successful commit of the FINAL state.
    commit = job.Job.commit

    def committed(self: Any, state: Any, version: int) -> int:
        written = commit(self, state, version)
        if written:
            emit(
                ev="commit",
                status=state.status.value,
                round=state.version,
                nodes=len(state.nodes),
                t=time.monotonic(),
            )
        return written

    job.Job.commit = committed  # type: ignore[method-assign]


def _instrument_server() -> None:
    """The embedded service's side: calls by method, and the streams open at once."""
    from elastic_launch.rendezvous.embedded import peering as embedded_peering
    from elastic_launch.rendezvous.embedded import server as es

    service = es._Service
    open_streams = collections.Counter[str]()
    unary = ("Range", "Put", "Txn", "DeleteRange", "LeaseGrant", "LeaseRevoke")
    for owner, name in [(service, n) for n in unary] + [(embedded_peering.Peering, "Status")]:
        original = getattr(owner, name)

        def make(original: Any = original, name: str = name) -> Any:
            async def call(self: Any, request: Any, context: Any) -> Any:
                count(f"server.{name}")
                return await original(self, request, context)

            return call

        setattr(owner, name, make())

    for name in ("Watch", "LeaseKeepAlive"):
        original = getattr(service, name)

        def make_stream(original: Any = original, name: str = name) -> Any:
            async def call(self: Any, requests: Any, context: Any) -> AsyncIterator[Any]:
                count(f"server.{name}(stream)")
                with _lock:
                    open_streams[name] += 1
                    now_open = sum(open_streams.values())
                peak("server.open_streams", now_open)

                async def counted() -> AsyncIterator[Any]:
                    async for r in requests:
                        if name == "Watch" and r.HasField("create_request"):
                            count("server.Watch.create")
                        elif name == "LeaseKeepAlive":
                            count("server.LeaseKeepAlive")
                        yield r

                try:
                    async for reply in original(self, counted(), context):
                        yield reply
                finally:
                    with _lock:
                        open_streams[name] -= 1

            return call

        setattr(service, name, make_stream())


# ---- the agents -------------------------------------------------------------------------------


def _stack_counts(*_: Any) -> None:
    """Every thread's innermost frames, counted: which waits hold the agents (faulthandler
    shows only 100 threads)."""
    import traceback

    counts: collections.Counter[str] = collections.Counter()
    for frame in sys._current_frames().values():
        stack = traceback.extract_stack(frame)[-4:]
        counts[
            " < ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(stack))
        ] += 1
    for stack, n in counts.most_common(40):
        print(f"{n:5d} {stack}", file=sys.stderr, flush=True)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--min", type=int, required=True)
    parser.add_argument("--max", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--first", type=int, default=0, help="index of the first handler")
    parser.add_argument("--conf", default="", help="--rdzv-conf as k=v,k=v")
    parser.add_argument("--host", action="store_true", help="embedded: host the service")
    parser.add_argument(
        "--ramp", type=float, default=0.0, help="seconds over which its agents start (in turn)"
    )
    return parser.parse_args()


def _instrument(args: argparse.Namespace) -> None:
    if os.environ.get("RDZV_SIM_SHARED_CHANNEL", "1") == "1":
        _share_channels()
    else:
        _own_connections()
    _quiet_grpc_waits()
    _instrument_grpc()
    _instrument_store()
    if args.backend == "etcd-v2":
        _instrument_v2()
    if args.host:
        _instrument_server()


class _Agents:
    """This process's simulated agents: each a thread with a real rendezvous handler."""

    def __init__(self, args: argparse.Namespace) -> None:
        from elastic_launch.cancel import CancelToken

        self.args = args
        self.conf = dict(kv.split("=", 1) for kv in args.conf.split(",") if kv)
        if args.backend in ("embedded", "c10d"):
            self.conf["is_host"] = "true" if args.host else "false"
        self.handlers: list[Any] = [None] * args.count
        self.cancel = CancelToken()
        self.changed = [threading.Event() for _ in range(args.count)]
        self.running: list[bool] = [False] * args.count

    def params(self) -> Any:  # as the launcher's plan makes them
        from elastic_launch.rendezvous import RendezvousParameters

        a = self.args
        return RendezvousParameters(
            backend=a.backend,
            endpoint=a.endpoint,
            run_id=a.run_id,
            min_nodes=a.min,
            max_nodes=a.max,
            max_restarts=3,
            local_world_size=1,
            config=self.conf,
            local_addr="127.0.0.1",
        )

    def handler(self, i: int) -> Any:
        """Agent `i`'s handler, made when first asked for (as an agent makes it at its start:
        its lease is granted then; one made long before its first round finds it expired)."""
        from elastic_launch.rendezvous import create_handler

        h = self.handlers[i]
        if h is None:
            h = self.handlers[i] = create_handler(self.params())
            _store_index[id(h.store)] = self.args.first + i
        return h

    def agent(self, i: int) -> None:
        """An agent's loop: rendezvous, 'run' until the round is over for it, again."""
        from elastic_launch.rendezvous import RestartReason

        h = self.handler(i)
        me = self.args.first + i
        reason = RestartReason.START
        while not self.cancel.cancelled:
            t_call = time.monotonic()
            try:
                info = h.next_rendezvous(reason, cancel=self.cancel)
            except Exception as e:
                emit(ev="error", h=me, error=f"{type(e).__name__}: {e}"[:300])
                return
            emit(
                ev="done",
                h=me,
                round=info.round,
                rank=info.group_rank,
                world=info.group_world_size,
                reason=reason.value,
                t_call=t_call,
                t=time.monotonic(),
            )
            self.running[i] = True
            self.changed[i].wait()
            self.changed[i].clear()
            self.running[i] = False
            emit(ev="changed", h=me, t=time.monotonic(), round=info.round)
            reason = RestartReason.MEMBERSHIP

    def monitor(self) -> None:
        """The agents' monitor loop (the agent looks every monitor_interval): one thread."""
        while not self.cancel.cancelled:
            for i, h in enumerate(self.handlers):
                if self.running[i] and h is not None and h.membership_changed():
                    self.changed[i].set()
            time.sleep(0.05)

    def go(self) -> None:
        for i in range(self.args.count):
            threading.Thread(target=self.agent, args=(i,), daemon=True).start()
            if self.args.ramp > 0:
                time.sleep(self.args.ramp / self.args.count)  # nodes arrive over time
        threading.Thread(target=self.monitor, daemon=True).start()


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a stuck round waits
    signal.signal(signal.SIGUSR2, _stack_counts)  # the same, for thousands of threads
    args = _parse_args()
    _instrument(args)
    agents = _Agents(args)
    if args.host:  # the service must be up before the others come
        agents.handler(0)
    emit(ev="ready", pid=os.getpid())
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "go":
            agents.go()
        elif cmd == "snap":
            emit(ev="snap", **snapshot())
        elif cmd == "quit":
            break
    os._exit(0)  # the driver ends the store; no lease revokes on the way out


if __name__ == "__main__":
    main()
