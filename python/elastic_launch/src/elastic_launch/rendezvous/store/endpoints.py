"""``--rdzv-endpoint`` as a store's members: ``HOST:PORT[,HOST:PORT...]``, the members of an
etcd cluster or the embedded service's hosts in the order they take over. Every item is used;
a DNS name that resolves to several addresses counts as several members (as etcd's clients do
with a name that lists a cluster). A list with an empty item or a member named twice is an
error that quotes it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from elastic_launch.api import ConfigError
from elastic_launch.net import host_port, parse_endpoint

#: The port of an endpoint given without one: the embedded service's (torch's c10d port) and
#: etcd's client port.
DEFAULT_EMBEDDED_PORT = 29400
DEFAULT_ETCD_PORT = 2379


@dataclass(frozen=True)
class StoreMember:
    """One member of a store: where to connect (`host`, `port`), and the name it was resolved
    from when that is not `host` (TLS checks the member's certificate against the name)."""

    host: str
    port: int
    name: str | None = None

    @property
    def target(self) -> str:
        return host_port(self.host, self.port)

    @property
    def written(self) -> str:
        """As the user wrote it (the name, not the address it resolved to)."""
        return host_port(self.name or self.host, self.port)


def split(value: str, flag: str, default_port: int) -> list[tuple[str, int]]:
    """The items of a comma-separated endpoint list, each parsed; an empty item or a member
    named twice is a ConfigError that quotes the list."""
    items = [item.strip() for item in value.split(",")]
    if not any(items):
        raise ConfigError(f"{flag} '{value}' names no endpoint: give HOST:PORT[,HOST:PORT...]")
    parsed: list[tuple[str, int]] = []
    for i, item in enumerate(items, 1):
        if not item:
            raise ConfigError(
                f"{flag} '{value}': item {i} of {len(items)} is empty (a stray comma?); give "
                "HOST:PORT[,HOST:PORT...]"
            )
        host, port = parse_endpoint(item, flag, default_port)
        key = (_normal(host), port)
        if key in [(_normal(h), p) for h, p in parsed]:
            raise ConfigError(
                f"{flag} '{value}' names {host_port(host, port)} twice: give each member once"
            )
        parsed.append((host, port))
    return parsed


def _normal(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower().rstrip(".")


def resolve(endpoints: list[tuple[str, int]]) -> list[StoreMember]:
    """The members: an address as it is, a name that resolves to one address as the name
    (gRPC resolves it again on every connection), a name that resolves to several addresses
    as one member per address. A name that does not resolve stays a member: it fails when it
    is used, with the resolver's words, and the others serve meanwhile."""
    members: list[StoreMember] = []
    for host, port in endpoints:
        for member in _members_of(host, port):
            if member.target not in [m.target for m in members]:
                members.append(member)
    return members


def _members_of(host: str, port: int) -> list[StoreMember]:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return [StoreMember(host, port)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return [StoreMember(host, port)]
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if len(addresses) <= 1 or host == "localhost":  # localhost: one host however it resolves
        return [StoreMember(host, port)]
    return [StoreMember(address, port, name=host) for address in addresses]


def members_of(
    given: str | Sequence[StoreMember], default_port: int = DEFAULT_ETCD_PORT
) -> list[StoreMember]:
    """The members `given` as a list, or as ``HOST:PORT[,HOST:PORT...]``."""
    if isinstance(given, str):
        return resolve(split(given, "the store's address", default_port))
    return list(given)


def written(members: Sequence[StoreMember]) -> str:
    """The members as a list in a message."""
    return ",".join(dict.fromkeys(m.written for m in members))
