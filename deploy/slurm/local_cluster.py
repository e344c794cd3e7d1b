"""A real two-node Slurm cluster on one host, to try ``elasticrun.sbatch`` and to test it.

It runs Debian's ``munged``, ``slurmctld`` and one ``slurmd -N <node>`` per node. Each node
has its own port on 127.0.0.1. Everything lives in one directory: the configuration, the munge
key and socket, the state, the spool and the logs. Nothing is written to /etc, and no system
service is touched. Slurm's commands find the cluster through ``SLURM_CONF`` (:attr:`env`).
Run as root: slurmd starts each job's tasks as the submitting user.

    python deploy/slurm/local_cluster.py /tmp/cluster   # then, in another shell:
    export SLURM_CONF=/tmp/cluster/slurm.conf
    sbatch --nodes 2 deploy/slurm/elasticrun.sbatch train.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = "Debian's slurm-wlm and munge (apt-get install slurm-wlm munge)"


class ClusterError(RuntimeError):
    """The cluster cannot start here, or a Slurm command failed: the message says why."""


def missing() -> str | None:
    """Why this host cannot run the cluster, or None when it can."""
    absent = [d for d in (*DAEMONS, "sbatch", "scontrol") if shutil.which(d) is None]
    if absent:
        return f"{', '.join(absent)} not found: install {PACKAGES}"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs' tasks"
    return None


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalCluster:
    """``nodes`` Slurm nodes named n1, n2, ... on 127.0.0.1, each with ``cpus`` CPUs."""

    def __init__(self, root: Path, nodes: int = 2, cpus: int = 2) -> None:
        self.root = root.resolve()
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # ---- life -----------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Start munged, slurmctld and the slurmds; return once every node is idle."""
        reason = missing()
        if reason:
            raise ClusterError(reason)
        self._write_files()
        munge = self.root / "munge"
        try:
            self._spawn(
                "munged",
                ["munged", "--foreground", "--force", f"--socket={munge / 'socket'}"]
                + [f"--{k}-file={munge / k}" for k in ("key", "pid", "log", "seed")],
            )
            self._wait_for((munge / "socket").exists, timeout, "munged's socket")
            self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
            self._wait_for(self._all_idle, timeout, "every node idle in sinfo")
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 20.0) -> None:
        """Cancel every job and give Slurm a moment to end it, end the daemons (SIGTERM, then
        SIGKILL; slurmds first), then SIGKILL whatever still carries this cluster's SLURM_CONF
        (a job step's slurmstepd or task that outlived its slurmd)."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            subprocess.run(
                ["scancel", "--full", "--signal=KILL", f"--user={os.geteuid()}"],
                env=self.env,
                capture_output=True,
                timeout=10,
                check=False,
            )
            with contextlib.suppress(ClusterError):
                self._wait_for(lambda: not self.run(["squeue", "--noheader"]).strip(), 15, "")
        for name in sorted(self._procs, key=lambda n: (not n.startswith("slurmd"), n)):
            proc = self._procs[name]
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        self._procs.clear()
        for pid in self._strays():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _strays(self) -> list[int]:
        """Processes other than this one whose environment names this cluster's SLURM_CONF."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def pids(self) -> list[int]:
        """The daemons' process ids."""
        return [p.pid for p in self._procs.values()]

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- jobs -----------------------------------------------------------------------------

    def run(self, args: Sequence[str], timeout: float = 30.0) -> str:
        """Run a Slurm command against this cluster; its output, or ClusterError."""
        result = subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if result.returncode != 0:
            raise ClusterError(f"{' '.join(args)}: {result.stderr.strip() or result.stdout}")
        return result.stdout

    def submit(self, args: Sequence[str], env: dict[str, str] | None = None) -> int:
        """``sbatch --parsable ARGS`` with `env` added; the job's id."""
        result = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            raise ClusterError(f"sbatch {' '.join(args)}: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def cancel(self, job_id: int) -> None:
        """SIGKILL whatever of the job still runs (nothing if it has ended)."""
        subprocess.run(
            ["scancel", "--signal=KILL", "--full", str(job_id)],
            env=self.env,
            capture_output=True,
            timeout=30,
            check=False,
        )

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, NodeList, ...)."""
        text = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)])
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: int, timeout: float) -> dict[str, str]:
        """Wait until the job has ended; its last fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return fields
            if time.monotonic() > deadline:
                self.cancel(job_id)
                raise ClusterError(f"job {job_id} still {fields.get('JobState')} after {timeout} s")
            time.sleep(0.2)

    @staticmethod
    def processes(job_id: int) -> list[tuple[int, int, list[str]]]:
        """(pid, SLURM_NODEID, argv) of the job's task processes on this host, found by their
        environment (for killing one node's agent or worker by its id)."""
        found = []
        want = str(job_id).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                environ = dict(
                    v.split(b"=", 1)
                    for v in (entry / "environ").read_bytes().split(b"\0")
                    if b"=" in v
                )
            except OSError:
                continue
            if environ.get(b"SLURM_JOB_ID") == want and b"SLURM_NODEID" in environ:
                found.append((int(entry.name), int(environ[b"SLURM_NODEID"]), argv[:-1]))
        return found

    # ---- set-up ---------------------------------------------------------------------------

    def _write_files(self) -> None:
        munge = self.root / "munge"
        for d in (munge, self.root / "state", *(self.root / "spool" / n for n in self.nodes)):
            d.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o711)  # munged wants its socket's directory reachable, not writable
        key = munge / "key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o600)
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        r = self.root
        lines = [
            "ClusterName=elasticrun",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={munge / 'socket'}",
            "CredType=cred/munge",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd-%n.log'}",
            # No cgroups in a container: processes are tracked by their parents.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MpiDefault=none",
            "SwitchType=switch/none",
            # A node whose slurmd stops answering is DOWN after this long (seconds).
            "SlurmdTimeout=30",
        ]
        for node, port in zip(self.nodes, node_ports, strict=True):
            lines.append(
                f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={self.cpus} State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=local Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=YES"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / f"{name}.out").open("wb")
        self._procs[name] = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def _all_idle(self) -> bool:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                out = (self.root / f"{name}.out").read_text(errors="replace")[-2000:]
                raise ClusterError(f"{name} exited with {proc.returncode}:\n{out}")
        result = subprocess.run(
            ["sinfo", "--Node", "--noheader", "--format=%N %t"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in self.nodes)

    @staticmethod
    def _wait_for(ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("directory", type=Path, help="where the cluster keeps its files")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--for", dest="seconds", type=float, default=3600.0, help="then stop")
    args = p.parse_args()
    cluster = LocalCluster(args.directory, nodes=args.nodes)
    try:
        cluster.start()
    except ClusterError as e:
        print(f"local_cluster: {e}", file=sys.stderr)
        return 1
    print(f"export SLURM_CONF={cluster.conf}  # the cluster runs for {args.seconds:.0f} s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        time.sleep(args.seconds)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
