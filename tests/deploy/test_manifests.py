"""deploy/: the container image's Dockerfile, linted with hadolint, and the Kubernetes manifests,
validated offline against the Kubernetes schemas (kubernetes-validate) and read as elasticrun
would read their command lines."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from elastic_launch.launcher import cli
from elastic_launch.launcher.config import check_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
MISSING = "installed by `make test` (requirements-dev.txt)"


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(str(Path(sys.executable).parent / name))
    assert found, f"{name} is not installed: it is {MISSING}"
    return found


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--no-warn", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_dockerfile_passes_hadolint():
    result = subprocess.run(
        [tool("hadolint"), str(DEPLOY / "docker" / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install g++\nRUN cd /src && make\n")
    result = subprocess.run(
        [tool("hadolint"), str(bad)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0 and "DL3006" in result.stdout  # untagged image


def test_the_dockerfile_builds_what_the_repository_has():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    for package in ("elastic_core", "elastic_launch", "elastic_sampler"):
        assert f"./python/{package}" in text and (ROOT / "python" / package).is_dir()
    for copied in re.findall(r"^COPY (\S+) ", text, re.MULTILINE):
        if not copied.startswith("--from"):
            assert (ROOT / copied).exists(), f"COPY {copied}: not in the repository"
    assert 'ENTRYPOINT ["elasticrun"]' in text


def core_documents(path: Path) -> list[dict]:
    """The file's Kubernetes objects; Kubeflow's (kubeflow.org, trainer.kubeflow.org) are
    validated against their CRDs' schemas in test_kubeflow.py."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return [d for d in docs if not d["apiVersion"].split("/")[0].endswith("kubeflow.org")]


@pytest.mark.parametrize("path", [p for p in KUBERNETES if core_documents(p)], ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(path, tmp_path):
    core = tmp_path / path.name
    core.write_text(yaml.safe_dump_all(core_documents(path)))
    result = validate(core)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(core_documents(path)), result.stdout


def test_the_validation_would_catch_a_bad_manifest(tmp_path):
    bad = tmp_path / "bad.yaml"
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "job.yaml").read_text()))
    docs[0]["spec"]["completions"] = "two"
    docs[0]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/"
    bad.write_text(yaml.safe_dump_all(docs))
    result = validate(bad)
    assert result.returncode != 0, result.stdout


def containers(path: Path):
    for doc in yaml.safe_load_all(path.read_text()):
        spec = (doc or {}).get("spec", {})
        pod = spec.get("template", {}).get("spec", {})
        for c in pod.get("containers", []):
            yield doc, pod, c


def _expand(args: list[str], names: set[str]) -> list[str]:
    """What Kubernetes makes of $(NAME) in args: the variable's value ("job-x" for each here);
    a name the container does not define stays as it is there, so it is an error here."""

    def value(m: re.Match[str]) -> str:
        assert m.group(1) in names, f"$({m.group(1)}) names no variable of the container"
        return "job-x"

    return [re.sub(r"\$\((\w+)\)", value, a) for a in args]


def test_the_job_runs_elasticrun_with_flags_elasticrun_accepts():
    found = False
    for doc, pod, c in containers(DEPLOY / "kubernetes" / "job.yaml"):
        found = True
        args = _expand(c["args"], {e["name"] for e in c.get("env", [])})
        config, _ = cli.launch_from_args(cli.get_args_parser().parse_args(args))
        check_config(config)
        assert config.rdzv_backend == "etcd" and config.run_id == "job-x"
        grace = pod["terminationGracePeriodSeconds"]
        assert grace > config.shutdown_timeout, "SIGKILL before the workers' own grace ends"
        health = int(config.health_port.rsplit(":", 1)[1])
        metrics = int(config.metrics_port.rsplit(":", 1)[1])
        for probe in ("livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/healthz", "port": health}
        annotations = doc["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(metrics)
        assert config.health_port.startswith("0.0.0.0:"), "the kubelet probes the pod's address"
    assert found
