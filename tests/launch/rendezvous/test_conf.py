"""``--rdzv-conf``: one table for every backend, its defaults, and the errors for what a backend
does not take."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
from elastic_launch.rendezvous import RendezvousConfigError
from elastic_launch.rendezvous.conf import (
    KEYS,
    URL_KEYS,
    WORKER_KEYS,
    RendezvousConf,
    help_text,
    keys_for,
    markdown,
    parse_conf,
)


def test_defaults_and_torch_names():
    conf = parse_conf("etcd", {})
    assert (conf.join_timeout, conf.last_call_timeout, conf.lease_ttl) == (600.0, 3.0, 5.0)
    assert conf.read_timeout == 10.0
    conf = parse_conf("c10d", {"timeout": "30", "last_call_timeout": "1", "read_timeout": "2"})
    assert (conf.join_timeout, conf.last_call_timeout, conf.read_timeout) == (30.0, 1.0, 2.0)
    conf = parse_conf("embedded", {"keep_alive_interval": "2", "keep_alive_max_attempt": "4"})
    assert conf.lease_ttl == 8.0, "torch's keep-alive settings make the lease's TTL"


def test_an_unknown_key_lists_the_valid_ones_for_that_backend():
    with pytest.raises(RendezvousConfigError) as info:
        parse_conf("static", {"color": "red"})
    assert "'color' is not an option of the static rendezvous (it takes: rank, timeout)" in str(
        info.value
    )
    with pytest.raises(
        RendezvousConfigError, match="'is_host' is not an option of the etcd"
    ) as info:
        parse_conf("etcd", {"is_host": "true"})
    assert "cacert" in str(info.value) and "read_timeout" in str(info.value)
    with pytest.raises(
        RendezvousConfigError, match="'read_timeout' is not an option of the static"
    ):
        parse_conf("static", {"read_timeout": "5"})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"join_timeout": "-3"}, "join_timeout='-3' is not valid"),
        ({"join_timeout": "inf"}, "join_timeout='inf' is not valid"),
        ({"keep_alive_max_attempt": "0"}, "keep_alive_max_attempt='0' is not valid"),
        ({"is_host": "maybe"}, "is_host='maybe' is not valid"),
        ({"heartbeat_timeout": "1"}, "at least 2 seconds"),
        ({"user": "u"}, "give both user=... and password_file=PATH"),
    ],
)
def test_bad_values_quote_the_key_and_value(raw, message):
    backend = "etcd" if "user" in raw else "embedded"
    with pytest.raises(RendezvousConfigError, match=message):
        parse_conf(backend, raw)


def test_protocol_and_token_from_the_environment(monkeypatch):
    with pytest.raises(RendezvousConfigError, match="protocol='ftp' is not valid"):
        parse_conf("etcd-v2", {"protocol": "ftp"})
    monkeypatch.setenv("ELASTICRUN_RDZV_TOKEN", "s3cret")
    assert parse_conf("embedded", {}).token == "s3cret"
    assert parse_conf("embedded", {"token": "given"}).token == "given"


def test_every_key_is_documented_and_taken_by_some_backend():
    for key in KEYS:
        assert key.help and key.backends, key.name
    assert keys_for("static") == ["rank", "timeout"], "torch's static takes a timeout too"
    assert "token" in keys_for("embedded") and "token" not in keys_for("etcd")


SRC = Path(__file__).resolve().parents[3] / "python" / "elastic_launch" / "src" / "elastic_launch"
REPO = SRC.parents[3]


def test_no_default_is_written_twice():
    """A key's default is in KEYS alone: RendezvousConf has none of its own, no help text
    repeats one, and no other module pairs a key's name with its default."""
    assert all(f.default is MISSING for f in fields(RendezvousConf)), "defaults come from KEYS"
    assert RendezvousConf.defaults().join_timeout == next(
        k.default for k in KEYS if k.name == "join_timeout"
    )
    for key in KEYS:
        assert not re.search(r"\d", key.help), f"{key.name}: its help names a number"
    numeric = [k for k in KEYS if isinstance(k.default, (int, float)) and not k.alias]
    for path in SRC.rglob("*.py"):
        if path.name == "conf.py" or "etcdpb" in path.parts:
            continue
        text = path.read_text()
        for key in numeric:
            value = rf"""["']?{key.default:g}(?:\.0+)?(?![\d.])"""
            pattern = rf"""\b{key.name}["']?\s*(?::[\w .|\[\]]+?=|[:=])\s*{value}"""
            assert not re.search(pattern, text), f"{path.name} writes {key.name}'s default again"


def test_the_docs_table_is_the_one_in_the_code():
    doc = (REPO / "docs" / "rendezvous.md").read_text()
    start = doc.index("<!-- generated: rendezvous keys -->\n") + len(
        "<!-- generated: rendezvous keys -->\n"
    )
    end = doc.index("<!-- end generated -->")
    assert doc[start:end] == markdown(), (
        "regenerate it: python -c 'from elastic_launch.rendezvous import conf; print(conf.markdown())'"
    )


def test_help_names_every_key_with_its_default():
    text = help_text()
    for key in KEYS:
        assert key.name in text
    assert "join_timeout=600" in text and "last_call_timeout=3" in text


def test_the_workers_and_the_url_read_the_same_table():
    assert WORKER_KEYS == {k.name for k in KEYS if k.workers}
    assert "token" in WORKER_KEYS and "join_timeout" not in WORKER_KEYS, "the agents' own"
    assert set(URL_KEYS) == {"timeout", "last_call_timeout", "protocol", "cacert", "cert", "key"}


def test_the_embedded_services_longest_lease_bounds_heartbeat_timeout():
    from elastic_launch.rendezvous.api import RendezvousConfigError
    from elastic_launch.rendezvous.conf import parse_conf
    from elastic_launch.rendezvous.store.wire import MAX_TTL

    with pytest.raises(RendezvousConfigError, match=f"last {MAX_TTL} s at most; give {MAX_TTL}"):
        parse_conf("embedded", {"heartbeat_timeout": str(MAX_TTL + 1)})
    assert parse_conf("embedded", {"heartbeat_timeout": str(MAX_TTL)}).lease_ttl == MAX_TTL
