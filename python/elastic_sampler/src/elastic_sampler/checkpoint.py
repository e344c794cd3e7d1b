"""Checkpoints that are never lost: the manager of one job's checkpoints (save, keep the last
K, load the newest that verifies, background saving), single-file helpers, and agreement across
ranks on node-local storage.

The manager composes tiers (`_tiers`): the disk (`_disk`), the node's memory (`_memory_tier`),
a peer node's memory (`_replica`). How one file is written and checked: `_files`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from elastic_sampler import _memory, _payload
from elastic_sampler._files import (
    GoneError,
    UnusableError,
    check_fits,
    load,
    meta_path,
    read_verified,
    why,
    write_verified,
)
from elastic_sampler._snapshot import snapshot
from elastic_sampler._tiers import Settings, TierOptions, compose
from elastic_sampler.api import CheckpointError, UnsafeCheckpointError

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "CheckpointManager",
    "TierOptions",
    "broadcast_latest",
    "load_checkpoint",
    "restore_latest",
    "save_checkpoint",
    "snapshot",
]

_RESCANS = 100  # load_latest: how often others' pruning may send it back to the newest step


class CheckpointManager:
    """The checkpoints of one job in one directory: save, keep the last K, load the newest
    that verifies.

    The manager composes tiers (`_tiers`), each of which knows where its bytes live: the disk
    always, the node's memory with `memory`, a peer node's memory with `replicas`. The manager
    knows which step goes where and which one to load.

    With `reuse_buffers` (the default), a background save copies the state into the buffers
    of the previous background save where shapes match, which blocks training about a third
    as long; those buffers (one copy of the state, which every background save needs anyway)
    stay allocated until `close()`. ``reuse_buffers=False`` frees them after each write.

    A background save still running when the script ends (without `close()`) is finished
    before the process exits, for at most `finish_timeout` seconds (default 300); on SIGTERM,
    for at most the grace the launcher gives (``$ELASTICRUN_SHUTDOWN_TIMEOUT``, else 30 s).
    Past that it is abandoned and its temporary file removed; the process says so on stderr
    either way.

    With `memory` (under elasticrun), every save also goes to the memory tier: a slot in the
    node's shared memory that outlives this worker (the launcher removes it when it ends), so
    a replacement resumes from the last step saved, not the last one on disk. Steps reach the
    disk every `persist_every` steps (default 1; counted from the last one written there); the
    others live only in memory, two copies at most per rank. Outside elasticrun there is no
    slot: `memory` warns once and only the disk is used.

    With `overlap` (the default), the copy of a large state to memory runs on a thread while
    the next step computes, and the next ``optimizer.step()`` waits for it: save() costs about
    a serialization of the state's small parts. The state's large tensors must then change
    only in that optimizer step (a change torch sees otherwise voids the copy, with a warning,
    and later copies finish inside save(); a change through ``.data`` is not seen: pass
    ``overlap=False`` if training does that).

    With `replicas` 1, the state is this rank's own (a ZeRO or FSDP shard, per-rank RNG): the
    files are named by rank and world size (``<prefix>-rank<R>of<W>-<step>.pt``; every rank
    passes the same directory and prefix), and each memory copy is also sent to the rank of
    the same local rank on the next node, so that the loss of one node loses no rank's step.
    Every rank must then save the same steps, and resume with `restore_latest`."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep_last: int = 3,
        prefix: str = "checkpoint",
        reuse_buffers: bool = True,
        **options: Unpack[TierOptions],
    ) -> None:
        s = Settings.of(keep_last, prefix, dict(options))
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.replicas = s.replicas
        self.persist_every = s.persist_every
        self.finish_timeout = float(s.finish_timeout)
        self.reuse_buffers = reuse_buffers
        tiers = compose(self.directory, prefix, keep_last, reuse_buffers, s)
        #: The tiers this manager composes (the memory and replica tiers may be None).
        self.disk_tier = tiers.disk
        self.memory_tier = tiers.memory
        self.replica_tier = tiers.replica
        self.prefix = self.disk_tier.prefix
        self._overlap = s.overlap  # without a memory tier: only said back
        # The last step written to disk by this manager (or its first save, until one is).
        self._persisted: int | None = None
        # Said by one worker of a node (local rank 0), not by every rank in the same words.
        if s.memory and self.memory_tier is None and os.environ.get("LOCAL_RANK", "0") == "0":
            warnings.warn(
                f"CheckpointManager(memory=True): ${_memory.MEMORY_DIR_ENV} is not set (elasticrun "
                "sets it for its workers), so there is no memory tier: steps reach the disk "
                f"every {s.persist_every} step(s), and the others are not kept",
                stacklevel=2,
            )

    @property
    def overlap(self) -> bool:
        """Whether a large state's copy to memory overlaps the next step (turned off by a
        copy that was changed while it ran)."""
        return self.memory_tier.overlap if self.memory_tier is not None else self._overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self._overlap = value
        if self.memory_tier is not None:
            self.memory_tier.overlap = value

    # ---- saving --------------------------------------------------------------------------

    def path(self, step: int) -> Path:
        return self.disk_tier.path(step)

    def save(
        self, state: Any, step: int, background: bool = False, *, persist: bool | None = None
    ) -> Path:
        """Write `state` as checkpoint `step`. With `background`, the state is copied first
        (so training may change it right away) and written by a worker thread; at most one
        write is in flight, and its error surfaces on the next call.

        With the memory tier, every step goes to memory, and to disk when it is due: a
        multiple of `persist_every`, or `persist_every` steps after the last one written
        there; ``persist=True`` writes it to disk anyway (the end of training, an epoch's
        end), ``persist=False`` keeps it in memory only.

        Saving a step that exists already replaces it; until the new copy is durable the old
        one still loads, so a failure or a crash mid-save never loses the step."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: give the step as an integer >= 0")
        self.wait()  # one write at a time; raises a background error
        memory = self.replica_tier or self.memory_tier
        if memory is not None:
            memory.save(state, step)
        if not (self._due(step) if persist is None else persist):
            return self.path(step)  # in memory only (or, outside elasticrun, not kept)
        self._persisted = step
        return self.disk_tier.save(state, step, background)

    def _due(self, step: int) -> bool:
        """Whether `step` goes to disk: every step without a memory tier's spacing
        (persist_every 1), else multiples of persist_every and no gap of more."""
        every, since = self.persist_every, self._persisted
        if since is None:
            self._persisted = since = step  # the gap counts from this manager's first save
            return step % every == 0 or every == 1
        return step % every == 0 or step == since or abs(step - since) >= every

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a background write and a copy to memory; raise their errors."""
        if self.memory_tier is not None:
            self.memory_tier.wait(timeout)
        self.disk_tier.wait(timeout)

    def finish(self, timeout: float, why: str, hint: str) -> bool:
        """Wait for the background write at most `timeout` s, else abandon it (its temporary
        file removed); report on stderr. False if its thread is still running afterwards."""
        return self.disk_tier.finish(timeout, why, hint)

    def close(self) -> None:
        """Finish any background write (raising its error) and free the copy's buffers. The
        memory tier's slot stays (a later worker of the job may resume from it)."""
        self.disk_tier.close()
        try:
            self.wait()
        finally:
            if self.memory_tier is not None:
                self.memory_tier.close()
            if self.replica_tier is not None:
                self.replica_tier.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- loading -------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps with a checkpoint file here (not verified), oldest first."""
        return self.disk_tier.steps()

    def latest_step(self, verified: bool = True) -> int | None:
        """The newest step whose checkpoint verifies (or merely exists), in memory or on
        disk."""
        in_memory = self.memory_tier.latest_step() if self.memory_tier is not None else None
        if verified:
            newer = self.disk_tier.verified(1, above=in_memory)
        else:
            newer = [s for s in self.steps() if in_memory is None or s > in_memory][-1:]
        return newer[0] if newer else in_memory

    def restored_from_memory(self, step: int) -> None:
        """Count a restore of `step` from memory (this rank's or a peer's): if the worker dies
        again before saving a newer step, twice, the step is not restored from memory again."""
        if self.memory_tier is not None:
            self.memory_tier.restored(step)

    def step_bytes(self, step: int) -> bytes | bytearray:
        """The serialized checkpoint `step` as this rank holds it (memory first, then disk)."""
        if self.memory_tier is not None:
            got = self.memory_tier.read_bytes(step)
            if got is not None:
                return got
        return self.disk_tier.read_bytes(step)

    def keep_copy(self, data: Any, step: int) -> None:
        """Keep checkpoint `step` (its bytes as another rank held them: a memory payload or a
        file's) in the memory tier if there is one, else on disk (as a torch.save file)."""
        if self.memory_tier is not None:
            self.memory_tier.keep_bytes(data, step)
        else:
            self.disk_tier.keep_bytes(data, step)

    def load_latest(
        self,
        map_location: Any = "cpu",
        model: torch.nn.Module | None = None,
        *,
        weights_only: bool = True,
    ) -> tuple[Any, int] | None:
        """(state, step) of the newest checkpoint that verifies, skipping torn or corrupt ones
        with a warning; None if there is none. Given `model`, a checkpoint of another model is
        an error. A checkpoint another process prunes meanwhile is not an error: the search
        starts again from the newest.

        Only tensors, containers, plain values and numpy arrays are rebuilt (torch's
        ``weights_only=True``); a checkpoint holding other objects is an
        `UnsafeCheckpointError`, not skipped. ``weights_only=False`` unpickles anything: only
        for files you wrote yourself."""
        self.wait()
        memory = self.memory_tier
        in_memory = memory.latest_step() if memory is not None else None
        load = (map_location, model, weights_only)
        for _ in range(_RESCANS):
            try:
                found = self._newest_on_disk(in_memory, load)
            except GoneError:
                continue  # pruned under us: newer checkpoints exist, look again
            if found is not None or in_memory is None:
                return found
            assert memory is not None
            found = memory.load_newest(map_location, model, weights_only)
            if found is not None:
                self.restored_from_memory(found[1])
                return found
            in_memory = None  # the memory copy failed to load: the disk, from the newest
        raise CheckpointError(
            f"the checkpoints in '{self.directory}' kept being removed while being read "
            f"({_RESCANS} times): is another job pruning this directory?"
        )

    def _newest_on_disk(
        self, above: int | None, load: tuple[Any, torch.nn.Module | None, bool]
    ) -> tuple[Any, int] | None:
        """(state, step) of the newest file newer than `above` that loads, skipping (with a
        warning) those that do not verify; GoneError if one is pruned meanwhile."""
        map_location, model, weights_only = load
        for step in reversed(self.steps()):
            if above is not None and step <= above:
                break  # the memory tier's copy is as new: no disk read
            try:
                return self.disk_tier.read(step, map_location, weights_only, model), step
            except UnusableError as e:
                warnings.warn(f"skipping checkpoint '{e.path}': {e.problem}", stacklevel=4)
        return None


def save_checkpoint(path: str | os.PathLike[str], state: Any) -> Path:
    """Save one checkpoint file atomically, with its checksum."""
    try:
        return write_verified(path, state)
    except GoneError as e:
        raise CheckpointError(str(e)) from None


def load_checkpoint(
    source: str | os.PathLike[str] | IO[bytes],
    map_location: Any = "cpu",
    model: torch.nn.Module | None = None,
    *,
    weights_only: bool = True,
) -> Any:
    """Load one checkpoint: a file written by `save_checkpoint` or a manager (verified against
    its checksum), a plain ``torch.save`` file (no checksum beside it: loaded as torch would),
    or a readable binary stream. Given `model`, a state of another model is an error."""
    if hasattr(source, "read"):
        where = f"the stream {getattr(source, 'name', type(source).__name__)!r}"
        try:
            state = load(source, where, map_location, weights_only)
        except UnsafeCheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{where} holds no checkpoint torch.load can read: {e}") from e
    else:
        path = Path(os.fspath(source))
        where = f"checkpoint '{path}'"
        if meta_path(path).exists() or not path.exists():
            try:
                return read_verified(path, map_location, model, weights_only)
            except GoneError:
                raise CheckpointError(f"{where} does not exist") from None
        try:  # a plain torch.save file: one to migrate
            state = load(path, where, map_location, weights_only)
        except UnsafeCheckpointError:
            raise
        except OSError as e:
            raise CheckpointError(f"{where} cannot be read: {why(e)}") from e
        except Exception as e:
            raise CheckpointError(
                f"'{path}' is neither a checkpoint with a checksum (no "
                f"'{meta_path(path).name}' beside it) nor a file torch.load can read: {e}"
            ) from e
    if model is not None:
        check_fits(state, model, where)
    return state


def broadcast_latest(
    manager: CheckpointManager,
    group: Any = None,
    map_location: Any = "cpu",
    *,
    weights_only: bool = True,
    keep: bool = True,
) -> tuple[Any, int] | None:
    """For node-local storage: the ranks agree on the newest step any of them holds intact
    (in memory or on disk), the lowest rank holding it sends it to all (gloo or any backend
    with broadcast), and the others keep a copy (in their memory slot, else their directory)
    unless `keep` is False: ranks that do not save pass it, so that a node holds one copy of
    a state every rank shares. Returns (state, step), or None if no rank has a checkpoint.
    Every rank of `group` must call it."""
    import torch.distributed as dist

    if manager.replicas:
        raise ValueError(
            "broadcast_latest sends one state to every rank, but a manager with replicas=1 "
            "holds a state per rank: call restore_latest(manager)"
        )
    manager.wait()  # a background write of this rank's must be complete (or fail here)
    local = manager.latest_step()
    best = torch.tensor([-1 if local is None else local], dtype=torch.int64)
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    step = int(best.item())
    if step < 0:
        return None
    me = dist.get_rank()
    holder = torch.tensor([me if local == step else 1 << 62], dtype=torch.int64)
    dist.all_reduce(holder, op=dist.ReduceOp.MIN, group=group)
    src = int(holder.item())
    data: bytes | bytearray = b""
    problem = ""
    if me == src:
        try:
            data = manager.step_bytes(step)
        except OSError as e:
            problem = why(e)
    # -1: the holder could not read it; every rank raises rather than waiting forever.
    size = torch.tensor([-1 if problem else len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if int(size.item()) < 0:
        raise CheckpointError(
            f"rank {src} holds checkpoint step {step} but could not read it"
            + (f": {problem}" if problem else f" (rank {src}'s error says why)")
        )
    buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    if me == src:
        writable = data if isinstance(data, bytearray) else bytearray(data)
        buffer.copy_(torch.frombuffer(writable, dtype=torch.uint8))
    dist.broadcast(buffer, src=src, group=group)
    raw = data if me == src else memoryview(buffer.numpy())  # type: ignore[arg-type]
    if keep and local != step:  # our own copy: this node may need it after the next failure
        manager.keep_copy(raw, step)
    if _payload.is_payload(raw):  # a copy from a memory tier, this rank's or the sender's
        manager.restored_from_memory(step)
    where = f"checkpoint step {step} (sent by rank {src})"
    return _payload.decode(raw, where, map_location, weights_only), step


def restore_latest(
    manager: CheckpointManager, map_location: Any = "cpu", *, weights_only: bool = True
) -> tuple[Any, int] | None:
    """(this rank's state, step) for states that differ per rank (a manager with
    ``replicas=1``): the ranks agree on the newest step held for every rank, in any node's
    memory or on that rank's disk, and each rank gets its own state from the rank holding it
    (itself if it can). None if no rank holds a checkpoint; a CheckpointError if no one step
    is held for every rank. Every rank must call it. Without replicas (or outside
    elasticrun), it is ``manager.load_latest()``."""
    manager.wait()
    if manager.replica_tier is None:
        return manager.load_latest(map_location, weights_only=weights_only)
    return manager.replica_tier.restore(map_location, weights_only)
