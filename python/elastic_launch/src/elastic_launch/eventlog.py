"""The events file (``--events-file``): one record format and one writer, for the agent's events
and those the train loop's workers add to the same file.

A record is one JSON object on one line: ``event``, ``time`` (Unix seconds), ``run_id``,
``attempt``, ``pid`` (of the writer), then the event's own fields. Each record is one ``write``
to a file opened with ``O_APPEND``, so the lines of several writers never mix.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

#: Where the agent tells its workers the events file is (absent: there is none).
EVENTS_FILE_ENV = "ELASTICRUN_EVENTS_FILE"


def record(name: str, run_id: str, attempt: int, data: dict[str, Any], when: float) -> str:
    """One record, as its line (without the newline)."""
    fields = {"event": name, "time": when, "run_id": run_id, "attempt": attempt}
    return json.dumps({**fields, "pid": os.getpid(), **data}, default=str)


class EventsFile:
    """The events file, open for appending records."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(
        self, name: str, run_id: str, attempt: int, data: dict[str, Any], when: float | None = None
    ) -> None:
        line = record(name, run_id, attempt, data, time.time() if when is None else when)
        os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def append(path: str, name: str, run_id: str, attempt: int, **data: Any) -> None:
    """Append one record to `path` (a worker's rare events: opened and closed each time)."""
    f = EventsFile(path)
    try:
        f.write(name, run_id, attempt, data)
    finally:
        f.close()
