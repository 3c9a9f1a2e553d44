"""inferlets: the WIT world, wasmtime host and guest SDK.

from inferlets import InferletRuntime, build_component
"""

from inferlets.build import WIT_DIR, build_component
from inferlets.host import InferletRuntime, RunLimits
from inferlets.host.errors import (
    InferletError,
    InferletFailedError,
    InferletHandleError,
    InferletLimitError,
    InferletTimeoutError,
    InferletTrapError,
    InvalidComponentError,
)

__all__ = [
    "WIT_DIR",
    "build_component",
    "InferletRuntime",
    "RunLimits",
    "InferletError",
    "InferletFailedError",
    "InferletHandleError",
    "InferletLimitError",
    "InferletTimeoutError",
    "InferletTrapError",
    "InvalidComponentError",
]
