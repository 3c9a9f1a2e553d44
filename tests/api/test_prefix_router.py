"""The cache-aware replica router (``api.prefix_router``): longest held prefix wins when it
covers enough of the request, bounded by load; trees stay under their character budget."""

from __future__ import annotations

import os
import random

import pytest

from api.prefix_router import PrefixRouter, RadixTree

SYSTEM = "You are a careful assistant for the pie-media project. " * 14  # ~770 chars


def test_radix_tree_matches_the_longest_common_prefix_of_what_it_holds() -> None:
    tree = RadixTree(max_chars=1 << 20)
    tree.insert("abcd")
    tree.insert("abxy")
    assert (tree.match("abc"), tree.match("abxq"), tree.match("abz"), tree.match("q")) == (3, 3, 2, 0)
    assert tree.chars == len("ab") + len("cd") + len("xy")  # the shared edge is stored once
    # Against brute force on random strings over a small alphabet (many splits).
    rng = random.Random(7)
    held: list[str] = []
    tree = RadixTree(max_chars=1 << 20)
    for _ in range(300):
        s = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 12)))
        tree.insert(s)
        held.append(s)
        probe = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 14)))
        assert tree.match(probe) == max(len(os.path.commonprefix((probe, h))) for h in held)


def test_longest_held_prefix_wins() -> None:
    router = PrefixRouter()
    router.record(SYSTEM + "first question", "r0")
    router.record(SYSTEM + "second question, longer", "r1")
    router.record("something else entirely", "r2")
    loads = {"r0": 0, "r1": 0, "r2": 0}
    choice = router.choose(SYSTEM + "second question, longer still", loads)
    assert (choice.replica, choice.reason) == ("r1", "prefix")
    assert choice.matched == len(SYSTEM + "second question, longer")
    assert router.choose(SYSTEM + "first question again", loads).replica == "r0"


def test_a_match_below_the_threshold_goes_to_the_least_loaded() -> None:
    router = PrefixRouter(threshold=0.5)
    router.record("Be brief.", "r0")
    text = "Be brief." + " and explain the whole history of the printing press" * 3
    choice = router.choose(text, {"r0": 0, "r1": 1})
    assert (choice.replica, choice.reason) == ("r0", "least_loaded")  # r0 is also the idle one
    choice = router.choose(text, {"r0": 1, "r1": 0})
    assert (choice.replica, choice.reason) == ("r1", "least_loaded")
    # A lower threshold accepts the same short match.
    low = PrefixRouter(threshold=0.05, min_match=1)
    low.record("Be brief.", "r0")
    assert low.choose(text, {"r0": 1, "r1": 0}).reason == "prefix"


def test_a_short_shared_start_is_no_reason_to_prefer_a_replica() -> None:
    # "model, user:Request " is most of these short texts but less than a KV page.
    router = PrefixRouter(min_match=64)
    router.record("tiny\0user:Request 1: say something.", "r0")
    choice = router.choose("tiny\0user:Request 2: say something.", {"r0": 0, "r1": 0})
    assert (choice.replica, choice.reason) == ("r1", "least_loaded")
    assert PrefixRouter(min_match=0).choose("x", {"r0": 0}).reason == "least_loaded"  # empty trees
    router.min_match = 0
    assert router.choose("tiny\0user:Request 2: say something.", {"r0": 0, "r1": 0}).reason == "prefix"


def test_load_bounds_the_preference() -> None:
    router = PrefixRouter(imbalance=4)
    router.record(SYSTEM + "q", "r0")
    text = SYSTEM + "another q"
    assert router.choose(text, {"r0": 4, "r1": 0}).replica == "r0"  # within the bound
    choice = router.choose(text, {"r0": 5, "r1": 0})
    assert (choice.replica, choice.reason, choice.matched) == ("r1", "imbalance", 0)
    # The bound is relative to the least loaded replica, not absolute.
    assert router.choose(text, {"r0": 9, "r1": 5}).replica == "r0"


def test_ties_break_deterministically() -> None:
    # Empty trees, equal loads: the first name, whatever order the loads come in.
    for order in (["b", "a", "c"], ["c", "b", "a"]):
        assert PrefixRouter().choose("x", {n: 0 for n in order}).replica == "a"
    # Equal matches: fewer in flight, then the name.
    router = PrefixRouter()
    for name in ("r1", "r0"):
        router.record(SYSTEM, name)
    assert router.choose(SYSTEM + "q", {"r1": 0, "r0": 0}).replica == "r0"
    assert router.choose(SYSTEM + "q", {"r1": 0, "r0": 2}).replica == "r1"
    # No match on an idle service: the replica with the smaller tree, so prefixes spread.
    router = PrefixRouter()
    firsts = [router.route(f"{i} " + SYSTEM, {"r0": 0, "r1": 0}).replica for i in range(4)]
    assert firsts == ["r0", "r1", "r0", "r1"]


def test_chats_sharing_one_system_prompt_go_to_one_replica() -> None:
    router = PrefixRouter()
    loads = {"replica-a": 0, "replica-b": 0}
    questions = ["What is 2+2?", "Name a colour.", "Why is the sky blue?", "Hi", "Define entropy.", "Go"]
    chosen = [router.route(f"m\0system:{SYSTEM}\0user:{q}", loads) for q in questions]
    assert {c.replica for c in chosen} == {"replica-a"}
    assert [c.reason for c in chosen] == ["least_loaded"] + ["prefix"] * 5


def test_trees_stay_under_their_budget_evicting_least_recently_used() -> None:
    router = PrefixRouter(max_chars=400)
    for i in range(50):
        router.record(f"conversation {i:03d} " + "x" * 80, "r0")
        router.record("kept warm " + "y" * 60, "r0")  # touched every round: never evicted
        assert router.size("r0") <= 400
    tree = router.trees["r0"]
    assert tree.match("kept warm " + "y" * 60) == 70
    assert tree.match("conversation 049 " + "x" * 80) == 97  # the newest is whole
    assert tree.match("conversation 000 " + "x" * 80) == len("conversation 0")  # the oldest went
    with pytest.raises(ValueError):
        RadixTree(max_chars=0)


def test_retain_forgets_replicas_that_left() -> None:
    router = PrefixRouter()
    router.record(SYSTEM, "old")
    router.retain(["new"])
    assert router.trees == {}
    assert router.choose(SYSTEM, {"new": 0}).replica == "new"
    with pytest.raises(ValueError):
        router.choose(SYSTEM, {})
