"""wasmtime component host for inferlets."""

from inferlets.host.control import InferletRun
from inferlets.host.errors import (
    InferletCancelledError,
    InferletError,
    InferletFailedError,
    InferletHandleError,
    InferletHostError,
    InferletLimitError,
    InferletTimeoutError,
    InferletTrapError,
    InvalidComponentError,
    UnknownModelError,
)
from inferlets.host.limits import RunLimits
from inferlets.host.runtime import InferletRuntime

__all__ = [
    "InferletCancelledError",
    "InferletError",
    "InferletFailedError",
    "InferletHandleError",
    "InferletHostError",
    "InferletLimitError",
    "InferletTimeoutError",
    "InferletTrapError",
    "InvalidComponentError",
    "UnknownModelError",
    "InferletRun",
    "InferletRuntime",
    "RunLimits",
]
