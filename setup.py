"""Build hook: generate the decent_wire.v1 protobuf/gRPC modules from proto/ before packaging."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).parent
#: proto/decent/v1/*.proto is imported as decent_wire.v1.*_pb2 (protoc maps the path)
PROTO_DIR = "proto/decent/v1"
MODULE_DIR = "decent_wire/v1"
OUT = ROOT / "wire" / "v1"


def generate_protos() -> None:
    """Run grpc_tools.protoc over proto/decent/v1 into wire/v1 (messages and services)."""
    protos = sorted(p.name for p in (ROOT / PROTO_DIR).glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{MODULE_DIR}={PROTO_DIR}",
                f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                *(f"{MODULE_DIR}/{name}" for name in protos)]
        subprocess.run(args, cwd=ROOT, check=True)
        for made in (pathlib.Path(tmp) / MODULE_DIR).iterdir():
            shutil.copyfile(made, OUT / made.name)


class BuildWithProtos(build_py):
    """build_py that first regenerates the wire modules."""

    def run(self) -> None:
        generate_protos()
        super().run()


#: the daemon's SIGBUS guard (daemon/workers/sigbus.c): C, because a Python handler cannot
#: resume a fault. It uses only Python's stable ABI, so one build (sigbus.abi3.so) loads in
#: every CPython from 3.11 on
SIGBUS_GUARD = Extension("decentd.workers.sigbus", ["daemon/workers/sigbus.c"],
                         extra_compile_args=["-O2"], py_limited_api=True,
                         define_macros=[("Py_LIMITED_API", "0x030B0000")])

setup(cmdclass={"build_py": BuildWithProtos}, ext_modules=[SIGBUS_GUARD])
