"""Typed exceptions: one subclass of LogitserveError per gRPC status code."""

import grpc


class LogitserveError(Exception):
    """A failed logitserve call. `code` is the grpc.StatusCode, `details` the server's message
    (for INVALID_ARGUMENT it names the field and the first bad row)."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, details="", code=None):
        if code is not None:
            self.code = code
        self.details = details
        super().__init__("%s: %s" % (self.code.name, details))


class Cancelled(LogitserveError):
    code = grpc.StatusCode.CANCELLED


class Unknown(LogitserveError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(LogitserveError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(LogitserveError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(LogitserveError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(LogitserveError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(LogitserveError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(LogitserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(LogitserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(LogitserveError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(LogitserveError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(LogitserveError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(LogitserveError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(LogitserveError, ConnectionError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(LogitserveError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(LogitserveError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in (
    Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
    PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange, Unimplemented,
    Internal, Unavailable, DataLoss, Unauthenticated)}
_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def error_for(code, details):
    """The typed exception for a grpc.StatusCode or a numeric google.rpc.Code."""
    if isinstance(code, int):
        code = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, LogitserveError)
    return cls(details, code=code)


def from_rpc_error(e):
    """Converts a grpc.RpcError (sync or aio) into the typed exception."""
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return error_for(code, details or "")
