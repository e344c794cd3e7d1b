"""Build hooks: compile the etcd v3 protocol subset (rendezvous/etcdpb/*.proto) with grpcio-tools
into Python modules next to the .proto files, for wheels and editable installs alike; and make the
package require at least the protobuf and grpcio versions that generated them.

Generated modules refuse an older runtime at import ("Runtime version cannot be older than the
linked gencode version"), so the requirement follows the generator that built this package rather
than a fixed bound that a newer grpcio-tools would silently break.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from hatchling.metadata.plugin.interface import MetadataHookInterface

PROTO_DIR = Path("src/elastic_launch/rendezvous/etcdpb")
#: Requirements besides the generated code's runtimes.
DEPENDENCIES = ["elasticrun-core==0.1.*", "prometheus-client>=0.17"]


def generate(root: Path, out: Path) -> list[Path]:
    """Compile every .proto of PROTO_DIR into `out` (a source root); the files written."""
    from grpc_tools import protoc

    src = root / "src"
    include = Path(protoc.__file__).parent / "_proto"  # the well-known types
    for proto in sorted((root / PROTO_DIR).glob("*.proto")):
        args = [
            "grpc_tools.protoc",
            f"-I{src}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(proto.relative_to(src)),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    made = out / PROTO_DIR.relative_to("src")
    return [p for p in made.iterdir() if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))]


def runtime_bounds(files: list[Path]) -> tuple[str, str]:
    """(protobuf, grpcio) versions the generated code needs at least, read from its headers."""
    text = "\n".join(p.read_text() for p in files if p.suffix == ".py")
    protobuf = re.search(r"^# Protobuf Python Version: (\S+)", text, re.MULTILINE)
    grpc = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", text, re.MULTILINE)
    if protobuf is None or grpc is None:
        raise RuntimeError("cannot read the generator's versions from the generated modules")
    return protobuf.group(1), grpc.group(1)


class ProtoBuildHook(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "protoc"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        root = Path(self.root)
        generated = generate(root, root / "src")
        build_data["artifacts"].extend(os.path.relpath(p, root) for p in generated)


class GeneratorBoundsHook(MetadataHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "generator-bounds"

    def update(self, metadata: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            protobuf, grpc = runtime_bounds(generate(Path(self.root), Path(tmp)))
        metadata["dependencies"] = [*DEPENDENCIES, f"grpcio>={grpc}", f"protobuf>={protobuf}"]
