"""The generated decent.v1 wire modules, imported in one place for the daemon."""

from decent.v1 import decent_pb2 as pb
from decent.v1 import decent_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
