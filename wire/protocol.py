"""The protocol's version and the names both sides give the wire's enums."""

from __future__ import annotations

from decent_wire.v1 import decent_pb2 as pb

#: the version this build speaks (``ProtocolVersion.PROTOCOL_VERSION_CURRENT`` in the proto);
#: workers and peers that speak another are refused at registration and handshake
PROTOCOL_VERSION: int = pb.PROTOCOL_VERSION_CURRENT

#: compressors of compressed gossip, by the name users pass
COMPRESSORS: dict[str, int] = {"topk": pb.TOPK, "sign": pb.SIGN, "int8": pb.QINT8,
                               "int4": pb.QINT4}
#: how an allreduce (or a reducing alltoall) combines, by the name users pass
REDUCE_OPS: dict[str, int] = {"average": pb.AVERAGE, "sum": pb.SUM, "min": pb.MIN,
                              "max": pb.MAX, "product": pb.PRODUCT}
#: averaging rules of WAGMA's group allreduce, by the name users pass
GROUP_RULES: dict[str, int] = {"mean": pb.GROUP_MEAN, "with-self": pb.GROUP_WITH_SELF}


_LABELS = {int(value): str(name).lower() for name, value in pb.OpType.items()}


def op_label(op: int) -> str:
    """``neighbor_allreduce`` style name of an ``OpType`` (ValueError for none)."""
    label = _LABELS.get(op)
    return str(pb.OpType.Name(op)).lower() if label is None else label


#: ops that meet by name, by the op their parts carry (a hierarchical neighbor allreduce's node
#: part is a neighbor allreduce's): two of them under one name and round clash unless they map
#: to the same op here; others (windows, groups) never meet these by name
NAMED_OPS = {op: op for op in (pb.NEIGHBOR_ALLREDUCE, pb.NEIGHBOR_ALLGATHER, pb.ALLREDUCE,
                               pb.BARRIER, pb.BROADCAST, pb.COMPRESSED_NEIGHBOR_ALLREDUCE,
                               pb.ALLGATHER)}
NAMED_OPS[pb.HIERARCHICAL_NEIGHBOR_ALLREDUCE] = pb.NEIGHBOR_ALLREDUCE


def clash(op: int, other: int) -> bool:
    """Whether ops ``op`` and ``other``, under one name and round, are two different ops."""
    return op in NAMED_OPS and other in NAMED_OPS and NAMED_OPS[op] != NAMED_OPS[other]
