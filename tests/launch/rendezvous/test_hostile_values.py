"""Values in the rendezvous store that this job did not write: each parser checks types, ranges
and sizes, and a bad value is a StoreValueError naming the key (rc 1 and one line from the
launcher), never a traceback. Property tests feed arbitrary bytes and JSON to every parser of
store values."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
from elastic_launch.rendezvous.api import RendezvousParameters, StoreValueError
from elastic_launch.rendezvous.conf import RendezvousConf
from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store, key_text
from elastic_launch.rendezvous.round.elastic import ElasticRendezvous
from elastic_launch.rendezvous.round.state import Member, RoundState, Status, round_info
from elastic_launch.rendezvous.round.values import MAX_VALUE_BYTES, text_value
from elastic_launch.rendezvous.store.api import StoreAccess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CONF = RendezvousConf.defaults(join_timeout=10.0, last_call_timeout=0.5, heartbeat_timeout=5.0)

BAD_STATES = [
    (b'{"version": "x"}', "version='x'"),
    (b"[1, 2]", "a JSON list where an dict belongs"),
    (b"\xff\xfe\x00", "no JSON"),
    (b'{"version": 1, "status": "final", "size": 1, "world": -4}', "world=-4"),
    (b'{"version": 1, "status": ["final"]}', "status=['final']"),
    (b'{"version": 1, "status": "final", "master": ["h", 99999999]}', "port=99999999"),
    (b'{"version": true}', "version=True"),
    (b'{"version": 1, "closed": {"reason": [1]}}', "closed="),
    (b"[" * 100_000, "no JSON (RecursionError"),
    (b'{"version": 1, "notes": {"a": 3}}', "notes="),
]


def _join_in_background(handler: ElasticRendezvous) -> tuple[threading.Thread, list]:
    """`handler.next_rendezvous()` on a thread of its own; what it raised goes to the list."""
    errors: list[BaseException] = []

    def join() -> None:
        try:
            handler.next_rendezvous()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=join, daemon=True)
    t.start()
    return t, errors


@pytest.mark.parametrize(("value", "problem"), BAD_STATES, ids=lambda v: str(v)[:30])
def test_a_bad_state_key_is_a_clear_error_naming_it(embedded, value, problem):
    address, token = embedded
    run_id = f"bad-{time.monotonic_ns()}"
    params = RendezvousParameters("etcd", address, run_id, 1, 1, 1, local_addr="127.0.0.1")
    store = EtcdV3Store(address, StoreAccess("test store", token=token, retry_for=5))
    store.put(f"/elasticrun/{run_id}/state", value)
    handler = ElasticRendezvous(params, store, CONF, "127.0.0.1")
    try:
        with pytest.raises(StoreValueError) as e:
            handler.next_rendezvous()
    finally:
        handler.shutdown()
    message = str(e.value)
    assert f"'/elasticrun/{run_id}/state'" in message, message
    assert problem in message, message
    assert "give this job a new --rdzv-id" in message


def test_a_bad_join_key_is_a_clear_error_naming_it(embedded):
    address, token = embedded
    run_id = f"badjoin-{time.monotonic_ns()}"
    params = RendezvousParameters("etcd", address, run_id, 2, 2, 1, local_addr="127.0.0.1")
    store = EtcdV3Store(address, StoreAccess("test store", token=token, retry_for=5))
    handler = ElasticRendezvous(params, store, CONF, "127.0.0.1")
    outsider = EtcdV3Store(address, StoreAccess("outsider", token=token, retry_for=5))
    t, errors = _join_in_background(handler)
    try:
        deadline = time.monotonic() + 10
        joins: list = []
        while not joins and time.monotonic() < deadline:
            kvs, _ = outsider.range(f"/elasticrun/{run_id}/")
            joins = [kv.key for kv in kvs if "/join/" in kv.key]
            time.sleep(0.02)
        assert joins, "the node joined round 1"
        bad = joins[0].rsplit("/", 1)[0] + "/intruder"
        outsider.put(bad, json.dumps({"addr": "h", "port": 99999999, "lws": -1}).encode())
        t.join(15)
    finally:
        handler.shutdown()
        t.join(15)
    assert errors and isinstance(errors[0], StoreValueError), errors
    assert f"{bad!r}" in str(errors[0]) and "port=99999999" in str(errors[0])


def test_a_membership_without_this_node_is_a_clear_error():
    state = RoundState(3, Status.FINAL, size=1, world=2).with_shards(
        [b'{"other":[0,0,"h",1,2,0,"",0,2]}']
    )
    with pytest.raises(StoreValueError, match="no entry for this node"):
        round_info(state, "me")
    state = RoundState(3, Status.FINAL, size=1, world=2).with_shards(
        [b'{"me":[5,0,"h",1,2,0,"",0,2]}']
    )
    with pytest.raises(StoreValueError, match="rank 5 of 1 nodes"):
        round_info(state, "me")


def test_keys_and_names_that_are_not_utf8_read_without_error():
    assert key_text(b"/elasticrun/x/\xff") == "/elasticrun/x/\ufffd"
    with pytest.raises(StoreValueError, match="not UTF-8"):
        text_value(b"\xff", "/elasticrun/x/leader")


def test_an_oversized_value_is_refused_before_it_is_parsed():
    with pytest.raises(StoreValueError, match=f"at most {MAX_VALUE_BYTES} are read"):
        RoundState.from_json(b" " * (MAX_VALUE_BYTES + 1), "k")


# ---- properties: only StoreValueError comes out ------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
STATE_FIELDS = [
    "version",
    "status",
    "restarts",
    "size",
    "world",
    "master",
    "shards",
    "ran",
    "notes",
    "left",
    "leader",
    "closed",
    "protocol",
    "release",
    "expires_at",
]
MEMBER_FIELDS = ["addr", "port", "lws", "release", "protocol", "presence", "role"]


def objects(fields: list[str]) -> st.SearchStrategy[bytes]:
    good = {"status": st.sampled_from([s.value for s in Status])}
    return st.fixed_dictionaries(
        {}, optional={f: good.get(f, json_values) | json_values for f in fields}
    ).map(lambda d: json.dumps(d).encode())


def anything(fields: list[str]) -> st.SearchStrategy[bytes]:
    return (
        st.binary(max_size=200)
        | json_values.map(lambda v: json.dumps(v).encode())
        | objects(fields)
    )


PROPERTY = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def parses_or_is_refused(parse, data, kind: type) -> None:
    """`parse(data)` gives a `kind`, or raises a StoreValueError that says why: nothing else."""
    try:
        result = parse(data)
    except StoreValueError as e:
        result = e
    if isinstance(result, StoreValueError):
        assert str(result), "a refusal says why"
    else:
        assert isinstance(result, kind), f"{data!r} parsed to {result!r}, not a {kind.__name__}"


@PROPERTY
@given(anything(STATE_FIELDS))
def test_any_state_value_parses_or_is_a_store_value_error(data):
    parses_or_is_refused(lambda d: RoundState.from_json(d, "k"), data, RoundState)


@PROPERTY
@given(anything(MEMBER_FIELDS))
def test_any_join_value_parses_or_is_a_store_value_error(data):
    parses_or_is_refused(lambda d: Member.from_json(d, "k"), data, Member)


row_items = st.lists(json_values | st.integers(-5, 70000) | st.text(max_size=5), max_size=10)


@PROPERTY
@given(
    st.binary(max_size=100)
    | st.dictionaries(st.text(max_size=5), row_items | json_values, max_size=4).map(
        lambda d: json.dumps(d).encode()
    ),
    st.text(max_size=5),
)
def test_any_members_shard_parses_or_is_a_store_value_error(data, node):
    def parse(d: bytes) -> RoundState:
        state = RoundState(2, Status.FINAL, size=3, world=7).with_shards([d], "k")
        if node in state.nodes:
            round_info(state, node)
        return state

    parses_or_is_refused(parse, data, RoundState)


@PROPERTY
@given(anything(["lws", "role", "addr", "port"]))
def test_any_torch_store_row_parses_or_is_a_store_value_error(data):
    from elastic_launch.rendezvous.torch_shaped import _node_row

    class Store:
        def get(self, key: str) -> bytes:
            return data

    parses_or_is_refused(lambda _: _node_row(Store(), 0), data, dict)


@PROPERTY
@given(st.binary(max_size=50))
def test_any_key_or_leader_value_reads_or_is_a_store_value_error(data):
    assert isinstance(key_text(data), str)
    parses_or_is_refused(lambda d: text_value(d, "k"), data, str)


def test_property_tests_can_fail():
    # The properties above would pass vacuously if parse errors were swallowed elsewhere.
    with pytest.raises(StoreValueError):
        RoundState.from_json(b'{"size": -1}', "k")
    with pytest.raises(StoreValueError):
        Member.from_json(b'{"lws": "4"}', "k")


def test_text_from_the_store_cannot_forge_a_log_line():
    """A closed job's detail (or any text field) reaches the launcher's log: a newline or an
    escape sequence in it is shown escaped, never printed raw."""
    from elastic_launch.rendezvous.api import CloseReason, JobClosed

    forged = "worker failed\nelasticrun: the job SUCCEEDED\x1b[2K"
    stored = RoundState(3, Status.CLOSED, closed=JobClosed(CloseReason.FAILED, forged)).to_json()
    closed = RoundState.from_json(stored, "k").closed
    assert closed is not None
    assert "\n" not in str(closed) and "\x1b" not in str(closed)
    assert closed.detail == "worker failed\\x0aelasticrun: the job SUCCEEDED\\x1b[2K"
    plain = RoundState.from_json(json.dumps({"closed": forged}).encode(), "k").closed
    assert plain is not None and "\n" not in plain.detail
    assert text_value(b"node\nelasticrun: x", "k") == "node\\x0aelasticrun: x"


def _handler(embedded, nodes: tuple[int, int] = (1, 1), join_timeout: float = 10.0):
    address, token = embedded
    run_id = f"impossible-{time.monotonic_ns()}"
    params = RendezvousParameters("etcd", address, run_id, *nodes, 1, local_addr="127.0.0.1")
    store = EtcdV3Store(address, StoreAccess("test store", token=token, retry_for=5))
    conf = dataclasses.replace(CONF, join_timeout=join_timeout)
    return ElasticRendezvous(params, store, conf, "127.0.0.1"), store, run_id


@pytest.mark.parametrize("members", [0, 5], ids=["no-members", "beyond-the-maximum"])
def test_an_impossible_final_round_ends_in_a_clear_error_not_a_hot_loop(embedded, members):
    """Well-typed but impossible states: round 3 final with its members shard missing, or with
    five members in a job of at most one node. Nothing will change them, so the agent looks
    again at most pace.RATE times a second and stops at the join timeout with one line that
    says what is wrong (the first polled etcd 508 times a second, past its join timeout)."""
    from elastic_launch.rendezvous.api import RendezvousTimeoutError
    from elastic_launch.rendezvous.round import state as rnd
    from elastic_launch.rendezvous.round.pace import RATE

    handler, store, run_id = _handler(embedded, join_timeout=2.0)
    ghosts = {f"ghost{i}": Member("127.0.0.1", 1, 1, presence=1) for i in range(members)}
    final = dataclasses.replace(
        rnd.initial(handler.release),
        version=3,
        status=Status.FINAL,
        size=max(members, 1),
        world=max(members, 1),
        shards=1,
        nodes=ghosts,
        ranks={n: i for i, n in enumerate(ghosts)},
        offsets={n: i for i, n in enumerate(ghosts)},
    )
    store.put(f"/elasticrun/{run_id}/state", final.to_json())
    if members:
        store.put(f"/elasticrun/{run_id}/m/3/0", final.shard_values()[0])
    try:
        with pytest.raises(RendezvousTimeoutError) as e:
            handler.next_rendezvous()
        requests = handler.counters().store_requests
    finally:
        handler.shutdown()
    assert "round 3 is final but cannot be joined or entered" in str(e.value)
    assert "give the job a new --rdzv-id" in str(e.value) and "\n" not in str(e.value)
    # Two reads (the state, the shard) per look, a few more as a spare; a hot loop made
    # thousands in the 2 s.
    assert requests is not None and requests <= 4 * (2.0 * RATE + 10), requests


def _rewritten_under_a_waiting_node(embedded, join_timeout: float, states: list[RoundState]):
    """A node that waits for a peer that never comes while the job's state is written as
    `states`, in turn: (what its next_rendezvous raised, its store requests)."""
    handler, store, run_id = _handler(embedded, (2, 2), join_timeout=join_timeout)
    key = f"/elasticrun/{run_id}/state"
    t, errors = _join_in_background(handler)
    try:
        deadline = time.monotonic() + 10
        while store.get(key) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for state in states:
            store.put(
                key, dataclasses.replace(state, release=state.release or handler.release).to_json()
            )
        t.join(30)
        requests = handler.counters().store_requests
    finally:
        handler.shutdown()
    assert not t.is_alive(), "the node ended"
    assert len(errors) == 1, errors
    return errors[0], requests, handler.release


def test_a_round_going_backwards_under_a_waiting_node_is_joined_not_looped_on(embedded):
    """The state rewritten to a later round, then to older ones, while a node waits for its
    peers: the node joins what the store says now, and ends at its join timeout with a clear
    error (no peer came), looking at most pace.RATE times a second."""
    from elastic_launch.rendezvous.api import RendezvousTimeoutError

    states = [RoundState(version=v, status=Status.JOINABLE) for v in (7, 2, 1)]
    error, requests, _ = _rewritten_under_a_waiting_node(embedded, 3.0, states)
    assert isinstance(error, RendezvousTimeoutError), error
    assert requests is not None and requests < 300, "no hot loop: " + str(requests)


def test_the_release_changing_under_a_round_is_a_one_line_error(embedded):
    """Another elasticrun version rewrites the job's state while this node waits: the node
    stops with one line that names both versions."""
    from elastic_launch.rendezvous.api import RendezvousVersionError

    states = [RoundState(version=2, status=Status.JOINABLE, release="9.9.9")]
    error, _, release = _rewritten_under_a_waiting_node(embedded, 20.0, states)
    assert isinstance(error, RendezvousVersionError), error
    assert "\n" not in str(error) and "elasticrun 9.9.9" in str(error) and release in str(error)
