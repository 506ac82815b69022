"""Op names on the wire: the job id qualifies the user's name, so jobs never meet."""

from __future__ import annotations

#: separates the job id from the op name in wire keys (a character no sane name contains)
JOB_SEPARATOR = "\x1f"


def qualify(job: str, name: str) -> str:
    """The wire key of op ``name`` in job ``job``."""
    return f"{job}{JOB_SEPARATOR}{name}" if job else name


def display_name(wire_name: str) -> str:
    """The user's op name inside a wire key (for messages)."""
    return wire_name.rsplit(JOB_SEPARATOR, 1)[-1]
