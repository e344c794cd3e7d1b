"""Reading what the rendezvous store holds. Anyone who can write the store (another program,
another job sharing a prefix, a damaged key) decides these bytes, so every field is checked for
its type, range and size before the rendezvous uses it; a bad value is a `StoreValueError`
naming the key and the field, never a traceback from deep inside the agent."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, NoReturn

from elastic_launch.rendezvous.api import StoreValueError

#: The largest value read: a round's state is under 1 KiB and a members shard about 3 KiB.
MAX_VALUE_BYTES = 1 << 20
#: The longest string field (an address, a node name, a release, a note).
MAX_TEXT = 4096
#: The most entries a mapping field may hold (nodes of a shard, notes).
MAX_ENTRIES = 1 << 16
#: Counts (versions, sizes, worlds, restarts) above this are not a job's.
MAX_COUNT = (1 << 53) - 1


#: Characters that would end or rewrite a log line, or a terminal's, shown escaped instead.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)} | {
    0x85: "\\x85",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def printable(text: str) -> str:
    """`text` with its control characters (a newline, an escape sequence) escaped: text
    from the store reaches log lines, and must not be able to forge one."""
    return text.translate(_CONTROL)


def bad(key: str, problem: str) -> NoReturn:
    raise StoreValueError(
        f"the rendezvous store's key {key!r} holds {problem}; another program or another "
        "job wrote there, or the key is damaged: give this job a new --rdzv-id"
    )


def decode(data: Any, key: str, shape: type = dict) -> Any:
    """The JSON value of `data` (bytes or str), which must be of `shape` (dict or list)."""
    if not isinstance(data, (bytes, bytearray, str)):
        bad(key, f"a {type(data).__name__}, not bytes")
    if len(data) > MAX_VALUE_BYTES:
        bad(key, f"{len(data)} bytes (at most {MAX_VALUE_BYTES} are read)")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        bad(key, f"no JSON ({type(e).__name__}: {str(e)[:100]})")
    if not isinstance(raw, shape):
        bad(key, f"a JSON {type(raw).__name__} where an {shape.__name__} belongs")
    return raw


def text_value(data: bytes, key: str) -> str:
    """A value that is one string (a node name): UTF-8, at most MAX_TEXT characters."""
    try:
        text = bytes(data).decode()
    except UnicodeDecodeError:
        bad(key, "bytes that are not UTF-8")
    if len(text) > MAX_TEXT:
        bad(key, f"{len(text)} characters (at most {MAX_TEXT})")
    return printable(text)


class Fields:
    """One JSON object from key `key`, read field by field."""

    def __init__(self, raw: Mapping[str, Any], key: str) -> None:
        self.raw = raw
        self.key = key

    @classmethod
    def of(cls, data: Any, key: str) -> Fields:
        return cls(decode(data, key), key)

    def bad(self, name: str, value: Any, want: str) -> NoReturn:
        bad(self.key, f"{name}={_short(value)}, not {want}")

    def integer(self, name: str, default: int = 0, low: int = 0, high: int = MAX_COUNT) -> int:
        value = self.raw.get(name, default)
        if not _is_int(value, low, high):
            self.bad(name, value, f"an integer from {low} to {high}")
        return int(value)

    def port(self, name: str, default: int = 0) -> int:
        return self.integer(name, default, 0, 65535)

    def text(self, name: str, default: str = "") -> str:
        value = self.raw.get(name, default)
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            self.bad(name, value, f"a string of at most {MAX_TEXT} characters")
        return printable(value)

    def number(self, name: str) -> float | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            self.bad(name, value, "a number")
        return float(value)

    def strings(self, name: str) -> dict[str, str]:
        """A mapping of strings to strings (absent or null: empty)."""
        value = self.raw.get(name) or {}
        if (
            not isinstance(value, dict)
            or len(value) > MAX_ENTRIES
            or not all(isinstance(v, str) and len(v) <= MAX_TEXT for v in value.values())
        ):
            self.bad(name, value, "an object of strings")
        return dict(value)


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def row(value: Any, key: str, node: str, kinds: tuple[type, ...]) -> list[Any]:
    """One node's row of a members shard: a list whose items are of `kinds`, in order."""
    if not isinstance(value, list) or len(value) != len(kinds):
        bad(key, f"node {_short(node)}: {_short(value)}, not a list of {len(kinds)} items")
    for i, (item, kind) in enumerate(zip(value, kinds, strict=True)):
        ok = (
            _is_int(item, 0, MAX_COUNT)
            if kind is int
            else isinstance(item, str) and len(item) <= MAX_TEXT
        )
        if not ok:
            bad(key, f"node {_short(node)}: item {i} is {_short(item)}, not {kind.__name__}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
