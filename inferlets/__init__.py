"""inferlets: the WIT world, wasmtime host and guest SDK.

from inferlets import InferletRuntime, InferletRun, RunLimits, build_component
"""

from inferlets.build import WIT_DIR, build_component
from inferlets.host import (
    InferletCancelledError,
    InferletError,
    InferletFailedError,
    InferletHandleError,
    InferletHostError,
    InferletLimitError,
    InferletRun,
    InferletRuntime,
    InferletTimeoutError,
    InferletTrapError,
    InvalidComponentError,
    RunLimits,
    UnknownModelError,
)

__all__ = [
    "WIT_DIR",
    "build_component",
    "InferletRun",
    "InferletRuntime",
    "RunLimits",
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
]
