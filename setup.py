"""Build hook: generate the decent.v1 protobuf/gRPC modules from proto/ before packaging."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).parent


def generate_protos() -> None:
    """Run grpc_tools.protoc over proto/ into clients/ (the `decent` package owns `decent.v1`)."""
    out = ROOT / "clients"
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    args = [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={out}",
            f"--grpc_python_out={out}", *protos]
    subprocess.run(args, cwd=ROOT, check=True)


class BuildWithProtos(build_py):
    """build_py that first regenerates the wire modules."""

    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
