"""inferlets: the wasmtime host of two WIT worlds (Pie 0.4.0's, pie-media's own), their
builds and the guest SDKs.

from inferlets import InferletRuntime, InferletRun, RunLimits, build_pie_component
"""

from inferlets.build import WIT_DIR, build_component, build_pie_component
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
from inferlets.pie_project import PieManifest

__all__ = [
    "WIT_DIR",
    "build_component",
    "build_pie_component",
    "PieManifest",
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
