"""Generated modules of protocol package ``decent.v1`` (``proto/decent/v1/decent.proto``, built
by ``setup.py`` at install time): ``decent_pb2`` (messages) and ``decent_pb2_grpc`` (services)."""
