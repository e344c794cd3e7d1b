"""The embedded service's accounts, alone: shares per connection with a total and a reserve,
requests read in turns, and a watch stream's holdings given back when it ends."""

from __future__ import annotations

import asyncio

import pytest
from elastic_launch.rendezvous.embedded import bounds


def test_a_share_refuses_past_the_connections_part_and_the_total_naming_each():
    shares = bounds.Shares("widgets", per_client=3, total=5, reserved=1)
    for _ in range(3):
        assert shares.room("a") is None
        shares.take("a")
    assert shares.room("a") == "this connection would hold 4 widgets; one connection may hold 3"
    shares.take("b", 2)
    assert shares.count == 5
    # The total is reached: b is past its reserve, c is not.
    assert "the service holds 5 widgets already and may hold 5" in str(shares.room("b"))
    assert shares.room("c") is None
    shares.take("c")
    assert shares.room("c") is not None  # its reserve is one
    for client, n in (("a", 3), ("b", 2), ("c", 1)):
        shares.give(client, n)
    assert shares.count == 0 and not shares.held


def test_a_watch_streams_events_and_ranges_are_given_back_when_it_ends():
    events = bounds.Shares("bytes", per_client=100, total=150, reserved=10)
    ranges = bounds.Shares("bytes", per_client=50, total=60, reserved=5)
    out = bounds.Outbox(events, ranges, "a")
    assert out.watch(30) is None
    assert "one connection may hold 50" in str(out.watch(30))
    assert out.watch(20) is None and ranges.count == 50
    out.unwatch(20)
    assert ranges.count == 30
    assert out.charge(60) and events.count == 60
    assert not out.charge(60)  # past the connection's share: cut off
    assert out.overflowed
    assert not out.queue.empty()  # the cut-off, queued
    out.drop()
    assert events.count == 0 and ranges.count == 0 and not events.held and not ranges.held
    assert out.queue.empty(), "what it queued goes with it (a cut-off call may live on)"


@pytest.fixture
def two_turns():
    return bounds.Turns(2)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_turns_are_taken_a_bounded_number_at_once_one_per_connection_in_order(two_turns):
    async def scenario() -> list[str]:
        inside: list[str] = []
        leave = {name: asyncio.Event() for name in ("a1", "a2", "b", "c", "d")}

        async def request(name: str) -> None:
            async with two_turns.turn(name[0]):
                inside.append(name)
                await leave[name].wait()

        async def settle() -> None:
            for _ in range(10):
                await asyncio.sleep(0)

        tasks = []
        for name in ("a1", "a2", "b", "c", "d"):
            tasks.append(asyncio.ensure_future(request(name)))
            await settle()
        # Two at once; a's second waits behind its first although it came before b.
        assert inside == ["a1", "b"]
        leave["a1"].set()
        await settle()
        assert inside == ["a1", "b", "c"]
        leave["b"].set()
        await settle()
        # a's second joined the queue when its first left: behind d, which waited already.
        # A connection with many requests waits its turn as one with one does.
        assert inside == ["a1", "b", "c", "d"]
        for event in leave.values():
            event.set()
        await asyncio.gather(*tasks)
        assert not two_turns._mine
        return inside

    assert _run(scenario()) == ["a1", "b", "c", "d", "a2"]


def test_a_request_whose_turn_does_not_come_is_refused(two_turns, monkeypatch):
    monkeypatch.setattr(bounds, "TURN_WAIT", 0.05)

    async def scenario() -> None:
        never = asyncio.Event()

        async def hold(client: str) -> None:
            async with two_turns.turn(client):
                await never.wait()

        holders = [asyncio.ensure_future(hold(c)) for c in ("a", "b")]
        await asyncio.sleep(0)
        with pytest.raises(bounds.NoTurnError):
            async with two_turns.turn("c"):
                pass
        waiting = asyncio.ensure_future(hold("d"))  # its call is cancelled while it waits
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        for h in holders:
            h.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
        assert not two_turns._mine
        async with two_turns.turn("c"), two_turns.turn("d"):  # every turn was given back
            pass

    _run(scenario())


def test_the_keys_a_connection_wrote_count_against_its_shares_until_another_writes_them(
    monkeypatch,
):
    from elastic_launch.rendezvous.embedded.state import ServiceState

    monkeypatch.setattr(bounds, "DATA_PER_CLIENT", 100)
    monkeypatch.setattr(bounds, "KEYS_PER_CLIENT", 3)
    state = ServiceState()
    for i in range(3):
        assert state.room_for(b"k%d" % i, b"v" * 10, "a") is None
        state.put(b"k%d" % i, b"v" * 10, 0, "a")
    assert "one connection may hold 3" in str(state.room_for(b"k9", b"v", "a"))
    assert state.room_for(b"k0", b"v" * 20, "a") is None, "its own key, rewritten: no new key"
    assert "one connection may hold 100" in str(state.room_for(b"k0", b"v" * 98, "a"))
    assert state.room_for(b"k9", b"v", "b") is None, "another connection has its own shares"
    state.put(b"k0", b"w", 0, "b")  # b wrote it last: it counts against b's shares now
    assert state.room_for(b"k9", b"v", "a") is None
    state.delete(b"k1")
    state.delete(b"k2")
    state.delete(b"k0")
    assert state.writers.bytes.count == 0 and state.writers.keys.count == 0
    assert not state.writers.of


def test_a_watch_stream_whose_queue_is_not_taken_stops_being_read():
    """The watch stream's reader stops reading once UNHANDLED_REQUESTS wait in its queue (a
    stream whose client reads no answer blocks the loop that takes them): a client sending
    creates past its share without end holds a bounded queue, not one that grows."""
    from elastic_launch.rendezvous.embedded.server import _read_watch_requests
    from elastic_launch.rendezvous.etcdpb import rpc_pb2

    async def scenario() -> None:
        pulled = 0

        async def creates():
            nonlocal pulled
            while True:
                pulled += 1
                yield rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"k"))

        ranges = bounds.Shares("bytes", per_client=0, total=0)  # every create is refused
        out = bounds.Outbox(bounds.Shares("bytes", 1, 1), ranges, "a")
        reader = asyncio.ensure_future(_read_watch_requests(creates(), out))
        for _ in range(100):
            await asyncio.sleep(0)
        assert pulled == bounds.UNHANDLED_REQUESTS and out.queue.qsize() == pulled
        kind, _ = await out.get()  # the stream takes one, as its loop does
        assert kind == "refuse"
        out.unhandled.release()
        for _ in range(100):
            await asyncio.sleep(0)
        assert pulled == bounds.UNHANDLED_REQUESTS + 1
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)

    _run(scenario())


def test_a_watch_range_is_not_held_by_a_stream_that_has_ended():
    out = bounds.Outbox(bounds.Shares("b", 10, 10), bounds.Shares("b", 100, 100), "a")
    out.drop()
    assert out.watch(10) == "the stream has ended" and out.ranges.count == 0


def test_generated_code_of_either_kind_adds_unary_methods_that_read_in_turns():
    """Code generated with gRPC's registered methods, and without (it adds a generic
    handler only): either way a unary method reads its request in turns."""
    import grpc
    from elastic_launch.rendezvous.embedded.server import _InTurns

    class Server:
        def __init__(self) -> None:
            self.generic: list = []
            self.registered: dict = {}

        def add_generic_rpc_handlers(self, handlers) -> None:
            self.generic.extend(handlers)

        def add_registered_method_handlers(self, service, handlers) -> None:
            self.registered.update(handlers)

    def handlers() -> dict:
        return {"Range": grpc.unary_unary_rpc_method_handler(lambda r, c: r)}

    server = Server()
    in_turns = _InTurns(server, service=None)  # type: ignore[arg-type]
    in_turns.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("kv", handlers())])
    in_turns.add_registered_method_handlers("kv", handlers())

    class Details:
        method = "/kv/Range"

    by_generic = server.generic[0].service(Details())
    for h in (by_generic, server.registered["Range"]):
        assert h.request_streaming and not h.response_streaming and h.stream_unary is not None
    assert server.generic[0].service(Details()) is by_generic


def test_freed_memory_is_given_back_after_so_many_bytes_and_once_they_stop(monkeypatch):
    trimmer = bounds.Trimmer(every=10 << 20)
    trims: list[int] = []
    trimmer._trim = trims.append
    for _ in range(9):
        trimmer.passed(1 << 20)
    assert not trims  # small or few: left alone
    trimmer.passed(1 << 20)
    assert len(trims) == 1 and trimmer.since == 0
    monkeypatch.setattr(bounds, "TRIM_PERIOD", 0.001)

    async def until(n: int) -> None:
        while len(trims) < n:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # fifty periods more: none comes
        assert len(trims) == n

    async def quiet_then_a_little() -> None:
        task = asyncio.ensure_future(trimmer.run())
        await until(2)  # once more, TRIM_LATE periods after the last, then no more
        trimmer.passed(bounds.MAX_REQUEST // 2)  # what the last requests of a load left
        await until(4)  # at the next period, and once more after it
        task.cancel()

    _run(quiet_then_a_little())
