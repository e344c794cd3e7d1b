"""Packaging facts: one version everywhere, typed, and stubs that match the extension."""

from __future__ import annotations

import ast
import inspect
import re
from importlib.metadata import requires, version
from pathlib import Path

import elastic_core
from elastic_core import _core

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "python" / "elastic_core" / "src" / "elastic_core"


def test_one_version_for_the_library_and_the_three_packages():
    cpp_version = (REPO / "cpp" / "VERSION").read_text().strip()
    assert elastic_core.LIBRARY_VERSION == cpp_version
    for dist in ("elasticrun-core", "elasticrun-launch", "elasticrun-sampler"):
        assert version(dist) == cpp_version, dist
    major_minor = ".".join(cpp_version.split(".")[:2])
    assert f"elasticrun-core=={major_minor}.*" in (requires("elasticrun-launch") or [])


def test_abi_version_matches_the_header_and_cmake():
    header = (REPO / "cpp" / "include" / "elastic" / "elastic.h").read_text()
    cmake = (REPO / "cpp" / "CMakeLists.txt").read_text()
    abi = int(re.search(r"#define ELASTIC_ABI_VERSION (\d+)", header).group(1))
    assert elastic_core.ABI_VERSION == abi
    assert f"set(ELASTIC_ABI_VERSION {abi})" in cmake


def test_distribution_names_carry_the_prefix():
    for pkg in ("elastic_core", "elastic_launch", "elastic_sampler"):
        text = (REPO / "python" / pkg / "pyproject.toml").read_text()
        name = re.search(r'^name = "([^"]+)"', text, re.MULTILINE).group(1)
        assert name == "elasticrun-" + pkg.split("_")[1]


def test_typed_and_stubbed():
    assert (PACKAGE / "py.typed").exists()
    stub = ast.parse((PACKAGE / "_core.pyi").read_text())
    stubbed = {
        node.name if not isinstance(node, ast.AnnAssign) else node.target.id
        for node in stub.body
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AnnAssign))
    }
    public = {name for name in dir(_core) if not name.startswith("_")}
    assert public == stubbed, "every public name of _core has a stub, and nothing more"
    classes = {node.name: node for node in stub.body if isinstance(node, ast.ClassDef)}
    for name, node in classes.items():
        obj = getattr(_core, name)
        if issubclass(obj, BaseException) or not inspect.isclass(obj):
            continue
        members = (
            {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            | {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
            | {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets}
        )
        for member in members:
            assert hasattr(obj, member), f"stub {name}.{member} is not in the extension"
        actual = {m for m in vars(obj) if not m.startswith("_")}
        assert actual <= members, f"{name} members without a stub: {actual - members}"


def test_everything_exported():
    assert set(elastic_core.__all__) >= {n for n in dir(_core) if not n.startswith("_")}
