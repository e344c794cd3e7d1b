"""``--rdzv-conf``: one table of every key, which backends take it, and what it means.

A one-node ``embedded`` job (the in-process rendezvous) takes the same keys as a several-node
one, so that a command line stays valid when ``--nnodes`` changes; the waits those keys bound
cannot occur on one node. Outside backends read ``RendezvousParameters.config`` themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from elastic_launch.rendezvous.api import RendezvousConfigError

EMBEDDED, ETCD, ETCD_V2, STATIC = "embedded", "etcd", "etcd-v2", "static"
ELASTIC = frozenset({EMBEDDED, ETCD, ETCD_V2})
_ETCDS = frozenset({ETCD, ETCD_V2})
TOKEN_ENV = "ELASTICRUN_RDZV_TOKEN"


def positive_seconds(raw: str) -> float:
    value = float(raw)
    if not 0 < value < float("inf"):
        raise ValueError("give seconds, more than 0")
    return value


def positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("give a whole number, 1 or more")
    return value


def as_bool(raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "t", "yes", "y"):
        return True
    if text in ("0", "false", "f", "no", "n"):
        return False
    raise ValueError("give true or false")


def _protocol(raw: str) -> str:
    if raw not in ("http", "https"):
        raise ValueError("use http or https")
    return raw


@dataclass(frozen=True)
class Key:
    name: str
    parse: Callable[[str], Any]
    backends: frozenset[str]
    help: str
    field: str = ""  # the RendezvousConf field it sets (default: its name)


KEYS: tuple[Key, ...] = (
    Key("join_timeout", positive_seconds, ELASTIC, "seconds to gather MIN nodes (600)"),
    Key("timeout", positive_seconds, ELASTIC, "torch's name for join_timeout", "join_timeout"),
    Key("last_call_timeout", positive_seconds, ELASTIC, "after MIN joined, for more (3)"),
    Key("close_timeout", positive_seconds, ELASTIC, "for a frozen round's members to confirm (30)"),
    Key(
        "heartbeat_timeout", positive_seconds, ELASTIC, "lease TTL: a dead node is seen within (5)"
    ),
    Key("keep_alive_interval", positive_seconds, ELASTIC, "torch's: heartbeat = this x attempts"),
    Key("keep_alive_max_attempt", positive_int, ELASTIC, "torch's: see keep_alive_interval (3)"),
    Key("read_timeout", positive_seconds, ELASTIC, "seconds one store request may take (10)"),
    Key(
        "reconnect_timeout",
        positive_seconds,
        ELASTIC,
        "how long a running job waits for a store that went away (30)",
    ),
    Key("is_host", as_bool, frozenset({EMBEDDED}), "host the embedded service here (true) or not"),
    Key("token", str, frozenset({EMBEDDED}), "shared secret of the embedded service"),
    Key("protocol", _protocol, _ETCDS, "http or https"),
    Key("cacert", str, _ETCDS, "CA certificate file (TLS)"),
    Key("cert", str, _ETCDS, "client certificate file (TLS)"),
    Key("key", str, _ETCDS, "client key file (TLS)"),
    Key("user", str, _ETCDS, "etcd user"),
    Key("username", str, _ETCDS, "alias of user", "user"),
    Key("password", str, _ETCDS, "etcd password"),
    Key("rank", int, frozenset({STATIC}), "this node's rank (as --node-rank)", "node_rank"),
)


@dataclass(frozen=True)
class RendezvousConf:
    """The parsed options, with their defaults."""

    join_timeout: float = 600.0
    last_call_timeout: float = 3.0
    close_timeout: float = 30.0
    heartbeat_timeout: float = 5.0
    keep_alive_interval: float | None = None
    keep_alive_max_attempt: int = 3
    read_timeout: float = 10.0
    reconnect_timeout: float = 30.0
    is_host: bool | None = None
    token: str | None = None
    protocol: str | None = None
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    node_rank: int | None = None

    @property
    def lease_ttl(self) -> float:
        """The lease's TTL: heartbeat_timeout, or torch's interval x attempts."""
        if self.keep_alive_interval is not None:
            return self.keep_alive_interval * self.keep_alive_max_attempt
        return self.heartbeat_timeout


def kind_of(backend: str, max_nodes: int) -> str:
    """Which row of the table a backend reads (``c10d`` is ``embedded``)."""
    return EMBEDDED if backend == "c10d" else backend


def keys_for(kind: str) -> list[str]:
    return sorted(k.name for k in KEYS if kind in k.backends)


def parse_conf(backend: str, raw: Mapping[str, str]) -> RendezvousConf:
    """Check ``--rdzv-conf`` against `backend`'s keys and convert the values."""
    kind = kind_of(backend, 0)
    by_name = {k.name: k for k in KEYS}
    values: dict[str, Any] = {}
    for name, text in raw.items():
        key = by_name.get(name)
        if key is None or kind not in key.backends:
            known = ", ".join(keys_for(kind)) or "none"
            raise RendezvousConfigError(
                f"--rdzv-conf: '{name}' is not an option of the {backend} rendezvous "
                f"(it takes: {known})"
            )
        try:
            values[key.field or key.name] = key.parse(text)
        except (TypeError, ValueError) as e:
            raise RendezvousConfigError(
                f"--rdzv-conf: {name}='{text}' is not valid for the {backend} rendezvous: {e}"
            ) from None
    conf = replace(RendezvousConf(), **values)
    if kind == EMBEDDED and conf.token is None and os.environ.get(TOKEN_ENV):
        conf = replace(conf, token=os.environ[TOKEN_ENV])
    if kind in ELASTIC and conf.lease_ttl < 2.0:
        raise RendezvousConfigError(
            f"--rdzv-conf heartbeat_timeout={conf.lease_ttl:g}: the lease needs at least 2 seconds"
        )
    if (conf.user is None) != (conf.password is None):
        raise RendezvousConfigError("--rdzv-conf: give both user=... and password=..., or neither")
    return conf


assert {k.field or k.name for k in KEYS} <= {f.name for f in fields(RendezvousConf)}
