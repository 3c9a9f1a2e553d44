"""Typed inferlet errors (stable codes, one PieMediaError base)."""

from media.errors import PieMediaError


class InferletError(PieMediaError):
    """Base of every error an inferlet run ends with."""

    code = "inferlet_error"


class InferletTrapError(InferletError):
    """The guest trapped (a bug, a runaway loop out of fuel, a memory bomb past the cap)."""

    code = "inferlet_trap"


class InferletTimeoutError(InferletError):
    """The run passed its wall-clock deadline (epoch interruption)."""

    code = "inferlet_timeout"


class InferletFailedError(InferletError):
    """The guest returned an error result."""

    code = "inferlet_failed"


class InferletHandleError(InferletError):
    """A forged, closed or foreign handle."""

    code = "inferlet_bad_handle"


class InferletLimitError(InferletError):
    """Too many live handles or an oversized buffer."""

    code = "inferlet_limit"


class InvalidComponentError(InferletError):
    """The bytes are not a WebAssembly component of this world."""

    code = "invalid_inferlet"
