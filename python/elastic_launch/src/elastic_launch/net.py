"""Small network helpers, each in one place: free ports, this host's address, whether a name is
this host, a host-wide lock without a file, a presence port that tells whether an agent's
process is still alive, and the parsing of ``host:port``."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import math
import random
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_launch.api import ConfigError
from elastic_launch.cancel import join


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


#: Where free_port looks first: below the ephemeral range, which the kernel hands out to every
#: bind to port 0 and every outgoing connection on this host.
_QUIET_PORTS = (10000, 32768)


def ephemeral_range() -> tuple[int, int]:
    """This host's ephemeral ports (``ip_local_port_range``; Linux's default if unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (on every interface when `host` is not an address of this
    machine), for a server that another process binds later (MASTER_PORT, a test's rendezvous).
    It is taken outside the ephemeral range when one is free there: a port the kernel picked
    for a bind to port 0 is the kernel's to hand out again, to any outgoing connection or other
    bind, before its user binds it."""
    low, _ = ephemeral_range()
    lo, hi = _QUIET_PORTS[0], min(_QUIET_PORTS[1], low)
    rng = random.SystemRandom()
    for _ in range(32 if hi > lo else 0):
        port = rng.randrange(lo, hi)
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError:  # a name or address not on this host: any interface will do
            s.bind(("", 0))
        return int(s.getsockname()[1])


def port_listened(host: str, port: int) -> bool:
    """True if a socket listens on host:port already: binding it as a server does (with
    SO_REUSEADDR, so that connections of an earlier server in TIME_WAIT do not count) fails."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


#: How often await_listening tries again while a port refuses (a refusal comes back at once).
LISTEN_POLL = 0.002


def await_listening(
    host: str,
    port: int,
    timeout: float,
    give_up: Callable[[], bool] = lambda: False,
) -> bool:
    """Wait until something accepts connections at `host`:`port` (a connection made and closed
    at once, tried every :data:`LISTEN_POLL` seconds), up to `timeout` seconds or until
    `give_up()`; whether it did. A TCPStore client that finds its server not yet listening
    backs off for up to a second before it tries again: one that comes after this call
    connects at its first try. `host` is resolved once (again at most once a second while it
    does not resolve), not at every try."""
    deadline = time.monotonic() + timeout
    targets: list[tuple[socket.AddressFamily, Any]] = []
    resolved_at = -math.inf
    while not give_up():
        now = time.monotonic()
        left = deadline - now
        if not targets and now - resolved_at >= 1.0:
            resolved_at, targets = now, addresses(host, port)
        if any(_accepts(family, at, max(min(left, 1.0), 0.01)) for family, at in targets):
            return True
        if left <= 0:
            return False
        time.sleep(LISTEN_POLL)
    return False


def addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, Any]]:
    """The (family, socket address) pairs `host`:`port` resolves to, each once; none if it
    does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    found: list[tuple[socket.AddressFamily, Any]] = []
    for family, _, _, _, sockaddr in infos:
        if (family, sockaddr) not in found:
            found.append((family, sockaddr))
    return found


def _accepts(family: socket.AddressFamily, sockaddr: Any, timeout: float) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(sockaddr)
        except OSError:
            return False
        return True


def names_this_host(host: str, port: int) -> bool:
    """Whether `host` resolves to an address of this machine (one lookup)."""
    return any(is_local_address(str(at[0]), family) for family, at in addresses(host, port))


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (``[::1]:29400``), as gRPC and URLs
    want it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolve(host: str) -> tuple[socket.AddressFamily, str]:
    """The first address of `host` (IPv4 or IPv6) and its family."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0]
    return family, str(sockaddr[0])


def local_address(target_host: str) -> str:
    """The address of this host on the route to `target_host` (what other nodes reach), of the
    same family as the target's."""
    try:
        family, addr = _resolve(target_host)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # no packet is sent
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def listeners(port: int) -> list[tuple[int, int]]:
    """(uid, socket inode) of each socket listening on TCP `port` of this host, on any
    address (Linux: /proc/net/tcp and tcp6; empty elsewhere, or if none listens)."""
    found: list[tuple[int, int]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: LISTEN
                continue
            local = fields[1].rsplit(":", 1)
            if len(local) == 2 and int(local[1], 16) == port:
                found.append((int(fields[7]), int(fields[9])))
    return found


def listener_owners(port: int) -> set[int]:
    """The users (uids) of the sockets listening on TCP `port` of this host."""
    return {uid for uid, _ in listeners(port)}


def resolve_error(host: str) -> str | None:
    """Why `host` does not resolve to an address (the resolver's words), or None if it does."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as e:
        return str(e.strerror or e)
    return None


def is_loopback(host: str) -> bool:
    """True if every address `host` names is a loopback address (only this host reaches it)."""
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]).is_loopback for info in infos
    )


def is_local_host(host: str) -> bool:
    """True if `host` names this machine."""
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        family, addr = _resolve(host)
    except OSError:
        return False
    if addr.startswith("127.") or addr == "::1":
        return True
    return is_local_address(addr, family)


def is_local_address(ip: str, family: socket.AddressFamily | None = None) -> bool:
    """Whether `ip` is an address of this machine (only such an address can be bound)."""
    if family is None:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
    except OSError:
        return False
    return True


class PresencePort:
    """A listening socket whose only job is to exist while this process does: another agent
    that connects and is refused knows this agent's process is gone, without waiting for its
    lease to expire. Connections are accepted and closed by a small thread."""

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            try:
                self._sock.bind((host, 0))
            except OSError:
                self._sock.bind(("", 0))
            self._sock.listen(64)
        except BaseException:
            self._sock.close()
            raise
        self.port = int(self._sock.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="elasticrun-presence", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    with contextlib.suppress(OSError):
                        conn, _ = self._sock.accept()
                        conn.close()

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
            join(self._thread, 5, "the presence port thread")
        for s in (self._sock, self._wake_r, self._wake_w):
            s.close()


UP, REFUSED, SILENT = "up", "refused", "silent"


def probe(targets: dict[str, tuple[str, int]], timeout: float) -> dict[str, str]:
    """Connect to every (host, port) at once; by key: UP if it accepted within `timeout` (the
    process behind it lives), REFUSED if nothing listens there any more (it is gone), SILENT if
    no answer came (a host that is down, or a network that drops: nobody can tell)."""
    result = dict.fromkeys(targets, SILENT)
    pending: dict[socket.socket, str] = {}
    with selectors.DefaultSelector() as sel:
        for key, (host, port) in targets.items():
            s = socket.socket(_family(host), socket.SOCK_STREAM)
            s.setblocking(False)
            code = s.connect_ex((host, port))
            if code == 0:
                result[key] = UP
                s.close()
            elif code in (errno.EINPROGRESS, errno.EAGAIN):
                pending[s] = key
                sel.register(s, selectors.EVENT_WRITE)
            else:
                result[key] = REFUSED if code == errno.ECONNREFUSED else SILENT
                s.close()
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for sk, _ in sel.select(left):
                s = sk.fileobj  # type: ignore[assignment]  # the sockets registered above
                key = pending.pop(s)
                sel.unregister(s)
                code = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                result[key] = UP if code == 0 else REFUSED if code == errno.ECONNREFUSED else SILENT
                s.close()
        for s in pending:
            s.close()
    return result


def digits(text: str) -> bool:
    """Whether `text` is ASCII digits only. ``str.isdigit`` also takes '²' and '①', which
    ``int`` then refuses."""
    return text.isascii() and text.isdigit()


def parse_endpoint(value: str, flag: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` (or ``host`` when there is a default port)."""
    text = value.strip()
    host, port_text = text, ""
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ConfigError(f"{flag} '{value}': an IPv6 address needs a closing ']'")
        host, rest = text[1:close], text[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{flag} '{value}' is not host:port")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif text.count(":") > 1:
        raise ConfigError(f"{flag} '{value}': write an IPv6 address in brackets, [::1]:29400")
    if not host:
        raise ConfigError(f"{flag} '{value}' has no host: write it like node0:29400")
    if not port_text:
        if default_port is None:
            raise ConfigError(f"{flag} '{value}' has no port: write it like {host}:29400")
        return host, default_port
    if not digits(port_text) or int(port_text) > 65535:
        raise ConfigError(f"{flag} '{value}': port '{port_text}' is not a number from 0 to 65535")
    return host, int(port_text)


def parse_bind(value: str, flag: str) -> tuple[str, int]:
    """``PORT`` (on 127.0.0.1) or ``HOST:PORT`` for the servers the launcher runs."""
    if digits(value):
        port = int(value)
        if port > 65535:
            raise ConfigError(f"{flag} '{value}' is not a port number (0 to 65535)")
        return "127.0.0.1", port
    return parse_endpoint(value, flag)
