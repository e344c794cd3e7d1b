"""deploy/kubernetes/pytorchjob.yaml and trainjob.yaml: Kubeflow's PyTorchJob (training
operator) and TrainJob (Trainer). Each is validated against its CRD's schema, kept in
deploy/kubernetes/schemas/ with its source noted, and its pod parts against Kubernetes' own
schemas. Then elasticrun runs on two local "pods" (processes) with exactly the environment
each operator sets from the manifest, and the job forms and completes."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from launcher_util import free_port
from test_manifests import validate

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
EXAMPLE = ROOT / "examples" / "train_ddp.py"
TRAIN = ["--samples", "64", "--image-size", "8", "--classes", "4", "--batch-size", "16"]
TRAIN += ["--epochs", "1"]
KUBEFLOW = {"PyTorchJob": "pytorchjob.yaml", "TrainJob": "trainjob.yaml"}


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d]


def the(kind: str) -> dict:
    (doc,) = [d for d in documents(KUBEFLOW[kind]) if d["kind"] == kind]
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
