"""What a caption is, for one job: the prompts, the sampling, an optional JSON schema the
output must match, and how videos are cut and sampled.

``settings()`` is what every record carries and what resume compares: a record made
under other settings is another job's."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from api.batch.sources import metadata_value

DEFAULT_PROMPT = "Describe this image."


class MissingPromptFieldError(Exception):
    code = "missing_prompt_field"


@dataclass(frozen=True)
class CaptionSpec:
    prompts: tuple[str, ...] = (DEFAULT_PROMPT,)
    """Several prompts: one record each, sharing the media's prefill (forks)."""
    max_tokens: int = 32
    prompt_field: str | None = None
    """Read each sample's prompt from this metadata field / column (``a.b`` for nested
    JSON); the ``prompts`` are then not used."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: dict[str, Any] | None = None
    fps: float | None = None
    max_frames: int | None = None
    segments: int | None = None
    """Cut every video into this many equal segments, one caption each."""
    scene_cuts: bool = False
    """Cut every video at its scene changes, one caption per scene."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.prompts and self.prompt_field is None:
            raise ValueError("give at least one prompt")
        if self.segments is not None and self.segments < 1:
            raise ValueError(f"segments must be >= 1, got {self.segments}")
        if self.segments is not None and self.scene_cuts:
            raise ValueError("--segments and --scene-cuts are exclusive")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max_frames must be >= 1, got {self.max_frames}")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps must be > 0, got {self.fps}")

    # -- what records carry ------------------------------------------------------------
    def settings(self, model_name: str) -> dict[str, Any]:
        """The settings in a record besides its prompt: model and max_tokens always, the
        rest only where they differ from the defaults (a plain job's records stay as they
        were)."""
        out: dict[str, Any] = {"model": model_name, "max_tokens": self.max_tokens}
        defaults = CaptionSpec()
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "fps",
            "max_frames",
            "segments",
            "scene_cuts",
            "prompt_field",
        ):
            value = getattr(self, name)
            if value != getattr(defaults, name):
                out[name] = value
        if self.json_schema is not None:
            out["json_schema"] = hashlib.sha256(
                json.dumps(self.json_schema, sort_keys=True).encode()
            ).hexdigest()[:16]
        return out

    def fingerprint(self, model_name: str) -> str:
        """One string for the whole job's settings, prompts included (the shard ledgers)."""
        whole = {**self.settings(model_name), "prompts": list(self.prompts)}
        return hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()[:16]

    def prompts_for(self, metadata: dict[str, Any]) -> list[str]:
        if self.prompt_field is None:
            return list(self.prompts)
        value = metadata_value(metadata, self.prompt_field)
        if isinstance(value, str) and value.strip():
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, str) and v.strip() for v in value):
            return list(value)
        raise MissingPromptFieldError(
            f"the sample has no text in its {self.prompt_field!r} field (its metadata has: "
            f"{', '.join(sorted(metadata)) or 'nothing'})"
        )

    # -- what the engine is given ------------------------------------------------------
    def sampler(self) -> Any:
        from engine import Sampler

        if self.temperature == 0:
            return Sampler.greedy()
        return Sampler(temperature=self.temperature, topp=self.top_p, topk=self.top_k)

    def penalties(self) -> Any:
        from engine import Penalties

        if (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) == (0.0, 0.0, 1.0):
            return None
        return Penalties(
            presence=self.presence_penalty,
            frequency=self.frequency_penalty,
            repetition=self.repetition_penalty,
        )

    def grammar(self) -> Any:
        if self.json_schema is None:
            return None
        from engine import Grammar

        return Grammar.json_schema(self.json_schema)

    def video_params(self, family: str) -> dict[str, Any]:
        """The encoder's video parameters for ``fps`` / ``max_frames`` (Gemma-4 samples a
        frame count, Qwen3-VL caps one)."""
        params: dict[str, Any] = {}
        if self.fps is not None:
            params["fps"] = self.fps
        if self.max_frames is not None:
            if family == "gemma4":
                if self.fps is None:
                    params["num_frames"] = self.max_frames
            else:
                params["max_frames"] = self.max_frames
        return params
