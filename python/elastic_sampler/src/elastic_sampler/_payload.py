"""The memory tier's payload: a state laid out so that its tensors are copied straight into
shared memory, by elastic_core's copy that checksums as it copies (the GIL released), rather
than through a serializer.

A payload is ``MAGIC(8) skeleton_size(8)`` and whose state it is (`Identity`: the owner rank,
or -1 for a state every rank shares, the world size, the step, a digest of the run id), the
skeleton, then (from the next page) each tensor's bytes, 64-byte aligned, large tensors on
pages of their own. The identity is inside the checksummed bytes: a copy that holds another
rank's state (or step, or job) than it is taken for is refused (`check_identity`) when it is
sealed, received, sent back or read, so a restore takes the next source. The skeleton is a
pickle of ``{"state": ..., "at": [...]}`` holding nothing but builtins, OrderedDicts, torch
dtypes and devices, and tensor references (`TensorRef`): the state with every tensor replaced
by a reference to its entry in ``at`` (its offset after the skeleton, dtype name, shape and
device).
It is read back by an unpickler that builds those types and refuses any other, so a payload is
as safe to read as ``weights_only=True``.

A state that holds anything else (a numpy array, an object, a sparse or quantized tensor, a
tensor subclass) is saved whole by ``torch.save`` instead, at `plan` time: its bytes follow the
same head (magic ``WHOLE``), and are read back by ``torch.load``.

Planning (`plan`) runs on the training thread and is cheap: a walk, clones of the small
tensors (state that changes outside optimizer.step(), such as BatchNorm statistics, is small)
and a pickle of builtins. Copying (`Plan.write`) runs on another thread while training goes
on, as long as nothing changes the large tensors meanwhile: `Plan.changed` tells, from torch's
version counters. That thread runs almost no Python: Python on it would hold the GIL that the
training thread needs between its operators.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic_sampler._files import load
from elastic_sampler.api import CheckpointError, UnsafeCheckpointError


class ForeignCopyError(CheckpointError):
    """A memory copy whose bytes name another owner, step or job than its slot says."""


MAGIC = b"ERPAYLD3"
WHOLE = b"ERWHOLE3"  # the head, then a torch.save file's bytes
_HEAD = struct.Struct("<8sQiiq32s")  # magic, body size, owner, world, step, run digest
ALIGN = 64
#: Tensors smaller than this are cloned when the plan is made (cheap, and small state is what
#: changes outside optimizer.step()); larger ones are read by the copy.
CLONE_BELOW = 64 << 10
#: A payload's checksum is the CRC-32C of the CRC-32Cs of its pieces of this many bytes (the
#: last one shorter), little-endian: pieces are checksummed as they are copied, three at once.
CHUNK = 1 << 20
_PLAIN = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


#: Large tensors start on a page of the payload (the slot's buffers start on pages): a copy
#: whose source and target pages do not line up runs at half speed.
PAGE = 4096


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Identity:
    """Whose state a payload holds: `owner` rank (-1: one every rank shares) in a world of
    `world` ranks, at checkpoint `step`, of the job whose run id digests to `run`."""

    owner: int
    world: int
    step: int
    run: bytes

    def head(self, magic: bytes, body: int) -> bytes:
        return _HEAD.pack(magic, body, self.owner, self.world, self.step, self.run)

    def says(self) -> str:
        whose = "the ranks' shared state" if self.owner < 0 else f"rank {self.owner}'s state"
        return f"{whose} of step {self.step} in a world of {self.world}"


def identity_of(data: Any) -> Identity | None:
    """The identity a payload's head names; None if `data` is no payload (a torch.save file's
    bytes, or bytes of no format)."""
    view = memoryview(data).cast("B")
    if view.nbytes < _HEAD.size or bytes(view[:8]) not in (MAGIC, WHOLE):
        return None
    _, _, owner, world, step, run = _HEAD.unpack_from(view, 0)
    return Identity(owner, world, step, run)


def check_identity(data: Any, expected: Identity, where: str, claim: str = "is sealed as") -> None:
    """A `ForeignCopyError` unless `data` is a payload naming `expected`; its message says
    that `where` `claim` (is sealed as, is to be sealed as, ...) what `expected` names."""
    found = identity_of(data)
    if found == expected:
        return
    if found is None:
        raise ForeignCopyError(f"{where} names no owner: it was not written by this version")
    if found.run != expected.run:
        raise ForeignCopyError(f"{where} holds another job's state: it is refused")
    raise ForeignCopyError(
        f"{where} {claim} {expected.says()} but holds {found.says()}: it is refused"
    )


class TensorRef:
    """Where a tensor was, in a skeleton: the index of its entry in the table."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        if type(index) is not int or index < 0:
            raise ValueError(f"a tensor reference is a whole number, not {index!r}")
        self.index = index

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (TensorRef, (self.index,))


class _OpaqueError(Exception):
    """The state holds something the skeleton does not: it is saved whole by torch.save."""


def _plain_tensor(t: torch.Tensor) -> bool:
    return (
        type(t) is torch.Tensor  # not a subclass (a DTensor's shape is global)
        and t.layout == torch.strided
        and not t.is_quantized
        and t.device.type in ("cpu", "cuda")
    )


def _rebuilt(state: Any, items: list[tuple[Any, Any]]) -> Any:
    if type(state) is collections.OrderedDict:
        return collections.OrderedDict(items)
    return dict(items)  # dict, and other mappings as dicts (as their pickle would need)


@dataclass
class Plan:
    """One state's payload before it is written: its head (magic, size, skeleton) and its
    tensors with their offsets from the start of the payload."""

    head: bytes
    tensors: list[torch.Tensor]
    offsets: list[int]
    size: int
    versions: list[int] = field(default_factory=list)
    #: For CUDA tensors: an event per device, recorded on its stream when the plan was made,
    #: after which the tensors hold the step (the optimizer's kernels may still be running).
    events: dict[torch.device, Any] = field(default_factory=dict)

    @property
    def apart(self) -> int:
        """The bytes the copy reads from the state's tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def changed(self) -> bool:
        """Whether a tensor was changed in place since the plan was made (through torch: a
        change through ``.data`` is not seen)."""
        return any(t._version != v for t, v in zip(self.tensors, self.versions))

    def write(self, view: memoryview) -> int:
        """Copy the payload into `view` (at least `size` bytes); its checksum. One call into
        elastic_core copies and checksums it all: Python on this thread between copies would
        hold the GIL the training thread needs."""
        segments = []
        dest: torch.Tensor | None = None
        target: torch.Tensor | None = None
        try:
            side = _side_stream(self) if self.events else None
            for t, at in zip(self.tensors, self.offsets):
                n = t.numel() * t.element_size()
                if n == 0:
                    continue
                if t.device.type == "cpu" and t.is_contiguous():
                    segments.append((at, t.data_ptr(), n))
                    continue
                # Put in place by torch (from a GPU, or not contiguous), then checksummed there.
                if dest is None:
                    dest = torch.frombuffer(view, dtype=torch.uint8, count=self.size)
                target = dest[at : at + n].view(t.dtype).view(t.shape)
                if side is not None and t.device.type == "cuda":
                    with torch.cuda.stream(side):
                        target.copy_(t, non_blocking=True)
                    side.synchronize()
                else:
                    target.copy_(t)
                segments.append((at, target.data_ptr(), n))
            crcs = _core().copy_crc32c_gather(view, self.size, self.head, segments, CHUNK)
        finally:
            # No tensor may outlive the call on `view`: the slot's map can only be closed
            # (or grown) once nothing exports it, even when an error's traceback keeps this
            # frame.
            dest = target = None
        return _combined(crcs)


def _side_stream(plan: Plan) -> Any:
    """A CUDA stream that waits for the step's kernels: device-to-host copies on it overlap the
    next step's compute. (Not run here: this machine has no GPU.)"""
    (device, event), *others = plan.events.items()
    if others:
        raise CheckpointError("the memory tier copies tensors of one CUDA device per rank")
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    side.wait_event(event)
    return side


def plan(state: Any, identity: Identity) -> Plan:
    """Take `state` (`identity`'s) apart for `Plan.write`: its large tensors are referenced
    (read later, by the copy), its small ones cloned, its skeleton pickled now. A state the
    skeleton cannot hold is serialized whole now, by torch.save."""
    tensors: list[torch.Tensor] = []
    table: list[tuple[int, str, tuple[int, ...], str]] = []
    offset = 0

    def walk(x: Any) -> Any:
        nonlocal offset
        if isinstance(x, torch.Tensor):
            if not _plain_tensor(x):
                raise _OpaqueError
            t = x.detach()
            n = t.numel() * t.element_size()
            if n < CLONE_BELOW:
                t = t.clone()
            else:
                offset = _align(offset, PAGE)
            tensors.append(t)
            dtype = str(t.dtype).removeprefix("torch.")
            table.append((offset, dtype, tuple(t.shape), str(t.device)))
            offset = _align(offset + n)
            return TensorRef(len(table) - 1)
        if isinstance(x, dict) and not isinstance(x, collections.defaultdict):
            return _rebuilt(x, [(walk_key(k), walk(v)) for k, v in x.items()])
        if type(x) in (list, tuple):
            items = [walk(v) for v in x]
            return items if type(x) is list else tuple(items)
        if type(x) in _PLAIN:
            return x
        raise _OpaqueError

    def walk_key(k: Any) -> Any:
        if type(k) in _PLAIN or (type(k) is tuple and all(type(v) in _PLAIN for v in k)):
            return k
        raise _OpaqueError

    try:
        skeleton = walk(state)
    except _OpaqueError:
        return _whole(state, identity)
    body = pickle.dumps({"state": skeleton, "at": table}, protocol=4)
    head = identity.head(MAGIC, len(body)) + body
    start = _align(len(head), PAGE)
    events = {}
    for t in tensors:
        if t.device.type == "cuda" and t.device not in events:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(t.device))
            events[t.device] = event
    return Plan(
        head=head,
        tensors=tensors,
        offsets=[start + at for at, *_ in table],
        size=start + offset,
        versions=[t._version for t in tensors],
        events=events,
    )


def _whole(state: Any, identity: Identity) -> Plan:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return whole_bytes(buffer.getbuffer(), identity)


def whole_bytes(data: Any, identity: Identity) -> Plan:
    """A plan of a torch.save file's bytes, as `identity`'s."""
    view = memoryview(data).cast("B")
    head = identity.head(WHOLE, view.nbytes) + bytes(view)
    return Plan(head=head, tensors=[], offsets=[], size=len(head))


def _core() -> Any:
    try:
        import elastic_core
    except ImportError as e:
        raise CheckpointError(
            "the memory tier needs elastic_core (pip install elasticrun-core; elasticrun "
            f"installs it): {e}"
        ) from e
    return elastic_core


def _combined(crcs: list[int]) -> int:
    """The payload's checksum, from its pieces'."""
    return int(_core().crc32c(struct.pack(f"<{len(crcs)}I", *crcs)))


def checksum(view: memoryview) -> int:
    """A payload's checksum, of bytes already in `view` (what `Plan.write` returned)."""
    n = view.nbytes
    if n == 0 or view.readonly:
        view = memoryview(bytearray(view))
    where = torch.frombuffer(view, dtype=torch.uint8).data_ptr() if n else 0
    crcs = _core().copy_crc32c_gather(view, n, b"", [(0, where, n)] if n else [], CHUNK)
    return _combined(crcs)


def copy_out(dest: Any, src: int, n: int) -> int:
    """Copy a payload of `n` bytes from the address `src` into the writable buffer `dest`; its
    checksum, taken from the bytes as they are copied."""
    return _combined(_core().copy_crc32c_gather(dest, n, b"", [(0, src, n)], CHUNK))


def is_payload(data: Any) -> bool:
    """Whether `data` is a payload (rather than a torch.save file's bytes)."""
    return identity_of(data) is not None


class _SkeletonUnpickler(pickle.Unpickler):
    """Builds what a skeleton may hold, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("builtins", "complex"):
            return complex
        if (module, name) == (__name__, "TensorRef"):
            return TensorRef
        if module == "torch" and name == "device":
            return torch.device
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"a memory checkpoint's skeleton names {module}.{name}, which a skeleton never "
            "holds: it was not written by elastic_sampler, and is not loaded"
        )


def _device_for(map_location: Any, original: str, where: str) -> Any:
    if map_location is None:
        return original
    if isinstance(map_location, (str, torch.device)):
        return map_location
    if isinstance(map_location, dict):
        return map_location.get(original, original)
    raise CheckpointError(
        f"{where}: map_location={map_location!r} is not supported for memory checkpoints; "
        "give a device, a device name, or a dict of device names"
    )


def _skeleton(view: memoryview, where: str) -> tuple[dict[str, Any], int]:
    """A payload's skeleton (the state with its tensors as references, and their table), and
    where its tensors' bytes start."""
    skeleton_size = _HEAD.unpack_from(view, 0)[1]
    start = _align(_HEAD.size + skeleton_size, PAGE)
    if _HEAD.size + skeleton_size > view.nbytes:
        raise CheckpointError(f"{where} is cut short: its skeleton ends past its end")
    try:
        inner = _SkeletonUnpickler(io.BytesIO(view[_HEAD.size : _HEAD.size + skeleton_size])).load()
    except (UnsafeCheckpointError, CheckpointError):
        raise
    except Exception as e:
        raise CheckpointError(f"{where} has no readable skeleton: {e}") from e
    if (
        not isinstance(inner, dict)
        or set(inner) != {"state", "at"}
        or type(inner["at"]) is not list
    ):
        raise CheckpointError(f"{where} is not a memory-tier payload (no skeleton)")
    return inner, start


def decode(data: Any, where: str, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """The state in `data`: a payload, or a ``torch.save`` file's bytes. The payload's tensors
    share `data`'s memory on the CPU (made writable first if it is not)."""
    view = memoryview(data).cast("B")
    if not is_payload(view):
        return load(io.BytesIO(view), where, map_location, weights_only)
    if bytes(view[:8]) == WHOLE:
        return load(io.BytesIO(view[_HEAD.size :]), where, map_location, weights_only)
    if view.readonly:
        view = memoryview(bytearray(view))
    inner, start = _skeleton(view, where)
    table = inner["at"]

    def tensor(ref: TensorRef) -> torch.Tensor:
        index = ref.index
        entry = table[index] if type(index) is int and 0 <= index < len(table) else None
        if not (type(entry) is tuple and len(entry) == 4):
            raise CheckpointError(f"{where}: a tensor reference has no entry in its table")
        at, dtype_name, shape, original = entry
        dtype = getattr(torch, dtype_name, None) if type(dtype_name) is str else None
        if not isinstance(dtype, torch.dtype) or type(at) is not int or at < 0:
            raise CheckpointError(f"{where}: a tensor's entry is not one ({entry!r})")
        if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: a tensor's shape is not one ({shape!r})")
        numel = 1
        for d in shape:
            numel *= d
        n = numel * dtype.itemsize
        if start + at + n > view.nbytes:
            raise CheckpointError(f"{where} is cut short: a tensor ends past its end")
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(view, dtype=dtype, count=numel, offset=start + at).view(shape)
        target = _device_for(map_location, str(original), where)
        return t if str(target) == "cpu" else t.to(target)

    seen: set[int] = set()  # the containers walked: the encoder writes each once (a tree)

    def walk(x: Any) -> Any:
        if isinstance(x, TensorRef):
            return tensor(x)
        if isinstance(x, (dict, list, tuple)) and len(x):  # () is one shared object
            if id(x) in seen:
                # A few bytes of pickle can hold a container twice at every level: walked, it
                # would be 2^depth (seconds and gigabytes from 4 KB). Never written by plan().
                raise CheckpointError(
                    f"{where}: its skeleton holds one container in two places, which "
                    "elastic_sampler never writes; it is not loaded"
                )
            seen.add(id(x))
        if isinstance(x, dict):
            return _rebuilt(x, [(k, walk(v)) for k, v in x.items()])
        if type(x) in (list, tuple):
            items = [walk(v) for v in x]
            return items if type(x) is list else tuple(items)
        return x

    return walk(inner["state"])
