"""Build hook: compile the etcd v3 protocol subset (rendezvous/etcdpb/*.proto) with grpcio-tools
into Python modules next to the .proto files, for wheels and editable installs alike."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PROTO_DIR = Path("src/elastic_launch/rendezvous/etcdpb")


class ProtoBuildHook(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "protoc"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        from grpc_tools import protoc

        root = Path(self.root)
        src = root / "src"
        protos = sorted((root / PROTO_DIR).glob("*.proto"))
        include = Path(protoc.__file__).parent / "_proto"  # the well-known types
        for proto in protos:
            args = [
                "grpc_tools.protoc",
                f"-I{src}",
                f"-I{include}",
                f"--python_out={src}",
                f"--pyi_out={src}",
                f"--grpc_python_out={src}",
                str(proto.relative_to(src)),
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {proto}")
        generated = [
            os.path.relpath(p, root)
            for p in (root / PROTO_DIR).iterdir()
            if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
        ]
        build_data["artifacts"].extend(generated)
