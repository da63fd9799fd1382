"""tilepy.launch.PlanCache: bounded, and an unhashable signature stores nothing."""

from tilepy.launch import PlanCache


def test_plan_cache_is_bounded_and_skips_unhashable_keys():
    cache = PlanCache(limit=2)
    assert cache.lookup(("a", 1)) == (None, ("a", 1))
    cache.put(("a", 1), "A")
    cache.put(("b", 1), "B")
    assert cache.lookup(("a", 1)) == ("A", ("a", 1)) and len(cache) == 2
    cache.put(("c", 1), "C")                      # full: starts over
    assert len(cache) == 1 and cache.lookup(("a", 1))[0] is None
    entry, key = cache.lookup(("d", [1]))         # a list inside: unhashable
    assert entry is None and key is None
    cache.put(key, "D")
    assert len(cache) == 1 and list(cache.values()) == ["C"]
    cache.clear()
    assert len(cache) == 0
