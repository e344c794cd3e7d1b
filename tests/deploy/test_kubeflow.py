"""deploy/kubernetes/pytorchjob.yaml, pytorchjob-c10d.yaml and trainjob.yaml: Kubeflow's
PyTorchJob (training operator; over etcd, and over its default c10d rendezvous) and TrainJob
(Trainer). Each is validated against its CRD's schema, kept in deploy/kubernetes/schemas/ with
its source noted, and its pod parts against Kubernetes' own schemas. Then elasticrun runs on
two local "pods" (processes) with exactly the environment each operator sets from the
manifest, and the job forms and completes (over c10d, with its first pod killed and started
again, as the operator does)."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from elastic_launch.rendezvous.embedded.succession import standing_by
from launcher_util import free_port, listening, wait_for
from test_manifests import validate

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
EXAMPLE = ROOT / "examples" / "train_ddp.py"
TRAIN = ["--samples", "64", "--image-size", "8", "--classes", "4", "--batch-size", "16"]
TRAIN += ["--epochs", "1"]
#: Each manifest (a kind, or a kind/variant) and its file; a kind's schema has its first file's name.
KUBEFLOW = {
    "PyTorchJob": "pytorchjob.yaml",
    "PyTorchJob/c10d": "pytorchjob-c10d.yaml",
    "TrainJob": "trainjob.yaml",
}


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d]


def the(manifest: str) -> dict:
    kind = manifest.split("/", maxsplit=1)[0]
    (doc,) = [d for d in documents(KUBEFLOW[manifest]) if d["kind"] == kind]
    return doc


def schema_errors(doc: dict) -> list[str]:
    schema = yaml.safe_load((KUBERNETES / "schemas" / KUBEFLOW[doc["kind"]]).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


# ---- the operators' environment, from their sources' facts ------------------------------------


def pytorchjob_env(job: dict, host: str) -> dict[str, str]:
    """What training-operator (pkg/controller.v1/pytorch/elastic.go, envvar.go) sets in each
    Worker pod of an elastic PyTorchJob; `host` stands for rdzvHost, a name a pod resolves."""
    policy = job["spec"]["elasticPolicy"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    env = {"PYTHONUNBUFFERED": "0"}
    port = policy.get("rdzvPort")
    if port is None:  # the Worker's `pytorch` container's port named pytorchjob-port
        (c,) = [c for c in worker["template"]["spec"]["containers"] if c["name"] == "pytorch"]
        (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "pytorchjob-port"]
    env["PET_RDZV_ENDPOINT"] = f"{host}:{port}"
    env["PET_RDZV_BACKEND"] = policy.get("rdzvBackend", "c10d")
    if "minReplicas" in policy or "maxReplicas" in policy:
        env["PET_NNODES"] = f"{policy['minReplicas']}:{policy['maxReplicas']}"
    else:
        env["PET_NNODES"] = str(worker["replicas"])
    for key, var in (("maxRestarts", "PET_MAX_RESTARTS"), ("nProcPerNode", "PET_NPROC_PER_NODE")):
        if key in policy:
            env[var] = str(policy[key])
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    if "rdzvConf" in policy:
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    if policy.get("standalone"):
        env["PET_STANDALONE"] = ""
    return env


def trainjob_env(job: dict, index: int, master: str, port: int) -> dict[str, str]:
    """What Kubeflow Trainer's torch plugin (pkg/runtime/framework/plugins/torch/torch.go) sets
    in node `index`'s pod; `master` and `port` stand for <name>-node-0-0.<name> and 29400."""
    trainer = job["spec"]["trainer"]
    return {
        "PET_NNODES": str(trainer.get("numNodes", 1)),
        "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
        "PET_NODE_RANK": str(index),  # the pod's Job completion index
        "PET_MASTER_ADDR": master,
        "PET_MASTER_PORT": str(port),
    }


def run_pods(argv: list[str], envs: list[dict[str, str]], tmp: Path) -> list[str]:
    """Start one elasticrun per "pod" with the given environment (and nothing of this test's
    own PET_ or TORCHELASTIC_ variables); wait for them all; their outputs."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    base["PATH"] = f"{Path(sys.executable).parent}:{base['PATH']}"
    procs = []
    for i, env in enumerate(envs):
        out = (tmp / f"pod{i}.out").open("w")
        procs.append(
            subprocess.Popen(
                argv, env={**base, **env}, cwd=tmp, stdout=out, stderr=subprocess.STDOUT, text=True
            )
        )
        out.close()
    try:
        codes = [p.wait(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    outputs = [(tmp / f"pod{i}.out").read_text() for i in range(len(envs))]
    assert codes == [0] * len(envs), "\n\n".join(outputs)
    return outputs


def container_argv(command: list[str], args: list[str]) -> list[str]:
    """The container's command line, with the image's /workspace/train.py replaced by the
    example job (elasticrun is the image's ENTRYPOINT when only args are given)."""
    argv = (command or ["elasticrun"]) + args
    i = argv.index("/workspace/train.py")
    return [*argv[:i], str(EXAMPLE), *TRAIN, *argv[i + 1 :]]


# ---- schemas ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KUBEFLOW))
def test_the_kubeflow_manifest_is_valid_against_its_crd_schema(kind):
    assert schema_errors(the(kind)) == []


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("PyTorchJob", ("spec", "elasticPolicy", "rdzvBackend"), "etcd3"),
        ("PyTorchJob", ("spec", "elasticPolicy", "minReplica"), 1),
        ("PyTorchJob", ("spec", "pytorchReplicaSpecs", "Worker", "replicas"), "two"),
        ("PyTorchJob", ("spec", "pytorchReplicaSpecs", "Workers"), {"template": {}}),
        ("TrainJob", ("spec", "trainer", "numNodes"), "2"),
        ("TrainJob", ("spec", "runtimeRef", "name"), ""),
        ("TrainJob", ("metadata", "name"), "Elastic_Train"),
    ],
)
def test_the_crd_schemas_would_catch_a_bad_manifest(kind, path, value):
    doc = copy.deepcopy(the(kind))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert schema_errors(doc) != []


def test_the_pods_are_valid_against_the_kubernetes_schemas(tmp_path):
    job = the("PyTorchJob")
    trainer = the("TrainJob")["spec"]["trainer"]
    container = {
        "name": "node",
        "image": trainer["image"],
        "command": trainer["command"],
        "args": trainer["args"],
        "resources": trainer["resourcesPerNode"],
    }
    templates = [
        job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"],
        {"spec": {"containers": [container]}},
    ]
    for i, template in enumerate(templates):
        path = tmp_path / f"pod{i}.yaml"
        path.write_text(
            yaml.safe_dump(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
                | {"template": template}
            )
        )
        result = validate(path)
        assert result.returncode == 0 and "passed" in result.stdout, result.stdout + result.stderr


def test_the_pytorchjob_follows_the_operators_conventions():
    job = the("PyTorchJob")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["name"] == "pytorch", "the operator sets its variables in the `pytorch` container"
    assert "command" not in c, "the image's ENTRYPOINT (elasticrun) runs the args"
    assert not [a for a in c["args"] if a.startswith("-")], "flags come from PET_* only"
    assert pod["terminationGracePeriodSeconds"] > 30, "more than --shutdown-timeout's default"
    annotations = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]
    assert annotations["annotations"]["prometheus.io/scrape"] == "true"


# ---- the operators' environment on two local pods -------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_elasticrun_under_the_pytorchjob_operators_environment(tmp_path, etcd):
    job = the("PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvHost"] == "etcd" and policy["rdzvPort"] == 2379
    (c,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    etcd_host, etcd_port = etcd.endpoint.rsplit(":", 1)
    job["spec"]["elasticPolicy"]["rdzvPort"] = int(etcd_port)  # this test's etcd
    envs = []
    for _ in range(job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]):
        env = pytorchjob_env(job, etcd_host)
        # The container's own (a Secret's value is absent here, as when it is not created).
        env |= {e["name"]: e["value"] for e in c["env"] if "value" in e}
        # Two pods on one host: their probe and metrics ports must differ.
        env |= {"PET_HEALTH_PORT": f"127.0.0.1:{free_port()}"}
        env |= {"PET_METRICS_PORT": f"127.0.0.1:{free_port()}"}
        envs.append(env)
    assert envs[0]["PET_NNODES"] == "1:4" and envs[0]["PET_RDZV_BACKEND"] == "etcd"
    outputs = run_pods(container_argv(c.get("command", []), c["args"]), envs, tmp_path)
    assert any("done: " in out for out in outputs), outputs


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_elasticrun_under_the_trainers_environment(tmp_path):
    job = the("TrainJob")
    trainer = job["spec"]["trainer"]
    port = free_port()
    envs = [trainjob_env(job, i, "127.0.0.1", port) for i in range(trainer["numNodes"])]
    assert [e["PET_NODE_RANK"] for e in envs] == ["0", "1"]
    outputs = run_pods(container_argv(trainer["command"], trainer["args"]), envs, tmp_path)
    # Two nodes of one worker each: 64 samples in steps of 16 per worker.
    assert any("done: 2 steps, 1 epochs" in out for out in outputs), outputs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_c10d_pytorchjob_goes_on_when_its_first_pod_is_killed_and_started_again(tmp_path):
    # The operator's default rendezvous: one endpoint, the first worker pod's Service. That
    # pod is SIGKILLed once the other pod's successor keeps a copy, and started again at the
    # same name (restartPolicy OnFailure); the job goes on and completes on both.
    job = the("PyTorchJob/c10d")
    policy = job["spec"]["elasticPolicy"]
    assert "rdzvBackend" not in policy and "rdzvHost" not in policy, "the operator's defaults"
    (c,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    env = pytorchjob_env(job, "elastic-train-c10d-worker-0")
    assert env["PET_RDZV_ENDPOINT"] == "elastic-train-c10d-worker-0:23456"
    assert env["PET_RDZV_BACKEND"] == "c10d"
    endpoint = f"127.0.0.1:{free_port()}"  # the Service's name resolves to pod 0 here
    env |= {"PET_RDZV_ENDPOINT": endpoint, "ELASTICRUN_RDZV_TOKEN": "k" * 32}
    env |= {e["name"]: e["value"] for e in c["env"] if "value" in e}
    gates, records = tmp_path / "gates", tmp_path / "records"
    gates.mkdir()
    job_args = ["--samples", "512", "--image-size", "8", "--classes", "4", "--batch-size", "16"]
    job_args += ["--epochs", "1", "--step-time", "0.05", "--hold-at-step", "4"]
    job_args += ["--hold-dir", str(gates), "--record-samples", str(records)]
    argv = container_argv(c.get("command", []), c["args"])
    argv = [*argv[: argv.index(str(EXAMPLE)) + 1], *job_args]
    pods = Pods(argv, env, tmp_path)
    try:
        pods.start(0)
        assert wait_for(lambda: listening(endpoint), 60), pods.output(0)
        pods.start(1)
        assert wait_for(lambda: pods.trained(4), 120), pods.output(1)
        assert wait_for(lambda: standing_by(endpoint, "k" * 32), 60), "no successor stood by"
        pods.kill(0)
        pods.start(0)  # the operator starts the pod again, at the same name
        (gates / "step-4").touch()
        assert pods.wait() == [0, 0], "\n\n".join(pods.output(i) for i in range(2))
        assert pods.trained(16), "the job went on to its last step (16: 512 samples, 2 x 16)"
    finally:
        pods.end()


class Pods:
    """Local "pods", each an elasticrun with the operator's environment, started again as
    the operator would (the same environment, a new process)."""

    def __init__(self, argv: list[str], env: dict[str, str], tmp: Path) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        base["PATH"] = f"{Path(sys.executable).parent}:{base['PATH']}"
        self.argv, self.env, self.tmp = argv, {**base, **env, "OMP_NUM_THREADS": "1"}, tmp
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.records = Path(argv[argv.index("--record-samples") + 1])

    def start(self, i: int) -> None:
        ports = {"PET_HEALTH_PORT": f"127.0.0.1:{free_port()}"}
        ports["PET_METRICS_PORT"] = f"127.0.0.1:{free_port()}"
        with (self.tmp / f"pod{i}.out").open("a") as out:
            self.procs[i] = subprocess.Popen(
                self.argv,
                env={**self.env, **ports},
                cwd=self.tmp,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )

    def kill(self, i: int) -> None:
        os.killpg(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait(30)

    def trained(self, step: int) -> bool:
        """Whether a rank recorded `step`."""
        for f in self.records.glob("attempt*-rank*.txt"):
            for line in f.read_text().splitlines():
                if line.count(" ") == 2 and int(line.split(" ")[1]) >= step:
                    return True
        return False

    def output(self, i: int) -> str:
        return (self.tmp / f"pod{i}.out").read_text()[-3000:]

    def wait(self) -> list[int]:
        return [self.procs[i].wait(timeout=180) for i in sorted(self.procs)]

    def end(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
