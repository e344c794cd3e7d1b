"""The memory tier's slot (elastic_sampler._memory): a rank's newest checkpoint in shared
memory, double-buffered, verified, of this job only."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from elastic_sampler import _payload
from elastic_sampler._memory import HEADER, MemorySlot, slot_bytes
from elastic_sampler.api import CheckpointError, UnsafeCheckpointError


def state(step: int, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step, "rng": torch.get_rng_state()}


def same(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["w"], b["w"]) and a["step"] == b["step"] and torch.equal(a["rng"], b["rng"])
    )


@pytest.fixture
def path(tmp_path):
    return tmp_path / "slot-0"


def test_a_saved_step_loads_back_with_its_step(path):
    slot = MemorySlot(path, "run-a")
    assert slot.load() is None and slot.latest_step() is None
    slot.put(state(7), 7)
    loaded, step = slot.load()
    assert step == 7 and same(loaded, state(7))
    slot.close()
    again = MemorySlot(path, "run-a")  # another process's view: the file, not this object
    assert again.latest_step() == 7
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_the_newest_intact_copy_wins_and_a_damaged_one_falls_back_to_the_previous(path):
    slot = MemorySlot(path, "run-a")
    slot.put(state(1), 1)
    slot.put(state(2), 2)
    assert slot.latest_step() == 2
    _, newest = slot.newest()
    with open(path, "r+b") as f:  # one byte of step 2's copy changes
        f.seek(HEADER + newest.index * slot._capacity + newest.size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    loaded, step = MemorySlot(path, "run-a").load()
    assert step == 1 and same(loaded, state(1))


def test_a_copy_of_another_job_is_never_returned(path):
    MemorySlot(path, "run-a").put(state(3), 3)
    assert MemorySlot(path, "run-b").load() is None
    assert MemorySlot(path, "run-a").latest_step() == 3


def test_a_file_that_is_not_a_slot_reads_as_empty_and_is_replaced(path):
    path.write_bytes(os.urandom(HEADER + 100))
    slot = MemorySlot(path, "run-a")
    assert slot.load() is None
    slot.put(state(4), 4)
    assert MemorySlot(path, "run-a").latest_step() == 4


def test_a_larger_state_grows_the_slot_and_keeps_the_previous_copy(path):
    slot = MemorySlot(path, "run-a")
    slot.put(state(1, 10), 1)
    small = slot._capacity
    slot.put(state(2, 2_000_000), 2)  # 8 MB: more than the first slot held
    assert slot._capacity > small
    assert sorted(c.step for c in slot._copies()) == [1, 2], "the previous step moved along"
    loaded, step = MemorySlot(path, "run-a").load()
    assert step == 2 and same(loaded, state(2, 2_000_000))


def test_a_save_beyond_the_limit_is_refused_and_the_previous_copy_stays(path):
    slot = MemorySlot(path, "run-a", limit=slot_bytes(2 << 20))
    slot.put(state(1, 1000), 1)
    with pytest.raises(CheckpointError, match=r"more than its limit of \d+ bytes: raise the limit"):
        slot.put(state(2, 1_000_000), 2)  # 4 MB, twice
    loaded, step = MemorySlot(path, "run-a").load()
    assert step == 1 and same(loaded, state(1, 1000))


def test_a_crafted_copy_is_refused_by_default(path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    MemorySlot(path, "run-a").put({"x": Evil()}, 5)
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True refuses"):
        MemorySlot(path, "run-a").load()


def test_a_refused_memory_copy_falls_back_to_the_disk(tmp_path, monkeypatch):
    """Through the manager, a memory copy that is refused (or cannot be decoded) is skipped
    with a warning, as a torn one is, and the newest good step on disk loads."""
    from elastic_sampler import CheckpointManager

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    monkeypatch.setenv("ELASTICRUN_MEMORY_DIR", str(tmp_path / "mem"))
    (tmp_path / "mem").mkdir(mode=0o700)
    m = CheckpointManager(tmp_path / "ckpt", memory=True, persist_every=2)
    m.save(state(2, 1000), 2)  # memory and disk
    m.save(state(3, 1000), 3)  # memory only
    m.wait()
    m.memory_tier.slot.put({"x": Evil()}, 4)  # what a rogue writer of the slot leaves
    with pytest.warns(UserWarning, match="refused the memory checkpoint"):
        loaded, step = CheckpointManager(tmp_path / "ckpt", memory=True).load_latest()
    assert step == 2 and same(loaded, state(2, 1000))


SIZE = 32 << 20


def payload(step: int) -> bytes:
    return bytes([step % 256]) * SIZE


def tensors(step: int) -> dict:
    return {"w": torch.full((SIZE // 4,), step, dtype=torch.int32), "step": step}


def _save_forever(path: str, ready, planned: bool) -> None:
    slot = MemorySlot(path, "run-a")
    put = slot.put if planned else slot.put_bytes
    make = tensors if planned else payload
    put(make(1), 1)
    ready.set()
    step = 2
    while True:
        put(make(step), step)
        step += 1


def whole(data: bytes, step: int, planned: bool) -> bool:
    if not planned:  # the bytes, after the head that names whose step they are
        named = _payload.identity_of(data)
        return named is not None and named.step == step and data.endswith(payload(step))
    got = _payload.decode(data, "test")
    return got["step"] == step and bool((got["w"] == step).all())


@pytest.mark.slow  # real processes, SIGKILLed
@pytest.mark.parametrize("planned", [False, True], ids=["bytes", "tensors"])
def test_a_writer_killed_at_any_moment_leaves_a_whole_copy(planned):
    """A rank SIGKILLed while it copies a step into its slot (bytes, or a state's tensors with
    the checksum on a helper thread): what the slot returns is a whole copy of the step it
    says, never a torn one. Killed at random moments."""
    ctx = multiprocessing.get_context("spawn")  # torch in a forked child may deadlock
    rng = random.Random(0)
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        path = os.path.join(d, "slot")
        for _ in range(5):
            ready = ctx.Event()
            child = ctx.Process(target=_save_forever, args=(path, ready, planned))
            child.start()
            try:
                assert ready.wait(60), "the writer never saved its first step"
                time.sleep(rng.uniform(0.0, 0.3))
            finally:
                os.kill(child.pid, signal.SIGKILL)
                child.join(10)
            got = MemorySlot(path, "run-a").read()
            assert got is not None, "no whole copy left"
            data, step = got
            assert step >= 1 and whole(data, step, planned)
            os.unlink(path)


# ---- the manager's memory tier -----------------------------------------------------------------


@pytest.fixture
def under_elasticrun(tmp_path, monkeypatch):
    """The environment elasticrun gives a worker: the node's slot directory, the run id, the
    local rank."""
    home = tmp_path / "shm"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("ELASTICRUN_MEMORY_DIR", str(home))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("ELASTICRUN_MEMORY_LIMIT", raising=False)
    return home


def test_every_save_reaches_memory_and_every_nth_the_disk(tmp_path, under_elasticrun):
    from elastic_sampler import CheckpointManager

    with CheckpointManager(tmp_path / "ckpt", keep_last=5, memory=True, persist_every=5) as m:
        for step in range(1, 13):
            m.save(state(step), step, background=step % 2 == 0)
    assert CheckpointManager(tmp_path / "ckpt").steps() == [5, 10]
    # A replacement worker (another manager, the same node and rank) resumes at the last step.
    again = CheckpointManager(tmp_path / "ckpt", memory=True, persist_every=5)
    assert again.latest_step() == 12
    loaded, step = again.load_latest()
    assert step == 12 and same(loaded, state(12))
    slots = [p for p in under_elasticrun.iterdir() if not p.name.endswith(".restores")]
    assert len(slots) == 1, "one slot for the rank"


def test_steps_off_the_multiples_reach_the_disk_at_the_spacing_and_when_asked(
    tmp_path, under_elasticrun
):
    from elastic_sampler import CheckpointManager

    m = CheckpointManager(tmp_path / "ckpt", keep_last=9, memory=True, persist_every=4)
    for step in (1, 3, 5, 7, 9, 10):
        m.save(state(step), step, persist=True if step == 10 else None)
    m.save(state(11), 11, persist=False)
    m.close()
    assert m.steps() == [5, 9, 10], "4 steps after the first save, again 4 later, and asked"
    assert CheckpointManager(tmp_path / "ckpt", memory=True).latest_step() == 11


def test_a_disk_checkpoint_newer_than_memory_wins(tmp_path, under_elasticrun):
    from elastic_sampler import CheckpointManager

    CheckpointManager(tmp_path / "ckpt", memory=True, persist_every=100).save(state(3), 3)
    assert CheckpointManager(tmp_path / "ckpt").steps() == [], "step 3 is in memory only"
    CheckpointManager(tmp_path / "ckpt").save(state(9), 9)  # another writer, disk only
    m = CheckpointManager(tmp_path / "ckpt", memory=True)
    loaded, step = m.load_latest()
    assert step == 9 == m.latest_step() and same(loaded, state(9))


def test_memory_of_another_run_or_rank_is_not_used(tmp_path, under_elasticrun, monkeypatch):
    from elastic_sampler import CheckpointManager

    m = CheckpointManager(tmp_path / "ckpt", memory=True, persist_every=100)
    m.save(state(3), 3, persist=True)  # disk and memory
    m.save(state(5), 5)  # memory only
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert CheckpointManager(tmp_path / "ckpt", memory=True).load_latest()[1] == 3
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-b")
    assert CheckpointManager(tmp_path / "ckpt", memory=True).load_latest()[1] == 3
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    assert CheckpointManager(tmp_path / "ckpt", memory=True).load_latest()[1] == 5


def test_a_memory_copy_that_fails_to_load_falls_back_to_the_disk(tmp_path, under_elasticrun):
    from elastic_sampler import CheckpointManager

    m = CheckpointManager(tmp_path / "ckpt", memory=True, persist_every=100)
    m.save(state(2), 2, persist=True)
    m.memory_tier.slot.put_bytes(b"not a torch file", 5)  # sealed and checksummed, but not loadable
    with pytest.warns(UserWarning, match="skipping the memory checkpoint"):
        loaded, step = CheckpointManager(tmp_path / "ckpt", memory=True).load_latest()
    assert step == 2 and same(loaded, state(2))


def test_outside_elasticrun_memory_warns_and_keeps_every_nth_step_on_disk(tmp_path, monkeypatch):
    from elastic_sampler import CheckpointManager

    monkeypatch.delenv("ELASTICRUN_MEMORY_DIR", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.warns(UserWarning, match=r"\$ELASTICRUN_MEMORY_DIR is not set \(elasticrun sets"):
        m = CheckpointManager(tmp_path / "ckpt", keep_last=9, memory=True, persist_every=3)
    for step in range(1, 8):
        m.save(state(step), step)
    assert m.steps() == [3, 6]


def test_outside_elasticrun_only_a_node_s_first_worker_says_so(tmp_path, monkeypatch):
    """Under torchrun every rank builds the manager: one line per node, not one per rank."""
    import warnings

    from elastic_sampler import CheckpointManager

    monkeypatch.delenv("ELASTICRUN_MEMORY_DIR", raising=False)
    said = {}
    for local_rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = CheckpointManager(tmp_path / "ckpt", memory=True)
        assert m.memory_tier is None
        said[local_rank] = [str(w.message) for w in caught]
    assert len(said["0"]) == 1 and "there is no memory tier" in said["0"][0], said
    assert said["1"] == [], "a node's other workers say nothing"


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("ELASTICRUN_MEMORY_LIMIT", "lots", r"\$ELASTICRUN_MEMORY_LIMIT='lots': give the bytes"),
        ("ELASTICRUN_MEMORY_LIMIT", "²", r"\$ELASTICRUN_MEMORY_LIMIT='²'"),
        ("LOCAL_RANK", "one", r"\$LOCAL_RANK='one': expected a whole number"),
        ("ELASTICRUN_MEMORY_DIR", "/nonexistent/x", r"'/nonexistent/x' is not a directory"),
    ],
)
def test_a_bad_memory_setting_is_a_clear_error(
    tmp_path, under_elasticrun, monkeypatch, name, value, says
):
    from elastic_sampler import CheckpointManager

    monkeypatch.setenv(name, value)
    with pytest.raises(CheckpointError, match=says):
        CheckpointManager(tmp_path / "ckpt", memory=True)


def test_the_limit_reaches_the_slot(tmp_path, under_elasticrun, monkeypatch):
    from elastic_sampler import CheckpointManager

    monkeypatch.setenv("ELASTICRUN_MEMORY_LIMIT", str(slot_bytes(1 << 20)))
    m = CheckpointManager(tmp_path / "ckpt", memory=True, persist_every=10)
    m.save(state(1, 100), 1)
    with pytest.raises(CheckpointError, match="more than its limit"):
        m.save(state(2, 1_000_000), 2)
    assert m.load_latest()[1] == 1


# ---- copies that overlap the next step ------------------------------------------------------


def slow_copies(monkeypatch, seconds: float) -> None:
    """Every copy to memory starts `seconds` late, so that a step that did not wait for it
    would be seen (a machine slower than that only makes the wait longer)."""
    real = _payload.Plan.write

    def late(self, view):
        time.sleep(seconds)
        return real(self, view)

    monkeypatch.setattr(_payload.Plan, "write", late)


def held_copies(monkeypatch) -> threading.Event:
    """Every copy to memory waits until the test sets the event returned (30 s at most): the
    test acts while the copy is surely in flight, whatever the machine's speed."""
    real, go = _payload.Plan.write, threading.Event()

    def late(self, view):
        go.wait(30)
        return real(self, view)

    monkeypatch.setattr(_payload.Plan, "write", late)
    return go


def test_save_returns_at_once_and_the_next_optimizer_step_waits_for_the_copy(
    tmp_path, under_elasticrun, monkeypatch
):
    from elastic_sampler import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Linear(1000, 1000)  # 4 MB of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    m = CheckpointManager(tmp_path / "ckpt", memory=True, persist_every=100)
    model(torch.ones(1, 1000)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    go = held_copies(monkeypatch)
    m.save({"model": model.state_dict()}, 1)
    assert m.memory_tier._copy is not None and not m.memory_tier._copy.join(0), (
        "save() returned with the copy running"
    )
    go.set()
    optimizer.step()  # changes the weights, but only once the copy is over
    assert m.memory_tier._copy.join(0)
    assert not torch.equal(model.weight, before["weight"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a void copy would warn
        m.wait()
    loaded, step = CheckpointManager(tmp_path / "ckpt", memory=True).load_latest()
    assert step == 1
    assert all(torch.equal(loaded["model"][k], v) for k, v in before.items())


def test_a_tensor_changed_during_the_copy_voids_it_and_later_copies_finish_in_save(
    tmp_path, under_elasticrun, monkeypatch
):
    from elastic_sampler import CheckpointManager

    w = torch.zeros(1 << 20)
    m = CheckpointManager(tmp_path / "ckpt", memory=True, persist_every=100)
    m.save({"w": w}, 1)
    m.wait()
    go = held_copies(monkeypatch)
    m.save({"w": w}, 2)
    w.add_(1)  # no optimizer step: nothing waits for the copy
    go.set()
    with pytest.warns(UserWarning, match=r"step 2 was changed while .* memory keeps step 1"):
        m.wait()
    assert m.overlap is False and m.latest_step() == 1
    m.save({"w": w}, 3)
    assert m.memory_tier._copy is None, "copied inside save() from now on"
    loaded, step = m.load_latest()
    assert step == 3 and bool((loaded["w"] == 1).all())


def test_the_optimizer_step_waits_for_the_copy_but_not_for_what_follows_it(tmp_path, monkeypatch):
    from elastic_sampler._memory import MemorySlot
    from elastic_sampler._overlap import Copy

    w = torch.nn.Parameter(torch.zeros(1 << 18))
    optimizer = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.ones_like(w)
    sending = threading.Event()
    release = threading.Event()
    sent = []

    def send(kept: bool) -> None:  # a replica's exchange: reads the slot, not the state
        sending.set()
        release.wait(30)
        sent.append(kept)

    slow_copies(monkeypatch, 0.3)
    before = w.detach().clone()
    slot = MemorySlot(tmp_path / "slot", "run")
    copy = Copy(slot, _payload.plan({"w": w}, slot.identity(1)), 1, send)
    optimizer.step()  # waits for the copy, and returns while what follows it still runs
    assert copy.join_local(0), "the optimizer step did not wait for the copy"
    assert not copy.join(0)
    release.set()
    assert copy.join(30) and sent == [True] and copy.error is None
    assert sending.is_set()
    state, _ = MemorySlot(tmp_path / "slot", "run").load() or (None, None)
    assert torch.equal(state["w"], before), "the copy holds the step before the update"


def test_a_small_state_is_copied_inside_save(tmp_path, under_elasticrun):
    from elastic_sampler import CheckpointManager

    m = CheckpointManager(tmp_path / "ckpt", memory=True, persist_every=100)
    m.save(state(1), 1)
    assert m.memory_tier._copy is None and m.latest_step() == 1


# ---- crash loops -----------------------------------------------------------------------------


def test_a_memory_step_whose_restore_died_twice_falls_back_to_the_disk(tmp_path, under_elasticrun):
    """Each manager stands for one worker: it restores, then dies before saving a newer step.
    The third one is given the disk's step, and told why; a worker that saves again resets
    the count."""
    from elastic_sampler import CheckpointManager

    m = CheckpointManager(tmp_path / "ckpt", memory=True, persist_every=4)
    for step in range(1, 7):
        m.save(state(step), step)
    m.close()
    for _ in range(2):  # restored, then the worker dies (no save)
        assert CheckpointManager(tmp_path / "ckpt", memory=True).load_latest()[1] == 6
    third = CheckpointManager(tmp_path / "ckpt", memory=True)
    with pytest.warns(UserWarning, match="step 6 was restored 2 times, .* using the disk"):
        loaded, step = third.load_latest()
    assert step == 4 and same(loaded, state(4))
    third.save(state(5), 5)  # training goes on from the disk's step
    third.save(state(7), 7)
    fourth = CheckpointManager(tmp_path / "ckpt", memory=True)
    assert fourth.load_latest()[1] == 7
    fourth.save(state(8), 8)  # past the restored step: the count is cleared
    for _ in range(2):
        assert CheckpointManager(tmp_path / "ckpt", memory=True).load_latest()[1] == 8


SIGTERMED_MID_COPY = """
import os, sys, time, torch
from elastic_sampler import CheckpointManager, _payload

release = sys.argv[1] + "/release"
real = _payload.Plan.write

def held(self, view):  # the copy waits until the test has sent SIGTERM
    while not os.path.exists(release):
        time.sleep(0.01)
    return real(self, view)

_payload.Plan.write = held
m = CheckpointManager(sys.argv[1] + "/ckpt", memory=True, persist_every=100)
m.save({"w": torch.full((1 << 19,), 7.0)}, 7)  # 2 MiB: copied on a thread
open(sys.argv[1] + "/saved", "w").close()
time.sleep(120)
"""


def wait_until(condition, proc, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.slow
def test_a_worker_stopped_while_its_copy_is_in_flight_finishes_it_first(tmp_path):
    """A group restart SIGTERMs the saving rank while the copy of the step it just saved is
    on its thread: the copy reaches the slot before the worker dies (of its SIGTERM)."""
    home = tmp_path / "memory"
    home.mkdir()
    env = {
        **os.environ,
        "ELASTICRUN_MEMORY_DIR": str(home),
        "TORCHELASTIC_RUN_ID": "run-a",
        "LOCAL_RANK": "0",
    }
    err = tmp_path / "stderr"
    with open(err, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", SIGTERMED_MID_COPY, str(tmp_path)], env=env, stderr=f
        )
    try:
        wait_until((tmp_path / "saved").exists, proc, "never saved")
        proc.send_signal(signal.SIGTERM)
        said = "SIGTERM arrived: finishing the copy of checkpoint step 7 to memory"
        wait_until(lambda: said in err.read_text(), proc, "the copy was not waited for")
        (tmp_path / "release").touch()
        assert proc.wait(60) == -signal.SIGTERM, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    slot = next(home.glob("checkpoint-*-rank0"))
    assert MemorySlot(slot, "run-a").latest_step() == 7
