"""The stores' recency order: least recently used first, evictions that never take a pinned entry, the
quota and the TTL, and the host tier's pins given by a predicate."""

from hcache.storage.lru_index import Entry, LruIndex


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _index(quota=None, ttl=None, **kw) -> tuple[LruIndex, Clock]:
    clock = Clock()
    return LruIndex(quota, ttl, clock, **kw), clock


def _add(index: LruIndex, key: str, size: int, pins: int = 0) -> Entry:
    entry = Entry(size, index.clock(), where=key, pins=pins)
    index.add(key, entry)
    return entry


def test_entries_are_kept_least_recently_used_first_and_a_touch_renews_one():
    index, clock = _index()
    for key in "abc":
        _add(index, key, 10)
    clock.now += 5
    assert index.touch("a").last_used == clock.now
    assert list(index.entries) == ["b", "c", "a"] and len(index) == 3 and "a" in index
    assert index.pop_victim()[0] == "b"
    assert list(index.entries) == ["c", "a"]


def test_used_bytes_follow_adds_replacements_and_removals():
    index, _ = _index()
    _add(index, "a", 10)
    _add(index, "b", 20)
    _add(index, "a", 15)  # a replacement: counted once, at its new size, now the most recent
    assert index.used_bytes == 35 and list(index.entries) == ["b", "a"]
    assert index.remove("b").size == 20 and index.remove("b") is None
    assert index.used_bytes == 15


def test_start_up_adds_entries_in_the_order_of_their_last_use():
    index, _ = _index()
    index.add_in_age_order([("new", Entry(1, 30.0, 0)), ("old", Entry(1, 10.0, 0)), ("mid", Entry(1, 20.0, 0))])
    assert list(index.entries) == ["old", "mid", "new"]


def test_make_room_evicts_the_least_recently_used_unpinned_entries_until_the_size_fits():
    index, _ = _index(quota=100)
    _add(index, "pinned", 30, pins=1)
    _add(index, "a", 30)
    _add(index, "b", 30)
    assert index.fits(100) and not index.fits(101)
    victims = index.make_room(40)  # 90 + 40 > 100: one 30-byte entry must go, and the pinned one may not
    assert [key for key, _ in victims] == ["a"] and index.used_bytes == 60
    assert list(index.entries) == ["pinned", "b"]
    assert index.make_room(10) == []  # fits already: nothing evicted


def test_make_room_removes_nothing_when_pinned_entries_leave_too_little():
    index, _ = _index(quota=100)
    _add(index, "a", 50, pins=1)
    _add(index, "b", 30)
    assert index.make_room(60) is None
    assert list(index.entries) == ["a", "b"] and index.used_bytes == 80


def test_make_room_counts_the_entry_being_replaced_as_freed_and_never_evicts_it():
    index, _ = _index(quota=100)
    _add(index, "a", 40)
    _add(index, "b", 40)
    assert index.make_room(55, replacing="b") == []  # 80 - 40 + 55 fits
    assert [key for key, _ in index.make_room(70, replacing="b")] == ["a"]
    assert list(index.entries) == ["b"]


def test_entries_unused_for_longer_than_the_ttl_expire_unless_pinned():
    index, clock = _index(ttl=60)
    stale, held = _add(index, "stale", 10), _add(index, "held", 10, pins=1)
    clock.now += 30
    fresh = _add(index, "fresh", 10)
    clock.now += 31  # stale and held are 61 s old, fresh 31 s
    assert index.expired(stale) and not index.expired(held) and not index.expired(fresh)
    assert [key for key, _ in index.make_room(0)] == ["stale"]  # expired ones go even under the quota
    assert list(index.entries) == ["held", "fresh"]


def test_a_pinned_predicate_replaces_the_pin_count():
    """The host tier's entries are pinned while their pool slot is referenced, a count the pool keeps."""
    referenced = {"a"}
    index, _ = _index(pinned=lambda entry: entry.where in referenced)
    for key in "abc":
        _add(index, key, 10)
    assert index.pop_victim()[0] == "b"
    referenced.add("c")
    assert index.pop_victim() is None and list(index.entries) == ["a", "c"]
    referenced.clear()
    assert [key for key, _ in index.remove_unpinned()] == ["a", "c"] and index.used_bytes == 0


def test_remove_unpinned_leaves_the_pinned_entries_in_their_order():
    index, _ = _index()
    _add(index, "a", 10, pins=1)
    _add(index, "b", 10)
    _add(index, "c", 10, pins=2)
    _add(index, "d", 10)
    assert [key for key, _ in index.remove_unpinned()] == ["b", "d"]
    assert list(index.entries) == ["a", "c"] and index.used_bytes == 20


def test_the_cost_policy_pops_the_least_valuable_entry_per_byte_and_idle_second():
    index, clock = _index(policy="cost")
    _add(index, "deep", 10).value = 50.0  # least recent, but costly to recompute
    clock.now += 5
    _add(index, "shallow", 10).value = 1.0
    _add(index, "pinned", 10, pins=1).value = 0.0
    clock.now += 5
    # deep: 50 / 10 / 10 s = 0.5; shallow: 1 / 10 / 5 s = 0.02; pinned is never chosen
    assert index.pop_victim()[0] == "shallow"
    assert index.pop_victim()[0] == "deep" and index.pop_victim() is None


def _chain(index: LruIndex, clock: Clock, links: list[tuple[str, str]], size: int = 10) -> None:
    """Add ``(key, parent)`` entries in order, a second apart."""
    for key, parent in links:
        clock.now += 1
        index.add(key, Entry(size, clock.now, where=key, parent=parent))


LINKS = [("a", ""), ("b", "a"), ("c", "b"), ("x", "")]  # a chain saved in order (its root the oldest), then x


def _victims(index: LruIndex, size: int, **kw) -> list[str] | None:
    victims = index.make_room(size, **kw)
    return None if victims is None else [key for key, _ in victims]


def test_a_parent_goes_only_after_every_entry_that_names_it():
    for need, gone in [(10, ["c"]), (20, ["c", "b"]), (30, ["c", "b", "a"]), (40, ["c", "b", "a", "x"])]:
        index, clock = _index(quota=40)
        _chain(index, clock, LINKS)
        # a and b are the oldest but hold c; each goes as soon as its last child has, before the newer x
        assert _victims(index, need) == gone
        assert index.used_bytes == 40 - 10 * len(gone)


def test_the_chain_an_entry_to_come_continues_is_kept_whole():
    index, clock = _index(quota=40)
    _chain(index, clock, LINKS)
    assert _victims(index, 10, parent="c") == ["x"]  # c continues: a, b and c stay
    assert (
        _victims(index, 20, parent="c") is None and len(index) == 3
    )  # only the chain could go: refused, nothing removed
    assert _victims(index, 20, parent="b") == ["c"]  # c is no ancestor of the entry to come


def test_a_pinned_child_holds_its_parents_and_expiry_follows_the_chain():
    index, clock = _index(quota=40, ttl=100)
    _chain(index, clock, LINKS)
    index.entries["c"].pins = 1
    assert _victims(index, 10) == ["x"]  # c is pinned, so a and b are held
    index.entries["c"].pins = 0
    clock.now += 200  # everything expired: the chain goes child first
    assert _victims(index, 0) == ["c", "b", "a"]


def test_two_entries_naming_each_other_do_not_pin_the_quota():
    """Issue 67: a and b name each other (damaged or hostile headers): the link that would close the cycle
    is not trusted, so the free c and then the chain go, child first."""
    index, _ = _index(quota=100)
    _add(index, "c", 60)
    index.add("a", Entry(60, 1, "a", parent="b"))  # b does not exist yet: no parent
    index.add("b", Entry(60, 2, "b", parent="a"))
    assert _victims(index, 0) == ["c", "b"] and index.used_bytes == 60
    assert _victims(index, 60) == ["a"] and index.used_bytes == 0


def test_an_entry_naming_itself_holds_nothing():
    index, _ = _index(quota=100)
    index.add("a", Entry(60, 1, "a", parent="a"))
    _add(index, "b", 60)
    assert _victims(index, 0) == ["a"]  # the least recently used, not held by itself


def test_a_parent_missing_when_its_child_came_is_not_trusted():
    """x names p, which is not stored; p, saved later, names x: trusting both would make a cycle."""
    index, _ = _index(quota=100)
    index.add("x", Entry(60, 1, "x", parent="p"))
    index.add("p", Entry(60, 2, "p", parent="x"))
    assert _victims(index, 0) == ["p"]
    assert _victims(index, 60) == ["x"]


def test_a_put_that_would_close_a_long_chain_into_a_cycle_is_not_trusted():
    """A replacement of a 3,000-entry chain's first entry naming its last: the walk up the chain finds it."""
    index, clock = _index(quota=100)
    keys = [f"k{i}" for i in range(3000)]
    _chain(index, clock, list(zip(keys, [""] + keys[:-1])), size=1)
    index.add(keys[0], Entry(1, clock.now, keys[0], parent=keys[-1]))
    assert _victims(index, 0) == keys[-1:-2901:-1]  # the chain from its end: its first hundred entries stay
    assert index.used_bytes == 100


def test_start_up_breaks_a_cycle_of_3000_entries_whatever_their_order():
    """A start-up finds each parent stored (file times are last uses, so a parent is often added after its
    children): every link is trusted but the one that closes the cycle."""
    keys = [f"k{i}" for i in range(3000)]
    parent = dict(zip(keys, keys[-1:] + keys[:-1]))  # each names the one before it, the first the last
    for order in (keys, keys[::-1], keys[::2] + keys[1::2]):
        index, _ = _index(quota=100)
        index.add_in_age_order([(key, Entry(1, t, key, parent=parent[key])) for t, key in enumerate(order)])
        victims = _victims(index, 0)
        assert len(victims) == 2900 and index.used_bytes == 100
        kept = set(index.entries)
        assert all(index.entries[k].parent in kept | {""} for k in kept)  # what is left is whole chains


def test_a_chain_longer_than_the_quota_held_by_a_pinned_end_goes_from_that_end():
    """Ten entries over a quota of six, the last pinned (a read in flight): rather than keep the quota
    broken, its ancestors go from the nearest, so the chain's start stays restorable."""
    keys = [f"c{i}" for i in range(10)]
    index, clock = _index(quota=60)
    _chain(index, clock, list(zip(keys, [""] + keys[:-1])))
    index.entries["c9"].pins = 1
    assert _victims(index, 0) == ["c8", "c7", "c6", "c5"] and index.used_bytes == 60
    assert _victims(index, 10, parent="c4") is None  # the rest is the pinned end and the chain to come
    index.entries["c9"].pins = 0
    assert _victims(index, 10, parent="c4") == ["c9"]
    index.entries["c2"].pins = 1  # in the chain to come: it holds its parents still
    assert _victims(index, 20, parent="c4") is None and len(index) == 5
