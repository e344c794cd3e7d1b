"""The generated gRPC modules import with every protobuf and grpcio version the package's
requirement allows: the requirement is the generator's own versions (hatch_build.py), checked
here at exactly that lower bound, in a virtualenv of its own."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "python" / "elastic_launch" / "src"
PROBE = f"""
import sys
sys.path.insert(0, {str(SRC)!r})
from elastic_launch.rendezvous.etcdpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
import google.protobuf, grpc
print(google.protobuf.__version__, grpc.__version__, rpc_pb2.RangeRequest(key=b"k").SerializeToString())
"""


def lower_bounds() -> dict[str, str]:
    found = {}
    for req in requires("elasticrun-launch") or []:
        m = re.fullmatch(r"(protobuf|grpcio)>=(\S+)", req.strip())
        if m:
            found[m.group(1)] = m.group(2)
    return found


def test_the_requirement_is_the_generators_version():
    generated = (SRC / "elastic_launch" / "rendezvous" / "etcdpb" / "rpc_pb2.py").read_text()
    gencode = re.search(r"# Protobuf Python Version: (\S+)", generated).group(1)
    grpc_gen = re.search(
        r"GRPC_GENERATED_VERSION = '([^']+)'",
        (SRC / "elastic_launch" / "rendezvous" / "etcdpb" / "rpc_pb2_grpc.py").read_text(),
    ).group(1)
    assert lower_bounds() == {"protobuf": gencode, "grpcio": grpc_gen}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_modules_import_at_the_lower_bounds_and_not_below(tmp_path):
    bounds = lower_bounds()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    pins = [f"protobuf=={bounds['protobuf']}", f"grpcio=={bounds['grpcio']}"]
    subprocess.run([*pip, *pins], check=True, timeout=400, capture_output=True)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", PROBE],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == [bounds["protobuf"], bounds["grpcio"]]
    # The bound is needed: protobuf 6, which the requirement once allowed, cannot load them.
    subprocess.run([*pip, "protobuf==6.31.1"], check=True, timeout=400, capture_output=True)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", PROBE],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "VersionError" in done.stderr
