"""The served models: name -> loaded model, its kind, and its admission counter.

Every request for a model goes through that model's one engine (its scheduler batches
all requests' forward passes). Admission is bounded: a slot is taken synchronously when
the request is accepted (before any streaming response is returned) and given back when
the request ends, so a full model answers 429 at once instead of queueing without bound.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from api.http.errors import RECENT_DURATIONS, ServiceError, retry_after_estimate

_admissions = itertools.count()


@dataclass
class ServedModel:
    name: str
    model: Any
    """An ``engine.Model`` (chat) or a ``speech.SpeechModel`` (speech)."""
    kind: str
    """"chat" or "speech"."""
    max_concurrency: int
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0
    adapter: Any = None
    """An ``engine.Adapter`` every request to this name runs under (``--lora-modules``);
    ``model`` is then the base model's engine, shared with it."""
    parent: str | None = None
    """The served name of the base model, for an adapter."""
    _started: dict[int, float] = field(default_factory=dict, repr=False, compare=False)
    """When each admission in flight began (monotonic), by its number."""
    _durations: deque[float] = field(
        default_factory=lambda: deque(maxlen=RECENT_DURATIONS), repr=False, compare=False
    )
    """How long the recent admissions held their slot (the Retry-After estimate)."""

    @property
    def architecture(self) -> str:
        return str(self.model.architecture)

    @property
    def media_kinds(self) -> list[str]:
        return sorted(getattr(self.model, "media_kinds", ()) or ())

    def admit(self) -> Admission:
        """Take a slot or raise ``queue_full`` (429 with Retry-After: when the first request
        in flight is likely to end, from how long recent ones held their slot)."""
        now = time.monotonic()
        if self.in_flight >= self.max_concurrency:
            retry = retry_after_estimate(self._started.values(), self._durations, now)
            raise ServiceError(
                "queue_full",
                f"model {self.name!r} is serving its maximum of {self.max_concurrency} concurrent "
                f"requests; retry after {retry} s",
                retry_after=retry,
                limit=self.max_concurrency,
            )
        self.in_flight += 1
        number = next(_admissions)
        self._started[number] = now
        return Admission(self, number)

    def _ended(self, number: int) -> None:
        self.in_flight -= 1
        started = self._started.pop(number, None)
        if started is not None:
            self._durations.append(time.monotonic() - started)

    def __repr__(self) -> str:
        return f"ServedModel({self.name!r}, kind={self.kind!r}, in_flight={self.in_flight}/{self.max_concurrency})"


def parse_lora_module(spec: str) -> tuple[str, str, str | None]:
    """``NAME=PATH`` or ``NAME=PATH@BASE`` -> (name, adapter directory, base served name)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise ValueError(f"--lora-modules expects NAME=PATH or NAME=PATH@BASE, got {spec!r}")
    path, _, base = rest.rpartition("@") if "@" in rest else (rest, "", "")
    return name.strip(), path.strip(), base.strip() or None


def add_lora_modules(registry: ModelRegistry, specs: list[str], max_concurrency: int) -> None:
    """Serve each adapter under its own name on its base model's engine (loaded already):
    requests to it run under the adapter, batched with the base model's other requests."""
    for spec in specs:
        name, path, base = parse_lora_module(spec)
        chat = registry.of_kind("chat")
        if base is None:
            bases = [m for m in chat if m.adapter is None]
            if not bases:
                raise ValueError(f"--lora-modules {spec!r}: no chat model is served to put it on")
            parent = bases[0]
        else:
            parent = registry.get(base, kind="chat")
        adapter = parent.model.load_adapter(path, name)
        registry.add(
            ServedModel(
                name=name,
                model=parent.model,
                kind="chat",
                max_concurrency=max_concurrency,
                adapter=adapter,
                parent=parent.name,
            )
        )


class Admission:
    """A held slot; ``release()`` is idempotent (a stream may end in several ways)."""

    def __init__(self, served: ServedModel, number: int = -1):
        self.served = served
        self.number = number
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.served._ended(self.number)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self.ready = False

    def add(self, served: ServedModel) -> None:
        if served.name in self._models:
            raise ValueError(f"two models are served under the name {served.name!r}; use --served-model-name")
        self._models[served.name] = served

    def get(self, name: str, *, kind: str | None = None, adapters: bool = True) -> ServedModel:
        """The model served as ``name`` (``adapters=False``: a LoRA adapter name is refused,
        for endpoints that run the base model only)."""
        served = self._models.get(name)
        if served is not None and served.adapter is not None and not adapters:
            raise ServiceError(
                "invalid_request",
                f"{name!r} is a LoRA adapter; this endpoint runs base models (use {served.parent!r}) "
                "or send the request to /v1/chat/completions",
                param="model",
            )
        if served is None or (kind is not None and served.kind != kind):
            names = [m.name for m in self._models.values() if kind is None or m.kind == kind]
            what = f"{kind} model" if kind else "model"
            raise ServiceError(
                "model_not_found",
                f"the {what} {name!r} does not exist; served: {', '.join(names) or 'none'}",
                param="model",
            )
        return served

    def of_kind(self, kind: str) -> list[ServedModel]:
        return [m for m in self._models.values() if m.kind == kind]

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    def __repr__(self) -> str:
        return f"ModelRegistry({list(self._models)}, ready={self.ready})"
