"""The agent's side of learning imports, on fakes: what it reads from a worker (hostile files
included), when it asks for an heir, and how far a worker that keeps writing can push it."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from elastic_launch import learned
from elastic_launch.agent.learning import AHEAD, MAX_HEIRS, MAX_ROUNDS, Learning
from elastic_launch.processes.entrypoint import Entrypoint, Kind
from elastic_launch.processes.spawn import Settled


def zygote(modules: list[str] | None = None, ready: bool = True) -> SimpleNamespace:
    held = ["torch"] if modules is None else modules
    return SimpleNamespace(ready=ready, learned=None, pid=1, modules=held)


@dataclass
class FakeSpawner:
    """Settles each heir at once: as asked, or given up for the names in `unsafe`."""

    unsafe: set[str] = field(default_factory=set)
    asked: list[learned.ImportPlan] = field(default_factory=list)
    idle: list[bool] = field(default_factory=list)
    differ: set[str] = field(default_factory=set)
    learning: bool = False
    refuse: bool = False  # learn() says it cannot now
    zygote: SimpleNamespace = field(default_factory=zygote)
    chosen: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(kept=None))
    _done: list[Settled] = field(default_factory=list)

    def learn(self, plan: learned.ImportPlan, idle_cpu: bool = True) -> bool:
        if self.refuse:
            return False
        self.asked.append(plan)
        self.idle.append(idle_cpu)
        bad = {m: "its import starts a thread" for m in plan.modules if m in self.unsafe}
        account = {"loaded": [m for m in plan.modules if m not in bad], "left_out": bad}
        account |= {"excluded": list(bad), "failed": 0, "holds": []}
        self._done.append(Settled(plan, account, not bad, 4242))
        return True

    def settled(self) -> list[Settled]:
        done, self._done = self._done, []
        return done


class FakeGroup:
    def __init__(self, tmp: Path, spawner: FakeSpawner, workers: int = 1) -> None:
        log_dir = tmp / "logs"
        log_dir.mkdir()
        config = SimpleNamespace(preload=["auto"], log_dir=str(log_dir))
        entrypoint = Entrypoint(Kind.SCRIPT, str(tmp / "train.py"))
        layout = SimpleNamespace(run_dir=str(tmp))
        self.context = SimpleNamespace(config=config, entrypoint=entrypoint, layout=layout)
        self.spawner = spawner
        self.workers = [
            SimpleNamespace(local_rank=i, rank_dir=str(tmp / str(i))) for i in range(workers)
        ]
        for w in self.workers:
            Path(w.rank_dir).mkdir()
        self.stepped = 1

    def steps(self) -> dict[int, int]:
        return {w.local_rank: self.stepped for w in self.workers}


class FakeEvents:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict]] = []

    def emit(self, name: str, attempt: int, **data: object) -> None:
        self.emitted.append((name, data))


def write(tmp: Path, modules: list[str], rank: int = 0, changed: dict | None = None) -> None:
    path = learned.imports_file(str(tmp / str(rank)))
    Path(path).write_text(json.dumps({"modules": modules, "env_changed": changed or {}}))


def test_names_are_read_once_the_worker_stepped_and_asked_for_once(tmp_path):
    spawner = FakeSpawner()
    group = FakeGroup(tmp_path, spawner)
    learning = Learning(group, FakeEvents())  # type: ignore[arg-type]
    group.stepped = 0
    write(tmp_path, ["torch", "torch._dynamo"])
    learning.poll(0)
    assert spawner.asked == [], "not before its first step"
    group.stepped = 1
    learning.poll(0)
    learning.poll(0)
    assert [p.modules for p in spawner.asked] == [("torch", "torch._dynamo")]
    assert spawner.idle == [True], "learned on idle CPU"
    write(tmp_path, ["torch", "torch._dynamo", "torch._inductor"])
    learning.poll(0)
    assert len(spawner.asked) == 1, "read again only after step 100"
    group.stepped = 100
    learning.poll(0)
    assert spawner.asked[-1].modules == ("torch._inductor",)


def test_nothing_is_read_or_lost_while_the_zygote_is_not_ready_or_cannot_learn(tmp_path):
    spawner = FakeSpawner(zygote=zygote(ready=False))
    group = FakeGroup(tmp_path, spawner)
    learning = Learning(group, FakeEvents())  # type: ignore[arg-type]
    write(tmp_path, ["torch", "transformers"])
    learning.poll(0)
    spawner.zygote.ready, spawner.refuse = True, True
    learning.poll(0)
    assert spawner.asked == []
    spawner.refuse = False
    learning.poll(0)
    assert [p.modules for p in spawner.asked] == [("torch", "transformers")]


def test_a_hostile_imports_file_is_ignored_and_said_once(tmp_path, caplog):
    spawner = FakeSpawner()
    group = FakeGroup(tmp_path, spawner)
    learning = Learning(group, FakeEvents())  # type: ignore[arg-type]
    path = Path(learned.imports_file(str(tmp_path / "0")))
    os.mkfifo(path)  # a reader that opened it plainly would block here
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            learning.poll(0)
        path.unlink()
        path.write_text("not json at all")
        group.stepped = 100
        learning.poll(0)
    assert spawner.asked == []
    assert caplog.text.count("cannot be used") == 1, caplog.text


def test_a_worker_that_keeps_rewriting_its_file_is_read_at_most_twice(tmp_path, monkeypatch):
    spawner = FakeSpawner()
    group = FakeGroup(tmp_path, spawner)
    learning = Learning(group, FakeEvents())  # type: ignore[arg-type]
    reads = []
    real = learned.read
    monkeypatch.setattr(learned, "read", lambda p: reads.append(p) or real(p))
    for i in range(200):
        write(tmp_path, [f"pkg_{i}"])
        group.stepped = 1 + i
        learning.poll(0)
    assert len(reads) == 2 and len(spawner.asked) == 2


def test_workers_writing_new_names_get_a_bounded_number_of_heirs(tmp_path):
    spawner = FakeSpawner()
    group = FakeGroup(tmp_path, spawner, workers=20)
    events = FakeEvents()
    learning = Learning(group, events)  # type: ignore[arg-type]
    for rank in range(20):
        write(tmp_path, [f"pkg_{rank}"], rank)
        learning.poll(0)
    for _ in range(20):
        learning.poll(0)
    assert len(spawner.asked) == MAX_HEIRS
    assert [n for n, _ in events.emitted] == ["preload_learned"] * MAX_HEIRS


def test_two_workers_with_different_values_of_a_variable_make_it_differ_always(tmp_path):
    spawner = FakeSpawner()
    group = FakeGroup(tmp_path, spawner, workers=2)
    learning = Learning(group, FakeEvents())  # type: ignore[arg-type]
    write(tmp_path, ["a_pkg"], 0, {"FLAG": learned.digest("0")})
    write(tmp_path, ["a_pkg"], 1, {"FLAG": learned.digest("1")})
    learning.poll(0)
    assert spawner.asked[0].differ["FLAG"] == learned.ALWAYS


def test_an_heir_given_up_is_tried_again_without_what_it_left_out_a_bounded_number_of_times(
    tmp_path, caplog
):
    spawner = FakeSpawner(unsafe={"threaded"})
    group = FakeGroup(tmp_path, spawner, workers=12)
    learning = Learning(group, FakeEvents())  # type: ignore[arg-type]
    write(tmp_path, ["torch", "threaded"])
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            learning.poll(0)
    assert [p.modules for p in spawner.asked] == [("torch", "threaded"), ("torch",)]
    assert caplog.text.count("'threaded' is left out") == 1
    kept = learned.read_kept(learning.kept or "", learning.key)
    assert kept is not None and kept.modules == ("torch",) and "threaded" in kept.skip
    spawner.unsafe = {f"bad_{i}" for i in range(10)}
    for i in range(10):
        write(tmp_path, [f"bad_{i}"], 1 + i)
        for _ in range(3):
            learning.poll(0)
    assert len(spawner.asked) <= 2 + MAX_ROUNDS


def test_a_zygote_without_torch_learns_torch_and_its_lazy_imports_before_the_workers_say(
    tmp_path,
):
    """A wrapper hid torch from the script's text: the first replacement should not wait for
    the workers' list to be learned. What was learned ahead is not kept for the next run."""
    spawner = FakeSpawner(zygote=zygote(modules=[]))
    group = FakeGroup(tmp_path, spawner)
    group.stepped = 0
    learning = Learning(group, FakeEvents())  # type: ignore[arg-type]
    for _ in range(3):
        learning.poll(0)
    assert [p.modules for p in spawner.asked] == [AHEAD], "once, before any step"
    assert spawner.idle == [False], "at the normal policy: it races the first failure"
    group.stepped = 1
    write(tmp_path, ["transformers"])
    learning.poll(0)
    learning.poll(0)  # its heir settles
    assert spawner.asked[-1].modules == ("transformers",)
    kept = learned.read_kept(learning.kept or "", learning.key)
    assert kept is not None and kept.modules == ("transformers",)


def test_a_zygote_that_holds_torch_learns_nothing_ahead(tmp_path):
    spawner = FakeSpawner()
    group = FakeGroup(tmp_path, spawner)
    group.stepped = 0
    learning = Learning(group, FakeEvents())  # type: ignore[arg-type]
    for _ in range(3):
        learning.poll(0)
    assert spawner.asked == []


def test_what_is_kept_is_written_over_whatever_a_worker_put_there(tmp_path):
    spawner = FakeSpawner()
    group = FakeGroup(tmp_path, spawner)
    learning = Learning(group, FakeEvents())  # type: ignore[arg-type]
    node_file = Path(learning.node_file)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("untouched")
    node_file.symlink_to(elsewhere)
    for name in os.listdir(tmp_path):  # what a worker could guess of a temporary name
        os.mkfifo(tmp_path / f"{name}.tmp")
    write(tmp_path, ["torch"])
    learning.poll(0)
    learning.poll(0)  # its heir settles: what it learned is kept
    assert elsewhere.read_text() == "untouched", "the link is replaced, not followed"
    assert learned.read_kept(str(node_file), learning.key) is not None
