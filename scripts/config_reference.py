"""The configuration reference (every key of ``node.yaml``), generated from the daemon's pydantic
model :class:`decentd.service.config.NodeConfig`, so that it cannot drift from what the daemon
accepts.

``python scripts/config_reference.py`` prints it as Markdown; the documentation build puts it
into ``docs/configuration.md`` in place of the line ``<!-- config-reference -->``
(``docs/hooks/site.py``). Every key must carry a description (``Field(description=...)``):
one that lacks it stops the build, naming the key.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from decentd.service.config import NodeConfig, PeerPattern

#: the line of a Markdown page that the reference replaces
MARKER = "<!-- config-reference -->"

#: defaults that depend on the machine the reference is built on: shown as this text instead
MACHINE_DEFAULTS = {"socket": "see description"}


class MissingDescription(ValueError):
    """A key of the model has no description."""


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a section (``topology: TopologyConfig``, also ``TopologyConfig | None``)."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def type_name(annotation: Any) -> str:
    """A short, YAML-minded name of a field's type."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        optional = len(names) < len(args)
        return " \\| ".join(names) + (" \\| null" if optional else "")
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map {type_name(args[0])} → {type_name(args[1])}"
    plain = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if annotation in plain:
        return plain[annotation]
    return getattr(annotation, "__name__", str(annotation))


def default_text(name: str, field: FieldInfo) -> str:
    """The default as YAML would spell it."""
    if name in MACHINE_DEFAULTS:
        return MACHINE_DEFAULTS[name]
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if name.endswith("_bytes") and isinstance(value, int):
        for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
            if value >= 1 << shift and value % (1 << shift) == 0:
                return f"`{value}` ({value >> shift} {unit})"
    return f"`{value}`" if value != [] and value != {} else f"`{value!r}`"


def bounds_text(field: FieldInfo) -> str:
    """The field's numeric and length bounds (``>= 1``, ``<= 3600``, ...)."""
    parts = []
    for item in field.metadata:
        for attr, symbol in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"),
                             ("min_length", "length ≥")):
            value = getattr(item, attr, None)
            if value is not None and isinstance(item, annotated_types.BaseMetadata):
                parts.append(f"{symbol} {value}")
    return ", ".join(parts)


def describe(text: str) -> str:
    """A description in Markdown: reST's double backticks become code spans, pipes escaped."""
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    return text.replace("|", "\\|")


def section(model: type[BaseModel], prefix: str) -> list[str]:
    """The table of one section's keys (subsections follow as their own tables)."""
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    later: list[str] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = section_model(field.annotation)
        if sub is not None:
            doc = (sub.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
            what = describe(field.description or doc)
            default = default_text(name, field) if field.default is None else ""
            rows.append(f"| `{key}` | section | {default} | {what} ([below](#{anchor(key)})) |")
            later += ["", f"### `{key}`", "", what, ""]
            later += section(sub, f"{key}.")
            continue
        if not field.description:
            raise MissingDescription(f"{key}: no description (add Field(description=...) in "
                                     f"{model.__module__}.{model.__name__})")
        bounds = bounds_text(field)
        description = describe(field.description) + (f" ({bounds})" if bounds else "")
        rows.append(f"| `{key}` | {type_name(field.annotation)} | "
                    f"{default_text(name, field)} | {description} |")
    return rows + later


def anchor(key: str) -> str:
    """The id MkDocs gives the heading of section ``key`` (its toc slug)."""
    return re.sub(r"[^\w-]", "", key.lower().replace(" ", "-"))


def reference() -> str:
    """The whole reference: the top-level keys, then one table per section."""
    intro = ("Generated from the daemon's own model (`decentd.service.config.NodeConfig`) "
             "when the site is built: these are exactly the keys the daemon accepts.")
    pattern = (PeerPattern.__doc__ or "").strip().replace("\n", " ")
    return "\n".join([intro, "", *section(NodeConfig, ""), "", "### `peers` as a pattern", "",
                      describe(pattern), "", *section(PeerPattern, "peers.")]) + "\n"


def main() -> None:
    """Print the reference."""
    print(reference(), end="")


if __name__ == "__main__":
    main()
