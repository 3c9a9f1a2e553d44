"""Typed engine errors, each with a stable ``code`` (for APIs and logs)."""

from __future__ import annotations

from media.errors import InvalidRequestError, PieMediaError  # noqa: F401  (one class for every room)


class EngineError(PieMediaError):
    """Base class of everything the engine raises on purpose."""

    code: str = "engine_error"


class ModelLoadError(EngineError):
    """A checkpoint could not be loaded (missing files, unreadable config, bad weights)."""

    code = "model_load_error"


class MissingCheckpointFileError(ModelLoadError):
    """A file the checkpoint needs (config.json, weights, tokenizer) is absent."""

    code = "missing_checkpoint_file"


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture the engine does not serve."""

    code = "unsupported_architecture"


class CheckpointShapeError(ModelLoadError):
    """The weights do not fit the architecture the config describes."""

    code = "checkpoint_shape_mismatch"


class OutOfPagesError(EngineError):
    """The KV page pool cannot hold what was asked; nothing was changed."""

    code = "out_of_kv_pages"

    def __init__(self, message: str, *, needed: int, available: int):
        super().__init__(message, needed=needed, available=available)
        self.needed = needed
        self.available = available


class ContextClosedError(EngineError):
    """The context was closed; its pages are gone."""

    code = "context_closed"


class SavedContextNotFoundError(EngineError, KeyError):
    """No context was saved under that name."""

    code = "saved_context_not_found"


class SavedContextExistsError(EngineError):
    """A context is already saved under that name."""

    code = "saved_context_exists"


class AttentionBackendUnavailableError(EngineError, InvalidRequestError):
    """The attention backend asked for (``details['backend']``) cannot run here; the
    message says why (no CUDA device, an unsupported dtype, flashinfer not installed)."""

    code = "attention_backend_unavailable"


class NotASnapshotError(EngineError, InvalidRequestError):
    """The bytes given to ``Context.resume`` are not a context snapshot."""

    code = "not_a_snapshot"


class SnapshotCorruptError(EngineError, InvalidRequestError):
    """A snapshot that is truncated, altered (checksum) or internally inconsistent."""

    code = "snapshot_corrupt"


class SnapshotModelMismatchError(EngineError, InvalidRequestError):
    """A snapshot taken on another checkpoint (fingerprint mismatch)."""

    code = "snapshot_model_mismatch"


class AdapterNotFoundError(EngineError, InvalidRequestError):
    """The adapter path is not a PEFT adapter directory."""

    code = "adapter_not_found"


class AdapterMismatchError(EngineError, InvalidRequestError):
    """The adapter does not fit the model (architecture, module, shape) or is not LoRA."""

    code = "adapter_mismatch"


class QuantizationUnavailableError(EngineError, InvalidRequestError):
    """The weight quantization asked for (``details['method']``) is unknown or cannot run on
    this device; the message lists what is available here."""

    code = "quantization_unavailable"


class ContextLengthExceededError(EngineError, InvalidRequestError):
    """A prompt with the tokens asked for does not fit the model's context length
    (``Model.max_model_len``); ``details`` carry ``limit``, ``prompt_tokens`` and
    ``max_tokens``. OpenAI's code for it."""

    code = "context_length_exceeded"
