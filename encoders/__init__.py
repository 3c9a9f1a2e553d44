"""encoders: per-model preparation (exactly as the reference processors) and encoder
towers. Knows nothing about KV pages."""

from encoders.base import MediaEncoder, model_fingerprint
from encoders.cache import CacheStats, EncoderCache
from encoders.cache_scope import cache_scope, set_cache_scope, use_cache_scope
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
    "cache_scope",
    "encoder_for",
    "set_cache_scope",
    "use_cache_scope",
    "model_fingerprint",
]
