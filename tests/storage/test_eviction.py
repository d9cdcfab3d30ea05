"""The eviction policy: LRU takes the least recent; cost takes the least value per byte and idle second,
with ties to the least recent; values remembered by key, and a neutral one for a chunk never valued."""

import pytest

from hcache.storage.eviction import MIN_IDLE_S, Values, check_policy, retention, victim

NOW = 100.0


def test_lru_takes_the_first_candidate_whatever_their_values():
    candidates = [("old", 1e9, 1, 10.0), ("new", 1.0, 1, 99.0)]
    assert victim("lru", candidates, NOW) == "old"
    assert victim("lru", [], NOW) is None and victim("cost", [], NOW) is None


def test_cost_keeps_the_expensive_chunk_that_lru_would_drop():
    # old: 8 s saved over 4 bytes, idle 90 s -> 0.022; new: 1 s over 4 bytes, idle 1 s -> 0.25
    candidates = [("old", 8.0, 4, 10.0), ("new", 1.0, 4, 99.0)]
    assert victim("cost", candidates, NOW) == "old"
    expensive = [("old", 100.0, 4, 10.0), ("new", 1.0, 4, 99.0)]  # 0.28 against 0.25
    assert victim("cost", expensive, NOW) == "new" and victim("lru", expensive, NOW) == "old"


def test_cost_weighs_bytes_and_breaks_ties_by_recency():
    assert victim("cost", [("small", 2.0, 1, 90.0), ("large", 2.0, 4, 90.0)], NOW) == "large"
    assert victim("cost", [("a", 1.0, 1, 90.0), ("b", 1.0, 1, 90.0)], NOW) == "a"


def test_retention_of_a_chunk_used_this_instant_is_finite():
    assert retention(1.0, 2, 0.0) == 1.0 / 2 / MIN_IDLE_S
    assert retention(3.0, 1, 2.0) == 1.5


def test_unknown_policies_are_refused():
    assert check_policy("cost") == "cost"
    with pytest.raises(ValueError, match="cost, lru"):
        check_policy("lfu")


def test_values_are_remembered_by_key_and_an_unknown_chunk_gets_their_mean():
    values = Values(kept=2)
    assert values.get("x") == 0.0
    values.set("a", 1.0)
    values.set("b", 3.0)
    assert (values.get("a"), values.get("b"), values.get("x")) == (1.0, 3.0, 2.0)
    values.set("a", 5.0)  # a new value replaces the old, and counts once
    assert values.get("x") == 4.0
    values.set("c", 7.0)  # over ``kept``: the oldest set (b) is forgotten
    assert values.get("b") == 6.0 and values.get("c") == 7.0
