"""The memory tier's slot: one rank's newest checkpoint in a shared-memory file, where the
rank's death cannot take it (the file outlives the process that wrote it).

A slot is one file (on /dev/shm, or any directory): a header page and two buffers. A save
goes into the buffer that does not hold the newest complete copy, so the previous copy stays
whole until the new one is: its descriptor is cleared before the first byte is written and
sealed (its sequence number written last) after the last one. A process killed at any moment
therefore leaves the newest complete copy readable, and never a torn one that looks complete.
Each sealed copy carries its step, its size, a CRC-32C of its bytes, a digest of the job's
run id, and whose state it is: the rank that saved it and the world it saved in, or -1 for a
state every rank shares. A copy of another job, or one whose bytes changed, is never returned;
a slot returns only its owner's copies (a replica slot, `_replica`, holds a peer's). A copy
holds a payload (`_payload`): a state laid out so that its tensors are copied in, not
serialized, that names the same owner, world, step and run inside its checksummed bytes. A
copy is sealed only if its bytes name what its descriptor will (`seal`), and one whose bytes
name another than its descriptor (a descriptor rewritten in the file) is refused with a
warning, as a torn one is.

Layout (little-endian): ``magic(8) version(4) pad(4) capacity(8)``, then two descriptors of
``seq(8) step(8) size(8) crc32c(4) owner(4) world(4) run(32)`` at 64 and 192; buffers at 4096 and
4096 + capacity. A save that does not fit grows the slot: a new file with both buffers that
big, holding the newest copy, renamed over the old one.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_sampler import _payload
from elastic_sampler.api import CheckpointError

#: Set by elasticrun for its workers (the literal names are the contract with
#: elastic_launch's agent/memory_tier.py): the node's directory for slots, in shared memory,
#: which the launcher removes when it ends however it ends; and the bytes one slot may take.
MEMORY_DIR_ENV = "ELASTICRUN_MEMORY_DIR"
MEMORY_LIMIT_ENV = "ELASTICRUN_MEMORY_LIMIT"

MAGIC = b"ERMEMCK1"
VERSION = 4
HEADER = 4096
_HEAD = struct.Struct("<8sI4xQ")  # magic, version, capacity
_DESC = struct.Struct("<QqQIii32s")  # seq, step, size, crc32c, owner, world, run digest
_DESC_AT = (64, 192)
#: The owner of a state every rank holds alike (a DDP state): any rank may take it.
SHARED = -1
_MIN_CAPACITY = 1 << 20


_PAGE = 4096  # buffers start on pages: the copy's non-temporal stores want aligned targets


def _pages(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


def _address(m: mmap.mmap) -> int:
    """Where `m` is mapped (the ctypes view that tells is let go at once: `m` may be closed)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _fields(c: _Copy) -> tuple[int, int, int, int, int, int, bytes]:
    return c.seq, c.step, c.size, c.crc, c.owner, c.world, c.run


def run_digest(run_id: str) -> bytes:
    return hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).digest()


def slot_bytes(capacity: int) -> int:
    """What a slot whose buffers hold `capacity` bytes each takes in memory."""
    return HEADER + 2 * capacity


@dataclass(frozen=True)
class _Copy:
    """A sealed copy's descriptor: which buffer, its sequence number, what it holds."""

    index: int
    seq: int
    step: int
    size: int
    crc: int
    owner: int
    world: int
    run: bytes


class MemorySlot:
    """One rank's slot at `path`, for the job `run_id`. `limit`: the bytes the slot may take
    (both buffers and the header); a save that would need more is a CheckpointError and the
    previous copy stays. `owner`: whose copies the slot returns and seals (`SHARED`, or a
    rank), in a world of `world` ranks."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        run_id: str,
        limit: int | None = None,
        *,
        owner: int = SHARED,
        world: int = 0,
    ) -> None:
        self.path = Path(path)
        self.run = run_digest(run_id)
        self.limit = limit
        self.owner, self.world = owner, world
        self._map: mmap.mmap | None = None
        self._capacity = 0
        self._base = 0  # the map's address
        #: Views a failed transfer may still be writing or reading (gloo's thread): the map
        #: is never closed or replaced under them.
        self._pinned: list[memoryview] = []
        self._refused: set[tuple[int, int]] = set()  # (seq, buffer) of copies warned about

    def identity(self, step: int) -> _payload.Identity:
        """What this slot's owner's copy of `step` names in its bytes."""
        return _payload.Identity(self.owner, self.world, step, self.run)

    # ---- the file --------------------------------------------------------------------------

    def _open(self) -> bool:
        """Map the slot's file if it exists and is one; False if there is none."""
        if self._map is not None:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise CheckpointError(f"the memory slot '{self.path}' cannot be opened: {e}") from e
        try:
            size = os.fstat(fd).st_size
            if size < HEADER:
                return False
            m = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, capacity = _HEAD.unpack_from(m, 0)
        if magic != MAGIC or version != VERSION or slot_bytes(capacity) != size:
            m.close()
            return False  # not a slot of ours (or of another version): treated as none
        self._map, self._capacity, self._base = m, capacity, _address(m)
        return True

    def _create(self, capacity: int, keep: _Copy | None) -> None:
        """A new file with buffers of `capacity`, holding `keep` (a sealed copy of the current
        file) as its only copy, renamed over the old one."""
        need = slot_bytes(capacity)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, need)
            m = mmap.mmap(fd, need)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise CheckpointError(
                f"cannot make a memory slot of {need} bytes at '{tmp.parent}': {e}"
            ) from e
        os.close(fd)
        _HEAD.pack_into(m, 0, MAGIC, VERSION, capacity)
        if keep is not None and self._map is not None:
            start = HEADER + keep.index * self._capacity
            m[HEADER : HEADER + keep.size] = self._map[start : start + keep.size]
            _DESC.pack_into(m, _DESC_AT[0], *_fields(keep))
        try:
            os.replace(tmp, self.path)
        except OSError as e:
            m.close()
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise CheckpointError(f"cannot put the memory slot at '{self.path}': {e}") from e
        if self._map is not None:
            self._map.close()
        self._map, self._capacity, self._base = m, capacity, _address(m)

    # ---- copies ----------------------------------------------------------------------------

    def _copies(self, anyone: bool = False) -> list[_Copy]:
        """The sealed copies of the slot's owner (with `anyone`, of any owner), newest first
        (not yet checked against their bytes)."""
        assert self._map is not None
        found = []
        for index, at in enumerate(_DESC_AT):
            seq, step, size, crc, owner, world, run = _DESC.unpack_from(self._map, at)
            if seq > 0 and 0 <= size <= self._capacity and step >= 0:
                found.append(_Copy(index, seq, step, size, crc, owner, world, run))
        found.sort(key=lambda c: c.seq, reverse=True)
        return found if anyone else [c for c in found if self._mine(c)]

    def _mine(self, c: _Copy) -> bool:
        return c.owner == self.owner and (self.owner == SHARED or c.world == self.world)

    def held(self) -> list[_Copy]:
        """Every copy of this job in the slot that verifies, whoever's state it is, newest
        first."""
        if not self._open():
            return []
        return [c for c in self._copies(anyone=True) if self._intact(c)]

    def view(self, c: _Copy) -> memoryview:
        """The bytes of the copy `c`, in place: release the view before the slot's next
        save."""
        assert self._map is not None
        start = HEADER + c.index * self._capacity
        return memoryview(self._map)[start : start + c.size]

    def _intact(self, c: _Copy) -> bool:
        with self.view(c) as view:
            return c.run == self.run and _payload.checksum(view) == c.crc and self.names(c, view)

    def names(self, c: _Copy, data: Any) -> bool:
        """Whether the bytes of `c` name what its descriptor says (a warning, once, if not)."""
        expected = _payload.Identity(c.owner, c.world, c.step, c.run)
        try:
            _payload.check_identity(data, expected, f"the memory copy in '{self.path}'")
        except _payload.ForeignCopyError as e:
            if (c.seq, c.index) not in self._refused:
                self._refused.add((c.seq, c.index))
                warnings.warn(str(e), stacklevel=2)
            return False
        return True

    def newest(self) -> tuple[int, _Copy] | None:
        """(step, copy) of the newest copy of this job that verifies, or None."""
        if not self._open():
            return None
        for c in self._copies():
            if self._intact(c):
                return c.step, c
        return None

    def latest_step(self) -> int | None:
        found = self.newest()
        return None if found is None else found[0]

    def read(self) -> tuple[bytearray, int] | None:
        """(bytes, step) of the newest copy that verifies, copied out of the slot. The copy is
        what is checked: one pass, and a writer that changed the buffer meanwhile is caught."""
        if not self._open():
            return None
        for c in self._copies():
            data = self.read_copy(c)
            if data is not None:
                return data, c.step
        return None

    def read_copy(self, c: _Copy) -> bytearray | None:
        """The bytes of the copy `c`, copied out and checked as they are; None if they do not
        verify (or are another job's)."""
        if c.run != self.run:
            return None
        data = bytearray(c.size)
        start = self._base + HEADER + c.index * self._capacity
        if _payload.copy_out(data, start, c.size) != c.crc or not self.names(c, data):
            return None
        return data

    def last(self) -> _Copy | None:
        """The owner's newest sealed copy, not checked again (the copy just made: its
        checksum was taken as it was written)."""
        if not self._open():
            return None
        copies = self._copies()
        return copies[0] if copies else None

    def load(self, map_location: Any = "cpu", weights_only: bool = True) -> tuple[Any, int] | None:
        """(state, step) of the newest copy that verifies, or None."""
        got = self.read()
        if got is None:
            return None
        data, step = got
        where = f"memory checkpoint step {step} ('{self.path}')"
        return _payload.decode(data, where, map_location, weights_only), step

    def put(self, state: Any, step: int) -> None:
        """Make `state` the slot's newest copy, as checkpoint `step`."""
        self.put_plan(_payload.plan(state, self.identity(step)), step)

    def put_plan(self, plan: _payload.Plan, step: int) -> bool:
        """Copy a planned state in as checkpoint `step`; False (the previous copy kept) if its
        tensors changed while they were copied."""
        index = self._reserve(plan.size)
        with self._region(index, plan.size) as view:
            crc = plan.write(view)
        if plan.changed():
            return False
        self.seal(index, step, plan.size, crc, self.owner, self.world)
        return True

    def put_bytes(self, data: Any, step: int) -> None:
        """Make `data` (a payload, or a torch.save file's bytes: those are this slot's owner's)
        the slot's newest copy, as checkpoint `step`."""
        if not _payload.is_payload(data):
            self.put_plan(_payload.whole_bytes(data, self.identity(step)), step)
            return
        view = memoryview(data).cast("B")
        index = self._reserve(view.nbytes)
        with self._region(index, view.nbytes) as region:
            region[:] = view
            crc = _payload.checksum(region)
        self.seal(index, step, view.nbytes, crc, self.owner, self.world)

    def receive(self, size: int, fill: Any) -> int:
        """Let `fill(region)` write a copy of `size` bytes straight into the slot (a peer's,
        off the network); the buffer to `seal` it in. The previous copy stays whole until
        then."""
        index = self._reserve(size)
        region = self._region(index, size)
        try:
            fill(region)
        except BaseException:
            self.pin(region)  # the transfer may still write into it
            raise
        region.release()
        return index

    def pin(self, view: memoryview) -> None:
        """Keep the map under `view` as long as this process lives (a transfer that failed
        may still use it)."""
        self._pinned.append(view)

    def check_room(self, size: int) -> int:
        """The buffer size a copy of `size` bytes needs (the present one if it fits), or a
        CheckpointError if the slot's limit does not allow it."""
        if self._open() and size <= self._capacity:
            return self._capacity
        capacity = _pages(max(_MIN_CAPACITY, size + size // 4))  # room to grow a little
        if self.limit is not None and slot_bytes(capacity) > self.limit:
            capacity = max(_pages(size), (self.limit - HEADER) // 2 // _PAGE * _PAGE)
        need = slot_bytes(capacity)
        if self.limit is not None and need > self.limit:
            raise CheckpointError(
                f"the memory tier needs {need} bytes for this rank ({size} bytes of state, "
                f"twice, so that the previous step survives a save cut short), more than its "
                f"limit of {self.limit} bytes: raise the limit, or save less state"
            )
        return capacity

    def _reserve(self, size: int) -> int:
        """The buffer the next copy of `size` bytes goes to (the one not holding the newest
        copy), unsealed: a copy cut short is never taken for a whole one."""
        capacity = self.check_room(size)
        if self._pinned and capacity != self._capacity:
            raise CheckpointError(
                f"the memory slot '{self.path}' cannot grow: a transfer of it failed and may "
                "still use it; the worker must be restarted"
            )
        if capacity != self._capacity or self._map is None:
            kept = self.newest() if self._map is not None else None
            self._create(capacity, kept[1] if kept else None)
        assert self._map is not None
        copies = self._copies()
        index = 1 - copies[0].index if copies else 0
        _DESC.pack_into(self._map, _DESC_AT[index], 0, 0, 0, 0, SHARED, 0, bytes(32))
        return index

    def _region(self, index: int, size: int) -> memoryview:
        assert self._map is not None
        start = HEADER + index * self._capacity
        return memoryview(self._map)[start : start + size]

    def seal(self, index: int, step: int, size: int, crc: int, owner: int, world: int) -> None:
        """Make the copy written into buffer `index` the newest, as `owner`'s step `step`
        with checksum `crc` (for a copy `receive` wrote, its sender's: every reader checks it,
        so a copy damaged on its way is never returned). A `ForeignCopyError`, the buffer left
        unsealed, if its bytes name another owner, world, step or job."""
        assert self._map is not None
        expected = _payload.Identity(owner, world, step, self.run)
        with self._region(index, size) as region:  # its head only: a pass would cost more
            where = f"the copy written into '{self.path}'"
            _payload.check_identity(region, expected, where, "is to be sealed as")
        copies = self._copies(anyone=True)
        seq = (copies[0].seq if copies else 0) + 1
        at = _DESC_AT[index]
        _DESC.pack_into(self._map, at, 0, step, size, crc, owner, world, self.run)
        struct.pack_into("<Q", self._map, at, seq)  # sealed, last

    def close(self) -> None:
        if self._map is not None and not self._pinned:
            self._map.close()
            self._map = None


def slot_for(
    directory: Path, prefix: str, kind: str = "rank", owner: int = SHARED, world: int = 0
) -> MemorySlot | None:
    """This worker's slot for the checkpoints of `directory` (one per local rank, so that a
    replacement on the same node finds its predecessor's), or None outside elasticrun. `kind`
    "replica": the slot beside it that holds a peer's copies."""
    home = os.environ.get(MEMORY_DIR_ENV)
    if not home:
        return None
    if not os.path.isdir(home):
        raise CheckpointError(
            f"${MEMORY_DIR_ENV}={home!r} is not a directory: it is set by elasticrun for its "
            "workers; unset it, or run the script under elasticrun"
        )
    limit = None
    raw_limit = os.environ.get(MEMORY_LIMIT_ENV)
    if raw_limit:
        if not raw_limit.isascii() or not raw_limit.isdigit():
            raise CheckpointError(
                f"${MEMORY_LIMIT_ENV}={raw_limit!r}: give the bytes one rank's memory "
                "checkpoints may take, as a whole number (elasticrun sets it from "
                "--memory-checkpoint-limit)"
            )
        limit = int(raw_limit)
    local_rank = os.environ.get("LOCAL_RANK", "0")
    if not local_rank.isascii() or not local_rank.isdigit():
        raise CheckpointError(f"$LOCAL_RANK={local_rank!r}: expected a whole number")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    where = hashlib.sha256(os.fsencode(directory.resolve())).hexdigest()[:12]
    name = f"{prefix}-{where}-{kind}{int(local_rank)}"
    return MemorySlot(Path(home) / name, run_id, limit, owner=owner, world=world)
