"""The disk tier: one job's checkpoint files in one directory, the last `keep_last` of them
kept, at most one written in the background at a time.

Step N is ``<prefix>-<N:012d>.pt`` with its checksum beside it (how one file is written and
checked: `_files`); a background write that outlives a script that forgets ``close()`` is
finished at exit or on SIGTERM (`_finish`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from elastic_sampler import _finish, _payload
from elastic_sampler._files import (
    GoneError,
    UnusableError,
    atomic_write,
    meta_path,
    read_verified,
    record_checksum,
    remove_dead_temporaries,
    remove_my_temporaries,
    verify,
    why,
    write_verified,
)
from elastic_sampler._snapshot import snapshot
from elastic_sampler.api import CheckpointDirectoryError, CheckpointError

logger = logging.getLogger(__name__)


class DiskTier:
    """The checkpoint files named `prefix` in `directory`. `reuse_buffers`: a background save
    copies into the previous one's buffers (kept until `close`); `finish_timeout`: how long the
    exit waits for a background write."""

    def __init__(
        self,
        directory: Path,
        prefix: str,
        keep_last: int,
        *,
        reuse_buffers: bool = True,
        finish_timeout: float = 300.0,
    ) -> None:
        self.directory = directory
        self.prefix = prefix
        self.keep_last = keep_last
        self.reuse_buffers = reuse_buffers
        self.finish_timeout = finish_timeout
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d{{12,}})\.pt(\.meta\.json)?")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise CheckpointDirectoryError(
                f"cannot write checkpoints to '{directory}': {why(e)}; choose a writable directory"
            ) from None  # the reason is in the message; pathlib's chain of mkdirs adds nothing
        self._staging: Any = None  # the last background copy, once written: the next one's buffers
        self._thread: threading.Thread | None = None
        self._writing: int | None = None  # the step the background write is saving
        self._abandon = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        remove_dead_temporaries(directory, f"{prefix}-")

    def path(self, step: int) -> Path:
        return self.directory / f"{self.prefix}-{step:012d}.pt"

    # ---- saving --------------------------------------------------------------------------

    def save(self, state: Any, step: int, background: bool = False) -> Path:
        """Write `state` as step `step` (the caller waited for the previous write). With
        `background`, a copy of it is written by a thread; its error surfaces in `wait`."""
        if not background:
            return self._write(state, step)
        staging, self._staging = self._staging, None
        copied = snapshot(state, staging)  # no reference kept here: see snapshot
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
                stacklevel=4,
            )
            return target
        except CheckpointError as e:
            previous = self.latest_verified()  # only now: it reads every byte to verify
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

    def keep_bytes(self, data: Any, step: int) -> None:
        """Keep step `step` from its bytes as another rank held them (a memory payload or a
        file's), as a file of this tier; a failure is only said."""
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

    # ---- the write in flight ---------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the background write; raise its error."""
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
        """Finish the background write (raising its error) and free the copy's buffers."""
        self._staging = None
        self.wait()

    # ---- reading ---------------------------------------------------------------------------

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
                continue  # not how this tier names a step (extra leading zeros)
            if m.group(2):
                checksums.add(step)
            else:
                data.append(step)
        return sorted(data), checksums

    def steps(self) -> list[int]:
        """Steps with a checkpoint file here (not verified), oldest first."""
        return self._listing()[0]

    def verified(self, most: int, above: int | None = None) -> list[int]:
        """The newest steps that verify, newest first: at most `most`, all newer than
        `above`."""
        found: list[int] = []
        for step in reversed(self.steps()):
            if len(found) == most or (above is not None and step <= above):
                break
            if verify(self.path(step)) is None:
                found.append(step)
        return found

    def latest_verified(self) -> int | None:
        newest = self.verified(1)
        return newest[0] if newest else None

    def read(
        self,
        step: int,
        map_location: Any = "cpu",
        weights_only: bool = True,
        model: torch.nn.Module | None = None,
    ) -> Any:
        """Step `step`, verified as it is read (and, given `model`, checked to fit it):
        UnusableError if it is torn or corrupt, GoneError if it was removed meanwhile."""
        return read_verified(self.path(step), map_location, model, weights_only)

    def load(self, step: int, map_location: Any = "cpu", weights_only: bool = True) -> Any:
        """Step `step`, or a CheckpointError saying why it cannot be read."""
        try:
            return self.read(step, map_location, weights_only)
        except (UnusableError, GoneError) as e:
            raise CheckpointError(f"checkpoint step {step} cannot be read from disk: {e}") from e

    def read_bytes(self, step: int) -> bytes:
        return self.path(step).read_bytes()
