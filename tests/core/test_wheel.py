"""`pip install ./python/elastic_core` works from a self-contained sdist, without CUDA or NVML."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sdist_builds_a_wheel_with_the_extension(tmp_path: Path):
    # The sdist must carry the C++ sources (reached through the `cpp` symlink).
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from scikit_build_core.build import build_sdist; build_sdist(sys.argv[1])",
            str(tmp_path),
        ],
        cwd=REPO / "python" / "elastic_core",
        check=True,
        timeout=300,
        capture_output=True,
    )
    (sdist,) = tmp_path.glob("elasticrun_core-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        assert any(n.endswith("cpp/src/watchdog.cpp") for n in names)
        assert not any(n.endswith(".o") or "/build/" in n for n in names)
        tar.extractall(tmp_path / "src", filter="data")
    (source,) = (tmp_path / "src").iterdir()
    env = dict(os.environ)
    env.pop("ELASTIC_NVML_LIBRARY", None)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            # Unoptimized: what is tested is that the sdist builds, and -O0 builds in half the
            # time. The release flags are the ones `make test` builds and tests.
            "-C",
            "cmake.build-type=Debug",
            "-C",
            "cmake.define.CMAKE_CXX_FLAGS_DEBUG=-O0",
            str(source),
        ],
        check=True,
        timeout=540,
        env=env,
    )
    (wheel,) = (tmp_path / "wheel").glob("elasticrun_core-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert any(n.startswith("elastic_core/_core") and n.endswith(".so") for n in names)
    assert "elastic_core/_core.pyi" in names
    assert "elastic_core/py.typed" in names
    assert "elastic_core/__init__.py" in names
