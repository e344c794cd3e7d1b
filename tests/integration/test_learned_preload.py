"""Learned imports for real: a DDP job started through a wrapper (runpy), whose script reaches
torch, DDP and an installed package only inside a function, so that --preload auto's reading of
the wrapper finds none of them. Once the workers step, the zygote's heir imports what they
hold; the workers of the restart fork from it (their parent is the heir, whose own account
names all three); a package that starts a thread on import is left out, named once; the same
job started again with the same --log-dir forks its first workers from a zygote that holds what
the first run learned. And a hot spare starts before the workers' second step."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from launcher_util import alive, held, release, start, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from classic_example import EXAMPLE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TRAIN = """
import os, sys, time


def main():
    import torch
    import torch.distributed as dist
    import learned_pkg.tool
    import threaded_pkg
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = os.environ["LEARN_OUT"]
    for step in range(1, 100000):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        with open(os.path.join(out, f"{os.getpid()}.steps"), "a") as f:
            f.write(f"{step}\\n")
        if os.path.exists(os.path.join(out, "stop")):
            dist.barrier()
            return
        time.sleep(0.02)


if __name__ == "__main__":
    main()
"""

WRAPPER = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
runpy.run_module("train_impl", run_name="__main__")
"""


def installed(site: Path) -> None:
    """learned_pkg (with a submodule) and threaded_pkg, as an installed distribution's."""
    (site / "learned_pkg").mkdir(parents=True)
    (site / "learned_pkg" / "__init__.py").write_text("")
    (site / "learned_pkg" / "tool.py").write_text("VALUE = 1\n")
    (site / "threaded_pkg").mkdir()
    (site / "threaded_pkg" / "__init__.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True, name='poller').start()\n"
    )
    info = site / "learned_test_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: learned-test-dist\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("learned_pkg\nthreaded_pkg\n")


class Job:
    def __init__(self, tmp: Path, name: str) -> None:
        self.out = tmp / name
        self.out.mkdir()
        self.events_file = self.out / "events.jsonl"
        self.log = self.out / "console.log"
        args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
        args += ["--log-dir", str(tmp / "logs"), "--events-file", str(self.events_file)]
        args += [str(tmp / "wrap" / "run.py"), str(tmp / "job")]
        env = {"PYTHONPATH": str(tmp / "site"), "LEARN_OUT": str(self.out)}
        self.proc = start(args, env=env, cwd=str(tmp), log=self.log)

    def events(self, name: str) -> list[dict]:
        if not self.events_file.exists():
            return []
        found = [json.loads(line) for line in self.events_file.read_text().splitlines()]
        return [e for e in found if e["event"] == name]

    def stepping(self) -> set[int]:
        return {int(p.stem) for p in self.out.glob("*.steps") if p.read_text()}

    def finish(self) -> str:
        (self.out / "stop").touch()
        try:
            assert self.proc.wait(120) == 0, self.log.read_text()[-3000:]
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        return self.log.read_text()


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    installed(tmp_path / "site")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train_impl.py").write_text(TRAIN)
    (tmp_path / "wrap").mkdir()
    (tmp_path / "wrap" / "run.py").write_text(WRAPPER)
    return tmp_path


def test_a_wrapped_jobs_restart_forks_from_a_zygote_that_learned_its_imports(tree: Path):
    job = Job(tree, "first")
    try:

        def workers_list_learned() -> list[dict]:
            return [e for e in job.events("preload_learned") if "learned_pkg.tool" in e["holds"]]

        assert wait_for(workers_list_learned, 180), job.log.read_text()[-3000:]
        ahead, learned = job.events("preload_learned")[0], workers_list_learned()[0]
        assert "torch" in ahead["holds"], "torch learned ahead: the wrapper hid it"
        assert not learned["kept"]
        holds = set(learned["holds"])
        assert {"torch", "torch.nn.parallel.distributed", "learned_pkg.tool"} <= holds
        assert "threaded_pkg" in learned["left_out"] and "threaded_pkg" not in holds
        first = job.stepping()
        os.kill(min(first), signal.SIGKILL)
        assert wait_for(lambda: len(job.stepping() - first) == 2, 120), job.log.read_text()
        for pid in job.stepping() - first:
            assert parent_of(pid) == learned["pid"], "forked from the heir"
        text = job.finish()
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
    assert text.count("'threaded_pkg' is left out of the zygote") == 1, text[-3000:]
    assert "starts a thread" in text

    again = Job(tree, "again")
    try:
        assert wait_for(lambda: len(again.stepping()) == 2, 180), again.log.read_text()[-3000:]
        assert wait_for(lambda: again.events("preload_learned"), 60), again.log.read_text()
        kept = again.events("preload_learned")
        assert kept[0]["kept"], "the first zygote imported what the first run learned"
        assert {"torch.nn.parallel.distributed", "learned_pkg.tool"} <= set(kept[0]["holds"])
        assert "threaded_pkg" not in kept[0]["holds"]
        for pid in again.stepping():
            assert parent_of(pid) == kept[0]["pid"], "the first workers fork from it"
        again.finish()
    finally:
        if again.proc.poll() is None:
            os.killpg(again.proc.pid, signal.SIGKILL)


def test_a_hot_spare_starts_before_the_workers_second_step(tmp_path: Path):
    gates = tmp_path / "gates"
    log, events_file = tmp_path / "console.log", tmp_path / "events.jsonl"
    args = ["--standalone", "--nproc-per-node", "2", "--hot-spares", "1"]
    args += ["--events-file", str(events_file), str(EXAMPLE), "--out", str(tmp_path / "f.json")]
    proc = start([*args, *held(gates, 2)], cwd=str(tmp_path), log=log)

    def spare_started() -> bool:
        text = events_file.read_text() if events_file.exists() else ""
        return '"hot_spare_started"' in text

    try:
        assert wait_for(spare_started, 120), log.read_text()[-3000:]
        release(gates, 2)
        assert proc.wait(180) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    time.sleep(0)
    assert not alive(proc.pid)
