"""tilepy.gemm_softmax: results against float64 NumPy (simulator, small shapes: edges that are
not multiples of a tile, N = 1, several N tiles, both parks, both dtypes, any scale), the config
choice, every user error before launch, the offline compile of the GPU configs, and (GPU) full
size against PyTorch. The speed-up over tilepy.gemm followed by tilepy.softmax is a benchmark
(bench/test_bench_softmax.py::test_gemm_softmax_vs_unfused), not a test.

In the simulator every CUDA thread is a Python thread: the kernels here run the smallest
config (32-row blocks of two warps, 32-column N tiles, k-steps of 16), so a few dozen columns
already cross several N tiles and k-steps.
"""

import functools

import numpy as np
import pytest
from numba import cuda, types

import tilepy
from tilepy import arrays
from tilepy.ops import gemm_softmax as gs
from tilepy.ops import gemm_softmax_mma_sync as gsk
from tilepy.ops.gemm_softmax_mma_sync import GemmSoftmaxConfig
from tilepy.ops.gemm_wgmma_ws import WsConfig
from tilepy.ptx import global_addr, shared_addr
from tilepy.ptx.cp_async import cp_async_wait_all
from tilepy.tile import layout
from tilepy.tile.config import BlockTile, GemmConfig, Pipeline, WarpLayout

ml_dtypes = pytest.importorskip("ml_dtypes")

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# The unnormalised value is rounded to the dtype once before the rescale and the result once
# more: up to one unit in the last place (f16 2**-10, bf16 2**-7 relative) plus float32 math.
RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2}
# float16 results below its subnormal spacing round to 0; bfloat16 and the float32 inside
# flush results below 2**-126 (ex2.approx.ftz).
ATOL = {"float16": 2.0**-24, "bfloat16": 2.0**-126}

pytestmark = [pytest.mark.sim, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def rand(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(NP[dtype])


def reference(a, b, scale):
    """softmax(scale · a @ b) in float64, from the 16-bit inputs (NaN rows stay NaN)."""
    with np.errstate(invalid="ignore", over="ignore"):
        x = scale * (np.asarray(a).astype(np.float64) @ np.asarray(b).astype(np.float64))
        x = x - x.max(axis=1, keepdims=True)
        e = np.exp(x)
        return e / e.sum(axis=1, keepdims=True)


def check(got, ref, dtype):
    got = np.asarray(got).astype(np.float64)
    assert got.shape == ref.shape
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan), "NaN pattern differs (or an unwritten element)"
    err = np.abs(got[~nan] - ref[~nan])
    bound = RTOL[dtype] * np.abs(ref[~nan]) + ATOL[dtype]
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


def poisoned(shape, dtype):
    return np.full(shape, np.nan, NP[dtype])


def bits(x):
    return np.asarray(x).view(np.uint16)


@pytest.fixture(autouse=True)
def fresh_plans():
    """Every test starts with no cached launch plans (a plan cached by an earlier test with
    the same signature would skip the kernel choices some tests watch)."""
    gs._PLANS.clear()
    yield
    gs._PLANS.clear()


@pytest.fixture
def global_park(monkeypatch):
    """Make every N take the long-row path (unnormalised rows through global memory)."""
    monkeypatch.setattr(gs, "ON_CHIP_MAX_N", 0)


# ---- results -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k,scale", [
    (17, 33, 40, 0.5),      # no dimension a multiple of the tile; N over two tiles; unaligned N
    (5, 1, 16, 1.0),        # N = 1
    (40, 70, 24, -0.7),     # two row blocks, three N tiles (the last one 6 wide), negative scale
    (1, 1, 1, 2.0),
])
def test_shapes(dtype, m, n, k, scale):
    rng = np.random.default_rng()
    a, b = rand(rng, (m, k), dtype), rand(rng, (k, n), dtype)
    assert gs.choose_config(n, dtype).park == "smem"
    out = poisoned((m, n), dtype)
    assert tilepy.gemm_softmax(a, b, scale=scale, out=out) is out
    check(out, reference(a, b, scale), dtype)


# the TMA + wgmma kernel's softmax mode (config=WsConfig): its smallest chunk (64 columns),
# 2 stages; each case runs 384 simulated threads, so few and small
TMA_SIM = {"block_m": 128, "block_n": 64, "stages": 2, "persistent": True,
           "smem_epilogue": True}


@pytest.mark.parametrize("dtype,m,n,k,scale,b_col", [
    ("float16", 100, 300, 72, -0.5, False),   # 5 chunks, the last one partial; 2 k steps
    ("bfloat16", 140, 70, 40, 2.0, True),     # two row blocks; column-major b; K < 64
    pytest.param("float16", 70, 328, 64, 1.0, False,   # 16-byte rows: TMA out; 6 chunks
                 marks=pytest.mark.extended),
    ("bfloat16", 130, 200, 24, 0.7, False),   # TMA out: 2 row blocks, last chunk partial
], ids=["f16-5-chunks-negative-scale", "bf16-2-row-blocks-col-major-b", "f16-tma-out",
        "bf16-tma-out-partial"])
def test_tma_softmax_mode(monkeypatch, dtype, m, n, k, scale, b_col):
    from tilepy.ptx import tma as T

    stores = {"n": 0}
    orig = T.tma_store_2d_hint

    def counted(*args):
        stores["n"] += 1
        return orig(*args)
    monkeypatch.setattr(T, "tma_store_2d_hint", counted)
    rng = np.random.default_rng()
    a = rand(rng, (m, k), dtype)
    b = rand(rng, (n, k), dtype).T if b_col else rand(rng, (k, n), dtype)
    out = poisoned((m, n), dtype)
    cfg = WsConfig(dtype=dtype, **TMA_SIM)
    assert tilepy.gemm_softmax(a, b, scale=scale, out=out, config=cfg) is out
    check(out, reference(a, b, scale), dtype)
    # rows of 16-byte multiples go out through TMA stores (one 64 × 64 box per warpgroup and
    # chunk, each chunk but the last again after its rescale), others through the threads
    blocks, chunks = -(-m // 128), -(-n // 64)
    assert stores["n"] == (blocks * 2 * (2 * chunks - 1) if (2 * n) % 16 == 0 else 0), stores


@pytest.mark.parametrize("dtype,k,m", [("float16", 136, 130), ("bfloat16", 40, 60)],
                         ids=["f16-overlap", "bf16-k-too-short-to-overlap"])
def test_tma_softmax_mode_overlap(monkeypatch, dtype, k, m):
    """128-column chunks with TMA out: two accumulators per consumer, each chunk's softmax
    under the next chunk's first k-steps (K of 3 k-steps with 3 stages); with K of one k-step
    the plain chunk loop. 3 chunks, the last partial; 2 row blocks (1 for the short K)."""
    from tilepy.ops import gemm_softmax_wgmma as gsw

    made = []
    real = gsw.gemm_softmax_wgmma_kernel
    monkeypatch.setattr(gsw, "gemm_softmax_wgmma_kernel",
                        lambda *a, **kw: made.append(kw.get("overlap")) or real(*a, **kw))
    rng = np.random.default_rng()
    n = 264
    a, b = rand(rng, (m, k), dtype), rand(rng, (k, n), dtype)
    out = poisoned((m, n), dtype)
    cfg = WsConfig(128, 128, 3, dtype, persistent=True, smem_epilogue=True)
    tilepy.gemm_softmax(a, b, scale=0.6, out=out, config=cfg)
    check(out, reference(a, b, 0.6), dtype)
    assert made == [k >= 128]


def test_tma_softmax_mode_strided_out():
    """out with a column stride of 2 elements (a view of every other column): staged stores
    and the rescale go element by element, no 16-byte vectors."""
    rng = np.random.default_rng()
    a, b = rand(rng, (40, 24), "float16"), rand(rng, (24, 72), "float16")
    big = poisoned((40, 144), "float16")
    out = big[:, ::2]
    tilepy.gemm_softmax(a, b, scale=0.5, out=out, config=WsConfig(**TMA_SIM))
    check(out, reference(a, b, 0.5), "float16")
    assert np.isnan(big[:, 1::2].astype(np.float64)).all()   # nothing written in between


def test_tma_softmax_mode_errors():
    a = np.zeros((8, 16), np.float16)
    b = np.zeros((16, 8), np.float16)
    with pytest.raises(ValueError, match="config is for bfloat16"):
        tilepy.gemm_softmax(a, b, config=WsConfig(dtype="bfloat16", **TMA_SIM))
    with pytest.raises(ValueError, match="softmax mode needs"):
        tilepy.gemm_softmax(a, b, config=WsConfig(128, 64, 2, "float16"))
    with pytest.raises(ValueError, match="at most 1024 columns"):
        tilepy.gemm_softmax(a, np.zeros((16, 1030), np.float16),
                            config=WsConfig(**TMA_SIM))


# ---- launch plans reused per call signature ----------------------------------------------------

@pytest.fixture
def plans_built(monkeypatch):
    """The names of the launch-plan classes built from here on (the op's plans; the tensor-map
    writer kernel's own plans are left out)."""
    from tilepy import launch
    from tilepy.tile import device_write

    built = []
    real = launch.LaunchPlan.__init__

    def init(self, dispatcher, *args, **kwargs):
        if dispatcher is not device_write._write_words:
            built.append(type(self).__name__)
        real(self, dispatcher, *args, **kwargs)

    monkeypatch.setattr(launch.LaunchPlan, "__init__", init)
    return built


@pytest.mark.parametrize("park", ["smem", "global"])
def test_cached_plan_mma_sync(monkeypatch, plans_built, park):
    """The mma.sync kernel: a second call with new arrays (new contents, new allocations) and
    a new scale of the same signature reuses the plan (a fresh result allocated per call and,
    park="global", a fresh float32 scratch per call); a caller's out or another shape is
    another signature."""
    if park == "global":
        monkeypatch.setattr(gs, "ON_CHIP_MAX_N", 0)
    rng = np.random.default_rng()
    m, n, k = 37, 40, 24
    keep = []

    def call(scale, rows=m, out=None):
        a, b = rand(rng, (rows, k), "float16"), rand(rng, (k, n), "float16")
        keep.append((a, b))    # alive: the next call's arrays are new allocations
        got = tilepy.gemm_softmax(a, b, scale=scale, out=out)
        check(got, reference(a, b, scale), "float16")
        return got

    first = call(0.5)
    assert gs.choose_config(n, "float16").park == park
    assert plans_built == ["LaunchPlan"] and len(gs._PLANS) == 1
    (entry,) = gs._PLANS.values()
    assert (entry.alloc_seg is not None) == (park == "global")
    if park == "global":
        scratch = []
        real = entry.alloc_seg
        entry.alloc_seg = lambda: scratch.append(1) or real()
    second = call(-0.8)
    assert plans_built == ["LaunchPlan"] and second is not first
    if park == "global":
        assert scratch == [1]
    call(0.3, out=poisoned((m, n), "float16"))            # the caller's out: a new signature
    call(1.7, out=poisoned((m, n), "float16"))            # ... and its second call
    assert plans_built == ["LaunchPlan"] * 2 and len(gs._PLANS) == 2
    call(0.5, rows=m + 1)                                  # another shape
    assert plans_built == ["LaunchPlan"] * 3 and len(gs._PLANS) == 3
    with pytest.raises(TypeError, match="scale must be a float"):   # checked on a hit too
        tilepy.gemm_softmax(*keep[1], scale="1")
    with pytest.raises(ValueError, match="scale must be finite"):
        tilepy.gemm_softmax(*keep[1], scale=float("nan"))


def test_inputs_that_needed_a_copy_are_not_cached(plans_built):
    """b with rows of 66 bytes (an aligned copy), and K = 0 (zeros): every call builds its
    launch afresh, and nothing is cached."""
    rng = np.random.default_rng()
    for _ in range(2):
        a, b = rand(rng, (9, 16), "float16"), rand(rng, (16, 33), "float16")
        check(tilepy.gemm_softmax(a, b, scale=0.4), reference(a, b, 0.4), "float16")
    tilepy.gemm_softmax(np.ones((4, 0), np.float16), np.ones((0, 8), np.float16))
    assert plans_built == ["LaunchPlan"] * 3 and len(gs._PLANS) == 0


def test_cached_plan_tma_softmax_mode(plans_built):
    """The TMA + wgmma softmax mode (config=WsConfig), 144-byte rows: TMA-stored out, so the
    maps describe a, b and out. A second call with new arrays reuses the plan (its maps for
    the new pointers written by the map writer into buffers from the caller's allocator,
    64-byte aligned); the caller's out is another signature, whose repeated pointers reuse
    their maps; another shape misses."""
    rng = np.random.default_rng()
    cfg = WsConfig(dtype="float16", **TMA_SIM)
    m, n, k = 70, 72, 40
    keep = []   # every array stays alive: a later call's arrays are new allocations

    def call(scale, out=None, a=None, b=None, rows=m):
        if a is None:
            a, b = rand(rng, (rows, k), "float16"), rand(rng, (k, n), "float16")
        got = tilepy.gemm_softmax(a, b, scale=scale, out=out, config=cfg)
        keep.append((a, b, got))
        check(got, reference(a, b, scale), "float16")
        return got

    call(0.6)
    assert plans_built == ["TmaLaunchPlan"] and len(gs._PLANS) == 1
    (entry,) = gs._PLANS.values()
    plan = entry.bound.plan
    assert plan.maps_encoded == 1
    call(-1.3)                                       # new a, b and a fresh out: new maps
    assert plans_built == ["TmaLaunchPlan"] and plan.maps_encoded == 2
    assert len(plan._maps) == 2
    for buf in plan._maps.values():
        assert buf.ptr % 64 == 0 and isinstance(buf.owner, np.ndarray)
    out = poisoned((m, n), "float16")
    call(0.9, out=out)                               # the caller's out: another signature
    assert plans_built == ["TmaLaunchPlan"] * 2 and len(gs._PLANS) == 2
    (_, entry2) = gs._PLANS.values()
    a, b, _ = keep[-1]
    out[:] = np.nan
    call(0.2, out=out, a=a, b=b)                     # the same pointers: the same maps
    assert entry2.bound.plan.maps_encoded == 1 and plans_built == ["TmaLaunchPlan"] * 2
    call(0.6, rows=m + 60)                           # another shape
    assert plans_built == ["TmaLaunchPlan"] * 3 and len(gs._PLANS) == 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", [(17, 70, 40), (3, 40, 8)])   # K = 8: one k-step per N tile
def test_large_n_fallback_gives_the_same_bits(global_park, monkeypatch, dtype, m, n, k):
    rng = np.random.default_rng()
    a, b = rand(rng, (m, k), dtype), rand(rng, (k, n), dtype)
    assert gs.choose_config(n, dtype).park == "global"
    out = poisoned((m, n), dtype)
    tilepy.gemm_softmax(a, b, scale=0.8, out=out)
    check(out, reference(a, b, 0.8), dtype)
    monkeypatch.setattr(gs, "ON_CHIP_MAX_N", 1 << 30)
    assert gs.choose_config(n, dtype).park == "smem"
    assert np.array_equal(bits(tilepy.gemm_softmax(a, b, scale=0.8)), bits(out))


@pytest.mark.parametrize("park", ["smem", "global"])
def test_warps_along_m_and_column_major_b_read_in_place(monkeypatch, park):
    """A config with two warps stacked along M (one warp per row segment), and b given as the
    transpose of a row-major (N, K) array: read in place, not copied."""
    dtype = "float16"
    cfg = GemmSoftmaxConfig(GemmConfig(BlockTile(32, 32, 16), WarpLayout(2, 1), Pipeline(2),
                                       dtype), park)
    rng = np.random.default_rng()
    a, bt = rand(rng, (37, 48), dtype), rand(rng, (45, 48), dtype)
    copies = []
    real = arrays.copy_aligned
    monkeypatch.setattr(arrays, "copy_aligned", lambda op, *x: copies.append(op.name) or
                        real(op, *x))
    out = poisoned((37, 45), dtype)
    tilepy.gemm_softmax(a, bt.T, scale=0.3, out=out, config=cfg)
    assert copies == []
    check(out, reference(a, bt.T, 0.3), dtype)


@pytest.mark.parametrize("park", ["smem", "global"])
def test_the_gpu_configs_themselves(park):
    """The built-in GPU configs, slow in the simulator (4 warps of 64 x 64 tiles) but the ones
    that run: one 64-row block, two 256-column N tiles (the last one partial), two k-steps."""
    base = gs._ON_CHIP_GPU[0] if park == "smem" else gs._GLOBAL_GPU
    m, n = 61, 300
    rng = np.random.default_rng()
    a, b = rand(rng, (m, 40), "float16"), rand(rng, (40, n), "float16")
    out = poisoned((m, n), "float16")
    tilepy.gemm_softmax(a, b, scale=0.3, out=out, config=GemmSoftmaxConfig(base, park))
    check(out, reference(a, b, 0.3), "float16")


@pytest.mark.parametrize("park", ["smem", "global"])
def test_out_written_one_element_at_a_time(monkeypatch, park):
    """N even, but out transposed (column stride != 1) or its rows not 4-byte aligned: the
    kernel writes (and, park="global", reads back) 16-bit elements instead of pairs."""
    if park == "global":
        monkeypatch.setattr(gs, "ON_CHIP_MAX_N", 0)
    rng = np.random.default_rng()
    a, b = rand(rng, (9, 16), "bfloat16"), rand(rng, (16, 40), "bfloat16")
    ref = reference(a, b, 1.5)
    out_t = np.full((40, 9), np.nan, ml_dtypes.bfloat16).T
    tilepy.gemm_softmax(a, b, scale=1.5, out=out_t)
    check(out_t, ref, "bfloat16")
    out_odd = np.full((9, 41), np.nan, ml_dtypes.bfloat16)[:, 1:]     # rows 82 bytes apart
    assert gs._out_view(arrays.describe(out_odd, "out"), 40)[1] is False
    tilepy.gemm_softmax(a, b, scale=1.5, out=out_odd)
    check(out_odd, ref, "bfloat16")
    assert np.array_equal(bits(out_odd), bits(out_t))


def test_scales_zero_huge_and_negative():
    rng = np.random.default_rng()
    a, b = rand(rng, (9, 20), "float16"), rand(rng, (20, 50), "float16")
    got = tilepy.gemm_softmax(a, b, scale=0.0)
    np.testing.assert_allclose(got.astype(np.float64), 1 / 50, rtol=1e-3)
    for scale in (40.0, -25.0):       # scores of several hundreds: almost one-hot rows
        got = tilepy.gemm_softmax(a, b, scale=scale)
        assert np.isfinite(got.astype(np.float64)).all()
        check(got, reference(a, b, scale), "float16")


def test_nan_rows_and_rows_sum_to_one():
    rng = np.random.default_rng()
    a, b = rand(rng, (6, 24), "bfloat16"), rand(rng, (24, 40), "bfloat16")
    a[2, 5] = np.nan
    got = tilepy.gemm_softmax(a, b).astype(np.float64)
    assert np.isnan(got[2]).all() and not np.isnan(np.delete(got, 2, axis=0)).any()
    np.testing.assert_allclose(np.delete(got, 2, axis=0).sum(axis=1), 1.0, rtol=2e-2)


def test_empty_and_k_zero():
    got = tilepy.gemm_softmax(np.ones((4, 0), np.float16), np.ones((0, 6), np.float16))
    assert np.array_equal(bits(got), bits(np.full((4, 6), 1 / 6, np.float16)))
    assert tilepy.gemm_softmax(np.ones((0, 8), np.float16), np.ones((8, 5), np.float16)).shape \
        == (0, 5)
    assert tilepy.gemm_softmax(np.ones((3, 8), np.float16), np.ones((8, 0), np.float16)).shape \
        == (3, 0)


# ---- the config choice -------------------------------------------------------------------------

def test_gpu_config_choice(monkeypatch):
    monkeypatch.setattr(arrays, "SIMULATOR", False)   # what choose_config(n, dtype) sees
    # on sm_90: the TMA + wgmma kernel where its output can be TMA-stored, up to 16 chunks
    for n in (1, 1000, 4096):
        cfg = gs.choose_config(n, "bfloat16", hopper=True)
        assert isinstance(cfg, WsConfig) and cfg.dtype == "bfloat16"
        assert (cfg.block_m, cfg.block_n, cfg.stages) == gs.HOPPER_CONFIG
    assert isinstance(gs.choose_config(4097, "float16", hopper=True), GemmSoftmaxConfig)
    assert isinstance(gs.choose_config(1000, "float16", hopper=True, tma_out=False),
                      GemmSoftmaxConfig)
    monkeypatch.setattr(gs, "choose_config", functools.partial(gs.choose_config, hopper=False))
    limit = 227 * 1024
    for n in (1, 256, 1000, 1024):
        cfg = gs.choose_config(n, "float16")
        assert cfg.park == "smem" and cfg.gemm.block.m == 64 and cfg.gemm.pipeline.stages == 4
        assert cfg.smem_bytes(n) <= limit
    assert gs.choose_config(1200, "bfloat16").gemm.pipeline.stages == 3
    assert gs.choose_config(1200, "bfloat16").gemm.dtype == "bfloat16"
    for n in (1300, 4096, 100000):
        cfg = gs.choose_config(n, "float16")
        assert cfg.park == "global" and cfg.smem_bytes(n) <= limit
    # smaller blocks keep longer rows on chip, where allowed
    monkeypatch.setattr(gs, "ON_CHIP_MIN_BLOCK_M", 16)
    cfg = gs.choose_config(4096, "float16")
    assert cfg.park == "smem" and cfg.gemm.block.m == 16 and cfg.fits(4096)
    assert gs.choose_config(6000, "float16").park == "global"
    cands = gs.candidates(1024, "float16")
    assert {c.park for c in cands if isinstance(c, GemmSoftmaxConfig)} == {"smem", "global"}
    assert any(isinstance(c, WsConfig) for c in cands)          # the TMA softmax mode, timed
    assert not any(isinstance(c, WsConfig) for c in gs.candidates(5000, "float16"))
    assert all(c.fits(1024) for c in gs.candidates(1024, "bfloat16")
               if isinstance(c, GemmSoftmaxConfig))


@pytest.mark.parametrize("rows,cols,threads", [(32, 256, 128), (64, 32, 128), (16, 64, 128)])
def test_tile_copy_lands_in_the_swizzled_layout(rows, cols, threads):
    """The lean tile copy of the GPU configs (a B tile of 32 x 256 takes 8 passes of 4 rows,
    whose swizzle differs by a constant XOR) writes every element where the fragment loads
    look for it (tilepy.tile.layout), and zero-fills past both bounds."""
    setup, issue = gsk.tile_copy(rows, cols, threads)
    size = rows * cols

    @cuda.jit
    def kernel(src, rows_left, cols_left, dst):
        tile = cuda.shared.array(size, types.uint16)
        tid = cuda.threadIdx.x
        r0, c, sh0 = setup(tid)
        stride = src.strides[0]
        start = np.int64(global_addr(src, (0, 0))) + r0 * stride + c * 16
        issue(shared_addr(tile, 0), start, r0, c, sh0, stride, rows_left, cols_left)
        cp_async_wait_all()
        cuda.syncthreads()
        for i in range(tid, size, threads):
            dst[i] = tile[i]

    rng = np.random.default_rng()
    src = rng.integers(1, 60000, (rows, cols)).astype(np.uint16)
    rows_left, cols_left = rows - 3, cols - 11
    dst = np.zeros(size, np.uint16)
    kernel[1, threads](src, rows_left, cols_left, dst)
    for r in range(rows):
        got = np.array([dst[layout.element_offset(r, col, cols)] for col in range(cols)])
        want = src[r] * (np.arange(cols) < cols_left) if r < rows_left else 0 * src[r]
        assert np.array_equal(got, want), r


def test_tile_copy_needs_whole_passes():
    assert gsk.copy_plan_ok(32, 256, 128) and not gsk.copy_plan_ok(16, 32, 128)
    with pytest.raises(ValueError, match="whole passes"):
        gsk.tile_copy(16, 32, 128)


# ---- errors, before launch ---------------------------------------------------------------------

def test_errors_are_raised_before_launch(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched")

    monkeypatch.setattr(gsk, "plan", no_launch)
    monkeypatch.setattr(gs, "_run", no_launch)   # where gemm_softmax builds and launches
    a, b = np.ones((4, 8), np.float16), np.ones((8, 16), np.float16)
    with pytest.raises(ValueError, match=r"\(4, 8\).*\(9, 16\)"):
        tilepy.gemm_softmax(a, np.ones((9, 16), np.float16))
    with pytest.raises(TypeError, match="float16 and b bfloat16"):
        tilepy.gemm_softmax(a, b.astype(ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match="a: dtype float32"):
        tilepy.gemm_softmax(a.astype(np.float32), b.astype(np.float32))
    with pytest.raises(TypeError, match="b: dtype float64"):
        tilepy.gemm_softmax(a, b.astype(np.float64))
    with pytest.raises(TypeError, match="list"):
        tilepy.gemm_softmax([[1.0]], b)
    with pytest.raises(ValueError, match="2-D"):
        tilepy.gemm_softmax(np.ones((2, 4, 8), np.float16), b)
    with pytest.raises(ValueError, match=r"out must have shape \(4, 16\)"):
        tilepy.gemm_softmax(a, b, out=np.empty((4, 15), np.float16))
    with pytest.raises(ValueError, match="out must have dtype float16"):
        tilepy.gemm_softmax(a, b, out=np.empty((4, 16), ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match="out: dtype float32"):
        tilepy.gemm_softmax(a, b, out=np.empty((4, 16), np.float32))
    with pytest.raises(TypeError, match="scale must be a float"):
        tilepy.gemm_softmax(a, b, scale="1")
    with pytest.raises(ValueError, match="scale must be finite"):
        tilepy.gemm_softmax(a, b, scale=float("inf"))
    with pytest.raises(TypeError, match="config must be"):
        tilepy.gemm_softmax(a, b, config=gs.SIMULATOR_CONFIG)
    with pytest.raises(ValueError, match="config is for bfloat16"):
        tilepy.gemm_softmax(a, b, config=GemmSoftmaxConfig(
            GemmConfig(BlockTile(32, 32, 16), WarpLayout(1, 2), Pipeline(2), "bfloat16")))
    with pytest.raises(ValueError, match="shared memory"):
        tilepy.gemm_softmax(np.ones((4, 8), np.float16), np.ones((8, 20000), np.float16),
                            config=GemmSoftmaxConfig(gs._ON_CHIP_GPU[0]))
    with pytest.raises(ValueError, match="park"):
        GemmSoftmaxConfig(gs.SIMULATOR_CONFIG, "registers")
    with pytest.raises(ValueError, match="whole copy passes"):
        GemmSoftmaxConfig(GemmConfig(BlockTile(16, 16, 48), WarpLayout(1, 1), Pipeline(2)))
    # a NumPy array on a machine with a GPU
    monkeypatch.setattr(arrays, "SIMULATOR", False)
    with pytest.raises(TypeError, match="a: a NumPy array lives on the host"):
        tilepy.gemm_softmax(a, b)


# ---- offline compile (no GPU, no simulator: a subprocess) ------------------------------------

@pytest.mark.compile
def test_gpu_configs_compile_for_sm90_without_spills():
    from tilepy.offline import find_ptxas, run_in_subprocess

    if find_ptxas() is None:
        pytest.skip("ptxas not found (install the test extra)")
    reports = run_in_subprocess("tilepy.ops.gemm_softmax_mma_sync:compile_reports")
    assert set(reports) == {name for name, *_ in gsk.compiled_configs()}
    for name, rep in reports.items():
        assert "error" not in rep, rep["error"]
        assert rep["fits"], (name, rep["smem_bytes"])
        assert rep["registers"] <= 255, (name, rep["registers"])
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, name
        assert rep["stack_frame"] == 0 and rep["local_bytes"] == 0, name
        c = rep["counts"]
        assert c["ld.local"] == 0 and c["st.local"] == 0, name
        assert c["mma"] >= 16 and c["ldmatrix"] >= 4 and c["cp.async"] >= 4, name
        assert c["cp.async.wait"] >= 1 and rep["ex2"] >= 16 and rep["f64"] == 0, name
        print(f"{name}: {rep['registers']} registers, {rep['smem_bytes']} B smem at "
              f"N={rep['n']} ({rep['config']})")


# ---- GPU: full size against PyTorch ------------------------------------------------------------

def _torch_inputs(m, n, k, dtype, seed=0):
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dtype)
    a = torch.randn(m, k, device="cuda", dtype=tdt, generator=g)
    b = torch.randn(k, n, device="cuda", dtype=tdt, generator=g)
    return torch, a, b


def gpu_check(got, a, b, scale, dtype):
    torch = pytest.importorskip("torch")
    want = torch.softmax(scale * (a.float() @ b.float()), dim=-1).double()
    got = got.double()
    assert not bool(torch.isnan(got).any()), "NaN (or an unwritten element)"
    err = (got - want).abs()
    bound = 2 * RTOL[dtype] * want.abs() + 2 * ATOL[dtype] + 1e-6 * want.abs().max()
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", [(16384, 1024, 1024), (16384, 4096, 1024), (4096, 1000, 520),
                                   (1000, 1100, 64), (333, 1300, 1000), (7, 1, 9),
                                   (513, 30000, 256)])
def test_gpu_full_size_against_torch(m, n, k, dtype):
    torch, a, b = _torch_inputs(m, n, k, dtype)
    scale = 1 / 32
    out = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
    assert tilepy.gemm_softmax(a, b, scale=scale, out=out) is out
    gpu_check(out, a, b, scale, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("block_n,stages", [(256, 3), (128, 4)], ids=["256-col", "128-col"])
@pytest.mark.parametrize("m,n,k,b_col", [(16384, 1024, 1024, False), (16384, 4096, 1024, False),
                                         (4096, 1000, 520, True), (333, 1300, 1000, False),
                                         (333, 1304, 1000, False), (7, 1, 9, False)])
def test_gpu_tma_softmax_mode_against_torch(m, n, k, b_col, block_n, stages, dtype):
    """config=WsConfig: the TMA + wgmma kernel's softmax mode (sm_90), full size; 256-column
    chunks (the built-in choice) and 128-column ones (overlapped where out is TMA-stored and
    K long enough; N = 4096 is 32 chunks of 128, over the limit, so refused)."""
    torch, a, b = _torch_inputs(m, n, k, dtype)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    if b_col:
        b = b.t().contiguous().t()
    cfg = WsConfig(128, block_n, stages, dtype, persistent=True, smem_epilogue=True)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
    if n > 16 * block_n:
        with pytest.raises(ValueError, match="at most"):
            tilepy.gemm_softmax(a, b, scale=1 / 32, out=out, config=cfg)
        return
    assert tilepy.gemm_softmax(a, b, scale=1 / 32, out=out, config=cfg) is out
    gpu_check(out, a, b, 1 / 32, dtype)


@pytest.mark.gpu
def test_gpu_both_parks_and_column_major_b_give_the_same_bits():
    torch, a, b = _torch_inputs(4096, 1024, 1024, "float16", seed=1)
    cfg = gs.choose_config(1024, "float16", hopper=False)
    assert cfg.park == "smem"
    on_chip = tilepy.gemm_softmax(a, b, scale=0.05, config=cfg)   # (sm_90's default is TMA)
    gpu_check(on_chip, a, b, 0.05, "float16")
    bt = b.t().contiguous().t()          # column-major b: read in place
    assert torch.equal(tilepy.gemm_softmax(a, bt, scale=0.05, config=cfg), on_chip)
    same_block = GemmSoftmaxConfig(cfg.gemm, "global")
    assert torch.equal(tilepy.gemm_softmax(a, b, scale=0.05, config=same_block), on_chip)
    gpu_check(tilepy.gemm_softmax(a, b, scale=0.05, config=GemmSoftmaxConfig(
        gs._GLOBAL_GPU, "global")), a, b, 0.05, "float16")


@pytest.mark.gpu
def test_gpu_stream_and_cupy():
    torch, a, b = _torch_inputs(8192, 1024, 512, "bfloat16", seed=2)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a2 = a * 2                       # ordered on s before the kernel
        got = tilepy.gemm_softmax(a2, b, scale=0.1)
    s.synchronize()
    gpu_check(got, a * 2, b, 0.1, "bfloat16")
    cupy = pytest.importorskip("cupy")
    ca = cupy.asarray(a.float().cpu().numpy()).astype(cupy.float16)
    cb = cupy.asarray(b.float().cpu().numpy()).astype(cupy.float16)
    res = tilepy.gemm_softmax(ca, cb, scale=0.1)
    assert isinstance(res, cupy.ndarray) and res.dtype == cupy.float16
