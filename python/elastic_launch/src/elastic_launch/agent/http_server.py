"""The small HTTP server behind ``/healthz`` and ``/metrics``, bounded whatever its clients do.

One event loop on one thread serves every connection: an idle connection costs a coroutine
and a socket, not a thread. At most :data:`MAX_CONNECTIONS` wait for their request: a new one
beyond that closes the one that has waited longest (so idle connections cannot lock a probe
out), a request's head must arrive whole within :data:`REQUEST_TIMEOUT` and hold at most
:data:`MAX_REQUEST` bytes, and the pages are made by a pool of :data:`PAGE_THREADS` threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Mapping

from elastic_launch.api import ConfigError
from elastic_launch.cancel import join
from elastic_launch.net import host_port

#: A page: () -> (HTTP status, content type, body).
Page = Callable[[], tuple[int, str, bytes]]

MAX_CONNECTIONS = 256
REQUEST_TIMEOUT = 5.0
MAX_REQUEST = 8192
PAGE_THREADS = 2
_START_TIMEOUT = 10.0
_REASONS = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
    500: "Internal Server Error",
}


class SmallHttpServer:
    """Serves `pages` (by path) on host:port; `flag` names the setting in errors."""

    def __init__(self, host: str, port: int, pages: Mapping[str, Page], flag: str) -> None:
        self.pages = dict(pages)
        self._waiting: dict[asyncio.Task[None], None] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(PAGE_THREADS, "elasticrun-http")
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(host, port, started), name="elasticrun-http", daemon=True
        )
        self._thread.start()
        try:
            started.result(_START_TIMEOUT)
        except OSError as e:
            self.close()
            raise ConfigError(
                f"{flag} {host_port(host, port)} cannot be served: {e.strerror or e}; choose "
                "a free port"
            ) from None

    def _run(self, host: str, port: int, started: concurrent.futures.Future[None]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST, backlog=128)
            )
        except OSError as e:
            started.set_exception(e)
            return
        started.set_result(None)
        self._loop.run_forever()
        left = asyncio.all_tasks(self._loop)
        for task in left:
            task.cancel()
        with contextlib.suppress(BaseException):
            if left:  # a second at most: a stop is never held up by a connection
                self._loop.run_until_complete(asyncio.wait(left, timeout=1.0))
        self._loop.close()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def open_connections(self) -> int:
        """Connections waiting for their request."""
        return len(self._waiting)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        if len(self._waiting) >= MAX_CONNECTIONS:
            oldest = next(iter(self._waiting))  # the longest waiting: dict order is arrival
            del self._waiting[oldest]
            oldest.cancel()
        self._waiting[me] = None
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            self._waiting.pop(me, None)
            await self._answer(head, writer)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # too slow, too long, or gone: the connection is closed
        except asyncio.CancelledError:
            pass  # closed for a newer connection, or the server is closing
        finally:
            self._waiting.pop(me, None)
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> None:
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        method, path = (parts[0], parts[1].split("?", 1)[0]) if len(parts) >= 2 else ("", "")
        page = self.pages.get(path)
        if method not in ("GET", "HEAD"):
            status, kind, body = 405, "text/plain", b"GET only\n"
        elif page is None:
            status, kind, body = 404, "text/plain", f"try {' or '.join(self.pages)}\n".encode()
        else:
            try:
                status, kind, body = await self._loop.run_in_executor(self._pool, page)
            except Exception as e:  # a page that fails is a 500, not a closed server
                status, kind, body = 500, "text/plain", f"{type(e).__name__}: {e}\n".encode()
        reason = _REASONS.get(status, "")
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: "
            f"{len(body)}\r\nConnection: close\r\n\r\n".encode()
        )
        if method != "HEAD":
            writer.write(body)
        await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT)

    def close(self) -> None:
        if self._loop.is_running():

            def stop() -> None:
                if self._server is not None:
                    self._server.close()
                self._loop.stop()

            self._loop.call_soon_threadsafe(stop)
        join(self._thread, 5, "the HTTP server thread")
        self._pool.shutdown(wait=False, cancel_futures=True)
