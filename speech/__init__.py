"""speech: CSM text to speech, ``SpeechModel.load(dir).speak(text)`` / ``speak_stream``, and the
clip codecs. Requests run on the engine's pages and scheduler (``speech.frames``), so many
voices share batched passes::

    from speech import SpeechModel, Speech
"""

# First: the engine's OpenMP wait settings must precede torch's libgomp (engine/openmp_wait.py).
import engine  # noqa: F401, I001
from speech.admission import SpeechCapacity, SpeechTicket
from speech.clip import Speech
from speech.codecs import MIME_TYPES, SPEECH_FORMATS, encode_pcm, format_from_extension, normalize_format
from speech.errors import (
    EmptyTextError,
    InvalidDurationError,
    NoSpeechHeadError,
    SpeechBusyError,
    SpeechError,
    TextTooLongError,
    UnsupportedAudioFormatError,
    UnsupportedVoiceError,
)
from speech.job import SpeechJob
from speech.model import (
    CSM_ARCHITECTURE,
    MAX_SPEAKER_ID,
    MAX_SPEECH_TEXT_TOKENS,
    SPEAKER_PRESETS,
    SpeechModel,
    audio_cutoff,
    is_end_frame,
)
from speech.stream_encoder import STREAM_FORMATS, StreamEncoder

__all__ = [
    "STREAM_FORMATS",
    "StreamEncoder",
    "CSM_ARCHITECTURE",
    "EmptyTextError",
    "InvalidDurationError",
    "MAX_SPEAKER_ID",
    "MAX_SPEECH_TEXT_TOKENS",
    "MIME_TYPES",
    "NoSpeechHeadError",
    "SPEAKER_PRESETS",
    "SPEECH_FORMATS",
    "Speech",
    "SpeechError",
    "SpeechBusyError",
    "SpeechCapacity",
    "SpeechJob",
    "SpeechTicket",
    "SpeechModel",
    "TextTooLongError",
    "UnsupportedAudioFormatError",
    "UnsupportedVoiceError",
    "audio_cutoff",
    "encode_pcm",
    "format_from_extension",
    "is_end_frame",
    "normalize_format",
]
