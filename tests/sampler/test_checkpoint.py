"""Checkpoints: atomic and verified, pruned safely, saved in the background, shared across
ranks; clear errors for unwritable or full storage and for another model's checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from elastic_sampler import (
    CheckpointDirectoryError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    load_checkpoint,
    save_checkpoint,
)
from ranks_util import run_ranks


def model_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(4, 3).state_dict(), "step": seed}


def test_save_load_and_keep_last(tmp_path):
    m = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    for step in (10, 20, 30):
        m.save(model_state(step), step)
    assert m.steps() == [20, 30], "older ones go once a newer one is on disk"
    state, step = m.load_latest()
    assert step == 30 and state["step"] == 30
    meta = json.loads((tmp_path / "ckpt" / "checkpoint-000000000030.pt.meta.json").read_text())
    assert meta["size"] == (tmp_path / "ckpt" / "checkpoint-000000000030.pt").stat().st_size
    assert not [p for p in (tmp_path / "ckpt").iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("damage", ["torn", "corrupt", "no-checksum"])
def test_a_damaged_newest_checkpoint_is_skipped(tmp_path, damage):
    m = CheckpointManager(tmp_path, keep_last=3)
    m.save(model_state(1), 1)
    m.save(model_state(2), 2)
    newest = m.path(2)
    if damage == "torn":
        with open(newest, "r+b") as f:
            f.truncate(newest.stat().st_size // 2)
    elif damage == "corrupt":
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
    else:
        Path(str(newest) + ".meta.json").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, step = m.load_latest()
    assert step == 1 and state["step"] == 1
    reason = {"torn": "torn", "corrupt": "corrupt", "no-checksum": "did not finish"}[damage]
    assert any(reason in str(w.message) and str(newest) in str(w.message) for w in caught)


def test_background_save_copies_first_and_writes_later(tmp_path):
    m = CheckpointManager(tmp_path)
    weights = torch.zeros(1000)
    m.save({"w": weights}, 1, background=True)
    weights.add_(5)  # training goes on at once
    m.save({"w": weights}, 2, background=True)  # waits for the first: one write in flight
    m.wait()
    assert torch.equal(load_checkpoint(m.path(1))["w"], torch.zeros(1000))
    assert torch.equal(load_checkpoint(m.path(2))["w"], torch.full((1000,), 5.0))
    m.close()


@pytest.mark.parametrize("reuse", [True, False])
def test_background_saves_reuse_the_previous_copy(tmp_path, reuse):
    m = CheckpointManager(tmp_path, keep_last=5, reuse_buffers=reuse)
    weights, bias = torch.zeros(1000), torch.zeros(3)
    m.save({"model": {"w": weights, "b": bias}, "step": 1, "extra": [bias]}, 1, background=True)
    m.wait()
    first = m.disk_tier._staging["model"]["w"] if reuse else None
    weights.add_(1)
    # `b` changes shape: a new buffer for it, the old one for `w`.
    m.save({"model": {"w": weights, "b": torch.ones(4)}, "step": 2, "extra": []}, 2, True)
    weights.add_(1)  # training goes on while the copy is written
    m.wait()
    if reuse:
        assert m.disk_tier._staging["model"]["w"] is first, "the buffer of the last copy was reused"
    else:
        assert m.disk_tier._staging is None
    one, two = load_checkpoint(m.path(1)), load_checkpoint(m.path(2))
    assert torch.equal(one["model"]["w"], torch.zeros(1000)), "a written copy never changes"
    assert torch.equal(two["model"]["w"], torch.ones(1000)) and two["step"] == 2
    assert torch.equal(two["model"]["b"], torch.ones(4)) and two["extra"] == []
    m.close()
    assert m.disk_tier._staging is None, "close frees the buffers"


def test_background_errors_surface_on_the_next_call(tmp_path):
    directory = tmp_path / "gone"
    m = CheckpointManager(directory)
    shutil.rmtree(directory)
    m.save({"w": torch.ones(3)}, 1, background=True)
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        m.save({"w": torch.ones(3)}, 2)


def test_unwritable_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot write checkpoints to '/proc/elastic-x'"):
        CheckpointManager("/proc/elastic-x")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointDirectoryError, match="Not a directory; choose a writable") as e:
        CheckpointManager(tmp_path / "file" / "checkpoints")  # under a regular file
    assert e.value.show_traceback is False, "a setting to fix: the launcher shows the line"


@pytest.mark.slow  # a real process
def test_full_disk_keeps_the_previous_checkpoint(tmp_path):
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from elastic_sampler import CheckpointManager, CheckpointError
        m = CheckpointManager({str(tmp_path)!r})
        m.save({{"w": torch.ones(10)}}, 1)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))  # a nearly full disk
        try:
            m.save({{"w": torch.ones(1_000_000)}}, 2)
        except CheckpointError as e:
            print("ERROR", e)
        state, step = m.load_latest()
        print("LATEST", step, float(state["w"].sum()))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "ERROR cannot write checkpoint" in out
    assert "File too large (the disk or quota is full)" in out
    assert "(checkpoint step 1 is intact)" in out
    assert "LATEST 1 10.0" in out
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "nothing half-written left"


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    m = CheckpointManager(tmp_path)
    m.save(model_state(1), 1)
    other = torch.nn.Linear(5, 3)
    with pytest.raises(CheckpointMismatchError, match="saved from another model") as e:
        m.load_latest(model=other)
    assert "weight: checkpoint (3, 4) vs model (3, 5)" in str(e.value)
    state, _ = m.load_latest(model=torch.nn.Linear(4, 3))
    assert "model" in state


def test_single_file_helpers(tmp_path):
    path = tmp_path / "one.pt"
    save_checkpoint(path, {"x": 1})
    assert load_checkpoint(path) == {"x": 1}
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot be used: it is torn"):
        load_checkpoint(path)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep_last=0"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="prefix='a/b'"):
        CheckpointManager(tmp_path, prefix="a/b")
    with pytest.raises(ValueError, match="step=-1"):
        CheckpointManager(tmp_path).save({}, -1)


BROADCAST = """
import os, sys, torch, torch.distributed as dist
from elastic_sampler import CheckpointManager, broadcast_latest
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank,
                        world_size=2)
m = CheckpointManager(sys.argv[3] + "/rank" + str(rank))
m.save({"step": 5}, 5)
if rank == 0:
    m.save({"step": 10, "w": torch.arange(1000)}, 10, background=True)  # broadcast waits
    if sys.argv[4] == "unreadable":
        import pathlib
        def refuse(self):
            raise PermissionError(13, "Permission denied", str(self))
        pathlib.Path.read_bytes = refuse
try:
    state, step = broadcast_latest(m)
    print("RESULT", rank, step, state["step"], m.steps(), flush=True)
except Exception as e:
    print("ERROR", rank, e, flush=True)
dist.destroy_process_group()
"""


def _broadcast(tmp_path: Path, mode: str) -> list[str]:
    return run_ranks(BROADCAST, 2, str(tmp_path), mode)


@pytest.mark.slow  # two real processes and gloo
def test_broadcast_latest_shares_the_newest_checkpoint(tmp_path):
    outs = _broadcast(tmp_path, "readable")
    assert "RESULT 0 10 10 [5, 10]" in outs[0]
    assert "RESULT 1 10 10 [5, 10]" in outs[1], "rank 1 received step 10 and kept a copy"
    assert os.path.exists(tmp_path / "rank1" / "checkpoint-000000000010.pt.meta.json")


@pytest.mark.slow  # two real processes and gloo
def test_a_holder_that_cannot_read_fails_every_rank(tmp_path):
    outs = _broadcast(tmp_path, "unreadable")
    why = "rank 0 holds checkpoint step 10 but could not read it"
    assert f"ERROR 0 {why}: Permission denied" in outs[0], outs
    assert f"ERROR 1 {why} (rank 0's error says why)" in outs[1], outs


def test_an_older_save_never_prunes_itself(tmp_path):
    # Resumed from step 50 because step 100 is corrupt: saving 60 must keep 60.
    m = CheckpointManager(tmp_path, keep_last=1)
    m.save(model_state(50), 50)
    m.save(model_state(100), 100)
    (tmp_path / "checkpoint-000000000100.pt").write_bytes(b"garbage")
    m.save(model_state(60), 60)
    assert m.steps() == [60, 100]
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        _, step = m.load_latest()
    assert step == 60


def test_only_this_hosts_dead_writers_temporaries_are_removed(tmp_path):
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    ours = tmp_path / f".checkpoint-000000000001.pt.tmp-{host}-{dead.pid}-1"
    theirs = tmp_path / f".checkpoint-000000000001.pt.tmp-other-host-{dead.pid}-1"
    running = tmp_path / f".checkpoint-000000000002.pt.tmp-{host}-{os.getpid()}-1"
    for p in (ours, theirs, running):
        p.write_bytes(b"partial")
    CheckpointManager(tmp_path)
    assert not ours.exists(), "a dead writer's temporary on this host is removed"
    assert theirs.exists(), "another host's writer may still be writing"
    assert running.exists(), "a live writer's temporary is kept"


# ---- a background save outlives a script that forgets close() --------------------------------

# The state pickles slowly (`Slow.seconds` in the writer thread, or until the file `release`
# exists), so the script ends while the write is in flight; it unpickles as a plain int (by
# calling `int`: loaded with weights_only=False, as this file is the test's own).
SLOW_SAVE = """
import os, signal, sys, time, torch
from elastic_sampler import CheckpointManager

class Slow:
    def __init__(self, seconds, release):
        self.seconds, self.release = seconds, release
    def __deepcopy__(self, memo):
        return Slow(self.seconds, self.release)
    def __reduce__(self):
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline and not os.path.exists(self.release):
            time.sleep(0.01)
        return (int, (7,))

m = CheckpointManager(sys.argv[1], finish_timeout=float(sys.argv[3]))
m.save({"w": torch.ones(3)}, 1)
slow = Slow(float(sys.argv[4]), sys.argv[1] + "/release")
m.save({"w": torch.ones(3), "slow": slow}, 2, background=True)
print("SAVING", flush=True)
how = sys.argv[2]
if how == "exit":
    sys.exit(0)
if how == "raise":
    raise RuntimeError("the training script failed")
if how == "wait-for-sigterm":
    time.sleep(60)
"""


def _slow_save(tmp_path, how, finish_timeout=300.0, seconds=1.5, env=None, release=False):
    """Runs SLOW_SAVE; with `release`, the save goes on only once the script has said it
    waits for it (after the SIGTERM), so the signal always meets the save in flight."""
    log = tmp_path / "stderr.log"
    with open(log, "w") as errors:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SLOW_SAVE,
                str(tmp_path),
                how,
                str(finish_timeout),
                str(seconds),
            ],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env={**os.environ, **(env or {})},
        )
    try:
        assert proc.stdout.readline() == "SAVING\n"
        if how == "wait-for-sigterm":
            proc.send_signal(15)
        if release:
            said = "SIGTERM arrived: finishing the background save"
            deadline = time.monotonic() + 60
            while said not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.02)
            (tmp_path / "release").touch()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, log.read_text()


def _temporaries(directory):
    return [p.name for p in Path(directory).iterdir() if ".tmp-" in p.name]


@pytest.mark.slow  # real processes
@pytest.mark.parametrize("how", ["exit", "return", "raise"])
def test_a_background_save_completes_when_the_script_ends_without_close(tmp_path, how):
    code, err = _slow_save(tmp_path, how)
    assert code == (1 if how == "raise" else 0), err
    assert (
        "the script ended without CheckpointManager.close(): finishing the background save " in err
    )
    assert "checkpoint step 2 saved to" in err
    m = CheckpointManager(tmp_path)
    state, step = m.load_latest(weights_only=False)
    assert step == 2 and state["slow"] == 7
    assert not _temporaries(tmp_path)
    assert "Fatal Python error" not in err and "Aborted" not in err


@pytest.mark.slow  # real processes
def test_a_save_that_outlasts_its_bound_at_exit_is_abandoned_and_reported(tmp_path):
    code, err = _slow_save(tmp_path, "exit", finish_timeout=0.5, seconds=5)
    assert code == 1, err
    assert "abandoned the background save of checkpoint step 2: it did not finish in 0.5 s" in err
    assert not _temporaries(tmp_path), "no temporary file is left"
    assert CheckpointManager(tmp_path).steps() == [1], "the previous checkpoint is intact"


@pytest.mark.slow  # real processes
def test_sigterm_finishes_the_save_within_the_launchers_grace(tmp_path):
    code, err = _slow_save(
        tmp_path,
        "wait-for-sigterm",
        seconds=60,
        env={"ELASTICRUN_SHUTDOWN_TIMEOUT": "20"},
        release=True,
    )
    assert code == -15, "the process still dies of SIGTERM"
    assert "SIGTERM arrived: finishing the background save of checkpoint step 2" in err
    assert CheckpointManager(tmp_path).load_latest(weights_only=False)[1] == 2
    assert not _temporaries(tmp_path)


@pytest.mark.slow  # real processes
def test_sigterm_with_too_little_grace_removes_the_temporary_file(tmp_path):
    code, err = _slow_save(
        tmp_path, "wait-for-sigterm", seconds=30, env={"ELASTICRUN_SHUTDOWN_TIMEOUT": "1.5"}
    )
    assert code == -15
    assert "SIGTERM arrived: finishing the background save of checkpoint step 2" in err
    assert "(for at most 0.5 s)" in err, "the grace less a margin to clean up"
    assert "abandoned the background save of checkpoint step 2" in err
    assert not _temporaries(tmp_path), "its temporary file was removed"
    assert CheckpointManager(tmp_path).steps() == [1]


def test_a_user_sigterm_handler_is_left_alone(tmp_path):
    import signal

    m = CheckpointManager(tmp_path)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        m.save({"w": torch.ones(3)}, 1, background=True)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        m.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    m.save({"w": torch.ones(3)}, 2, background=True)
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "taken while a save runs"
    m.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "given back once it is done"


# ---- concurrent managers, large steps, migrating plain torch.save files -----------------------


def test_a_checkpoint_pruned_while_it_is_read_sends_the_search_back_to_the_newest(
    tmp_path, monkeypatch
):
    import elastic_sampler._disk as disk

    m = CheckpointManager(tmp_path, keep_last=1)
    m.save(model_state(1), 1)
    other = CheckpointManager(tmp_path, keep_last=1)
    real = disk.read_verified
    calls = []

    def pruned_meanwhile(path, *args):
        calls.append(Path(path).name)
        if len(calls) == 1:  # another process saves step 2 and prunes step 1 under us
            other.save(model_state(2), 2)
        return real(path, *args)

    monkeypatch.setattr(disk, "read_verified", pruned_meanwhile)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning about it
        state, step = m.load_latest()
    assert step == 2 and state["step"] == 2
    assert calls == ["checkpoint-000000000001.pt", "checkpoint-000000000002.pt"]


PRUNING_WRITER = """
import sys, warnings, torch
from elastic_sampler import CheckpointManager
warnings.simplefilter("ignore")
m = CheckpointManager(sys.argv[1], keep_last=2)
first, count = int(sys.argv[2]), int(sys.argv[3])
for step in range(first, first + 2 * count, 2):
    m.save({"step": step, "w": torch.full((2000,), float(step))}, step)
print("DONE", flush=True)
"""


def _writers(tmp_path, firsts, count):
    return [
        subprocess.Popen(
            [sys.executable, "-c", PRUNING_WRITER, str(tmp_path), str(first), str(count)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for first in firsts
    ]


def _finish(procs):
    try:
        return [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow  # real processes
def test_load_latest_while_another_process_saves_and_prunes(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2)
    m.save({"step": 0, "w": torch.zeros(2000)}, 0)
    procs = _writers(tmp_path, [2], 150)
    seen = []
    try:
        while procs[0].poll() is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a save in progress: its checksum comes next
                state, step = m.load_latest()
            assert state["step"] == step and float(state["w"][0]) == step
            seen.append(step)
    finally:
        assert _finish(procs) == ["DONE\n"]
    assert seen == sorted(seen) and len(seen) > 1, seen


@pytest.mark.slow  # real processes
def test_two_managers_on_one_directory_leave_no_orphan_checksums(tmp_path):
    assert _finish(_writers(tmp_path, [1, 2], 100)) == ["DONE\n", "DONE\n"]
    names = {p.name for p in tmp_path.iterdir()}
    data = {n for n in names if n.endswith(".pt")}
    checksums = {n.removesuffix(".meta.json") for n in names if n.endswith(".meta.json")}
    assert checksums == data, "every checksum has its checkpoint and every checkpoint its checksum"
    assert not _temporaries(tmp_path)
    assert CheckpointManager(tmp_path).load_latest()[1] == max(CheckpointManager(tmp_path).steps())


def test_steps_of_a_trillion_and_more_sort_and_load(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2)
    for step in (999_999_999_999, 10**12, 10**15 + 3):
        m.save({"step": step}, step)
    assert m.steps() == [10**12, 10**15 + 3]
    assert m.path(10**12).name == "checkpoint-1000000000000.pt"
    state, step = m.load_latest()
    assert step == state["step"] == 10**15 + 3
    (tmp_path / "checkpoint-0000000000000005.pt").write_bytes(b"not ours")
    assert m.steps() == [10**12, 10**15 + 3], "a name this manager would not write is ignored"


def test_load_accepts_plain_torch_save_files_and_streams(tmp_path):
    import io

    plain = tmp_path / "old.pt"
    torch.save(model_state(3), plain)  # an existing checkpoint, no checksum beside it
    assert load_checkpoint(plain)["step"] == 3
    assert load_checkpoint(plain, model=torch.nn.Linear(4, 3))["step"] == 3
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint '.*old.pt' was saved from"):
        load_checkpoint(plain, model=torch.nn.Linear(5, 3))
    buffer = io.BytesIO()
    torch.save({"x": 2}, buffer)
    buffer.seek(0)
    assert load_checkpoint(buffer) == {"x": 2}
    with open(plain, "rb") as f:
        assert load_checkpoint(f)["step"] == 3
    with pytest.raises(CheckpointError, match="the stream 'BytesIO' holds no checkpoint"):
        load_checkpoint(io.BytesIO(b"junk"))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"junk")
    with pytest.raises(CheckpointError, match=r"'.*junk.pt' is neither a checkpoint with a chec"):
        load_checkpoint(junk)
    with pytest.raises(CheckpointError, match=r"checkpoint '.*missing.pt' does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    # Migrating: load the old file, save it as a managed step.
    m = CheckpointManager(tmp_path / "managed")
    m.save(load_checkpoint(plain), 3)
    assert m.load_latest()[1] == 3
