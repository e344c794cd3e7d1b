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
from elastic_launch.rendezvous.secrets import (
    PASSWORD_ENV,
    TOKEN_ENV,
    check_token,
    read_secret_file,
)
from elastic_launch.rendezvous.store.api import DEFAULT_READ_TIMEOUT
from elastic_launch.rendezvous.store.wire import MAX_TTL

EMBEDDED, ETCD, ETCD_V2, STATIC = "embedded", "etcd", "etcd-v2", "static"
ELASTIC = frozenset({EMBEDDED, ETCD, ETCD_V2})
_ETCDS = frozenset({ETCD, ETCD_V2})
_TLS = _ETCDS | {EMBEDDED}


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


_ALIAS = object()  # an alias's default: the key it names has it


@dataclass(frozen=True)
class Key:
    """One key: the only place its type, default and meaning are written. ``--rdzv-conf``,
    the train loop's workers (``workers``: taken over from the agents' by :mod:`.team`) and
    the classic rendezvous URL (``url``) all read this table; so do ``--help`` and the docs."""

    name: str
    parse: Callable[[str], Any]  # its type: text -> value, or ValueError saying what to give
    default: Any
    backends: frozenset[str]
    help: str
    field: str = ""  # the RendezvousConf field it sets (default: its name)
    workers: bool = False
    url: bool = False

    @property
    def target(self) -> str:
        return self.field or self.name

    @property
    def alias(self) -> bool:
        return self.default is _ALIAS


KEYS: tuple[Key, ...] = (
    Key("join_timeout", positive_seconds, 600.0, ELASTIC, "seconds to gather MIN nodes"),
    Key(
        "timeout",
        positive_seconds,
        _ALIAS,
        ELASTIC | {STATIC},
        "torch's name (static: unused)",
        "join_timeout",
        url=True,
    ),
    Key(
        "last_call_timeout", positive_seconds, 3.0, ELASTIC, "after MIN joined, for more", url=True
    ),
    Key("close_timeout", positive_seconds, 30.0, ELASTIC, "for a frozen round to be confirmed"),
    Key(
        "heartbeat_timeout",
        positive_seconds,
        5.0,
        ELASTIC,
        "lease TTL: a dead node is seen within",
        workers=True,
    ),
    Key(
        "keep_alive_interval",
        positive_seconds,
        None,
        ELASTIC,
        "torch's: TTL = this x attempts",
        workers=True,
    ),
    Key(
        "keep_alive_max_attempt",
        positive_int,
        3,
        ELASTIC,
        "torch's: see keep_alive_interval",
        workers=True,
    ),
    Key(
        "read_timeout",
        positive_seconds,
        DEFAULT_READ_TIMEOUT,
        ELASTIC,
        "seconds one store request may take",
        workers=True,
    ),
    Key(
        "reconnect_timeout",
        positive_seconds,
        30.0,
        ELASTIC,
        "how long a running job waits for a store that went away",
        workers=True,
    ),
    Key("is_host", as_bool, None, frozenset({EMBEDDED}), "host the embedded service here or not"),
    Key(
        "token",
        str,
        None,
        frozenset({EMBEDDED}),
        f"shared secret of the embedded service (prefer token_file or ${TOKEN_ENV})",
        workers=True,
    ),
    Key(
        "token_file",
        str,
        None,
        frozenset({EMBEDDED}),
        "file holding the token (readable by its owner only)",
    ),
    Key(
        "allow_unauthenticated",
        as_bool,
        False,
        frozenset({EMBEDDED}),
        "serve beyond loopback without a token (trusted networks only)",
    ),
    Key("protocol", _protocol, None, _ETCDS, "http or https", workers=True, url=True),
    Key("cacert", str, None, _TLS, "CA certificate file (TLS)", workers=True, url=True),
    Key("cert", str, None, _TLS, "certificate file (TLS)", workers=True, url=True),
    Key("key", str, None, _TLS, "private key file (TLS)", workers=True, url=True),
    Key("user", str, None, _ETCDS, "etcd user", workers=True),
    Key("username", str, _ALIAS, _ETCDS, "alias", "user", workers=True),
    Key(
        "password",
        str,
        None,
        _ETCDS,
        f"etcd password (prefer password_file or ${PASSWORD_ENV})",
        workers=True,
    ),
    Key(
        "password_file",
        str,
        None,
        _ETCDS,
        "file holding the etcd password (readable by its owner only)",
    ),
    Key(
        "allow_insecure_auth",
        as_bool,
        False,
        _ETCDS,
        "send user and password without TLS",
        workers=True,
    ),
    Key("rank", int, None, frozenset({STATIC}), "this node's rank (as --node-rank)", "node_rank"),
)


def default_of(name: str) -> Any:
    """The default of key `name` (for code that runs without a RendezvousConf)."""
    return next(k.default for k in KEYS if k.name == name)


#: The keys the train loop's workers take over from the agents' --rdzv-conf.
WORKER_KEYS = frozenset(k.name for k in KEYS if k.workers)
#: The role of a workers' rendezvous member (the train loop's team: one member per worker).
WORKERS_ROLE = "elasticrun-workers"
#: The keys the classic rendezvous URL takes (besides min_workers, max_workers, etcd_prefix).
URL_KEYS = {k.name: k for k in KEYS if k.url}


@dataclass(frozen=True)
class RendezvousConf:
    """The parsed options; :meth:`defaults` has the table's defaults."""

    join_timeout: float
    last_call_timeout: float
    close_timeout: float
    heartbeat_timeout: float
    keep_alive_interval: float | None
    keep_alive_max_attempt: int
    read_timeout: float
    reconnect_timeout: float
    is_host: bool | None
    token: str | None
    token_file: str | None
    allow_unauthenticated: bool
    protocol: str | None
    cacert: str | None
    cert: str | None
    key: str | None
    user: str | None
    password: str | None
    password_file: str | None
    allow_insecure_auth: bool
    node_rank: int | None

    @property
    def tls(self) -> bool:
        """Whether any TLS option is given (then TLS is used, whatever the endpoint says)."""
        return bool(self.cacert or self.cert or self.key or self.protocol == "https")

    @classmethod
    def defaults(cls, **values: Any) -> RendezvousConf:
        """The table's defaults, with `values` (by field) over them."""
        return cls(**{**{k.target: k.default for k in KEYS if not k.alias}, **values})

    @property
    def lease_ttl(self) -> float:
        """The lease's TTL: heartbeat_timeout, or torch's interval x attempts."""
        if self.keep_alive_interval is not None:
            return self.keep_alive_interval * self.keep_alive_max_attempt
        return self.heartbeat_timeout


def describe(key: Key) -> str:
    """A key in words: what it means, and its default (or what it stands for)."""
    if key.alias:
        return f"{key.help} for {key.target}"
    if key.default is None:
        return key.help
    return f"{key.help} (default {_text(key.default)})"


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}"


def help_text() -> str:
    """``--rdzv-conf``'s help, from the table."""
    names = ", ".join(
        f"{k.name}={_text(k.default)}"
        if isinstance(k.default, (int, float)) and not k.alias
        else k.name
        for k in KEYS
    )
    return f"rendezvous options, KEY=VALUE,...: {names} (docs/rendezvous.md has each one)"


def _default_text(k: Key) -> str:
    if k.alias:
        return f"as `{k.target}`"
    return "" if k.default is None else _text(k.default)


def markdown() -> str:
    """The table as docs/rendezvous.md shows it (a test keeps the two the same)."""
    rows = [
        "| key | backends | default | meaning | also taken by |",
        "|---|---|---|---|---|",
    ]
    for k in KEYS:
        backends = ", ".join(sorted(k.backends))
        default = _default_text(k)
        also = ", ".join(
            what for what, yes in (("the loop's workers", k.workers), ("the URL", k.url)) if yes
        )
        rows.append(f"| `{k.name}` | {backends} | {default} | {k.help} | {also} |")
    return "\n".join(rows) + "\n"


def kind_of(backend: str, max_nodes: int) -> str:
    """Which row of the table a backend reads (``c10d`` is ``embedded``)."""
    return EMBEDDED if backend == "c10d" else backend


def keys_for(kind: str) -> list[str]:
    return sorted(k.name for k in KEYS if kind in k.backends)


def parse_conf(backend: str, raw: Mapping[str, Any]) -> RendezvousConf:
    """Check ``--rdzv-conf`` against `backend`'s keys and convert the values (strings, or from
    Python any value whose ``str()`` is the option's text: ``{"rank": 0}``)."""
    kind = kind_of(backend, 0)
    by_name = {k.name: k for k in KEYS}
    values: dict[str, Any] = {}
    for name, given in raw.items():
        text = given if isinstance(given, str) else str(given)
        key = by_name.get(name)
        if key is None or kind not in key.backends:
            known = ", ".join(keys_for(kind)) or "none"
            raise RendezvousConfigError(
                f"--rdzv-conf: '{name}' is not an option of the {backend} rendezvous "
                f"(it takes: {known})"
            )
        try:
            values[key.target] = key.parse(text)
        except (TypeError, ValueError) as e:
            raise RendezvousConfigError(
                f"--rdzv-conf: {name}='{text}' is not valid for the {backend} rendezvous: {e}"
            ) from None
    conf = _secrets(kind, RendezvousConf.defaults(**values))
    if kind in ELASTIC and conf.lease_ttl < 2.0:
        raise RendezvousConfigError(
            f"--rdzv-conf heartbeat_timeout={conf.lease_ttl:g}: the lease needs at least 2 seconds"
        )
    if kind == EMBEDDED and conf.lease_ttl > MAX_TTL:
        raise RendezvousConfigError(
            f"--rdzv-conf heartbeat_timeout={conf.lease_ttl:g}: the embedded service's leases "
            f"last {MAX_TTL} s at most; give {MAX_TTL} or less"
        )
    if (conf.user is None) != (conf.password is None):
        raise RendezvousConfigError(
            "--rdzv-conf: give both user=... and password_file=PATH (or "
            f"${PASSWORD_ENV}, or password=...), or neither"
        )
    return conf


def _secrets(kind: str, conf: RendezvousConf) -> RendezvousConf:
    """The token and the password, from the key itself, its file or the environment (in that
    order), checked."""
    if kind == EMBEDDED:
        token, where = conf.token, "--rdzv-conf token"
        if token is None and conf.token_file:
            token, where = read_secret_file(conf.token_file, "token_file"), "token_file"
        elif token is None and os.environ.get(TOKEN_ENV):
            token, where = os.environ[TOKEN_ENV], f"${TOKEN_ENV}"
        if token is not None:
            conf = replace(conf, token=check_token(token, where))
    if kind in _ETCDS and conf.password is None and conf.user is not None:
        if conf.password_file:
            conf = replace(conf, password=read_secret_file(conf.password_file, "password_file"))
        elif os.environ.get(PASSWORD_ENV):
            conf = replace(conf, password=os.environ[PASSWORD_ENV])
    return conf


assert {k.target for k in KEYS} == {f.name for f in fields(RendezvousConf)}
