"""Shared fixtures: unique shared-memory paths, processes that are always ended, the fake NVML."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from etcd_servers import EtcdCluster, EtcdServer

REPO = Path(__file__).resolve().parent.parent
#: Fixtures that start real servers: a test that uses one is an integration test.
_SLOW_FIXTURES = {
    "etcd",
    "etcd_v2",
    "etcd_tls",
    "etcd_v6",
    "etcd_shared",
    "etcd_cluster",
    "etcd_clusters",
}
#: Parameters for fixtures that pick a store by name (`request.getfixturevalue`).
ETCD_PARAMS = [
    pytest.param("etcd", marks=pytest.mark.slow),
    pytest.param("etcd-v2", marks=pytest.mark.slow),
]


#: Files that take the longest (mostly waiting: phases that must outlast a limit, clusters that
#: start): run first, so that `-n 2 --dist loadfile` does not end with one of them alone.
LONGEST_FIRST = (
    "integration/test_hang_detection.py",
    "faults/test_store_faults.py",
    "core/test_wheel.py",
    "deploy/test_slurm.py",
    "compat/test_local_elastic_agent.py",
    "faults/test_faults.py",
    "compat/test_p2p.py",
)


def _longest_first(item: pytest.Item) -> int:
    path = Path(str(item.fspath)).as_posix()
    for i, name in enumerate(LONGEST_FIRST):
        if path.endswith(name):
            return i
    return len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`slow` marks the real thing: everything under integration/ and faults/ (real launchers,
    workers, clusters, injected faults) and every test that starts an etcd server. `pytest -m
    "not slow"` is the unit suite. The longest files go first (:data:`LONGEST_FIRST`)."""
    items.sort(key=_longest_first)  # stable: the rest keep their order
    real = (REPO / "tests" / "integration", REPO / "tests" / "faults")
    for item in items:
        path = Path(str(item.fspath))
        if any(d in path.parents for d in real) or _SLOW_FIXTURES & set(
            getattr(item, "fixturenames", ())
        ):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    """An output directory for real jobs; the workers they record there (`*.pid`) are killed
    at teardown, whatever the test did."""
    d = tmp_path / "out"
    d.mkdir()
    yield d
    for p in d.glob("*.pid"):
        text = p.read_text().strip()
        if text:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(text), signal.SIGKILL)


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


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """mount(size, name): a tmpfs of `size` bytes at tmp_path/name, unmounted after the test;
    the test is skipped where it cannot be mounted (it needs root)."""
    mounts: list[Path] = []

    def mount(size: int, name: str = "disk") -> Path:
        where = tmp_path / name
        where.mkdir()
        made = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            check=False,
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip()}): needs root")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def embedded() -> Iterator[tuple[str, str]]:
    """The embedded rendezvous service, in this process on a free port: (endpoint, token)."""
    from elastic_launch.rendezvous.embedded.server import EmbeddedServer

    server = EmbeddedServer("127.0.0.1", 0, token="t")
    yield f"127.0.0.1:{server.port}", "t"
    server.close()


@pytest.fixture
def etcd_class() -> type[EtcdServer]:
    """The class itself, for a test of how it starts (conftest is not importable by name)."""
    return EtcdServer


def _etcd(where: Path, **kw: object) -> Iterator[EtcdServer]:
    """The one way the fixtures start an etcd: started here, stopped after the test (each in
    a data directory of its own, should a test use two)."""
    data = where / f"etcd-data-{uuid.uuid4().hex[:8]}"
    server = EtcdServer(data, **kw)  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_v6(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd with both APIs serving clients on the IPv6 loopback, [::1]."""
    yield from _etcd(tmp_path, enable_v2=True, host="::1")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd (v3 API only, like etcd 3.6) for one test."""
    yield from _etcd(tmp_path, enable_v2=False)


@pytest.fixture(scope="module")
def etcd_shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd (both APIs) for a module whose tests each take their own run ids."""
    yield from _etcd(tmp_path_factory.mktemp("etcd"), enable_v2=True)


@pytest.fixture
def etcd_small(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd (v3) whose database may hold 1 MiB (--quota-backend-bytes): its NOSPACE
    alarm is a few writes away."""
    yield from _etcd(tmp_path, enable_v2=False, flags=["--quota-backend-bytes", "1048576"])


@pytest.fixture
def etcd_v2(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd serving the v2 API too (--enable-v2)."""
    yield from _etcd(tmp_path, enable_v2=True)


@pytest.fixture
def etcd_clusters(tmp_path: Path) -> Iterator[Callable[..., EtcdCluster]]:
    """make(size=3, where=None): fresh etcd clusters serving the v2 API too (see
    :class:`EtcdCluster`), started, and stopped after the test."""
    made: list[EtcdCluster] = []

    def make(size: int = 3, where: dict[int, dict[str, Any]] | None = None) -> EtcdCluster:
        cluster = EtcdCluster(tmp_path / f"etcd-cluster-{len(made)}", size, True, where)
        made.append(cluster)
        cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.stop()


@pytest.fixture
def etcd_cluster(etcd_clusters: Callable[..., EtcdCluster]) -> EtcdCluster:
    """A fresh 3-member etcd cluster on loopback, serving the v2 API too."""
    return etcd_clusters()


@pytest.fixture(scope="module")
def etcd_cluster_shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One 3-member etcd cluster for a module whose tests each use keys of their own (or
    remove theirs): a cluster costs three processes and an election to start."""
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd-cluster"), 3, enable_v2=True)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throwaway CA and a certificate it signed for 127.0.0.1 and localhost (with the
    client-auth use too: every node of a job presents the same one): {"cert", "key", "ca"}."""
    d = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=elasticrun-test-ca",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    )
    (d / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
    )
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return {"cert": d / "server.pem", "key": d / "server.key", "ca": d / "ca.pem"}


@pytest.fixture
def etcd_tls(tmp_path: Path, tls_files: dict[str, Path]) -> Iterator[EtcdServer]:
    """etcd serving clients over TLS, with a certificate from a throwaway CA."""
    yield from _etcd(tmp_path, enable_v2=False, tls=tls_files)
