"""Composable stop conditions: `max_tokens(32) | eos({2}) | stop_strings("\\n\\n")`.

A condition is an immutable description, reusable across contexts and generations. Per-generation
state lives in a tracker: `tracker = cond.start()`, then after every generated token
`tracker.check(token_ids, text)`, where token_ids are all tokens generated so far and text their
decoded text. `cond.check(token_ids, text)` is the stateless one-shot form (a fresh tracker).

When several conditions fire on the same token the reason is chosen by priority: stop_string
(its text is the shortest, truncated one), then eos, then length (the model's own stop wins over
the budget).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from media import check_int

Kind = Literal["length", "eos", "stop_string", "grammar"]
"""``grammar``: a constrained generation's grammar allowed nothing more (set by the
context, not by a condition here)."""
_PRIORITY: dict[str, int] = {"stop_string": 0, "eos": 1, "length": 2}


@dataclass(frozen=True)
class StopReason:
    """Why generation stopped.

    kind: "length" | "eos" | "stop_string" | "grammar" (mapped to the API's finish reason).
    text: the text to return: for "stop_string" truncated before the stop string (or through it
      when the condition was built with include=True); otherwise the text as checked.
    detail: the token budget, the EOS id that fired, or the stop string matched.
    """

    kind: Kind
    text: str
    detail: int | str


class Tracker(Protocol):
    def check(self, token_ids: list[int], text: str) -> StopReason | None: ...


class StopCondition:
    """Base class: `start()` makes a per-generation tracker; `a | b` stops when either does."""

    def start(self) -> Tracker:
        raise NotImplementedError

    def check(self, token_ids: list[int], text: str) -> StopReason | None:
        """One-shot check of a whole generation so far (no state kept)."""
        return self.start().check(token_ids, text)

    def holdback(self, text: str) -> int:
        """How many trailing characters of ``text`` a stream must not show yet because they
        could be the start of a stop string (0 for conditions without strings)."""
        return 0

    def __or__(self, other: StopCondition) -> StopCondition:
        if not isinstance(other, StopCondition):
            return NotImplemented
        return AnyOf((*_parts(self), *_parts(other)))


def _parts(c: StopCondition) -> tuple[StopCondition, ...]:
    return c.conditions if isinstance(c, AnyOf) else (c,)


class _Stateless:
    """Tracker for conditions that need no memory between steps."""

    def __init__(self, cond: Eos) -> None:
        self._cond = cond

    def check(self, token_ids: list[int], text: str) -> StopReason | None:
        return self._cond._test(token_ids, text)


@dataclass(frozen=True)
class MaxTokens(StopCondition):
    n: int

    def __post_init__(self) -> None:
        check_int("max_tokens", self.n, min=1)

    def start(self) -> Tracker:
        return _BudgetTracker(self.n)


class _BudgetTracker:
    """``MaxTokens``' tracker: one comparison per token."""

    def __init__(self, n: int) -> None:
        self._n = n

    def check(self, token_ids: list[int], text: str) -> StopReason | None:
        return StopReason("length", text, self._n) if len(token_ids) >= self._n else None


@dataclass(frozen=True)
class Eos(StopCondition):
    ids: frozenset[int]

    def start(self) -> Tracker:
        return _Stateless(self)

    def _test(self, token_ids: list[int], text: str) -> StopReason | None:
        if token_ids and token_ids[-1] in self.ids:
            return StopReason("eos", text, token_ids[-1])
        return None


@dataclass(frozen=True)
class StopStrings(StopCondition):
    strings: tuple[str, ...]
    include: bool = False

    def __post_init__(self) -> None:
        if not self.strings or any(not isinstance(s, str) or not s for s in self.strings):
            raise ValueError(f"stop_strings needs one or more non-empty strings, got {self.strings!r}")
        # The characters a proper prefix of a stop string can end with: a text ending in
        # any other character holds nothing back (the usual case, checked once per token).
        ends = frozenset(s[k - 1] for s in self.strings for k in range(1, len(s)))
        object.__setattr__(self, "_prefix_ends", ends)

    def start(self) -> Tracker:
        return _StopStringTracker(self)

    def holdback(self, text: str) -> int:
        if not text or text[-1] not in self._prefix_ends:  # type: ignore[attr-defined]
            return 0
        longest = 0
        for s in self.strings:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest


class _StopStringTracker:
    """Scans only the new tail of the text (plus len(longest) - 1 characters of overlap)."""

    def __init__(self, cond: StopStrings) -> None:
        self._cond = cond
        self._overlap = max(map(len, cond.strings)) - 1
        self._seen = ""  # text already scanned without a match

    def check(self, token_ids: list[int], text: str) -> StopReason | None:
        seen = self._seen
        if text.startswith(seen):
            common = len(seen)
        else:  # the decoder revised its tail (e.g. a completed multi-byte character)
            pairs = enumerate(zip(seen, text, strict=False))
            common = next((i for i, (a, b) in pairs if a != b), min(len(seen), len(text)))
        begin = max(0, common - self._overlap)
        best: tuple[int, int, str] | None = None  # (position, -length, string): earliest, then longest
        for s in self._cond.strings:
            pos = text.find(s, begin)
            if pos >= 0 and (best is None or (pos, -len(s)) < best[:2]):
                best = (pos, -len(s), s)
        if best is None:
            self._seen = text
            return None
        pos, _, s = best
        end = pos + len(s) if self._cond.include else pos
        return StopReason("stop_string", text[:end], s)


@dataclass(frozen=True)
class AnyOf(StopCondition):
    conditions: tuple[StopCondition, ...]

    def __post_init__(self) -> None:
        # Only conditions that can hold text back are asked, once per streamed token.
        holding = tuple(c for c in self.conditions if type(c).holdback is not StopCondition.holdback)
        object.__setattr__(self, "_holding", holding)

    def start(self) -> Tracker:
        return _AnyTracker([c.start() for c in self.conditions])

    def holdback(self, text: str) -> int:
        holding: tuple[StopCondition, ...] = self._holding  # type: ignore[attr-defined]
        if len(holding) == 1:
            return holding[0].holdback(text)
        return max((c.holdback(text) for c in holding), default=0)


class _AnyTracker:
    def __init__(self, trackers: list[Tracker]) -> None:
        self._trackers = trackers

    def check(self, token_ids: list[int], text: str) -> StopReason | None:
        fired = None  # the first of the highest priority among those that fire
        for t in self._trackers:
            r = t.check(token_ids, text)
            if r is not None and (fired is None or _PRIORITY[r.kind] < _PRIORITY[fired.kind]):
                fired = r
        return fired


def max_tokens(n: int) -> MaxTokens:
    """Stop once n tokens have been generated ("length")."""
    return MaxTokens(n)


def eos(ids: int | Iterable[int]) -> Eos:
    """Stop when the last generated token is one of `ids` ("eos"); the EOS token stays in the ids."""
    ids = [ids] if isinstance(ids, int) else list(ids)
    for i in ids:
        check_int("eos ids", i, min=0)
    return Eos(frozenset(ids))


def eos_from(source: Any) -> Eos:
    """EOS ids from a GenerationConfig / model config (its `eos_token_id`), a dict, an id or ids."""
    ids = source
    if isinstance(source, dict):
        ids = source.get("eos_token_id")
    elif hasattr(source, "eos_token_id"):
        ids = source.eos_token_id
    if ids is None or (not isinstance(ids, int) and not list(ids)):
        raise ValueError(f"no EOS token ids found in {type(source).__name__}")
    return eos(ids)


def stop_strings(*strings: str, include: bool = False) -> StopStrings:
    """Stop when the generated text contains any of `strings` ("stop_string").

    Matches may span token boundaries. The returned text ends just before the earliest match
    (the stop string is excluded, as in the OpenAI API) unless include=True.
    """
    return StopStrings(tuple(strings), include)


def to_json(cond: StopCondition | None) -> Any:
    """A JSON-ready description of a condition built from this module's parts (None for
    None or for a condition of another kind, which cannot be described)."""
    if isinstance(cond, MaxTokens):
        return {"max_tokens": cond.n}
    if isinstance(cond, Eos):
        return {"eos": sorted(cond.ids)}
    if isinstance(cond, StopStrings):
        return {"stop_strings": list(cond.strings), "include": cond.include}
    if isinstance(cond, AnyOf):
        parts = [to_json(c) for c in cond.conditions]
        return None if any(p is None for p in parts) else {"any": parts}
    return None


def from_json(data: Any) -> StopCondition | None:
    """The inverse of ``to_json`` (ValueError/KeyError/TypeError on a malformed one)."""
    if data is None:
        return None
    if "max_tokens" in data:
        return MaxTokens(int(data["max_tokens"]))
    if "eos" in data:
        return Eos(frozenset(int(i) for i in data["eos"]))
    if "stop_strings" in data:
        return StopStrings(tuple(str(s) for s in data["stop_strings"]), bool(data["include"]))
    if "any" in data:
        parts = [from_json(p) for p in data["any"]]
        return AnyOf(tuple(p for p in parts if p is not None))
    raise ValueError(f"not a stop condition: {data!r}")
