"""Error files: how a worker's exception reaches the launcher's failure summary.

The format is torch's (``torch.distributed.elastic.multiprocessing.errors``), so files written by
torch's ``@record`` and by ours read the same::

    {"message": {"message": "ValueError: bad batch",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000",
                               "monotonic_ns": "123456789"}}}

``monotonic_ns`` is ours (when the exception was recorded, on the watchdog's clock), for the
failure-to-detection metric.
"""

from __future__ import annotations

import functools
import json
import os
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from elastic_launch.compat import ERROR_FILE_ENV

__all__ = ["ERROR_FILE_ENV", "ErrorFileData", "read_error_file", "record", "write_error_file"]

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
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        return False  # never let error reporting hide the error itself
    return True


def record(fn: F) -> F:
    """Decorate a worker's main function: an exception it raises is written to its error file.

    Drop-in for torch's ``torch.distributed.elastic.multiprocessing.errors.record``. Under
    ``elasticrun`` an uncaught exception is recorded even without it; with it, the traceback
    is recorded where the function raised, before anything else can intervene.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:
            if e.code not in (None, 0):
                write_error_file(e)
            raise
        except BaseException as e:
            write_error_file(e)
            raise

    return wrapper  # type: ignore[return-value]


@dataclass
class ErrorFileData:
    """What an error file tells the launcher."""

    message: str
    traceback: str
    timestamp: float | None
    monotonic_ns: int | None


def read_error_file(path: str) -> ErrorFileData | None:
    """Read an error file written by us or by torch; None if absent or unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message", "")
    if isinstance(message, str):
        return ErrorFileData(message, "", _number(data.get("timestamp")), None)
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    monotonic = _number(extra.get("monotonic_ns"))
    return ErrorFileData(
        message=str(message.get("message", "")),
        traceback=str(extra.get("py_callstack", "")),
        timestamp=_number(extra.get("timestamp")),
        monotonic_ns=int(monotonic) if monotonic is not None else None,
    )


def _number(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
