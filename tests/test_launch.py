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


# ---- grids past CUDA's y / z limit: chunked launches (tilepy.launch.GridSplit) -------------

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

from tilepy import launch  # noqa: E402
from tilepy.launch import GridSplit, LaunchPlan, arg_at, grid_chunks, pointer  # noqa: E402


def _probe_kernel():
    @cuda.jit
    def probe(a, out):
        """One thread per block (1, y, z): the a element of query head y of batch z (GQA:
        head y // (heads / heads_kv)), and what the block sees of its launch."""
        y = cuda.blockIdx.y
        z = cuda.blockIdx.z
        g = out.shape[1] // a.shape[1]
        out[z, y, 0] = a[min(z, a.shape[0] - 1), y // g]
        out[z, y, 1] = cuda.gridDim.y
        out[z, y, 2] = cuda.gridDim.z
        out[z, y, 3] = out.shape[1]

    return probe


_PROBE_SPLIT = (GridSplit(1, 1, 1), GridSplit(2, 0, 0), GridSplit(2, 1, 0))


def _probe_plan(a, out, group):
    z, h = out.shape[:2]
    split = (GridSplit(1, 0, 1, group=group),) + _PROBE_SPLIT
    return LaunchPlan(_probe_kernel(), (a, out), (1, h, z), 1, split=split)


def _probe_arrays(z, za, heads, group, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((za, heads // group))
    return a, cuda.to_device(a), cuda.to_device(np.full((z, heads, 4), np.nan))


def _check_probe(a, out, limit, group):
    z, heads = out.shape[:2]
    want = a[np.minimum(np.arange(z), a.shape[0] - 1)][:, np.arange(heads) // group]
    np.testing.assert_array_equal(out[..., 0], want)
    assert out[..., 1].max() <= limit and out[..., 2].max() <= limit, "a launch past the limit"
    assert out[..., 3].max() <= limit


@pytest.mark.sim
@pytest.mark.parametrize("heads,group,z,za,limit", [
    (7, 1, 5, 5, 3),     # y and z both past the limit, ragged last chunks
    (6, 3, 4, 1, 4),     # GQA, chunks of whole groups (3 heads); a broadcast over the batch
    (6, 3, 2, 2, 2),     # a group larger than the limit: chunks inside one group
    (6, 6, 3, 3, 4),     # one K/V head (extent 1): it stays put
])
def test_a_grid_past_the_limit_launches_in_chunks(monkeypatch, heads, group, z, za, limit):
    monkeypatch.setattr(launch, "MAX_GRID_YZ", limit)
    a, a_dev, out = _probe_arrays(z, za, heads, group)
    plan = _probe_plan(a_dev, out, group)
    assert plan.chunks is not None and all(max(g[1:]) <= limit for g, _ in plan.chunks)
    plan.launch(0, (a_dev, out))
    _check_probe(a, out.copy_to_host(), limit, group)


@pytest.mark.sim
def test_a_bound_plan_launches_its_chunks_on_each_calls_pointers(monkeypatch):
    monkeypatch.setattr(launch, "MAX_GRID_YZ", 2)
    _, a0, out0 = _probe_arrays(3, 3, 4, 2)
    bound = _probe_plan(a0, out0, 2).bind([(0, launch.pointer(a0)), (1, launch.pointer(out0))])
    for seed in (1, 2):
        a, a_dev, out = _probe_arrays(3, 3, 4, 2, seed)
        bound(0, [launch.pointer(a_dev), launch.pointer(out)])
        _check_probe(a, out.copy_to_host(), 2, 2)


@pytest.mark.sim
def test_rows_per_block_are_chunked_by_rows(monkeypatch):
    """``per_block``: a block per 2 rows of 9, the limit 2: launches of rows 0-3, 4-7, 8."""
    @cuda.jit
    def double(x, out):
        row = cuda.blockIdx.y * 2 + cuda.threadIdx.x
        if row < x.shape[0]:
            out[row, 0] = 2 * x[row]
            out[row, 1] = cuda.gridDim.y
            out[row, 2] = x.shape[0]

    monkeypatch.setattr(launch, "MAX_GRID_YZ", 2)
    x = np.arange(9.0)
    x_dev, out = cuda.to_device(x), cuda.to_device(np.full((9, 3), np.nan))
    plan = LaunchPlan(double, (x_dev, out), (1, 5), 2,
                      split=(GridSplit(1, 0, 0, per_block=2), GridSplit(1, 1, 0, per_block=2)))
    assert [g for g, _ in plan.chunks] == [(1, 2, 1), (1, 2, 1), (1, 1, 1)]
    plan.launch(0, (x_dev, out))
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[:, 0], 2 * x)
    np.testing.assert_array_equal(got[:, 1], [2] * 8 + [1])
    np.testing.assert_array_equal(got[:, 2], [4] * 8 + [1])


def test_chunks_shift_pointers_and_cut_shapes():
    """What a chunked launch changes per array (the driver's parameter buffer and the
    simulator's rebuilt arrays alike): byte offsets along the split axes and the chunk's
    extents; the broadcast array (extent 1) is left alone."""
    a = cuda.to_device(np.zeros((1, 3)))            # broadcast over z; heads_kv 3, group 2
    out = cuda.to_device(np.zeros((5, 6, 4)))
    saved = launch.MAX_GRID_YZ
    try:
        launch.MAX_GRID_YZ = 4
        plan = _probe_plan(a, out, 2)
    finally:
        launch.MAX_GRID_YZ = saved
    row = 6 * 4 * 8
    assert plan.chunks == [
        ((1, 4, 4), [(0, 0, (1, 2)), (1, 0, (4, 4, 4))]),
        ((1, 2, 4), [(0, 16, (1, 1)), (1, 4 * 32, (4, 2, 4))]),
        ((1, 4, 1), [(0, 0, (1, 2)), (1, 4 * row, (1, 4, 4))]),
        ((1, 2, 1), [(0, 16, (1, 1)), (1, 4 * row + 4 * 32, (1, 2, 4))])]
    # on the GPU the kernel takes layout "A" for arrays whose chunks are not contiguous
    # (out's chunks of 4 batches × 4 heads of 6); a's chunks are
    assert plan.chunk_layouts() == {0: {"C"}, 1: {"A", "C"}}
    assert _probe_plan(a, out, 2).chunks is None     # within the real limit: one launch


def test_array_layout():
    from tilepy.launch import array_layout

    assert array_layout((4, 6, 4), (192, 32, 8), 8) == "C"
    assert array_layout((4, 2, 4), (192, 32, 8), 8) == "A"     # 2 of 6 rows per batch
    assert array_layout((1, 2, 4), (192, 32, 8), 8) == "C"     # extent 1: stride ignored
    assert array_layout((3, 5), (8, 24), 8) == "F"
    assert array_layout((3, 0), (8, 24), 8) == "C"


def test_grid_chunks():
    assert grid_chunks(5, 5) == [(0, 5)]
    assert grid_chunks(7, 3) == [(0, 3), (3, 3), (6, 1)]
    assert grid_chunks(12, 5, 3) == [(0, 3), (3, 3), (6, 3), (9, 3)]    # whole groups of 3
    assert grid_chunks(12, 7, 3) == [(0, 6), (6, 6)]
    assert grid_chunks(10, 2, 5) == [(0, 2), (2, 2), (4, 1), (5, 2), (7, 2), (9, 1)]


def test_a_grid_past_a_limit_without_a_split_is_refused(monkeypatch):
    x = cuda.to_device(np.zeros(4))
    monkeypatch.setattr(launch, "MAX_GRID_YZ", 3)
    with pytest.raises(ValueError, match="grid z of 4 blocks exceeds .* no GridSplit"):
        LaunchPlan(_probe_kernel(), (x, x), (1, 2, 4), 1, split=(GridSplit(1, 0, 0),))
    monkeypatch.setattr(launch, "MAX_GRID_X", 8)
    with pytest.raises(ValueError, match="grid x of 9 blocks"):
        LaunchPlan(_probe_kernel(), (x, x), (9, 1, 1), 1)
    with pytest.raises(ValueError, match="GridSplit.dim"):
        GridSplit(0, 0, 0)
    with pytest.raises(ValueError, match="no axis 1"):
        LaunchPlan(_probe_kernel(), (x, x), (1, 4, 1), 1, split=(GridSplit(1, 0, 1),))


@pytest.mark.sim
def test_plans_of_one_kernel_keep_their_own_grids():
    """The simulator's ``kernel[grid, …]`` configures the kernel object itself: a plan built
    after another of the same kernel must not change the grid the first one launches."""
    @cuda.jit
    def mark(out):
        out[cuda.blockIdx.x] = cuda.gridDim.x

    a, b = cuda.to_device(np.zeros(3)), cuda.to_device(np.zeros(1))
    first = LaunchPlan(mark, (a,), 3, 1)
    LaunchPlan(mark, (b,), 1, 1).launch(0, (b,))
    first.launch(0, (a,))
    np.testing.assert_array_equal(a.copy_to_host(), [3, 3, 3])


@pytest.mark.gpu
def test_gpu_chunked_launches_and_the_parameter_buffer_after_them(monkeypatch):
    """On the GPU (the driver's parameter buffer): chunks along y and z, GQA groups, and the
    buffer back as built after the launches."""
    monkeypatch.setattr(launch, "MAX_GRID_YZ", 3)
    a, a_dev, out = _probe_arrays(5, 5, 12, 2)
    plan = _probe_plan(a_dev, out, 2)
    before = plan.parameter_values()
    plan.launch(0, (a_dev, out))
    _check_probe(a, out.copy_to_host(), 3, 2)
    assert plan.parameter_values() == before


@cuda.jit
def _mixed_arguments(x, s, y, n, z, t):
    """Scalars between arrays: their slots in the one parameter buffer are padded to the next
    8-byte field (float32 s, int32 n, float64 t)."""
    i = cuda.grid(1)
    if i < x.shape[0]:
        y[i] = x[i] * s + n
        z[i] = x[i] + t


@pytest.mark.gpu
def test_gpu_parameter_buffer_with_scalars_between_arrays():
    x = np.arange(10, dtype=np.float32)
    xd, yd, zd = cuda.to_device(x), cuda.device_array(10, np.float32), \
        cuda.device_array(10, np.float64)
    args = (xd, np.float32(2.5), yd, np.int32(7), zd, np.float64(0.25))
    plan = LaunchPlan(_mixed_arguments, args, 1, 32)
    plan.launch(0, args)
    np.testing.assert_array_equal(yd.copy_to_host(), x * 2.5 + 7)
    np.testing.assert_array_equal(zd.copy_to_host(), x + 0.25)
    bound = plan.bind([(0, pointer(xd)), (1, pointer(yd)), (2, pointer(zd))])
    x2 = cuda.to_device(-x)
    y2, z2 = cuda.device_array(10, np.float32), cuda.device_array(10, np.float64)
    bound(0, [pointer(x2), pointer(y2), pointer(z2)], (np.float32(-1.0), np.int32(3),
                                                      np.float64(4.0)))
    np.testing.assert_array_equal(y2.copy_to_host(), x + 3)
    np.testing.assert_array_equal(z2.copy_to_host(), -x + 4.0)


@cuda.jit
def _tuple_arguments(x, pair, empty, y, s):
    """A tuple argument (an array and a scalar: its members' parameters in order), an empty
    one (no parameter), then an array and a scalar after them."""
    i = cuda.grid(1)
    if i < x.shape[0]:
        y[i] = x[i] * s + pair[0][i] + pair[1]


def _tuple_case(xd, wd, yd):
    return (xd, (wd, np.int64(5)), (), yd, np.float32(2.0))


@pytest.mark.parametrize("on_gpu", [pytest.param(False, marks=pytest.mark.sim),
                                    pytest.param(True, marks=pytest.mark.gpu)])
def test_tuple_arguments_are_flattened_and_bound(on_gpu):
    """Arrays and scalars inside tuple arguments take their places among the plan's arrays
    and scalars (positions as paths), in launches and in bound plans."""
    x, w = np.arange(10, dtype=np.float32), np.full(10, 0.5, np.float32)
    xd, wd, yd = cuda.to_device(x), cuda.to_device(w), cuda.device_array(10, np.float32)
    args = _tuple_case(xd, wd, yd)
    plan = LaunchPlan(_tuple_arguments, args, 1, 32)
    assert plan.array_positions() == [0, (1, 0), 3]
    assert [arg_at(args, p) for p in plan.array_positions()] == [xd, wd, yd]
    plan.launch(0, args)
    np.testing.assert_array_equal(yd.copy_to_host(), x * 2 + w + 5)
    bound = plan.bind([(0, pointer(xd)), (1, pointer(wd)), (2, pointer(yd))])
    x2, w2 = cuda.to_device(-x), cuda.to_device(2 * w)
    y2 = cuda.device_array(10, np.float32)
    bound(0, [pointer(x2), pointer(w2), pointer(y2)], (np.int64(-3), np.float32(3.0)))
    np.testing.assert_array_equal(y2.copy_to_host(), -x * 3 + 2 * w - 3)
    np.testing.assert_array_equal(yd.copy_to_host(), x * 2 + w + 5)   # untouched


@pytest.mark.gpu
def test_gpu_a_new_thread_replays_a_cached_plan():
    """A thread that has made no CUDA call yet replays a launch plan another thread built
    (``tilepy.gemm``'s cached call on PyTorch tensors): the result, not a refused launch
    (without a current context the plan enters its device and launches again)."""
    import threading

    torch = pytest.importorskip("torch")
    import tilepy

    a = torch.randn(96, 64, device="cuda", dtype=torch.float16)
    b = torch.randn(64, 80, device="cuda", dtype=torch.float16)
    tilepy.gemm(a, b)                      # the plan, made on this thread
    got, errors = [], []

    def replay():
        try:
            got.append(tilepy.gemm(a, b))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=replay)
    t.start()
    t.join()
    assert not errors, errors
    want = a.float() @ b.float()
    assert (got[0].float() - want).abs().max().item() < 2e-2 * want.abs().max().item()


def test_a_refused_programmatic_launch_falls_back_to_stream_order():
    """A ``dependent`` plan whose ``cuLaunchKernelEx`` the driver refuses (a driver that
    cannot make or capture a programmatic launch) launches with ``cuLaunchKernel`` instead,
    that time and after; a plain launch that fails is still an error naming the call; a
    refusal for want of a context is not taken for it (the plan retries in its device)."""
    calls = []

    class Driver:
        def __init__(self, ex_err):
            self.ex_err = ex_err

        def cuLaunchKernelEx(self, cfg, func, params, extra):
            calls.append("ex")
            return (self.ex_err,)

    def plain(ok):
        def launch_fn(*args):
            calls.append("plain")
            return (0 if ok else 7,)
        return launch_fn

    class Cfg:
        pass

    def stub(ex_err, plain_ok):
        plan = object.__new__(LaunchPlan)
        plan.dependent, plan.cluster, plan.block, plan.smem = True, 1, (32, 1, 1), 0
        plan._ex_cfg, plan._driver = Cfg(), Driver(ex_err)
        plan._launch_fn, plan._func = plain(plain_ok), object()
        plan._success, plan._no_context = 0, 201
        plan._params_addr = plan._extra_addr = 0
        plan.grid = (4, 1, 1)
        return plan

    plan = stub(801, True)                       # CUDA_ERROR_NOT_SUPPORTED, then fine
    plan._launch_grid(0, (4, 1, 1))
    assert calls == ["ex", "plain"] and not plan.dependent and plan._ex_cfg is None
    plan._launch_grid(0, (4, 1, 1))
    assert calls == ["ex", "plain", "plain"]
    calls.clear()
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed"):
        stub(801, False)._launch_grid(0, (4, 1, 1))
    assert calls == ["ex", "plain"]
    calls.clear()
    plan = stub(201, True)                       # no context: the caller's retry, not this
    with pytest.raises(launch.NoContextError):
        plan._launch_grid(0, (4, 1, 1))
    assert calls == ["ex"] and plan.dependent
