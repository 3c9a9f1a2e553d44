"""wasmtime component host for inferlets."""

from inferlets.host.errors import (
    InferletError,
    InferletFailedError,
    InferletHandleError,
    InferletLimitError,
    InferletTimeoutError,
    InferletTrapError,
    InvalidComponentError,
)
from inferlets.host.runtime import InferletRuntime, RunLimits

__all__ = [
    "InferletError",
    "InferletFailedError",
    "InferletHandleError",
    "InferletLimitError",
    "InferletTimeoutError",
    "InferletTrapError",
    "InvalidComponentError",
    "InferletRuntime",
    "RunLimits",
]
