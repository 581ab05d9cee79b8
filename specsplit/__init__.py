"""specsplit: speculative decoding split across a draft and a target gRPC service.

Client SDK: `Client` (blocking) and `AsyncClient` (asyncio) talk to the target service.
"""

from specsplit._channel import RetryPolicy, TLSConfig
from specsplit.aio import AsyncClient, AsyncGenerateStream
from specsplit.client import (
    Client,
    Delta,
    FinishReason,
    GenerateOptions,
    GenerateResult,
    GenerateStream,
    ModelInfo,
    TokenLogprob,
    Usage,
)
from specsplit.errors import (
    APIError,
    AuthenticationError,
    ClientClosedError,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    RequestCancelledError,
    SpecSplitError,
    UnavailableError,
    WrongServiceError,
)

__version__ = "0.1.0"

__all__ = [
    "APIError",
    "AsyncClient",
    "AsyncGenerateStream",
    "AuthenticationError",
    "Client",
    "ClientClosedError",
    "DeadlineExceededError",
    "Delta",
    "FinishReason",
    "GenerateOptions",
    "GenerateResult",
    "GenerateStream",
    "InvalidRequestError",
    "ModelInfo",
    "OverloadedError",
    "RequestCancelledError",
    "RetryPolicy",
    "SpecSplitError",
    "TLSConfig",
    "TokenLogprob",
    "UnavailableError",
    "Usage",
    "WrongServiceError",
    "__version__",
]
