"""encoders: per-model preparation (exactly as the reference processors) and encoder
towers. Knows nothing about KV pages."""

from encoders.base import MediaEncoder, model_fingerprint
from encoders.cache import CacheStats, EncoderCache
from encoders.errors import EncoderError, UnsupportedMediaKindError, UnsupportedModelError
from encoders.prepared import Encoded, Prepared
from encoders.registry import encoder_for
from encoders.span import TokenType

__all__ = [
    "CacheStats",
    "Encoded",
    "EncoderError",
    "EncoderCache",
    "MediaEncoder",
    "Prepared",
    "TokenType",
    "UnsupportedMediaKindError",
    "UnsupportedModelError",
    "encoder_for",
    "model_fingerprint",
]
