"""Typed errors raised by the specsplit SDK, mapped from gRPC status codes.

Every error the SDK raises derives from `SpecSplitError`; everything that came back from the server
(or from the channel on its behalf, e.g. an unreachable address) is an `APIError` carrying the gRPC
status code and details, and one subclass per status code that callers usually handle differently.
"""

from __future__ import annotations

import re

import grpc


class SpecSplitError(Exception):
    """Base class of every error the SDK raises."""


class APIError(SpecSplitError):
    """A call failed with a gRPC status; `code` and `details` are what the server (or channel) sent."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(f"{code.name}: {details}")


class InvalidRequestError(APIError):
    """INVALID_ARGUMENT. The server starts the message with the offending field, kept in `field`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.field = _field_of(details)


class OverloadedError(APIError):
    """RESOURCE_EXHAUSTED: the server's queue is full. Back off and retry later."""


class UnavailableError(APIError):
    """UNAVAILABLE: the server is unreachable, not ready or draining (after the SDK's retries)."""


class DeadlineExceededError(APIError):
    """DEADLINE_EXCEEDED: the call's deadline passed before it finished."""


class AuthenticationError(APIError):
    """UNAUTHENTICATED: missing or wrong bearer token, or PERMISSION_DENIED."""


class RequestCancelledError(APIError):
    """CANCELLED: the call was cancelled (by the server, e.g. an Abort, or by the client)."""


_ERROR_BY_CODE: dict[grpc.StatusCode, type[APIError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
}

# "max_new_tokens: must be > 0", "sampling.top_p: ...", "token_ids[3]: ..."
_FIELD_PREFIX = re.compile(r"^\s*([A-Za-z_][\w.\[\]]*)\s*:")


def _field_of(details: str) -> str | None:
    match = _FIELD_PREFIX.match(details)
    return match.group(1) if match else None


def error_from_status(code: grpc.StatusCode, details: str) -> APIError:
    return _ERROR_BY_CODE.get(code, APIError)(code, details)


def error_from_rpc(err: grpc.RpcError) -> APIError:
    """The typed error for a failed call: sync errors are also `grpc.Call`s, aio ones `AioRpcError`s."""
    code, details = getattr(err, "code", None), getattr(err, "details", None)
    if callable(code) and callable(details) and isinstance(status := code(), grpc.StatusCode):
        return error_from_status(status, str(details() or ""))
    return APIError(grpc.StatusCode.UNKNOWN, str(err))
