"""Where workers' output goes: the log directory layout and the tee pump.

Layout (torchrun's, except that attempts are numbered by every restart, so a later attempt
never overwrites an earlier one)::

    <log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/stdout.log
                                                        /stderr.log
                                                        /error.json   (the error file)
                                                        /stack.txt    (hang stack dumps)
                                                        /imports.json (the modules it holds)
                                           /filtered_stdout.log       (--duplicate-*-filters)
                               /learned_imports.json  (for the node's hot spares)
    <log_dir>/elasticrun_imports_<digest>.json  (what the runs of one script learned: the next
                                                 one starts with it; elastic_launch.learned)

Without ``--log-dir`` the base is a new temporary directory, removed at exit unless it holds the
log files asked for with ``--redirects``/``--tee``. ``--log-dir /dev/null`` keeps no logs: error
and stack files then live in a temporary directory removed at exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import IO

from elastic_launch import untrusted

logger = logging.getLogger(__name__)


class LogLayout:
    """The run's log directory and the paths of each attempt and rank.

    Without ``--log-dir`` the base is a new directory under the system's temporary directory:
    it is removed on every way out unless it holds log files the user asked for
    (``--redirects``/``--tee``), which the failure summary then points at. ``--log-dir
    /dev/null`` keeps nothing.
    """

    def __init__(self, log_dir: str | None, run_id: str, logs_requested: bool = False) -> None:
        self.keep_logs = log_dir != os.devnull
        temporary = log_dir is None or not self.keep_logs
        if temporary:
            base = tempfile.mkdtemp(prefix=f"elasticrun_{os.getpid()}_")
        else:
            assert log_dir is not None
            base = self._make_base(log_dir)
        #: The directory to remove on the way out (None: the user's, kept).
        self.temporary: str | None = base if temporary else None
        self.keep_temporary = temporary and self.keep_logs and logs_requested
        safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id) or "run"
        try:
            self.run_dir = tempfile.mkdtemp(prefix=f"{safe_id}_", dir=base)
        except OSError as e:
            self.close()
            raise _unusable(log_dir or base, e) from None

    @staticmethod
    def _make_base(log_dir: str) -> str:
        if os.path.isfile(log_dir):
            from elastic_launch.api import ConfigError

            raise ConfigError(f"--log-dir '{log_dir}' is a file: give a directory")
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as e:
            raise _unusable(log_dir, e) from None
        return log_dir

    def attempt_dir(self, attempt: int) -> str:
        return os.path.join(self.run_dir, f"attempt_{attempt}")

    def make_attempt_dir(self, attempt: int) -> str:
        """Make attempt `attempt`'s directory (raises OSError if it cannot be made)."""
        return self._make(self.attempt_dir(attempt))

    def rank_dir(self, attempt: int, local_rank: int, generation: int = 0) -> str:
        """Make a worker's directory; a replacement within the attempt gets ``<rank>_r<n>``
        (raises OSError if it cannot be made)."""
        name = str(local_rank) if generation == 0 else f"{local_rank}_r{generation}"
        return self._make(os.path.join(self.attempt_dir(attempt), name))

    def _make(self, path: str) -> str:
        """Workers can write in the run directory: what one left where the launcher makes a
        directory is moved aside, and said."""
        for what in untrusted.make_dir(path, self.run_dir):
            logger.warning("a worker left %s: the launcher's directory is made anew", what)
        return path

    @property
    def kept(self) -> bool:
        """Whether the run's directory stays after the launcher exits."""
        return self.temporary is None or self.keep_temporary

    def close(self) -> None:
        """Remove the temporary directory unless it holds requested logs; safe twice."""
        if self.temporary is not None and not self.keep_temporary:
            untrusted.remove_tree(self.temporary)

    def __enter__(self) -> LogLayout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unusable(path: str, error: OSError) -> Exception:
    from elastic_launch.api import ConfigError

    return ConfigError(
        f"--log-dir '{path}' cannot be used: {error.strerror or error}; give a directory this "
        "user can write to"
    )


#: A line a worker writes without ending it is cut into lines of this many bytes: its output
#: is the worker's to choose, the launcher's memory is not.
LINE_LIMIT = 64 << 10


@dataclass
class _Stream:
    log: IO[bytes] | None  # the rank's log file (tee)
    console: IO[bytes] | None  # where the console copy goes, None if filtered out
    prefix: bytes
    filtered: IO[bytes] | None  # the attempt's filtered_std*.log
    filters: list[bytes]
    partial: bytes = b""


class OutputPump:
    """Copies workers' piped output, line by line, to their log files and to the console with a
    per-rank prefix (``--tee``), and matching lines to the filtered log. One thread for all."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._open = 0
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._drained = threading.Condition(self._lock)

    def add(
        self,
        read_fd: int,
        log: IO[bytes] | None,
        console: IO[bytes] | None,
        prefix: str,
        filtered: IO[bytes] | None = None,
        filters: list[str] | None = None,
    ) -> None:
        os.set_blocking(read_fd, False)
        stream = _Stream(
            log, console, prefix.encode(), filtered, [f.encode() for f in filters or []]
        )
        with self._lock:
            self._selector.register(read_fd, selectors.EVENT_READ, stream)
            self._open += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="elasticrun-output", daemon=True
                )
                self._thread.start()
        os.write(self._wake_w, b"x")

    def wait_drained(self, timeout: float) -> bool:
        """Wait until every added stream reached end of file (its writers have exited)."""
        with self._drained:
            return self._drained.wait_for(lambda: self._open == 0, timeout)

    def drop_all(self) -> None:
        """Stop reading every stream (their writers outlived the wait); close their pipes."""
        with self._lock:
            for key in list(self._selector.get_map().values()):
                if key.data is not None:
                    self._selector.unregister(key.fd)
                    os.close(key.fd)
                    self._open -= 1
            self._drained.notify_all()

    def _emit(self, s: _Stream, line: bytes) -> None:
        # A destination that fails (a closed console pipe, a full disk) is dropped; the others,
        # and the draining of the worker's pipe, go on, so the worker never blocks on output.
        if s.log is not None:
            try:
                s.log.write(line)
            except (OSError, ValueError):
                s.log = None
        if s.console is not None:
            try:
                s.console.write(s.prefix + line)
            except (OSError, ValueError):
                s.console = None
        if s.filtered is not None and any(f in line for f in s.filters):
            try:
                s.filtered.write(s.prefix + line)
            except (OSError, ValueError):
                s.filtered = None

    def _flush(self, s: _Stream) -> None:
        for f in (s.log, s.console, s.filtered):
            if f is not None:
                with contextlib.suppress(OSError, ValueError):
                    f.flush()

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    os.read(self._wake_r, 4096)
                    continue
                # Reads happen under the lock, so drop_all() never closes a pipe mid-read.
                with self._lock:
                    if self._selector.get_map().get(key.fd) is not key:
                        continue  # dropped meanwhile
                    self._pump(key.fd, key.data)

    def _pump(self, fd: int, s: _Stream) -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            data = s.partial + chunk
            *lines, s.partial = data.split(b"\n")
            cut = len(s.partial) // LINE_LIMIT * LINE_LIMIT
            ends, s.partial = s.partial[:cut], s.partial[cut:]
            for line in lines + ([ends] if ends else []):
                for at in range(0, max(len(line), 1), LINE_LIMIT):
                    self._emit(s, line[at : at + LINE_LIMIT] + b"\n")
            self._flush(s)
            return
        if s.partial:
            self._emit(s, s.partial + b"\n")
            s.partial = b""
        self._flush(s)
        self._selector.unregister(fd)
        os.close(fd)
        self._open -= 1
        self._drained.notify_all()


def console_streams() -> tuple[IO[bytes], IO[bytes]]:
    """The launcher's stdout and stderr as binary streams (for prefixed tee lines), whatever
    they are now: a text stream without a buffer (a ``StringIO`` that a caller or a test
    framework put there) gets the lines decoded."""
    return _binary(sys.stdout), _binary(sys.stderr)


def _binary(stream: IO[str]) -> IO[bytes]:
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else _TextSink(stream)  # type: ignore[return-value]


class _TextSink:
    """Bytes written to a text stream (the pump's lines are whole, so each decodes alone)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, data: bytes) -> int:
        self.stream.write(data.decode(errors="replace"))
        return len(data)

    def flush(self) -> None:
        self.stream.flush()
