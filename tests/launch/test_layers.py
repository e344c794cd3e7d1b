"""The layout shows the architecture: each part of elastic_launch imports only the parts below
it, as its package docstring says. Read from the source (every import, at any depth), so that a
lazy import inside a function cannot hide an arrow that runs back up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "python" / "elastic_launch" / "src" / "elastic_launch"
FOUNDATION = {
    "api",
    "cancel",
    "compat",
    "errors",
    "eventlog",
    "files",
    "idle",
    "learned",
    "net",
    "spare",
    "untrusted",
    "teardown",
    "_version",
}
ENTRY = {"__init__", "__main__", "cli"}
#: What each part may import besides itself and the foundation.
ALLOWED = {
    "entry": {"launcher", "agent", "train_loop", "processes", "rendezvous"},
    "launcher": {"agent", "processes", "rendezvous"},
    "agent": {"processes", "rendezvous"},
    "train_loop": {"rendezvous"},
    "processes": set(),
    "rendezvous": set(),
    "foundation": set(),
}


def part_of(module: str) -> str:
    """The part a dotted name below elastic_launch belongs to."""
    head = module.split(".", maxsplit=1)[0]
    if head in FOUNDATION:
        return "foundation"
    if head in ENTRY:
        return "entry"
    return head


def imports_of(path: Path) -> set[str]:
    """The elastic_launch modules `path` imports (without the package prefix)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("elastic_launch."):
                found.add(name.removeprefix("elastic_launch."))
    return found


def modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "etcdpb" not in p.parts)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_each_part_imports_only_the_parts_below_it(path):
    here = part_of(".".join(path.relative_to(SRC).with_suffix("").parts))
    allowed = ALLOWED[here] | {here, "foundation"}
    for name in imports_of(path):
        there = part_of(name)
        if there in ALLOWED:  # a part (an imported name that is not a module is its module's)
            assert there in allowed, f"{path.relative_to(SRC)} ({here}) imports {name} ({there})"


def test_every_part_says_what_it_owns_and_what_it_may_import():
    for package in ("launcher", "agent", "processes", "rendezvous", "train_loop"):
        doc = ast.get_docstring(ast.parse((SRC / package / "__init__.py").read_text())) or ""
        assert "Owns:" in doc and "May import:" in doc, package


def test_the_node_side_never_imports_torch_at_load():
    """The launcher, the agent and the rendezvous run without torch (a worker's script brings
    it): only a function may import it, when a feature asks for it."""
    for path in modules():
        top = ast.parse(path.read_text()).body
        for node in top:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                module = getattr(node, "module", None) or ""
                assert not any(n.split(".")[0] == "torch" for n in [*names, module]), path


#: Inside the rendezvous: what each of its subpackages may import besides itself, the
#: package's own top modules and etcdpb (the protocol's messages). The store interface is at the
#: bottom; the etcd clients implement it; the embedded service serves etcd's API with the v3
#: client's connections; the round protocol runs on the interface alone.
RENDEZVOUS = {
    "store": set(),
    "etcd": {"store"},
    "embedded": {"store", "etcd"},
    "round": {"store"},
}


def rendezvous_part(name: str) -> str | None:
    """The subpackage of rendezvous a dotted name below elastic_launch is in (None: not in one)."""
    parts = name.split(".")
    return (
        parts[1] if len(parts) > 1 and parts[0] == "rendezvous" and parts[1] in RENDEZVOUS else None
    )


@pytest.mark.parametrize(
    "path",
    [p for p in modules() if rendezvous_part(".".join(p.relative_to(SRC).parts))],
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_the_rendezvous_subpackages_import_only_the_ones_below(path):
    here = rendezvous_part(".".join(path.relative_to(SRC).parts))
    assert here is not None
    for name in imports_of(path):
        there = rendezvous_part(name)
        if there is not None and there != here:
            assert there in RENDEZVOUS[here], f"{path.relative_to(SRC)} ({here}) imports {name}"
