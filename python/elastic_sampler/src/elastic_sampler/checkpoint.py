"""Checkpoints that are never lost: the manager of one job's checkpoints (save, keep the last
K, load the newest that verifies, background saving), single-file helpers, and agreement across
ranks on node-local storage. How one file is written and checked: `_files`; how a background
save outlives a script that forgets ``close()``: `_finish`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import threading
import warnings
from pathlib import Path
from typing import IO, Any

import torch

from elastic_sampler import _finish, _memory, _overlap, _payload, _replica, _restores
from elastic_sampler._files import (
    GoneError,
    UnusableError,
    atomic_write,
    check_fits,
    load,
    meta_path,
    read_verified,
    record_checksum,
    remove_dead_temporaries,
    remove_my_temporaries,
    verify,
    why,
    write_verified,
)
from elastic_sampler.api import CheckpointError, UnsafeCheckpointError

logger = logging.getLogger(__name__)

#: A copy to memory smaller than this is done inside save(): a thread costs more.
_OVERLAP_FROM = 1 << 20
_RESCANS = 100  # load_latest: how often others' pruning may send it back to the newest step


def _reusable(buffer: Any, tensor: torch.Tensor) -> bool:
    return (
        type(buffer) is torch.Tensor
        and type(tensor) is torch.Tensor  # not a subclass (a DTensor's shape is global)
        and buffer.device.type == "cpu"
        and buffer.shape == tensor.shape
        and buffer.dtype == tensor.dtype
        and buffer.layout == tensor.layout == torch.strided
        and not tensor.is_quantized
    )


def snapshot(state: Any, reuse: Any = None) -> Any:
    """A copy of `state` that training can no longer change: tensors are copied to the CPU,
    containers rebuilt, anything else deep-copied.

    `reuse` is an earlier snapshot nobody uses any more (it is taken apart): its tensors that
    match in place, shape and dtype are copied into rather than allocated anew (fresh memory
    costs a page fault per 4 KiB, which makes a copy about 3x slower); the others are let go
    before their replacement is allocated."""
    if isinstance(state, torch.Tensor):
        source = state.detach()
        if _reusable(reuse, source):
            return reuse.copy_(source)
        del reuse  # free the mismatched buffer first: peak memory stays one copy
        return source.to("cpu", copy=True)
    if isinstance(state, dict):
        old = reuse if isinstance(reuse, dict) else {}
        del reuse
        items = [(k, snapshot(v, old.pop(k, None))) for k, v in state.items()]
        old.clear()
        try:
            return type(state)(items)  # dict, OrderedDict (state_dict's type)
        except TypeError:
            return dict(items)
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        old_items: list[Any] = (
            reuse if isinstance(reuse, list) else list(reuse) if isinstance(reuse, tuple) else []
        )
        del reuse
        copied = []
        for i, v in enumerate(state):
            r = None
            if i < len(old_items):
                r, old_items[i] = old_items[i], None
            copied.append(snapshot(v, r))
        old_items.clear()
        return copied if isinstance(state, list) else tuple(copied)
    return copy.deepcopy(state)


class CheckpointManager:
    """The checkpoints of one job in one directory: save, keep the last K, load the newest
    that verifies.

    With `reuse_buffers` (the default), a background save copies the state into the buffers
    of the previous background save where shapes match, which blocks training about a third
    as long; those buffers (one copy of the state, which every background save needs anyway)
    stay allocated until `close()`. ``reuse_buffers=False`` frees them after each write.

    A background save still running when the script ends (without `close()`) is finished
    before the process exits, for at most `finish_timeout` seconds; on SIGTERM, for at most the
    grace the launcher gives (``$ELASTICRUN_SHUTDOWN_TIMEOUT``, else 30 s). Past that it is
    abandoned and its temporary file removed; the process says so on stderr either way.

    With `memory` (under elasticrun), every save also goes to the memory tier: a slot in the
    node's shared memory that outlives this worker (the launcher removes it when it ends), so
    a replacement resumes from the last step saved, not the last one on disk. Steps reach the
    disk every `persist_every` steps (counted from the last one written there); the others
    live only in memory, two copies at most per rank. Outside elasticrun there is no slot:
    `memory` warns once and only the disk is used.

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
        *,
        finish_timeout: float = 300.0,
        memory: bool = False,
        persist_every: int = 1,
        overlap: bool = True,
        replicas: int = 0,
    ) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last={keep_last!r}: keep at least 1 checkpoint")
        if (
            isinstance(persist_every, bool)
            or not isinstance(persist_every, int)
            or persist_every < 1
        ):
            raise ValueError(f"persist_every={persist_every!r}: give a number of steps >= 1")
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
            raise ValueError(f"prefix={prefix!r}: use letters, digits, '.', '_' and '-'")
        if type(replicas) is not int or replicas not in (0, 1):
            raise ValueError(f"replicas={replicas!r}: give 0, or 1 (a copy on the next node)")
        if replicas and not memory:
            raise ValueError("replicas=1 replicates the memory tier: pass memory=True as well")
        if not finish_timeout >= 0:  # also NaN
            raise ValueError(f"finish_timeout={finish_timeout!r}: give seconds >= 0")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.replicas = replicas
        rank, world = _replica.rank_and_world() if replicas else (_memory.SHARED, 0)
        # With replicas, files by rank (after a node's loss a rank may run on another node)
        # and world (a shard of one world is never another's).
        self.prefix = f"{prefix}-rank{rank}of{world}" if replicas else prefix
        self._family = prefix
        self.finish_timeout = float(finish_timeout)
        self._pattern = re.compile(rf"{re.escape(self.prefix)}-(\d{{12,}})\.pt(\.meta\.json)?")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise CheckpointError(
                f"cannot write checkpoints to '{self.directory}': {why(e)}; choose a writable "
                "directory"
            ) from e
        self.reuse_buffers = reuse_buffers
        self._staging: Any = None  # the last background copy, once written: the next one's buffers
        self._thread: threading.Thread | None = None
        self._writing: int | None = None  # the step the background write is saving
        self._abandon = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        remove_dead_temporaries(self.directory, f"{self.prefix}-")
        self.persist_every = persist_every
        # The last step written to disk by this manager (or its first save, until one is).
        self._persisted: int | None = None
        # Slots are named by local rank, not rank: a replacement finds its predecessor's.
        self._slot = (
            _memory.slot_for(self.directory, prefix, owner=rank, world=world) if memory else None
        )
        replica = _memory.slot_for(self.directory, prefix, "replica") if replicas else None
        self._replicator = (
            _replica.Replicator(self._slot, replica, rank, world)
            if replicas and self._slot is not None and replica is not None
            else None
        )
        self.overlap = overlap
        self._copy: _overlap.Copy | None = None  # the memory copy in flight
        self._restores = (
            _restores.RestoreLog(self._slot.path.with_name(self._slot.path.name + ".restores"))
            if self._slot is not None
            else None
        )
        self._restored: int | None = None  # the step this manager restored from memory
        self._fell_back: set[int] = set()  # memory steps not restored again (said once)
        if memory and self._slot is None:
            warnings.warn(
                "CheckpointManager(memory=True) outside elasticrun: there is no memory tier "
                f"(${_memory.MEMORY_DIR_ENV} is set for its workers); steps reach the disk "
                f"every {persist_every} step(s), and the others are not kept",
                stacklevel=2,
            )

    # ---- saving --------------------------------------------------------------------------

    def path(self, step: int) -> Path:
        return self.directory / f"{self.prefix}-{step:012d}.pt"

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
        if self._restored is not None and step > self._restored and self._restores is not None:
            self._restores.clear()  # training went on past the restored step
            self._restored = None
        if self._slot is not None:
            self._to_memory(state, step)
        if not (self._due(step) if persist is None else persist):
            return self.path(step)  # in memory only (or, outside elasticrun, not kept)
        self._persisted = step
        if not background:
            return self._write(state, step)
        copied = snapshot(state, self._take_staging())  # no reference kept here: see snapshot
        self._staging = copied if self.reuse_buffers else None
        self._abandon.clear()
        self._writing = step
        self._thread = threading.Thread(
            target=self._write_in_background,
            args=(copied, step),
            name="elastic-checkpoint",
            daemon=True,  # exit waits for it through _finish, bounded, not forever
        )
        _finish.started(self)
        self._thread.start()
        return self.path(step)

    def _to_memory(self, state: Any, step: int) -> None:
        assert self._slot is not None
        plan = _payload.plan(state)
        rep = self._replicator
        if rep is not None:
            rep.ready()
        if self.overlap and plan.apart >= _OVERLAP_FROM:
            self._slot.check_room(plan.size)  # a limit is refused here, not at the next save
            self._copy = _overlap.Copy(self._slot, plan, step, rep.send if rep else None)
        else:
            try:
                kept = self._slot.put_plan(plan, step)
            except BaseException:
                if rep is not None:
                    rep.send(False)  # the peer waits for word of this save
                raise
            if rep is not None:
                rep.send(kept)

    def _copied(self, timeout: float | None = None, *, report: bool = True) -> None:
        """Wait for the memory copy in flight; with `report`, raise its error or say that it
        was void."""
        copy = self._copy
        if copy is None:
            return
        if not copy.join(timeout):
            raise TimeoutError(
                f"the copy of step {copy.step} to memory did not finish in {timeout} s"
            )
        if not report:
            return
        self._copy = None
        if copy.error is not None:
            raise copy.error
        if copy.kept is False:
            self.overlap = False
            kept = self._slot.latest_step() if self._slot is not None else None
            warnings.warn(
                f"checkpoint step {copy.step} was changed while it was copied to memory (a "
                "large tensor of the state changed in place before the next optimizer step, "
                f"or that step did not wait); memory keeps step {kept}, and later copies "
                "finish before save() returns (pass overlap=False to say so from the start)",
                stacklevel=3,
            )

    def _due(self, step: int) -> bool:
        """Whether `step` goes to disk: every step without a memory tier's spacing
        (persist_every 1), else multiples of persist_every and no gap of more."""
        every, since = self.persist_every, self._persisted
        if since is None:
            self._persisted = since = step  # the gap counts from this manager's first save
            return step % every == 0 or every == 1
        return step % every == 0 or step == since or abs(step - since) >= every

    def _take_staging(self) -> Any:
        staging, self._staging = self._staging, None
        return staging

    def _write_in_background(self, state: Any, step: int) -> None:
        try:
            self._write(state, step, self._abandon)
        except BaseException as e:
            with self._lock:
                self._error = e

    def _write(self, state: Any, step: int, abandon: threading.Event | None = None) -> Path:
        target = self.path(step)
        try:
            write_verified(target, state, abandon)
        except GoneError:
            warnings.warn(
                f"checkpoint step {step} was removed by another process as soon as it was "
                f"written: two managers share '{self.directory}' with prefix '{self.prefix}'",
                stacklevel=3,
            )
            return target
        except CheckpointError as e:
            previous = self.latest_step()  # only now: it reads every byte to verify
            keep = (
                f"checkpoint step {previous} is intact"
                if previous is not None
                else "there is no earlier checkpoint"
            )
            raise CheckpointError(f"{e} ({keep})") from e.__cause__
        self._prune(step)
        return target

    def _prune(self, written: int) -> None:
        # Only up to the step just written: a newer one (of a timeline we resumed before)
        # never pushes out the checkpoint we just made. Data before checksum: a reader that
        # opened the data file still finds its checksum, or learns the step is gone.
        data, checksums = self._listing()
        older = [s for s in data if s <= written]
        for step in older[: -self.keep_last]:
            with contextlib.suppress(FileNotFoundError):
                self.path(step).unlink()
            with contextlib.suppress(FileNotFoundError):
                meta_path(self.path(step)).unlink()
        # Checksums whose checkpoint another manager removed while they were written.
        for step in checksums - set(data):
            if step <= written and not self.path(step).exists():
                with contextlib.suppress(FileNotFoundError):
                    meta_path(self.path(step)).unlink()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a background write and a copy to memory; raise their errors."""
        self._copied(timeout)
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"the background checkpoint write did not finish in {timeout} s")
            self._thread = None
            self._writing = None
            _finish.finished(self)
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def finish(self, timeout: float, why: str, hint: str) -> bool:
        """For `_finish` at exit or SIGTERM: wait for the write at most `timeout` s, else
        abandon it (its temporary file removed); report on stderr. False if its thread is
        still running afterwards."""
        thread, step = self._thread, self._writing
        if thread is None or step is None:
            return True
        target = self.path(step)
        if thread.is_alive():
            _finish.say(
                f"{why}: finishing the background save of checkpoint step {step} to "
                f"'{target}' (for at most {round(timeout, 1):g} s)"
            )
            thread.join(timeout)
        if thread.is_alive():
            self._abandon.set()
            thread.join(_finish.JOIN_AFTER_ABANDON)
            remove_my_temporaries(target)
            _finish.say(
                f"abandoned the background save of checkpoint step {step}: it did not finish "
                f"in {round(timeout, 1):g} s; its temporary files were removed and '{target}' was "
                f"not written ({hint})"
            )
            return not thread.is_alive()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            _finish.say(f"the background save of checkpoint step {step} failed: {error}")
        else:
            _finish.say(f"checkpoint step {step} saved to '{target}'")
        return True

    def close(self) -> None:
        """Finish any background write (raising its error) and free the copy's buffers. The
        memory tier's slot stays (a later worker of the job may resume from it)."""
        self._staging = None
        try:
            self.wait()
        finally:
            if self._slot is not None:
                self._slot.close()
            if self._replicator is not None:
                self._replicator.replica.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- loading -------------------------------------------------------------------------

    def _listing(self) -> tuple[list[int], set[int]]:
        """(steps with a checkpoint file, oldest first; steps with a checksum file)."""
        data, checksums = [], set()
        try:
            names = [p.name for p in self.directory.iterdir()]
        except FileNotFoundError:
            return [], set()
        for name in names:
            m = self._pattern.fullmatch(name)
            if m is None:
                continue
            step = int(m.group(1))
            if self.path(step).name != name.removesuffix(".meta.json"):
                continue  # not how this manager names a step (extra leading zeros)
            if m.group(2):
                checksums.add(step)
            else:
                data.append(step)
        return sorted(data), checksums

    def steps(self) -> list[int]:
        """Steps with a checkpoint file here (not verified), oldest first."""
        return self._listing()[0]

    def latest_step(self, verified: bool = True) -> int | None:
        """The newest step whose checkpoint verifies (or merely exists), in memory or on
        disk."""
        in_memory = self._memory_step()
        for step in reversed(self.steps()):
            if in_memory is not None and step <= in_memory:
                break
            if not verified or verify(self.path(step)) is None:
                return step
        return in_memory

    def _disk_steps(self, most: int) -> list[int]:
        """The newest steps on disk that verify (at most `most`, newest first; the memory
        tier aside)."""
        found: list[int] = []
        for step in reversed(self.steps()):
            if len(found) == most:
                break
            if verify(self.path(step)) is None:
                found.append(step)
        return found

    def _disk_state(self, step: int, map_location: Any, weights_only: bool) -> Any:
        """Checkpoint `step` from disk, verified."""
        try:
            return read_verified(self.path(step), map_location, None, weights_only)
        except (UnusableError, GoneError) as e:
            raise CheckpointError(f"checkpoint step {step} cannot be read from disk: {e}") from e

    def _memory_step(self) -> int | None:
        """The newest step in the memory tier, unless restoring it ended in a death twice."""
        if self._slot is None:
            return None
        self._copied(report=False)
        step = self._slot.latest_step()
        if step is None or self._restores is None:
            return step
        if self._restores.attempts(step) >= _restores.LIMIT:
            if step in self._fell_back:
                return None
            self._fell_back.add(step)
            warnings.warn(
                f"memory checkpoint step {step} was restored {_restores.LIMIT} times, and each "
                "time the worker died before saving a newer step: not restoring it again; "
                "using the disk",
                stacklevel=3,
            )
            return None
        return step

    def restored_from_memory(self, step: int) -> None:
        """Count a restore of `step` from memory (this rank's or a peer's): if the worker dies
        again before saving a newer step, twice, the step is not restored from memory again."""
        if self._restores is not None and self._restored != step:
            self._restores.record(step)
            self._restored = step

    def _memory_state(
        self, map_location: Any, model: torch.nn.Module | None, weights_only: bool
    ) -> tuple[Any, int] | None:
        """(state, step) from the memory tier, or None (no copy, or one that cannot be
        loaded: said, and the disk is used)."""
        if self._slot is None:
            return None
        try:
            found = self._slot.load(map_location, weights_only)
        except UnsafeCheckpointError:
            raise
        except Exception as e:
            warnings.warn(f"skipping the memory checkpoint: {e}; using the disk", stacklevel=3)
            return None
        if found is not None and model is not None:
            check_fits(found[0], model, f"memory checkpoint step {found[1]}")
        return found

    def step_bytes(self, step: int) -> bytes | bytearray:
        """The serialized checkpoint `step` as this rank holds it (memory first, then disk)."""
        if self._slot is not None:
            self._copied(report=False)
            got = self._slot.read()
            if got is not None and got[1] == step:
                return got[0]
        return self.path(step).read_bytes()

    def keep_copy(self, data: Any, step: int) -> None:
        """Keep checkpoint `step` (its bytes as another rank held them: a memory payload or a
        file's) in the memory tier if there is one, else on disk (as a torch.save file)."""
        if self._slot is not None:
            self._slot.put_bytes(data, step)
            return
        path = self.path(step)
        try:
            if _payload.is_payload(data):
                where = f"checkpoint step {step} (a memory copy)"
                write_verified(path, _payload.decode(data, where, "cpu", weights_only=True))
                return
            size_written, crc = atomic_write(path, lambda f: f.write(data))
            record_checksum(path, size_written, crc)
        except (OSError, GoneError, CheckpointError) as e:
            reason = why(e) if isinstance(e, OSError) else str(e) or "removed meanwhile"
            logger.warning("could not keep a copy of checkpoint %s: %s", path, reason)

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
        in_memory = self._memory_step()
        for _ in range(_RESCANS):
            try:
                for step in reversed(self.steps()):
                    if in_memory is not None and step <= in_memory:
                        break  # the memory tier's copy is as new: no disk read
                    try:
                        state = read_verified(self.path(step), map_location, model, weights_only)
                    except UnusableError as e:
                        warnings.warn(f"skipping checkpoint '{e.path}': {e.problem}", stacklevel=2)
                        continue
                    return state, step
                if in_memory is not None:
                    found = self._memory_state(map_location, model, weights_only)
                    if found is not None:
                        self.restored_from_memory(found[1])
                        return found
                    in_memory = None
                    continue  # the memory copy failed to load: the disk, from the newest
                return None
            except GoneError:
                continue  # pruned under us: newer checkpoints exist, look again
        raise CheckpointError(
            f"the checkpoints in '{self.directory}' kept being removed while being read "
            f"({_RESCANS} times): is another job pruning this directory?"
        )


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
    if manager._replicator is None:
        return manager.load_latest(map_location, weights_only=weights_only)
    return _replica.restore(manager, map_location, weights_only)
