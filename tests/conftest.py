"""Shared fixtures: unique shared-memory paths, processes that are always ended, the fake NVML."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def shm_path() -> Iterator[object]:
    """A factory of unique /dev/shm paths; whatever is left at them is removed afterwards."""
    made: list[str] = []

    def make(name: str = "t") -> str:
        path = f"/dev/shm/elastic-pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}"
        made.append(path)
        return path

    yield make
    for path in made:
        if os.path.exists(path):
            os.unlink(path)


class Processes:
    """Starts Python snippets as child processes and kills every one of them at teardown."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def python(self, code: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.started.append(proc)
        return proc

    def end_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()


@pytest.fixture
def procs() -> Iterator[Processes]:
    p = Processes()
    yield p
    p.end_all()


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake libnvidia-ml.so.1 (cpp/tests/fake_nvml), compiled for this test session."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler is needed to build the fake NVML library"
    out = tmp_path_factory.mktemp("nvml") / "libnvidia-ml.so.1"
    source = REPO / "cpp" / "tests" / "fake_nvml" / "fake_nvml.c"
    subprocess.run(
        [compiler, "-std=c99", "-shared", "-fPIC", "-O1", "-o", str(out), str(source)],
        check=True,
        timeout=120,
    )
    return out


@pytest.fixture
def nvml_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file whose lines script the fake NVML's answers (see fake_nvml.c)."""
    path = tmp_path / "nvml-script"
    path.write_text("")
    monkeypatch.setenv("ELASTIC_FAKE_NVML_SCRIPT", str(path))
    return path
