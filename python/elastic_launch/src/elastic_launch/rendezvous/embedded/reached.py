"""Whether an endpoint a client dialed reaches this embedded service: the addresses it was
started for, and any ``host:port`` with its port whose host resolves to the address it listens
on (any address of this machine, where it listens on all of them). A login or a credential
made for another endpoint was passed on by a process there (:mod:`.challenge`), and is
refused: another address of this machine at the same port may be another process's."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable

from elastic_launch.api import ConfigError
from elastic_launch.net import is_local_address, parse_endpoint

#: Seconds a name gets to resolve (a login waits for it once; the answer is kept).
RESOLVE_TIMEOUT = 2.0
#: Names whose answer is kept, at most (all are forgotten when full: a flood of made-up names
#: costs lookups, not memory).
MAX_KEPT = 256


def _key(endpoint: str) -> tuple[str, int] | None:
    try:
        host, port = parse_endpoint(endpoint, "an endpoint")
    except ConfigError:
        return None
    return host.lower(), port


async def _resolve(host: str) -> set[str]:
    """The addresses `host` resolves to (none if it does not, within RESOLVE_TIMEOUT)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT
        )
    except (OSError, asyncio.TimeoutError, UnicodeError):
        return set()
    return {str(info[4][0]).split("%", 1)[0] for info in infos}


_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


class ReachedAt:
    """The endpoints at which the service listening on `bound`:`port` is reached; `names`:
    those it was started for (its listed endpoint, as written and as resolved)."""

    def __init__(self, names: Iterable[str], port: int, bound: str = "") -> None:
        self.port = port
        self._names = {k for k in map(_key, names) if k is not None}
        self._kept: dict[tuple[str, int], bool] = {}
        self._bound = bound
        self._bound_ips: set[str] | None = None  # what `bound` resolves to, once asked

    def __call__(self, dialed: str) -> bool:
        """Whether `dialed` reaches this service, as far as is known without a lookup (a name
        not looked up yet is not: :meth:`learn` looks it up)."""
        key = _key(dialed)
        return key is not None and (key in self._names or self._kept.get(key, False))

    async def learn(self, dialed: str) -> bool:
        """Whether `dialed` reaches this service, its name looked up if need be (the answer
        is kept)."""
        key = _key(dialed)
        if key is None:
            return False
        if key in self._names or key in self._kept:
            return self(dialed)
        mine = key[1] == self.port and await self._local(key[0])
        if len(self._kept) >= MAX_KEPT:
            self._kept.clear()
        self._kept[key] = mine
        return mine

    async def _local(self, host: str) -> bool:
        """Whether `host` resolves to where this service listens."""
        ips = await _resolve(host)
        if self._bound in _WILDCARDS:
            return any(is_local_address(ip) for ip in ips)
        if self._bound_ips is None:
            self._bound_ips = await _resolve(self._bound)
        return bool(ips & self._bound_ips)

    def __str__(self) -> str:
        return ", ".join(sorted(f"{h}:{p}" for h, p in self._names)) or f"port {self.port}"
