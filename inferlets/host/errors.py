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


class InferletCancelledError(InferletError):
    """Whoever launched the run cancelled it."""

    code = "inferlet_cancelled"


class InferletHostError(InferletError):
    """A host call failed in an unexpected way (a bug on the host side, reported to the
    guest as this typed error instead of crashing the server)."""

    code = "inferlet_host_error"


class UnknownModelError(InferletError):
    """The guest named a model the host does not serve (or one of the wrong kind)."""

    code = "model_not_found"
