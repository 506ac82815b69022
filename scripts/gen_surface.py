"""Write the client's op methods from the op table.

    python scripts/gen_surface.py           # (re)write clients/core/surface/methods.py
    python scripts/gen_surface.py --check   # exit 1 when the file is not what it would write

Every user op of ``decent_wire.ops.OPS`` gets the methods its ``forms`` name (``x_async``,
``x``, ``x_async_``, ``x_``), with the parameters of its call in
:mod:`decent.core.surface.op_calls` or :mod:`decent.core.surface.window_calls` (one hand-written
function per op) and its docstring. The blocking forms go through ``Client._blocking``, the one
place adapters hook into (autograd for torch, ``tf.function`` staging for TensorFlow).
"""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "clients" / "core" / "surface" / "methods.py"

HEADER = '''"""The client's op methods, generated from the op table (``decent_wire.ops``) by
``scripts/gen_surface.py``: do not edit by hand (``tests/test_op_table.py`` fails when this file
is stale). Each op's arguments and docstring come from its call in
:mod:`decent.core.surface.op_calls` or :mod:`decent.core.surface.window_calls`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from inspect import signature
from typing import Any, Generic, TypeVar

from decent.core.requests.handles import Handle
from decent.core.surface.args import WeightsArg
from decent.core.surface.horovod_compression import Compressor
from decent_wire.ops import BY_NAME, OpDecl, Returns

T = TypeVar("T")

#: one op's call: its arguments by name (the tensor too) to a handle
Builder = Callable[..., Handle[Any]]


class OpMethods(Generic[T]):
    """Every op's methods, dispatched to the op's call (``builders``, by op name)."""

    def __init__(self, builders: Mapping[str, Builder]) -> None:
        self._builders = dict(builders)
        #: what a blocking call adds to its op's arguments: it is sent alone (never fused)
        self._alone = {name: {"fuse": False} if "fuse" in signature(b).parameters else {}
                       for name, b in builders.items()}

    def _start(self, op: OpDecl, kwargs: dict[str, Any]) -> Handle[T]:
        """Start op ``op`` with ``kwargs``; its handle."""
        handle: Handle[T] = self._builders[op.name](**kwargs)
        return handle

    def _blocking(self, op: OpDecl, kwargs: dict[str, Any]) -> Any:
        """Run op ``op`` with ``kwargs`` to its end: its result, None or True, as the op
        returns (adapters override this to make it differentiable or stage it in a graph)."""
        handle = self._start(op, kwargs)
        if op.returns is Returns.RESULT:
            return handle.wait()
        handle.join()
        return True if op.returns is Returns.TRUE else None

    def _plain(self, name: str, tensor: T, /, **kwargs: Any) -> Any:
        """The blocking op named ``name`` on ``tensor`` without the adapters' hooks (no
        gradients, no graph staging): what a backward pass runs."""
        decl = BY_NAME[name]
        return OpMethods._blocking(self, decl, {"tensor": tensor, **self._alone[name], **kwargs})
'''

IN_PLACE_DOC = ("In-place :meth:`{name}_async`: ``wait()`` writes the result into\n``tensor`` "
                "and returns it (no new tensor is allocated). Leave ``tensor`` alone\nuntil "
                "the handle is waited for.")


def _builders() -> dict[str, Callable[..., Any]]:
    sys.path[:0] = [str(ROOT / "build" / "typing")]
    from decent.core.surface.op_calls import OpCalls
    from decent.core.surface.window_calls import WindowCalls
    from decent_wire.ops import USER_OPS

    found = {}
    for op in USER_OPS:
        if not op.methods:
            continue
        holder = OpCalls if hasattr(OpCalls, op.name) else WindowCalls
        found[op.name] = getattr(holder, op.name)
    return found


def _params(fn: Callable[..., Any], drop: set[str]) -> list[inspect.Parameter]:
    return [p for name, p in inspect.signature(fn).parameters.items()
            if name not in drop and name != "self"]


def _signature(params: list[inspect.Parameter]) -> str:
    out, starred = [], False
    for p in params:
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not starred:
            out.append("*")
            starred = True
        text = f"{p.name}: {p.annotation}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {p.default!r}"
        out.append(text)
    return ", ".join(["self", *out])


def _kwargs(params: list[inspect.Parameter], extra: dict[str, str]) -> str:
    items = [f'"{p.name}": {p.name}' for p in params] + [f'"{k}": {v}' for k, v in
                                                          extra.items()]
    return "{" + ", ".join(items) + "}"


def _doc(text: str, indent: str = "        ") -> str:
    lines = inspect.cleandoc(text).splitlines()
    body = "\n".join((indent + line) if line else "" for line in lines[1:])
    head = f'{indent}"""{lines[0]}'
    return f"{head}\n{body}\n{indent}\"\"\"" if len(lines) > 1 else f'{head}"""'


def _method(name: str, params: list[inspect.Parameter], returns: str, doc: str,
            call: str) -> str:
    return (f"    def {name}({_signature(params)}) -> {returns}:\n{_doc(doc)}\n"
            f"        {call}\n")


def _forms(op_name: str, fn: Callable[..., Any]) -> list[str]:
    from decent_wire.ops import BY_NAME, Returns

    op = BY_NAME[op_name]
    names = inspect.signature(fn).parameters
    has_into = "into" in names
    into = {"into": "None"} if has_into else {}
    async_params = _params(fn, {"into"})
    blocking_params = _params(fn, {"into", "fuse"})
    blocking_extra = {"fuse": "False"} if "fuse" in names else {}
    returns = {Returns.RESULT: "T", Returns.NOTHING: "None", Returns.TRUE: "bool"}[op.returns]
    key = f'BY_NAME["{op_name}"]'
    doc = inspect.getdoc(fn) or ""
    out = []
    if op.forms.asynchronous:
        out.append(_method(f"{op_name}_async", async_params, "Handle[T]", doc,
                           f"return self._start({key}, {_kwargs(async_params, into)})"))
    if op.forms.blocking:
        blocking_doc = f"Blocking :meth:`{op_name}_async`." if op.forms.asynchronous else doc
        call = f"self._blocking({key}, {_kwargs(blocking_params, {**into, **blocking_extra})})"
        out.append(_method(op_name, blocking_params, returns, blocking_doc,
                           call if returns == "None" else f"return {call}"))
    if op.forms.in_place:
        mine = {"into": "tensor"}
        out.append(_method(f"{op_name}_async_", async_params, "Handle[T]",
                           IN_PLACE_DOC.format(name=op_name),
                           f"return self._start({key}, {_kwargs(async_params, mine)})"))
        out.append(_method(f"{op_name}_", blocking_params, "T",
                           f"Blocking in-place :meth:`{op_name}_async`.",
                           f"return self._blocking({key}, "
                           f"{_kwargs(blocking_params, {**mine, **blocking_extra})})"))
    return out


def render() -> str:
    """The text of the generated module (formatted by ruff, as the lint expects)."""
    methods = [m for name, fn in _builders().items() for m in _forms(name, fn)]
    text = HEADER + "\n" + "\n".join(methods)
    ruff = Path(sys.executable).parent / "ruff"
    done = subprocess.run([str(ruff), "format", "--line-length", "100", "-"], input=text,
                          capture_output=True, text=True, check=True)
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    """Write the module, or check it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if TARGET.read_text() != text:
            print(f"{TARGET.relative_to(ROOT)} is stale: run python scripts/gen_surface.py")
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__: list[Any] = ["main", "render"]
