"""Op names and tensors on the wire: the job id qualifies the user's name, so jobs never meet, and
the key's owner qualifies it again, so the workers of one daemon never meet either.

A worker-level key ends in the worker's rank (``job\\x1fname\\x1e5``): worker 5's op, and the
parts sent to worker 5. A node-level key (a daemon's part of a hierarchical collective) ends in
``\\x1en``. A part is sent under the receiver's key: :func:`readdress` turns the sender's own key
into it.
"""

from __future__ import annotations

from decent_wire.v1 import decent_pb2 as pb

#: (name, round): one op
OpKey = tuple[str, int]

#: separates the job id from the op name in wire keys (a character no sane name contains)
JOB_SEPARATOR = "\x1f"
#: separates the key's owner (a worker rank, or ``n`` for the node) from the rest
OWNER_SEPARATOR = "\x1e"
#: the owner mark of node-level keys
NODE = "n"
#: separates a segment's index from the name (segments of a large node-level tensor)
SEGMENT_SEPARATOR = "\x1d"
#: characters no op name may contain
RESERVED = JOB_SEPARATOR + OWNER_SEPARATOR + SEGMENT_SEPARATOR


def qualify(job: str, name: str) -> str:
    """The wire key of op ``name`` in job ``job`` (without its owner)."""
    return f"{job}{JOB_SEPARATOR}{name}" if job else name


def job_of(key: str) -> str:
    """The job a wire key belongs to ("" without a job id)."""
    job, sep, _ = key.partition(JOB_SEPARATOR)
    return job if sep else ""


def at_worker(name: str, rank: int) -> str:
    """Worker ``rank``'s key of the job-qualified ``name``."""
    return f"{name}{OWNER_SEPARATOR}{rank}"


def at_node(name: str) -> str:
    """The node-level key of the job-qualified ``name``."""
    return f"{name}{OWNER_SEPARATOR}{NODE}"


def owner(key: str) -> int | None:
    """The worker a key belongs to; None for a node-level key. ValueError for a key without an
    owner, or with one that is not a rank."""
    base, sep, who = key.rpartition(OWNER_SEPARATOR)
    if not sep:
        raise ValueError(f"wire key {display_name(key)!r} names no owner")
    if who == NODE:
        return None
    if not who.isdigit():
        raise ValueError(f"wire key {display_name(base)!r} has owner {who!r}")
    return int(who)


def node_level(key: str) -> bool:
    """Whether ``key`` is a node-level key (False for a worker's, or one without an owner)."""
    return key.rpartition(OWNER_SEPARATOR)[2] == NODE and OWNER_SEPARATOR in key


def segment(key: str, index: int) -> str:
    """The key of segment ``index`` of a tensor under ``key`` (segment 0: the key itself)."""
    if index == 0:
        return key
    base, sep, who = key.rpartition(OWNER_SEPARATOR)
    return f"{base}{SEGMENT_SEPARATOR}{index}{sep}{who}"


def agreement(key: str) -> str:
    """The key under which a collective's participants agree on ``key`` before it runs."""
    base, sep, who = key.rpartition(OWNER_SEPARATOR)
    return f"{base}{SEGMENT_SEPARATOR}agree{sep}{who}"


def op_name(key: str) -> str:
    """The job-qualified name of a key's op, whoever owns the key (a worker or the node), and
    without a segment or agreement mark: the keys one op of that name runs under share it."""
    return key.rpartition(OWNER_SEPARATOR)[0].split(SEGMENT_SEPARATOR, 1)[0]


def readdress(key: str, rank: int) -> str:
    """The same key owned by worker ``rank`` (a node-level key stays as it is)."""
    base, _, who = key.rpartition(OWNER_SEPARATOR)
    return key if who == NODE else at_worker(base, rank)


def display_name(wire_name: str) -> str:
    """The user's op name inside a wire key (for messages)."""
    name = wire_name.rsplit(JOB_SEPARATOR, 1)[-1].split(OWNER_SEPARATOR, 1)[0]
    return name.split(SEGMENT_SEPARATOR, 1)[0]


def part(name: str, round_: int, tag: int, op: int, dtype: int, shape: tuple[int, ...],
         nbytes: int, weight: float = 1.0) -> pb.Part:
    """The wire description of one tensor of a message."""
    return pb.Part(name=name, round=round_, tag=tag, op=op,
                   meta=pb.TensorMeta(dtype=dtype, shape=shape), weight=weight, nbytes=nbytes)
