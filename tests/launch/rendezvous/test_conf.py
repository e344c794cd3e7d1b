"""``--rdzv-conf``: one table for every backend, its defaults, and the errors for what a backend
does not take."""

from __future__ import annotations

import pytest
from elastic_launch.rendezvous import RendezvousConfigError
from elastic_launch.rendezvous.conf import KEYS, keys_for, parse_conf


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
    assert "'color' is not an option of the static rendezvous (it takes: rank)" in str(info.value)
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
        ({"user": "u"}, "give both user=... and password=..."),
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
    assert keys_for("static") == ["rank"]
    assert "token" in keys_for("embedded") and "token" not in keys_for("etcd")
