"""The import graph of decent's own packages, and what it must not contain.

    python scripts/import_graph.py            # modules, their size, and what each imports
    python scripts/import_graph.py --check    # exit 1 on a cycle, a private name imported
                                              # across modules, or a layer imported upward

Reads the source (``ast``), so it needs nothing installed. Package directories are mapped to
their import names as ``pyproject.toml`` maps them (``wire`` -> ``decent_wire``, ``daemon`` ->
``decentd``, ``clients`` -> ``decent``). Imports inside ``if TYPE_CHECKING:`` count like any
other: a cycle for the type checker is still a cycle for a reader.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"decent_wire": ROOT / "wire", "decentd": ROOT / "daemon", "decent": ROOT / "clients"}
#: which top-level package may import which (the design card: clients -> wire <- daemon)
ALLOWED = {"decent_wire": {"decent_wire"}, "decentd": {"decentd", "decent_wire"},
           "decent": {"decent", "decent_wire"}}
#: the rooms of each package, bottom up: a module may import its own room, the rooms below it
#: and its package's root modules (the base every room stands on), never a room above
ROOMS = {
    "decentd": ["security", "workers", "net", "mailbox", "windows", "membership", "ops",
                "engine", "service", "tools"],
    "decent": ["core.memory", "core.requests", "core.surface", "core.training", "core", "torch",
               "tf"],
}
#: root modules that stand above every room (entry points and maps), not below them
ROOT_ABOVE = {"decentd.__main__"}
#: ops reach the network and the mailbox only through their API (``ops.api``, ``ops.parts``)
OPS_API = {"decentd.ops.api", "decentd.ops.parts"}
OPS_BELOW_API = ("decentd.net", "decentd.mailbox")


@dataclass
class Module:
    """One module of ours: its file, size and imports of our modules."""

    name: str
    path: Path
    lines: int
    imports: set[str] = field(default_factory=set)
    private: list[str] = field(default_factory=list)  #: "module._name" imported from elsewhere


def module_name(package: str, root: Path, path: Path) -> str:
    """The import name of ``path`` inside ``package`` (rooted at ``root``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def discover() -> dict[str, Module]:
    """Every module of our packages (generated protobuf modules aside)."""
    found = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            name = module_name(package, root, path)
            found[name] = Module(name, path, len(path.read_text().splitlines()))
    return found


def resolve(name: str, modules: dict[str, Module]) -> str | None:
    """The module of ours that ``name`` (a module or a name inside one) refers to."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def read_imports(mod: Module, modules: dict[str, Module]) -> None:
    """Fill in ``mod.imports`` and ``mod.private`` from its source."""
    tree = ast.parse(mod.path.read_text(), str(mod.path))
    package = mod.name if mod.path.name == "__init__.py" else mod.name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = resolve(alias.name, modules)
                if target and target != mod.name:
                    mod.imports.add(target)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                target = resolve(f"{base}.{alias.name}", modules) or resolve(base, modules)
                if target and target != mod.name:
                    mod.imports.add(target)
                    if alias.name.startswith("_") and target == resolve(base, modules):
                        mod.private.append(f"{base}.{alias.name}")


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(modules[v].imports):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return found


def upward(modules: dict[str, Module]) -> list[str]:
    """Imports that cross the packages the wrong way (daemon <-> clients)."""
    bad = []
    for mod in modules.values():
        top = mod.name.split(".")[0]
        for target in sorted(mod.imports):
            if target.split(".")[0] not in ALLOWED[top]:
                bad.append(f"{mod.name} -> {target}")
    return bad


def room_level(name: str) -> int:
    """Where module ``name`` stands among its package's rooms: -1 for a root module below them
    all, len(rooms) for one above them all (an entry point, a package's map)."""
    package = name.split(".")[0]
    rooms = ROOMS.get(package, [])
    if name in ROOT_ABOVE:
        return len(rooms)
    inner = name[len(package) + 1:]
    for level, room in enumerate(rooms):
        if inner == room or inner.startswith(room + "."):
            return level
    return -1


def rooms_upward(modules: dict[str, Module]) -> list[str]:
    """Imports of a room above the importer's (or of the tools by the runtime), and ops that
    reach the network or the mailbox around their API."""
    bad = []
    for mod in modules.values():
        here = room_level(mod.name)
        for target in sorted(mod.imports):
            if target.split(".")[0] != mod.name.split(".")[0]:
                continue
            if room_level(target) > here:
                bad.append(f"{mod.name} -> {target}")
            elif mod.name.startswith("decentd.ops.") and mod.name not in OPS_API and \
                    target.startswith(OPS_BELOW_API):
                bad.append(f"{mod.name} -> {target} (ops use ops.api)")
    return bad


def main(argv: list[str] | None = None) -> int:
    """Print the graph, or check it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on any violation")
    args = parser.parse_args(argv)
    modules = discover()
    for mod in modules.values():
        read_imports(mod, modules)
    problems = [f"cycle: {' <-> '.join(group)}" for group in cycles(modules)]
    problems += [f"private name across modules: {m.name} imports {p}"
                 for m in modules.values() for p in m.private]
    problems += [f"layer imported upward: {edge}" for edge in upward(modules)]
    problems += [f"room imported upward: {edge}" for edge in rooms_upward(modules)]
    if not args.check:
        for mod in modules.values():
            deps = ", ".join(sorted(mod.imports)) or "-"
            print(f"{mod.name:38} {mod.lines:5}  -> {deps}")
        print(f"\n{len(modules)} modules, {sum(m.lines for m in modules.values())} lines")
    for problem in problems:
        print(problem)
    if args.check and not problems:
        print(f"{len(modules)} modules: no cycles, no private names across modules, "
              "clients -> wire <- daemon, rooms call down")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
