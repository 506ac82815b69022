"""The command lines of the benchmarks that take a table of options."""

from __future__ import annotations

import argparse
from typing import Any

#: an option: its name (without ``--``), type, default and help
Option = tuple[str, Any, Any, str]


def parser_of(doc: str | None, options: list[Option]) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first paragraph, with one ``--name`` per option (its
    help says its default)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    for name, kind, default, text in options:
        p.add_argument(f"--{name}", type=kind, default=default, help=f"{text} ({default})")
    return p
