"""The tree keeps its shape: layers that call down, no cycles, small modules, short functions."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = [REPO / "wire", REPO / "daemon", REPO / "clients"]
#: the design card's limits ("about" 500 lines a module, 60 a function), generated code aside
MODULE_LINES = 500
FUNCTION_LINES = 60


#: generated modules (checked against their generators instead)
GENERATED = ("_pb2.py", "_pb2_grpc.py", "surface/methods.py")


def library_files() -> list[Path]:
    return [p for root in LIBRARY for p in sorted(root.rglob("*.py"))
            if not p.as_posix().endswith(GENERATED)]


@pytest.mark.slow
def test_no_cycles_no_private_imports_and_clients_never_meet_the_daemon() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "import_graph.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for path in library_files():
        source = path.read_text()
        if len(source.splitlines()) > MODULE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: "
                                    f"{lines} lines")
    assert too_long == []


@pytest.mark.slow
def test_the_import_check_sees_a_cycle(tmp_path: Path) -> None:
    """The check itself can fail: a copy of the tree with a cycle added is refused."""
    import shutil

    for root in [*LIBRARY, REPO / "scripts"]:
        shutil.copytree(root, tmp_path / root.name,
                        ignore=shutil.ignore_patterns("__pycache__", "*_pb2*.py"))
    keys = tmp_path / "daemon" / "keys.py"
    keys.write_text(keys.read_text() + "\nfrom decentd.engine import requests  # noqa\n")
    proc = subprocess.run([sys.executable, str(tmp_path / "scripts" / "import_graph.py"),
                           "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "cycle: " in proc.stdout, proc.stdout


@pytest.mark.slow
def test_the_import_check_sees_a_room_imported_upward(tmp_path: Path) -> None:
    """The rooms hold: the network importing the engine, an op reaching around ``ops.api`` into
    the mailbox, and the runtime importing a tool are each refused."""
    import shutil

    for root in [*LIBRARY, REPO / "scripts"]:
        shutil.copytree(root, tmp_path / root.name,
                        ignore=shutil.ignore_patterns("__pycache__", "*_pb2*.py"))
    edits = {"daemon/net/flow.py": "from decentd.engine import requests",
             "daemon/ops/collectives.py": "from decentd.mailbox import slots",
             "daemon/service/server.py": "from decentd.tools import launcher"}
    for path, line in edits.items():
        target = tmp_path / path
        target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    proc = subprocess.run([sys.executable, str(tmp_path / "scripts" / "import_graph.py"),
                           "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout
    assert "room imported upward: decentd.net.flow -> decentd.engine.requests" in proc.stdout
    assert "decentd.ops.collectives -> decentd.mailbox.slots (ops use ops.api)" in proc.stdout
    assert "decentd.service.server -> decentd.tools.launcher" in proc.stdout


def test_no_library_folder_is_crowded() -> None:
    """No folder of library code holds more than about 15 modules."""
    crowded = {}
    for root in LIBRARY:
        for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
            modules = [p for p in folder.glob("*.py") if not p.name.endswith(
                ("_pb2.py", "_pb2_grpc.py"))]
            if len(modules) > 15:
                crowded[str(folder.relative_to(REPO))] = len(modules)
    assert crowded == {}


def test_every_mutation_still_finds_its_code() -> None:
    """scripts/mutation_check.py's snippets follow the code they break (a restructure that moves
    one fails here, not only when someone runs the mutations)."""
    spec = importlib.util.spec_from_file_location("mutation_check",
                                                  REPO / "scripts" / "mutation_check.py")
    assert spec is not None and spec.loader is not None
    mutation_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutation_check)
    assert mutation_check.main(["--check"]) == 0  # SystemExit naming the snippet otherwise
