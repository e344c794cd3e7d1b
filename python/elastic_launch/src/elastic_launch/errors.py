"""Error files: how a worker's exception reaches the launcher's failure summary; and the failure
types of torch's ``torch.distributed.elastic.multiprocessing.errors`` (:class:`ProcessFailure`,
:class:`ChildFailedError`), so that code written against torch's catches ours.

The format is torch's, so files written by torch's ``@record`` and by ours read the same::

    {"message": {"message": "ValueError: bad batch",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000",
                               "monotonic_ns": "123456789"}}}

``monotonic_ns`` is ours (when the exception was recorded, on the watchdog's clock), for the
failure-to-detection metric.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import signal
import socket
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from elastic_launch import untrusted
from elastic_launch.files import write_atomically

__all__ = [
    "ERROR_FILE_ENV",
    "ChildFailedError",
    "ErrorFileData",
    "ProcessFailure",
    "read_error_file",
    "record",
    "write_error_file",
]

#: Where a worker writes its uncaught exception (torch's variable).
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: torch's value for "no error file".
NOT_AVAILABLE = "<N/A>"
NO_TRACEBACK = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"

F = TypeVar("F", bound=Callable[..., Any])


def write_error_file(error: BaseException, tb: types.TracebackType | None = None) -> bool:
    """Write `error` to ``$TORCHELASTIC_ERROR_FILE`` unless it is unset or already written.

    Returns True if this call wrote the file. The first writer wins, so the innermost
    ``@record`` keeps its traceback when outer layers see the same exception.
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or os.path.exists(path):
        return False
    data = {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": "".join(
                    traceback.format_exception(type(error), error, tb or error.__traceback__)
                ),
                "timestamp": str(int(time.time())),
                "monotonic_ns": str(time.monotonic_ns()),
            },
        }
    }
    if not shows_traceback(error):
        data["message"]["extraInfo"]["show_traceback"] = "false"  # type: ignore[index]
    try:
        write_atomically(path, json.dumps(data))
    except OSError:
        return False  # never let error reporting hide the error itself
    return True


def shows_traceback(error: BaseException) -> bool:
    """Whether `error`'s traceback helps: not for an exception whose class says its message
    is all (``show_traceback = False``: a setting to fix, as ConfigError or elastic_sampler's
    CheckpointDirectoryError), which a report shows as its one line."""
    return getattr(error, "show_traceback", True) is not False


def record(fn: F) -> F:
    """Decorate a worker's (or a launcher's) main function, as torch's ``@record`` does: its
    return value is returned; an exception it raises is written to its error file and raised
    again; ``SystemExit(0)`` returns None (another exit code goes up, unrecorded); a
    :class:`ChildFailedError` copies its root cause's error file to this process's own.

    Drop-in for torch's ``torch.distributed.elastic.multiprocessing.errors.record``. Under
    ``elasticrun`` an uncaught exception is recorded even without it; with it, the traceback
    is recorded where the function raised, before anything else can intervene.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:
            if e.code == 0:
                return None
            raise
        except BaseException as e:
            first = getattr(e, "get_first_failure", None)
            if callable(first):  # ours or torch's ChildFailedError
                _, failure = first()
                dump_error_file(failure.error_file, failure.exitcode)
            elif isinstance(e, Exception):
                write_error_file(e)
            raise

    return wrapper  # type: ignore[return-value]


def dump_error_file(child_file: str, error_code: int = 0) -> None:
    """A child's error file, as this process's own (with the child's exit code), for a launcher
    that is itself run by a launcher."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or child_file == NOT_AVAILABLE:
        return
    try:  # the child wrote it: a regular file of bounded size, never a FIFO or a link
        raw = untrusted.read(child_file, ERROR_FILE_LIMIT + 1)
        if len(raw) > ERROR_FILE_LIMIT:
            return
        data = json.loads(raw)
        if error_code and isinstance(data.get("message"), dict):
            data["message"]["errorCode"] = error_code
        with open(path, "w") as f:
            json.dump(data, f)
    except Exception:  # OSError, bad JSON, too deep, not a dict: the child's file, not ours
        return  # never let error reporting hide the error itself


@dataclass
class ErrorFileData:
    """What an error file tells the launcher."""

    message: str
    traceback: str
    timestamp: float | None
    monotonic_ns: int | None
    show_traceback: bool = True  # False: the message is all (a setting to fix)


#: The most of a worker's error file the launcher reads: the worker writes it, so its size and
#: shape are the worker's to choose; a longer one is not read at all.
ERROR_FILE_LIMIT = 4 << 20


def read_error_file(path: str) -> ErrorFileData | None:
    """Read an error file written by us or by torch; None if absent, unreadable, longer than
    :data:`ERROR_FILE_LIMIT` or not of the expected shape."""
    try:
        raw = untrusted.read(path, ERROR_FILE_LIMIT + 1)
        data = json.loads(raw) if len(raw) <= ERROR_FILE_LIMIT else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    message = data.get("message", "")
    if isinstance(message, str):
        return ErrorFileData(message, "", _number(data.get("timestamp")), None)
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo", {})
    extra = extra if isinstance(extra, dict) else {}
    monotonic = _number(extra.get("monotonic_ns"))
    return ErrorFileData(
        message=str(message.get("message", "")),
        traceback=str(extra.get("py_callstack", "")),
        timestamp=_number(extra.get("timestamp")),
        monotonic_ns=int(monotonic) if monotonic is not None and abs(monotonic) < 2**63 else None,
        show_traceback=extra.get("show_traceback") != "false",
    )


def _number(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


@dataclass
class ProcessFailure:
    """One failed worker process, as torch describes it: from its exit code and its error file
    (what that holds: the message, and when; or, without one, the signal or a hint)."""

    local_rank: int
    pid: int
    exitcode: int  # negative: killed by that signal
    error_file: str
    error_file_data: dict[str, Any] = field(init=False)
    message: Any = field(init=False)  # a str, or the error file's structured message
    timestamp: int = field(init=False)  # Unix seconds

    def __post_init__(self) -> None:
        self.error_file_data = {"message": "<NONE>"}
        self.message = ""
        self.timestamp = int(time.time())
        if os.path.isfile(self.error_file):
            self.error_file_data = json.loads(untrusted.read(self.error_file, ERROR_FILE_LIMIT))
            message = self.error_file_data["message"]  # a file without one is not an error file
            if isinstance(message, str):
                self.message = message
                self.timestamp = int(self.error_file_data.get("timestamp", 0))
            else:
                self.message = message
                self.timestamp = int(message["extraInfo"]["timestamp"])
        else:
            self.error_file = NOT_AVAILABLE
        if not self.message:
            if self.exitcode < 0:
                self.message = (
                    f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
                )
            else:
                self.message = NO_TRACEBACK

    def signal_name(self) -> str:
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return NOT_AVAILABLE
        return NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        return datetime.datetime.fromtimestamp(self.timestamp).isoformat(sep="_")


class ChildFailedError(Exception):
    """Workers failed: `failures` by global rank (torch's exception, field for field)."""

    def __init__(self, name: str, failures: dict[int, ProcessFailure]) -> None:
        if not failures:
            raise AssertionError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures = failures
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """The root cause: the failure seen first (ties: the first given)."""
        rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
        return rank, self.failures[rank]

    def format_msg(self) -> str:
        root_rank, root = self.get_first_failure()
        others = [
            self._block(i, r, f) for i, (r, f) in enumerate(self.failures.items()) if r != root_rank
        ]
        lines = [
            f"{self.name} FAILED",
            "Failures:",
            *(others or ["  <NO_OTHER_FAILURES>"]),
            "Root Cause (first observed failure):",
            self._block(0, root_rank, root),
        ]
        width = min(max(len(line) for text in lines for line in text.splitlines()), 60)
        return "\n".join(["=" * width, *lines, "=" * width])

    @staticmethod
    def _block(index: int, rank: int, f: ProcessFailure) -> str:
        signal = f" ({f.signal_name()})" if f.exitcode < 0 else ""
        message = f.message
        if isinstance(message, dict):
            extra = message.get("extraInfo", {})
            message = extra.get("py_callstack") or message.get("message", "")
        return "\n".join(
            [
                f"[{index}]:",
                f"  time      : {f.timestamp_isoformat()}",
                f"  host      : {socket.getfqdn()}",
                f"  rank      : {rank} (local_rank: {f.local_rank})",
                f"  exitcode  : {f.exitcode} (pid: {f.pid}){signal}",
                f"  error_file: {f.error_file}",
                f"  traceback : {message}",
            ]
        )
