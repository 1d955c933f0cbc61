"""The one LRU map of the CPU tier, the disk tier and the cache server."""

from lmcache_triton.storage.lru import LRU


def _lru(*items: tuple[str, int]) -> LRU[str, str]:
    lru: LRU[str, str] = LRU()
    for key, nbytes in items:
        lru.put(key, key.upper(), nbytes)
    return lru


def test_order_sizes_and_touch() -> None:
    lru = _lru(("a", 10), ("b", 20), ("c", 30))
    assert list(lru) == ["a", "b", "c"] and list(lru.newest()) == ["c", "b", "a"]
    assert len(lru) == 3 and lru.used_bytes == 60 and "b" in lru
    assert lru.get("a") == "A" and list(lru) == ["a", "b", "c"], "get leaves the order alone"
    assert lru.touch("a") == "A" and list(lru) == ["b", "c", "a"]
    assert lru.touch("zz") is None and lru.get("zz") is None
    assert lru.put("b", "B2", 5) == "B" and list(lru) == ["c", "a", "b"] and lru.used_bytes == 45
    assert lru.pop("c") == "C" and lru.pop("c") is None and lru.used_bytes == 15
    assert list(lru.items()) == [("a", "A"), ("b", "B2")] and list(lru.values()) == ["A", "B2"]


def test_pop_lru_skips_held_entries() -> None:
    lru = _lru(("a", 1), ("b", 1), ("c", 1))
    held = {"A", "B"}
    assert lru.pop_lru(held=held.__contains__) == ("c", "C")
    assert lru.pop_lru(held=held.__contains__) is None and len(lru) == 2
    assert lru.pop_lru() == ("a", "A")


def test_evict_frees_just_enough_least_recent_first() -> None:
    lru = _lru(("a", 10), ("b", 10), ("c", 10), ("d", 10))
    assert lru.evict(40) == [] and lru.evict(45, incoming=5) == []
    assert lru.evict(40, incoming=15) == [("a", "A"), ("b", "B")]
    assert list(lru) == ["c", "d"] and lru.used_bytes == 20
    lru.evict(0)
    assert len(lru) == 0 and lru.used_bytes == 0


def test_evict_skips_held_and_evicts_nothing_when_it_cannot_make_room() -> None:
    lru = _lru(("a", 10), ("b", 10), ("c", 10))
    held = {"A"}.__contains__
    assert lru.evict(30, incoming=10, held=held) == [("b", "B")]
    assert list(lru) == ["a", "c"]
    # 'a' is held: even evicting 'c' leaves 10 + 25 > 30, so nothing goes
    assert lru.evict(30, incoming=25, held=held) is None and list(lru) == ["a", "c"] and lru.used_bytes == 20
    assert lru.evict(5, incoming=0) == [("a", "A"), ("c", "C")]


def test_count_prefix_stops_at_the_first_missing_key():
    lru = LRU()
    for k in "abc":
        lru.put(k, k, 1)
    assert lru.count_prefix("abcd") == 3 and lru.count_prefix("abxc") == 2 and lru.count_prefix("xa") == 0
    assert lru.count_prefix([]) == 0
