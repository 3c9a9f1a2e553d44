"""Named voices -> CSM speaker ids. OpenAI's voice names map to CSM's ten speakers
(0..9) in order; the speech model's presets (``default``, ``alternate``) and plain ids
("0".."9") work too."""

from __future__ import annotations

from api.http.schemas.speech import Voice, VoiceList
from speech import MAX_SPEAKER_ID, SPEAKER_PRESETS

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer")
VOICES: dict[str | int, int] = {
    **{name: i for i, name in enumerate(OPENAI_VOICES[: MAX_SPEAKER_ID + 1])},
    **SPEAKER_PRESETS,
    **{str(i): i for i in range(MAX_SPEAKER_ID + 1)},
}


def voice_list() -> VoiceList:
    return VoiceList(data=[Voice(id=str(name), speaker=speaker) for name, speaker in VOICES.items()])
