"""The design's limits, held by the suite: a function of at most 60 lines, a class of at most
450, no import cycle between modules. (At most 7 parameters is ruff's PLR0913, run by ``make
test`` with ``max-args = 7``; its exceptions are named in pyproject.toml.) A feature that would
break a limit changes the design, not the limit: the exceptions below are named, with why.

Read from the source, so that a lazy import inside a function or one under ``TYPE_CHECKING``
cannot hide an arrow of a cycle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: The code the limits hold for: the three packages, and the scripts that ship beside them.
ROOTS = [
    REPO / "python" / "elastic_core" / "src",
    REPO / "python" / "elastic_launch" / "src",
    REPO / "python" / "elastic_sampler" / "src",
    REPO / "benchmarks",
    REPO / "examples",
    REPO / "deploy",
]
MAX_FUNCTION = 60
MAX_CLASS = 450
#: Functions allowed to be longer, and why (path relative to the repository: qualified name).
LONG_FUNCTIONS: set[str] = set()


#: Another project's file as it ships (a benchmark runs it unmodified): not ours to shape.
UPSTREAM = REPO / "benchmarks" / "example01" / "upstream"


def sources() -> list[Path]:
    found: list[Path] = []
    for root in ROOTS:
        found += [
            p
            for p in root.rglob("*.py")
            if not {"etcdpb", "build"} & set(p.parts) and not p.is_relative_to(UPSTREAM)
        ]
    return sorted(found)


def definitions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Every function and class of `tree`, with its qualified name."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from definitions(node, f"{name}.")
        else:
            yield from definitions(node, prefix)


def lines(node: ast.AST) -> int:
    """A definition's lines, its decorators left out (as a reader counts a body)."""
    end = node.end_lineno or node.lineno
    return end - node.lineno + 1


def too_long() -> list[str]:
    out = []
    for path in sources():
        rel = path.relative_to(REPO).as_posix()
        for name, node in definitions(ast.parse(path.read_text())):
            limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            if lines(node) > limit and f"{rel}:{name}" not in LONG_FUNCTIONS:
                what = "class" if isinstance(node, ast.ClassDef) else "function"
                out.append(f"{rel}:{node.lineno} {what} {name}: {lines(node)} lines > {limit}")
    return out


def test_no_function_or_class_is_over_its_limit():
    assert too_long() == [], "split it along its concepts (docs/architecture.md)"


def test_the_named_long_functions_still_exist():
    """An exception whose function is gone (or short) is removed from the list."""
    for entry in LONG_FUNCTIONS:
        rel, name = entry.split(":")
        tree = ast.parse((REPO / rel).read_text())
        found = dict(definitions(tree))
        assert name in found, entry
        assert lines(found[name]) > MAX_FUNCTION, f"{entry} is short now: drop the exception"


# ---- import cycles ------------------------------------------------------------------------------


def module_name(path: Path) -> str:
    for root in ROOTS:
        if root in path.parents:
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            return ".".join(parts)
    raise AssertionError(path)


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of `known` that `path` (module `name`) imports, at any depth of the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            candidates = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for candidate in candidates:
            # `import a.b.c` binds a, and loads a and a.b: the module itself is the arrow.
            c = candidate
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c and c != name:
                found.add(c)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in sources()}
    known = set(paths)
    graph = {m: imports_of(p, m, known) for m, p in paths.items()}
    # A package's __init__ is loaded by its submodules' imports: that is not an arrow of ours.
    return {m: {t for t in ts if not m.startswith(f"{t}.")} for m, ts in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_two_modules_import_each_other():
    assert cycles(import_graph()) == [], "modules that import each other, directly or around"


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_cycles_are_found_direct_or_around(graph, expected):
    assert cycles(graph) == expected


def test_a_type_checking_or_lazy_import_is_an_arrow(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n"
    )
    known = {"pkg", "pkg.a", "pkg.b"}
    assert "pkg.b" in imports_of(pkg / "a.py", "pkg.a", known)
    assert imports_of(pkg / "b.py", "pkg.b", known) == {"pkg.a"}


def test_every_test_module_has_its_own_basename():
    """pytest imports test modules by basename (no packages under tests/): two of one name stop
    the collection of the whole suite on a clean checkout."""
    seen: dict[str, list[str]] = {}
    for path in (REPO / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(path.relative_to(REPO).as_posix())
    assert {n: ps for n, ps in seen.items() if len(ps) > 1} == {}


# ---- class names ---------------------------------------------------------------------------------

#: The modules in torch's shape: each class there adapts the project's own class of that name
#: to torch's API (docs/compat.md), so the name is torch's on purpose.
TORCH_SHAPED = {
    "python/elastic_launch/src/elastic_launch/launcher/api.py",
    "python/elastic_launch/src/elastic_launch/launcher/agent_api.py",
    "python/elastic_launch/src/elastic_launch/launcher/rendezvous_api.py",
}
#: Names defined twice elsewhere because user code needs both, and why.
NEEDED_TWICE = {
    # torchelastic 0.1's checkpoint manager, which classic scripts subclass
    # (docs/train_loop.md), beside elastic_sampler's for DDP scripts (docs/checkpoints.md).
    "CheckpointManager",
}


def test_no_class_name_is_defined_twice():
    """One name, one class in the packages: outside the torch-shaped modules, a second class
    of a name is a rename, or an entry above with its reason. Generated code (etcdpb) is not
    ours; examples and benchmarks are user code."""
    where: dict[str, list[str]] = {}
    for path in sources():
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith("python/") or rel in TORCH_SHAPED or "/etcdpb/" in rel:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(rel)
    twice = {n: ps for n, ps in where.items() if len(ps) > 1 and n not in NEEDED_TWICE}
    assert twice == {}
    assert all(len(where[n]) == 2 for n in NEEDED_TWICE), "a name needed twice is once now"
