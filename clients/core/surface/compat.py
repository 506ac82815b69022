"""BlueFog's and Horovod's names for decent's calls, in one place.

A script written for BlueFog (``import bluefog.torch as bf``) or Horovod (``import
horovod.torch as hvd``) runs with ``import decent.torch as bf`` / ``as hvd``: decent's own names
cover most of both APIs (``neighbor_allreduce``, ``win_put``, ``allreduce``, ``broadcast``,
...). What differs is listed here: other names of the same method, Horovod's keyword arguments,
and the module-level names only one of them has. The documentation's migration page is drawn
from these tables, and ``tests/test_op_table.py`` checks that every name here exists.
"""

from __future__ import annotations

#: another project's name of a :class:`decent.core.Client` method -> decent's (the same method)
METHOD_ALIASES: dict[str, str] = {
    "in_neighbor_ranks": "in_neighbors",  # BlueFog (at step 0)
    "out_neighbor_ranks": "out_neighbors",  # BlueFog (at step 0)
}

#: keyword arguments a method takes for Horovod's sake, by method: what each means in decent
ARGUMENT_ALIASES: dict[str, dict[str, str]] = {
    "broadcast_async": {"root_rank": "root"},
    "allreduce_async": {
        "average": 'op="average" when True, op="sum" when False',
        "compression": "applied before the reduction and undone after (fp16)",
        "prescale_factor": "multiplied in before the reduction",
        "postscale_factor": "multiplied in after the reduction",
    },
}

#: module-level names of ``decent.torch`` that exist for one project's scripts, by project
MODULE_NAMES: dict[str, tuple[str, ...]] = {
    "horovod": ("Average", "Sum", "Adasum", "Compression", "DistributedOptimizer",
                "broadcast_parameters", "broadcast_optimizer_state", "synchronize", "poll",
                "is_initialized", "cross_rank", "cross_size", "mpi_threads_supported",
                "nccl_built"),
    "bluefog": ("InferDestinationFromSourceRanks", "InferSourceFromDestinationRanks",
                "load_topology", "is_topo_weighted", "set_topology", "window_names",
                "win_associated_p", "win_mutex", "CommunicationType",
                "DistributedAdaptThenCombineOptimizer", "DistributedAdaptWithCombineOptimizer",
                "DistributedNeighborAllreduceOptimizer", "neighbor_allreduce_nonblocking",
                "wait", "win_update_then_collect", "nccl_built", "is_homogeneous", "suspend",
                "resume", "topology_util", "ExponentialTwoGraph", "RingGraph",
                "MeshGrid2DGraph", "StarGraph", "GetRecvWeights",
                "GetDynamicOnePeerSendRecvRanks", "IsTopologyEquivalent"),
}
