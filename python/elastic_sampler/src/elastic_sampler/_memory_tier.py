"""The memory tier: this rank's newest steps in its slot of the node's shared memory (`_memory`),
where the rank's death cannot take them.

A large state is copied on a thread while the next step computes (`_overlap`); a worker
stopped meanwhile (SIGTERM, for a group restart) or ending finishes that copy first, within the
launcher's grace (`_finish`), so the step it saved is not lost. A step whose restore from
memory ended in a death twice is not restored from memory again (`_restores`): the disk serves
it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from elastic_sampler import _finish, _overlap, _payload, _restores
from elastic_sampler._files import check_fits
from elastic_sampler._memory import MemorySlot
from elastic_sampler.api import CheckpointError, UnsafeCheckpointError

#: A copy to memory smaller than this is done inside save(): a thread costs more.
OVERLAP_FROM = 1 << 20


class MemoryTier:
    """This rank's copies in `slot`. With `overlap`, a large state's copy runs on a thread and
    the next optimizer step waits for it (see `CheckpointManager`)."""

    def __init__(
        self, slot: MemorySlot, overlap: bool = True, finish_timeout: float = 300.0
    ) -> None:
        self.slot = slot
        self.overlap = overlap
        self.finish_timeout = finish_timeout  # at exit, the longest a copy is waited for
        self.restores = _restores.RestoreLog(slot.path.with_name(slot.path.name + ".restores"))
        self._copy: _overlap.Copy | None = None  # the copy in flight
        self._restored: int | None = None  # the step restored from memory, until a newer save
        self._fell_back: set[int] = set()  # steps not restored again (said once)

    # ---- saving --------------------------------------------------------------------------

    def save(self, state: Any, step: int, then: Callable[[bool], None] | None = None) -> None:
        """Make `state` the slot's newest copy, as step `step`; then `then(kept)` (on the copy
        thread when the copy overlaps the next step; also after a failed copy, with False)."""
        if self._restored is not None and step > self._restored:
            self.restores.clear()  # training went on past the restored step
            self._restored = None
        plan = _payload.plan(state, self.slot.identity(step))
        if self.overlap and plan.apart >= OVERLAP_FROM:
            self.slot.check_room(plan.size)  # a limit is refused here, not at the next save
            self._copy = _overlap.Copy(self.slot, plan, step, then)
            _finish.started(self)  # a SIGTERM or the exit waits for it
            return
        try:
            kept = self.slot.put_plan(plan, step)
        except BaseException:
            if then is not None:
                then(False)  # whoever waits for word of this save hears it
            raise
        if then is not None:
            then(kept)

    def wait(self, timeout: float | None = None, *, report: bool = True) -> None:
        """Wait for the copy in flight; with `report`, raise its error or say that it was void
        (a large tensor changed while it was copied: later copies finish inside save())."""
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
        _finish.finished(self)
        if copy.error is not None:
            raise copy.error
        if copy.kept is False:
            self.overlap = False
            kept = self.slot.latest_step()
            warnings.warn(
                f"checkpoint step {copy.step} was changed while it was copied to memory (a "
                "large tensor of the state changed in place before the next optimizer step, "
                f"or that step did not wait); memory keeps step {kept}, and later copies "
                "finish before save() returns (pass overlap=False to say so from the start)",
                stacklevel=4,
            )

    def finish(self, timeout: float, why: str, hint: str) -> bool:
        """For `_finish` at exit or SIGTERM: let the copy in flight reach the slot, for at most
        `timeout` s (the step then survives this worker); what follows it (a peer's exchange)
        is not waited for. True: nothing of it runs any more, or only what follows it."""
        copy = self._copy
        if copy is None or copy.join_local(0):
            return True
        _finish.say(
            f"{why}: finishing the copy of checkpoint step {copy.step} to memory (for at most "
            f"{round(timeout, 1):g} s)"
        )
        if copy.join_local(timeout):
            _finish.say(f"checkpoint step {copy.step} is in memory")
            return True
        _finish.say(f"abandoned the copy of checkpoint step {copy.step} to memory ({hint})")
        return False

    def keep_bytes(self, data: Any, step: int) -> None:
        """Keep step `step` from its bytes as another rank held them."""
        self.slot.put_bytes(data, step)

    def close(self) -> None:
        self.slot.close()

    # ---- reading ---------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest step in the slot, unless restoring it ended in a death twice."""
        self.wait(report=False)
        step = self.slot.latest_step()
        if step is None:
            return None
        if self.restores.exhausted(step):
            if step not in self._fell_back:
                self._fell_back.add(step)
                warnings.warn(
                    f"memory checkpoint step {step} was restored {_restores.LIMIT} times, and "
                    "each time the worker died before saving a newer step: not restoring it "
                    "again; using the disk",
                    stacklevel=4,
                )
            return None
        return step

    def steps(self) -> list[int]:
        """The step this tier would restore (its newest that verifies), as a list."""
        step = self.latest_step()
        return [] if step is None else [step]

    def banned(self) -> int | None:
        """The step not to restore from memory again (any tier's copy of it), if any."""
        return self.restores.banned()

    def load_newest(
        self, map_location: Any, model: torch.nn.Module | None, weights_only: bool
    ) -> tuple[Any, int] | None:
        """(state, step) of the newest copy, or None (no copy, or one that cannot be loaded
        or is refused: said, and the caller uses the disk, as for a torn copy)."""
        try:
            found = self.slot.load(map_location, weights_only)
        except UnsafeCheckpointError as e:  # nothing of it ran: the disk may hold a good one
            warnings.warn(f"refused the memory checkpoint: {e}; using the disk", stacklevel=4)
            return None
        except Exception as e:
            warnings.warn(f"skipping the memory checkpoint: {e}; using the disk", stacklevel=4)
            return None
        if found is not None and model is not None:
            check_fits(found[0], model, f"memory checkpoint step {found[1]}")
        return found

    def load(self, step: int, map_location: Any = "cpu", weights_only: bool = True) -> Any:
        """Step `step`, if it is the slot's newest copy; else a CheckpointError."""
        found = self.slot.load(map_location, weights_only)
        if found is None or found[1] != step:
            raise CheckpointError(f"checkpoint step {step} is not in the memory slot")
        return found[0]

    def read_bytes(self, step: int) -> bytearray | None:
        """The bytes of step `step` if it is the slot's newest copy."""
        self.wait(report=False)
        got = self.slot.read()
        return got[0] if got is not None and got[1] == step else None

    def restored(self, step: int) -> None:
        """Count a restore of `step` from memory (this rank's or a peer's): if the worker dies
        again before saving a newer step, twice, the step is not restored from memory again."""
        if self._restored != step:
            self.restores.record(step)
            self._restored = step
