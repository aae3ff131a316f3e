"""Lazy access to the generated stubs (logitserve.v1.logitserve_pb2 / _pb2_grpc).

The stubs are generated when the package is built (setup.py); importing them lazily lets the pure
helpers (bf16 rounding, request planning) be used and tested without them.
"""

_cache = {}


def _load():
    if not _cache:
        try:
            from .v1 import logitserve_pb2, logitserve_pb2_grpc
        except ImportError as e:  # pragma: no cover - only in a broken install
            raise ImportError(
                "logitserve's generated gRPC stubs are missing: install the package with "
                "`pip install ./client/python` (it runs protoc) rather than importing it from "
                "the source tree") from e
        _cache["pb2"] = logitserve_pb2
        _cache["grpc"] = logitserve_pb2_grpc
    return _cache


def pb2():
    return _load()["pb2"]


def pb2_grpc():
    return _load()["grpc"]
