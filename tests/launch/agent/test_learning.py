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


@dataclass
class FakeSpawner:
    """Settles each heir at once: as asked, or given up for the names in `unsafe`."""

    unsafe: set[str] = field(default_factory=set)
    asked: list[learned.ImportPlan] = field(default_factory=list)
    differ: set[str] = field(default_factory=set)
    learning: bool = False
    zygote: object = field(
        default_factory=lambda: SimpleNamespace(ready=True, learned=None, pid=1, modules=["torch"])
    )
    _done: list[Settled] = field(default_factory=list)

    def learn(self, plan: learned.ImportPlan) -> bool:
        self.asked.append(plan)
        bad = {m: "its import starts a thread" for m in plan.modules if m in self.unsafe}
        account = {"loaded": [m for m in plan.modules if m not in bad], "left_out": bad}
        account |= {"excluded": list(bad), "failed": 0, "holds": []}
        self._done.append(Settled(plan, account, not bad, 4242))
        return True

    def settled(self) -> list[Settled]:
        done, self._done = self._done, []
        return done


class FakeGroup:
    def __init__(self, tmp: Path, spawner: FakeSpawner, log_dir: str | None = None) -> None:
        config = SimpleNamespace(preload=["auto"], log_dir=log_dir)
        entrypoint = Entrypoint(Kind.SCRIPT, str(tmp / "train.py"))
        layout = SimpleNamespace(run_dir=str(tmp))
        self.context = SimpleNamespace(config=config, entrypoint=entrypoint, layout=layout)
        self.spawner = spawner
        self.workers = [SimpleNamespace(local_rank=0, rank_dir=str(tmp / "0"))]
        (tmp / "0").mkdir()
        self.stepped = 1

    def steps(self) -> dict[int, int]:
        return {0: self.stepped}


class FakeEvents:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict]] = []

    def emit(self, name: str, attempt: int, **data: object) -> None:
        self.emitted.append((name, data))


def write(tmp: Path, modules: list[str]) -> None:
    path = learned.imports_file(str(tmp / "0"))
    Path(path).write_text(json.dumps({"modules": modules, "env_changed": {}}))
    os.utime(path, ns=(os.stat(path).st_mtime_ns + 1,) * 2)  # a new write, as the agent sees it


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
    learning.poll(0)
    assert len(spawner.asked) == 1, "nothing new: no heir"


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
        learning.poll(0)
    assert spawner.asked == []
    assert caplog.text.count("cannot be used") == 1, caplog.text


def test_a_worker_that_keeps_writing_new_names_gets_a_bounded_number_of_heirs(tmp_path):
    spawner = FakeSpawner()
    group = FakeGroup(tmp_path, spawner)
    events = FakeEvents()
    learning = Learning(group, events)  # type: ignore[arg-type]
    for i in range(200):
        write(tmp_path, [f"pkg_{i}"])
        learning.poll(0)
    assert len(spawner.asked) == MAX_HEIRS
    assert [n for n, _ in events.emitted] == ["preload_learned"] * MAX_HEIRS


def test_an_heir_given_up_is_tried_again_without_what_it_left_out_a_bounded_number_of_times(
    tmp_path, caplog
):
    spawner = FakeSpawner(unsafe={"threaded"})
    group = FakeGroup(tmp_path, spawner, log_dir=str(tmp_path / "logs"))
    (tmp_path / "logs").mkdir()
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
        write(tmp_path, [f"bad_{i}"])
        for _ in range(3):
            learning.poll(0)
    assert len(spawner.asked) <= 2 + MAX_ROUNDS


def test_a_zygote_without_torch_learns_torch_and_its_lazy_imports_before_the_workers_say(
    tmp_path,
):
    """A wrapper hid torch from the script's text: the first replacement should not wait for
    the workers' list to be learned."""
    spawner = FakeSpawner()
    spawner.zygote = SimpleNamespace(ready=True, learned=None, pid=1, modules=[])
    group = FakeGroup(tmp_path, spawner)
    group.stepped = 0
    learning = Learning(group, FakeEvents())  # type: ignore[arg-type]
    for _ in range(3):
        learning.poll(0)
    assert [p.modules for p in spawner.asked] == [AHEAD], "once, before any step"
    group.stepped = 1
    write(tmp_path, ["torch", "transformers"])
    learning.poll(0)
    assert spawner.asked[-1].modules == ("transformers",), "torch was learned ahead"


def test_a_zygote_that_holds_torch_learns_nothing_ahead(tmp_path):
    spawner = FakeSpawner()
    group = FakeGroup(tmp_path, spawner)
    group.stepped = 0
    learning = Learning(group, FakeEvents())  # type: ignore[arg-type]
    for _ in range(3):
        learning.poll(0)
    assert spawner.asked == []
