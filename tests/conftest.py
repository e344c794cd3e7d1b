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


class _PortTakenError(AssertionError):
    """etcd could not bind a port that was free when it was picked."""


def _post(url: str, body: dict[str, object], timeout: float = 5, token: str | None = None) -> dict:
    import json
    import urllib.request

    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **({"Authorization": token} if token else {})},
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


class EtcdServer:
    """A real etcd (Debian's etcd-server) on 127.0.0.1, free ports, a temporary data dir: alone,
    or a member `name` of a cluster (:class:`EtcdCluster` sets `cluster`)."""

    def __init__(
        self,
        data_dir: Path,
        enable_v2: bool,
        tls: dict[str, Path] | None = None,
        host: str = "127.0.0.1",
        name: str = "test",
        peer_host: str = "127.0.0.1",
        prefix: list[str] | None = None,
        flags: list[str] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.enable_v2 = enable_v2
        self.tls = tls  # {"cert", "key", "ca"}: serve clients over https
        self.host = host
        self.name = name
        self.peer_host = peer_host
        self.prefix = prefix or []  # runs it elsewhere (ip netns exec NAME)
        self.flags = flags or []  # more of etcd's flags
        self.cluster = ""  # --initial-cluster; empty: a cluster of this member alone
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False
        self._pick_ports()

    def _pick_ports(self) -> None:
        from elastic_launch.net import free_port

        # clients on `host`, peers on `peer_host`; below the ephemeral range (see free_port)
        self.port, self.peer_port = free_port(self.host), free_port(self.peer_host)
        host = self.host
        self.endpoint = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self.log = self.data_dir.parent / f"etcd-{self.port}.log"

    @property
    def peer_url(self) -> str:
        return f"http://{self.peer_host}:{self.peer_port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start etcd and wait until it is healthy. A port picked free can be taken before etcd
        binds it (another test's connection, a Slurm daemon): the first start then tries new
        ports, up to 3 times; a restart keeps its ports, as the tests' clients know them."""
        for attempt in range(3):
            try:
                self.launch()
                self.wait_healthy(timeout)
                self._started = True
                return
            except _PortTakenError:
                if self._started or attempt == 2:
                    raise
                shutil.rmtree(self.data_dir, ignore_errors=True)  # nothing of the failed start
                self._pick_ports()

    def launch(self) -> None:
        """Start the process (a cluster's members must all run before any is healthy)."""
        binary = shutil.which("etcd")
        assert binary, "etcd is not installed: `make test` installs Debian's etcd-server"
        scheme = "https" if self.tls else "http"
        args = [
            binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            f"{scheme}://{self.endpoint}",
            "--advertise-client-urls",
            f"{scheme}://{self.endpoint}",
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            self.cluster or f"{self.name}={self.peer_url}",
        ]
        if self.enable_v2:
            args.append("--enable-v2")
        args += self.flags
        if self.tls:
            args += ["--cert-file", str(self.tls["cert"]), "--key-file", str(self.tls["key"])]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, *args], stdout=log, stderr=subprocess.STDOUT
            )

    def wait_healthy(self, timeout: float) -> None:
        import ssl
        import time
        import urllib.request

        assert self.proc is not None
        scheme = "https" if self.tls else "http"
        context = ssl.create_default_context(cafile=str(self.tls["ca"])) if self.tls else None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                url = f"{scheme}://{self.endpoint}/health"
                with urllib.request.urlopen(url, timeout=1, context=context) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                log = self.log.read_text()[-2000:]
                if "address already in use" in log:
                    raise _PortTakenError(f"etcd exited: {log}")
                raise AssertionError(f"etcd exited: {log}")
            time.sleep(0.05)
        raise AssertionError(f"etcd did not become healthy in {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a member a test stopped ends too
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a machine's loss would end it."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def status(self) -> dict:
        """etcd's own status of this member (its id, the leader's, the revision)."""
        return _post(f"http://{self.endpoint}/v3/maintenance/status", {}, timeout=2)

    def gateway(self, path: str, body: dict[str, object], token: str | None = None) -> dict:
        """A call to etcd's v3 JSON gateway (used to set up users and auth)."""
        return _post(f"http://{self.endpoint}/v3/{path}", body, token=token)


class EtcdCluster:
    """A real etcd cluster of `size` members on loopback, as etcd is deployed: distinct client
    and peer ports, one --initial-cluster. `endpoint` names every member, first to last."""

    def __init__(
        self,
        root: Path,
        size: int = 3,
        enable_v2: bool = False,
        where: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        """`where`: EtcdServer's host, peer_host and prefix of some members (by index)."""
        self.members = [
            EtcdServer(root / f"m{i}" / "data", enable_v2, name=f"m{i}", **(where or {}).get(i, {}))
            for i in range(size)
        ]
        for m in self.members:
            m.data_dir.parent.mkdir(parents=True, exist_ok=True)

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 60.0) -> None:
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.cluster = cluster
            m.launch()
        for m in self.members:
            m.wait_healthy(timeout)
            m._started = True
        self.leader()  # elected

    def leader(self, timeout: float = 30.0) -> int:
        """The index of the member that leads now (waits for an election)."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, m in enumerate(self.members):
                if m.proc is None:
                    continue
                try:
                    status = m.status()
                except OSError:
                    continue
                if status.get("leader") and status["leader"] == status["header"]["member_id"]:
                    return i
            time.sleep(0.05)
        raise AssertionError(f"no etcd member led within {timeout} s")

    def lead(self, i: int) -> None:
        """Make member `i` the leader (etcd's leadership transfer, asked of the leader)."""
        import time

        leader = self.leader()
        if leader == i:
            return
        target = self.members[i].status()["header"]["member_id"]
        self.members[leader].gateway("maintenance/transfer-leadership", {"targetID": target})
        deadline = time.monotonic() + 30
        while self.leader() != i:
            assert time.monotonic() < deadline, f"member {i} did not take the lead"
            time.sleep(0.05)

    def compact(self, via: int) -> int:
        """Compact the cluster's history up to the current revision, asking member `via`:
        the revision."""
        member = self.members[via]
        revision = int(member.status()["header"]["revision"])
        member.gateway("kv/compaction", {"revision": revision, "physical": True})
        return revision

    def stop(self) -> None:
        for m in self.members:
            m.stop()


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
    from elastic_launch.rendezvous.embedded_server import EmbeddedServer

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
