"""Real etcd servers for the tests and the benchmarks: one member (Debian's etcd-server) on free
ports with a temporary data dir, or a cluster of members on loopback, as etcd is deployed."""

from __future__ import annotations

import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any


class _PortTakenError(AssertionError):
    """etcd could not bind a port that was free when it was picked."""


def _post(url: str, body: dict[str, object], timeout: float = 5, token: str | None = None) -> dict:
    import json

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

    def restart_empty(self) -> None:
        """Stopped, its data lost, started again with the same flags (a disk that was lost,
        a pod without a volume): the same cluster id and member id, every key gone."""
        self.stop()
        shutil.rmtree(self.data_dir)
        self.start()

    def status(self) -> dict:
        """etcd's own status of this member (its id, the leader's, the revision)."""
        return _post(f"http://{self.endpoint}/v3/maintenance/status", {}, timeout=2)

    def watchers(self) -> int:
        """How many watches this member serves (its metric etcd_debugging_mvcc_watcher_total)."""
        with urllib.request.urlopen(f"http://{self.endpoint}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("etcd_debugging_mvcc_watcher_total "):
                    return int(float(line.split()[1]))
        raise AssertionError(f"etcd at {self.endpoint} reports no watcher count")

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
