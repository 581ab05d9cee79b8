"""Typed errors raised by the specsplit SDK, mapped from gRPC status codes.

Every error the SDK raises derives from `SpecSplitError`; everything that came back from the server
(or from the channel on its behalf, e.g. an unreachable address) is an `APIError` carrying the gRPC
status code and details, and one subclass per status code that callers usually handle differently.
A generation's error also carries its `request_id` and the output received before it failed, so a
deadline or a dropped connection does not lose the tokens already streamed.

Mistakes in the call itself (an unknown keyword, a `str` where a list belongs) are `TypeError`s, as
Python raises for a wrong call; they never reach the server.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import grpc


class SpecSplitError(Exception):
    """Base class of every error the SDK raises."""


class ClientClosedError(SpecSplitError):
    """A call on a client after its `close()` (or after its `with` block ended)."""


class APIError(SpecSplitError):
    """A call failed with a gRPC status; `code` and `details` are what the server (or channel) sent.

    `request_id` is the generation's id (also for `abort`; None for `model_info` and `health`).
    `token_ids` and `text` are the output a generation had streamed before it failed (empty if none).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        request_id: str | None = None,
        token_ids: Sequence[int] = (),
        text: str = "",
    ) -> None:
        self.code = code
        self.details = details
        self.request_id = request_id
        self.token_ids = list(token_ids)
        self.text = text
        where = f" (request {request_id})" if request_id else ""
        super().__init__(f"{code.name}: {details}{where}")


class InvalidRequestError(APIError):
    """INVALID_ARGUMENT. The server starts the message with the offending field, kept in `field`."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        request_id: str | None = None,
        token_ids: Sequence[int] = (),
        text: str = "",
    ) -> None:
        super().__init__(code, details, request_id, token_ids, text)
        self.field = _field_of(details)


class OverloadedError(APIError):
    """RESOURCE_EXHAUSTED: the server's queue is full. Back off and retry later."""


class UnavailableError(APIError):
    """UNAVAILABLE: the server is unreachable, not ready, draining, or stopped while the stream ran
    (after the SDK's retries, which never replay a stream that produced output)."""


class DeadlineExceededError(APIError):
    """DEADLINE_EXCEEDED: the call's deadline passed before it finished; `token_ids`/`text` hold the
    output received until then."""


class AuthenticationError(APIError):
    """UNAUTHENTICATED: missing or wrong bearer token, or PERMISSION_DENIED."""


class WrongServiceError(APIError):
    """The address answers, but does not serve specsplit.v1.TargetService (UNIMPLEMENTED): e.g. it is
    the draft service's port."""


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


def error_from_status(
    code: grpc.StatusCode,
    details: str,
    request_id: str | None = None,
    token_ids: Sequence[int] = (),
    text: str = "",
) -> APIError:
    return _ERROR_BY_CODE.get(code, APIError)(code, details, request_id, token_ids, text)


def error_from_rpc(
    err: grpc.RpcError, request_id: str | None = None, token_ids: Sequence[int] = (), text: str = ""
) -> APIError:
    """The typed error for a failed call: sync errors are also `grpc.Call`s, aio ones `AioRpcError`s."""
    code, details = getattr(err, "code", None), getattr(err, "details", None)
    if callable(code) and callable(details) and isinstance(status := code(), grpc.StatusCode):
        return error_from_status(status, str(details() or ""), request_id, token_ids, text)
    return APIError(grpc.StatusCode.UNKNOWN, str(err), request_id, token_ids, text)
