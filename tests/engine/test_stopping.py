"""Stop conditions: each alone, composed, across token boundaries, reused, and property-tested."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.stopping import AnyOf, StopReason, eos, eos_from, max_tokens, stop_strings


def run(cond, pieces: list[str], ids: list[int] | None = None) -> tuple[int, StopReason | None]:
    """Feed tokens one at a time (piece i is token i's text); -> (tokens consumed, reason)."""
    ids = ids if ids is not None else list(range(100, 100 + len(pieces)))
    tracker = cond.start()
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        reason = tracker.check(ids[: i + 1], text)
        if reason is not None:
            return i + 1, reason
    return len(pieces), None


def test_max_tokens() -> None:
    n, r = run(max_tokens(3), ["a", "b", "c", "d"])
    assert (n, r) == (3, StopReason("length", "abc", 3))
    assert max_tokens(5).check([1, 2], "xy") is None


def test_eos() -> None:
    n, r = run(eos({2, 7}), ["a", "b", "</s>", "c"], ids=[5, 6, 7, 8])
    assert (n, r) == (3, StopReason("eos", "ab</s>", 7))
    assert eos(2).check([2, 3], "") is None  # only the last token counts
    assert eos(2).check([], "") is None


def test_eos_from() -> None:
    class Cfg:
        eos_token_id = [1, 106]

    assert eos_from(Cfg()).ids == {1, 106}
    assert eos_from({"eos_token_id": 2}).ids == {2}
    assert eos_from([3, 4]).ids == {3, 4}
    assert eos_from(9).ids == {9}
    with pytest.raises(ValueError, match="no EOS"):
        eos_from({"eos_token_id": None})
    with pytest.raises(ValueError, match="no EOS"):
        eos_from([])


def test_stop_string_across_token_boundaries() -> None:
    n, r = run(stop_strings("\n\n"), ["Hello", " world.\n", "\nNext", " para"])
    assert n == 3
    assert r == StopReason("stop_string", "Hello world.", "\n\n")  # stop string excluded
    n, r = run(stop_strings("END", include=True), ["x", "E", "N", "Dyz"])
    assert (n, r.text) == (4, "xEND")
    n, r = run(stop_strings("<|im_end|>"), ["ab<|", "im", "_e", "nd|>", "tail"])
    assert (n, r.text, r.detail) == (4, "ab", "<|im_end|>")


def test_earliest_then_longest_stop_string_wins() -> None:
    assert stop_strings("cd", "b").check([1], "abcd").text == "a"
    assert stop_strings("ab", "abc").check([1], "xabcx").detail == "abc"


def test_revised_text_tail_is_rescanned() -> None:
    # A decoder may show an incomplete character as U+FFFD, then replace it.
    tracker = stop_strings("é!").start()
    assert tracker.check([1], "caf\ufffd") is None
    assert tracker.check([1, 2], "café!").text == "caf"


def test_composed_conditions() -> None:
    cond = max_tokens(4) | eos({2}) | stop_strings("\n\n")
    assert isinstance(cond, AnyOf) and len(cond.conditions) == 3  # flattened
    assert run(cond, ["a", "b", "c", "d", "e"])[1].kind == "length"
    assert run(cond, ["a", "b", "c"], ids=[5, 2, 5])[1] == StopReason("eos", "ab", 2)
    assert run(cond, ["a\n", "\nb"])[1] == StopReason("stop_string", "a", "\n\n")
    # Same token fires several: stop_string (shortest text) > eos > length.
    assert cond.check([1, 2, 3, 2], "ab\n\n").kind == "stop_string"
    assert cond.check([1, 2, 3, 2], "abcd").kind == "eos"


def test_condition_is_reusable_across_generations() -> None:
    cond = max_tokens(10) | stop_strings("STOP")
    first, second = cond.start(), cond.start()
    assert first.check([1], "ST") is None
    assert second.check([1], "OP") is None  # trackers do not share state
    assert first.check([1, 2], "STOP").kind == "stop_string"
    assert second.check([1, 2], "OP and more") is None
    assert run(cond, ["S", "TOP"])[0] == 2  # and a third generation from the same condition
    assert run(cond, ["S", "TOP"])[0] == 2


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: max_tokens(0), "max_tokens"),
        (lambda: max_tokens(2.5), "max_tokens"),
        (lambda: eos([-1]), "eos"),
        (lambda: eos(["a"]), "eos"),
        (lambda: stop_strings(), "stop_strings"),
        (lambda: stop_strings("ok", ""), "stop_strings"),
    ],
)
def test_validation(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_or_with_non_condition() -> None:
    with pytest.raises(TypeError):
        max_tokens(1) | 3  # noqa: B018


ALPHABET = st.text(alphabet="ab\né", min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    text=ALPHABET,
    stops=st.lists(st.text(alphabet="ab\né", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=15),
)
def test_stop_strings_on_random_token_splits(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({c for c in cuts if 0 < c < len(text)})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)] if text else []
    n, reason = run(stop_strings(*stops), pieces)
    # Reference: the first token after which the text contains a stop string.
    prefix = ""
    for i, piece in enumerate(pieces):
        prefix += piece
        hits = [(prefix.find(s), -len(s), s) for s in stops if s in prefix]
        if hits:
            pos, _, s = min(hits)
            assert n == i + 1
            assert reason == StopReason("stop_string", prefix[:pos], s)
            return
    assert reason is None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\né<>x", max_size=12),
    stops=st.lists(st.text(alphabet="ab\né<>", min_size=1, max_size=5), min_size=1, max_size=3),
)
def test_holdback_is_the_longest_stop_string_prefix_the_text_ends_with(text: str, stops: list[str]) -> None:
    """What a stream holds back: the longest proper prefix of a stop string that ends the
    text (the shortcut for texts ending in no prefix's last character included)."""
    cond = stop_strings(*stops) | max_tokens(5)
    expected = max(
        (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
        default=0,
    )
    assert cond.holdback(text) == expected
    assert stop_strings(*stops).holdback(text) == expected
