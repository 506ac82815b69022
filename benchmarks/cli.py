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


def training_options(seeded: str, op_timeout: float) -> list[Option]:
    """The options of a D-SGD job on the namespaces (:mod:`benchmarks.chaos_run`'s workers and
    daemons): links, step, data, fault detection; ``seeded`` says what ``--seed`` seeds."""
    return [("rate", str, "1gbit", "tc tbf rate per link and direction"),
            ("pad-ms", float, 100.0, "each step's compute is padded to this"),
            ("batch", int, 32, "per worker"), ("lr", float, 0.05, "SGD"),
            ("seed", int, 0, seeded), ("heartbeat", float, 0.5, "timeouts.heartbeat (s)"),
            ("dead-after", float, 1.5, "faults.peer_dead_after (s)"),
            ("op-timeout", float, op_timeout, "timeouts.op (s): how long an op waits")]
