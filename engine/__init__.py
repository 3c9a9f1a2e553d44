"""engine: model loading, paged KV, contexts, scheduler, attention backends, samplers.

Knows nothing about HTTP or WASM. Import what you need from here::

    from engine import Model, Context, Sampler, max_tokens, eos
"""

from engine.caption import caption, caption_async, caption_many, caption_many_async
from engine.context import Context, Distribution, Generation, TokenEvent
from engine.errors import (
    AttentionBackendUnavailableError,
    CheckpointShapeError,
    ContextClosedError,
    EmptyTextError,
    EngineError,
    InvalidDurationError,
    InvalidRequestError,
    MissingCheckpointFileError,
    ModelLoadError,
    NoSpeechHeadError,
    OutOfPagesError,
    SavedContextExistsError,
    SavedContextNotFoundError,
    TextTooLongError,
    UnsupportedArchitectureError,
    UnsupportedAudioFormatError,
    UnsupportedVoiceError,
)
from engine.kv_pool import KVPool, PoolStats
from engine.model import Model
from engine.sampling import Sampler, generator
from engine.speech import MAX_SPEECH_TEXT_TOKENS, SPEECH_FORMATS, Speech, SpeechModel
from engine.stopping import StopCondition, StopReason, eos, eos_from, max_tokens, stop_strings
from engine.sync import SyncContext, run_sync

__all__ = [
    "AttentionBackendUnavailableError",
    "SpeechModel",
    "Speech",
    "SPEECH_FORMATS",
    "MAX_SPEECH_TEXT_TOKENS",
    "UnsupportedVoiceError",
    "UnsupportedAudioFormatError",
    "TextTooLongError",
    "NoSpeechHeadError",
    "InvalidDurationError",
    "EmptyTextError",
    "CheckpointShapeError",
    "Context",
    "ContextClosedError",
    "Distribution",
    "EngineError",
    "Generation",
    "InvalidRequestError",
    "KVPool",
    "MissingCheckpointFileError",
    "Model",
    "ModelLoadError",
    "OutOfPagesError",
    "PoolStats",
    "Sampler",
    "SavedContextExistsError",
    "SavedContextNotFoundError",
    "StopCondition",
    "StopReason",
    "SyncContext",
    "TokenEvent",
    "UnsupportedArchitectureError",
    "caption",
    "caption_async",
    "caption_many",
    "caption_many_async",
    "eos",
    "eos_from",
    "generator",
    "max_tokens",
    "run_sync",
    "stop_strings",
]
