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


def test_imported_device_arrays_do_not_wait_for_the_producers_stream(monkeypatch):
    """Arrays from PyTorch / CuPy become Numba device arrays without Numba's stream sync:
    tilepy enqueues on the caller's stream, so waiting there only stalls the host (a per-call
    float32 copy of a float16 bias made every fused GEMM call wait for all earlier work)."""
    import numba.cuda

    from tilepy import arrays

    seen = []

    class Raw:  # stands in for a CuPy array: only .view is used
        def view(self, dtype):
            return self

    def fake_import(x, sync=True):
        seen.append(sync)
        return x

    monkeypatch.setattr(numba.cuda, "as_cuda_array", fake_import, raising=False)
    op = arrays.Operand("x", "cupy", "float16", (4,), (1,), 0, Raw())
    arrays.raw_view(op)
    arrays.raw_view(arrays.Operand("x", "cupy", "float32", (4,), (1,), 0, Raw()))
    assert seen == [False, False]
