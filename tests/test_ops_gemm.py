"""tilepy.gemm: results against float64 NumPy (simulator, small shapes; GPU, full size), and
every user error raised before launch."""

import math

import numpy as np
import pytest

import tilepy
from tilepy.testing.reference import ACTIVATIONS

ml_dtypes = pytest.importorskip("ml_dtypes")

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
ACT = ACTIVATIONS


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(NP[dtype])


def f64(x):
    return np.asarray(x).astype(np.float64)


def check(got, ref, dtype, out_dtype=None):
    got = f64(got)
    assert got.shape == ref.shape
    assert not np.isnan(got).any(), "NaN or unwritten element"
    tol = TOL[out_dtype or dtype]
    scale = max(np.abs(ref).max(), 1e-6)
    assert np.abs(got - ref).max() / scale <= tol


pytestmark = pytest.mark.sim


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (17, 33, 65), (64, 64, 64)])
def test_shapes(dtype, m, n, k):
    rng = np.random.default_rng()
    a, b = rand(rng, (m, k), dtype), rand(rng, (k, n), dtype)
    out = np.full((m, n), np.nan, NP[dtype])
    res = tilepy.gemm(a, b, out=out)
    assert res is out
    check(out, f64(a) @ f64(b), dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_transposed_inputs_and_float32_out(dtype):
    rng = np.random.default_rng()
    at = rand(rng, (40, 24), dtype)        # a = at.T is column-major: copied to an aligned buffer
    bt = rand(rng, (48, 40), dtype)        # b = bt.T is column-major: read in place
    got = tilepy.gemm(at.T, bt.T, out_dtype="float32")
    assert got.dtype == np.float32
    check(got, f64(at.T) @ f64(bt.T), dtype, "float32")


@pytest.mark.parametrize("act", list(ACT))
def test_epilogues(act):
    rng = np.random.default_rng()
    dtype = "float16"
    a, b = rand(rng, (20, 24), dtype), rand(rng, (24, 40), dtype)
    bias = rng.standard_normal(40).astype(np.float32)
    c = rand(rng, (20, 40), dtype)
    got = tilepy.gemm(a, b, bias=bias, activation=act, alpha=0.5, beta=-1.5, c=c)
    ref = ACT[act](0.5 * (f64(a) @ f64(b)) - 1.5 * f64(c) + bias)
    check(got, ref, dtype)


def test_batched_and_broadcast():
    rng = np.random.default_rng()
    a = rand(rng, (3, 9, 16), "bfloat16")
    b = rand(rng, (3, 16, 24), "bfloat16")
    check(tilepy.gemm(a, b), f64(a) @ f64(b), "bfloat16")
    b2 = rand(rng, (16, 24), "bfloat16")     # 2-D b broadcast over the batch
    check(tilepy.gemm(a, b2), f64(a) @ f64(b2), "bfloat16")


def test_unaligned_leading_dimensions_take_the_copy_path():
    rng = np.random.default_rng()
    a, b = rand(rng, (7, 13), "float16"), rand(rng, (13, 11), "float16")  # rows of 26/22 bytes
    check(tilepy.gemm(a, b), f64(a) @ f64(b), "float16")


def test_float32_is_exact_path():
    rng = np.random.default_rng()
    a, b = rand(rng, (19, 21), "float32"), rand(rng, (21, 18), "float32")
    bias = rng.standard_normal(18).astype(np.float32)
    check(tilepy.gemm(a, b, bias=bias, activation="silu"),
          ACT["silu"](f64(a) @ f64(b) + bias), "float32")


def test_zero_sized_dimensions_follow_numpy():
    a, b = np.ones((5, 0), np.float16), np.ones((0, 3), np.float16)
    got = tilepy.gemm(a, b)
    assert got.shape == (5, 3) and not np.any(got)
    bias = np.arange(3, dtype=np.float32)
    assert np.array_equal(f64(tilepy.gemm(a, b, bias=bias)), np.tile(np.arange(3.0), (5, 1)))
    assert tilepy.gemm(np.ones((0, 4), np.float16), np.ones((4, 3), np.float16)).shape == (0, 3)


def test_outputs_with_overlapping_elements_are_refused():
    """An ``out`` whose elements share memory (a broadcast view) would take the writes of
    several results in one place: gemm, grouped_gemm and gemm_softmax refuse it before
    launch, naming it."""
    a, b = np.ones((4, 8), np.float16), np.ones((8, 16), np.float16)
    shared = np.broadcast_to(np.zeros((1, 16), np.float16), (4, 16))
    with pytest.raises(ValueError, match="out has overlapping elements"):
        tilepy.gemm(a, b, out=shared)
    with pytest.raises(ValueError, match="out has overlapping elements"):
        tilepy.grouped_gemm(a, np.ones((2, 8, 16), np.float16), np.array([1, 4], np.int32),
                            out=shared)
    with pytest.raises(ValueError, match="out has overlapping elements"):
        tilepy.gemm_softmax(a, b, out=shared)


def test_errors_are_raised_before_launch():
    a, b = np.ones((4, 8), np.float16), np.ones((8, 16), np.float16)
    with pytest.raises(ValueError, match=r"\(4, 8\).*\(9, 16\)"):
        tilepy.gemm(a, np.ones((9, 16), np.float16))
    with pytest.raises(TypeError, match="float16 and b float32"):
        tilepy.gemm(a, b.astype(np.float32))
    with pytest.raises(TypeError, match="float64"):
        tilepy.gemm(a.astype(np.float64), b.astype(np.float64))
    with pytest.raises(TypeError, match="list"):
        tilepy.gemm([[1.0]], b)
    with pytest.raises(ValueError, match="out must have shape"):
        tilepy.gemm(a, b, out=np.empty((4, 15), np.float16))
    with pytest.raises(ValueError, match="out must have dtype"):
        tilepy.gemm(a, b, out=np.empty((4, 16), np.float32))
    with pytest.raises(ValueError, match="beta != 0 needs c"):
        tilepy.gemm(a, b, beta=1.0)
    with pytest.raises(ValueError, match="activation"):
        tilepy.gemm(a, b, activation="tanh")
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\)"):
        tilepy.gemm(a, b, bias=np.ones(8, np.float32))
    with pytest.raises(NotImplementedError, match="TF32"):
        tilepy.gemm(a.astype(np.float32), b.astype(np.float32), allow_tf32=True)
    with pytest.raises(ValueError, match="batch sizes differ"):
        tilepy.gemm(np.ones((2, 4, 8), np.float16), np.ones((3, 8, 16), np.float16))


# ---- the launch-plan cache: a repeated signature must use the new call's arrays ----------

@pytest.mark.parametrize("bias_dtype", ["float16", "bfloat16"])
def test_a_bias_that_needs_float32_is_converted_per_call_through_the_plan(bias_dtype):
    """A 16-bit bias is read as a float32 copy; the plan is still reused (before, every such
    call rebuilt it: ~1.3 ms of host time per call with the TMA kernel on the H200), and each
    call must convert its own bias, not reuse the first call's copy."""
    from tilepy.ops import gemm as g

    rng = np.random.default_rng()
    g._PLANS.clear()
    m, n, k = 20, 24, 40
    a, b = rand(rng, (m, k), "float16"), rand(rng, (k, n), "float16")
    for i in range(3):
        bias = rand(rng, (n,), bias_dtype)
        out = np.full((m, n), np.nan, np.float16)
        tilepy.gemm(a, b, bias=bias, activation="relu", out=out)
        assert len(g._PLANS) == 1
        check(out, np.maximum(f64(a) @ f64(b) + f64(bias), 0), "float16")


def test_repeated_calls_reuse_the_plan_with_new_data():
    """Calls 2… take the cached plan (no validation, no views): each must still read its own
    inputs, write its own (new or given) output and use its own alpha / beta / c."""
    from tilepy.ops import gemm as g

    rng = np.random.default_rng()
    g._PLANS.clear()
    m, n, k = 20, 24, 40
    a, b = rand(rng, (m, k), "float16"), rand(rng, (k, n), "float16")
    bias = rng.standard_normal(n).astype(np.float32)
    first = tilepy.gemm(a, b, bias=bias)  # builds the plan
    assert len(g._PLANS) == 1
    check(first, f64(a) @ f64(b) + bias, "float16")
    for alpha in (1.0, -0.5):
        x, y = rand(rng, (m, k), "float16"), rand(rng, (k, n), "float16")
        bias2 = rng.standard_normal(n).astype(np.float32)
        got = tilepy.gemm(x, y, bias=bias2, alpha=alpha)
        assert got is not first and len(g._PLANS) == 1
        check(got, alpha * (f64(x) @ f64(y)) + bias2, "float16")
    # out given, beta·c: another signature, then reused with new c and beta
    for beta in (0.5, 2.0):
        x, y = rand(rng, (m, k), "float16"), rand(rng, (k, n), "float16")
        c = rand(rng, (m, n), "float16")
        out = np.full((m, n), np.nan, np.float16)
        assert tilepy.gemm(x, y, beta=beta, c=c, out=out) is out
        check(out, f64(x) @ f64(y) + beta * f64(c), "float16")
    assert len(g._PLANS) == 2


def test_same_buffer_twice_then_distinct_buffers():
    """A plan first built for gemm(a, a) must not tie b to a's pointer."""
    rng = np.random.default_rng()
    a = rand(rng, (32, 32), "float16")
    check(tilepy.gemm(a, a), f64(a) @ f64(a), "float16")
    x, y = rand(rng, (32, 32), "float16"), rand(rng, (32, 32), "float16")
    check(tilepy.gemm(x, y), f64(x) @ f64(y), "float16")


def test_views_with_other_alignment_do_not_share_a_plan():
    """A misaligned view has the same shape and strides as an aligned one: the signature
    holds the alignment, so the misaligned call takes the copying path, not the plan."""
    rng = np.random.default_rng()
    buf = rand(rng, (16 * 40 + 8,), "float16")
    a_ok = buf[:16 * 40].reshape(16, 40)
    a_off = buf[1:1 + 16 * 40].reshape(16, 40)   # 2-byte offset
    b = rand(rng, (40, 16), "float16")
    check(tilepy.gemm(a_ok, b), f64(a_ok) @ f64(b), "float16")
    check(tilepy.gemm(a_off, b), f64(a_off) @ f64(b), "float16")


# ---- batches past the grid's y limit (tilepy.launch.MAX_GRID_YZ, lowered here) -----------

@pytest.fixture
def grid_limit(monkeypatch):
    """CUDA's grid y / z limit lowered to 3, and no launch plan built under another limit
    before or after the test."""
    from tilepy import launch
    from tilepy.ops import gemm as g

    monkeypatch.setattr(launch, "MAX_GRID_YZ", 3)
    g._PLANS.clear()
    yield 3
    g._PLANS.clear()


def _launched_chunks(limit):
    """The chunks of the one cached plan (each at most ``limit`` blocks along y and z)."""
    from tilepy.ops import gemm as g

    (entry,) = g._PLANS.values()
    plan = entry.bound.plan
    assert plan.chunks is not None and len(plan.chunks) > 1
    assert all(max(grid[1:]) <= limit for grid, _ in plan.chunks)
    return plan.chunks


@pytest.mark.parametrize("b_layout", ["row", "col"])
def test_a_batch_past_the_grid_limit_launches_in_chunks(grid_limit, b_layout):
    """7 matrices on 3-block launches: a batched a times a broadcast 2-D b (row-major, or a
    column-major view read in place) with bias, a batched c and relu; then a broadcast 2-D a
    and c times a batched b; each twice (the second call through the bound plan, new data)."""
    rng = np.random.default_rng()
    z, m, n, k = 7, 9, 24, 16

    def operand_b(shape):
        if b_layout == "row":
            return rand(rng, shape, "float16")
        return np.swapaxes(rand(rng, shape[:-2] + shape[:-3:-1], "float16"), -1, -2)

    for _ in range(2):
        a, b = rand(rng, (z, m, k), "float16"), operand_b((k, n))
        bias = rng.standard_normal(n).astype(np.float32)
        c = rand(rng, (z, m, n), "float16")
        got = tilepy.gemm(a, b, bias=bias, c=c, beta=0.5, activation="relu")
        check(got, np.maximum(f64(a) @ f64(b) + 0.5 * f64(c) + bias, 0), "float16")
    _launched_chunks(grid_limit)
    from tilepy.ops import gemm as g

    g._PLANS.clear()
    for _ in range(2):
        a, b = rand(rng, (m, k), "float16"), operand_b((z, k, n))
        c = rand(rng, (m, n), "float16")
        out = np.full((z, m, n), np.nan, np.float16)
        assert tilepy.gemm(a, b, c=c, beta=-1.0, out=out) is out
        check(out, f64(a) @ f64(b) - f64(c), "float16")
    _launched_chunks(grid_limit)


def test_float32_batches_and_row_tiles_past_the_grid_limit(grid_limit):
    """The float32 kernel: the batch on grid z and the 16-row tiles on grid y, both past the
    limit (3 matrices of 33 rows: 3 row tiles, the limit at 2), c broadcast; twice (the
    second call through the bound plan)."""
    from tilepy import launch

    launch.MAX_GRID_YZ = 2   # restored by the fixture's monkeypatch
    rng = np.random.default_rng()
    b, c = rand(rng, (8, 16), "float32"), rand(rng, (33, 16), "float32")
    for _ in range(2):
        a = rand(rng, (3, 33, 8), "float32")
        check(tilepy.gemm(a, b, c=c, beta=2.0), f64(a) @ f64(b) + 2 * f64(c), "float32")
    assert len(_launched_chunks(2)) == 2 * 2    # z: 2 + 1 matrices; y: 2 + 1 row tiles


def test_a_tma_grid_config_past_the_limit_runs_one_dimensional(grid_limit):
    """The TMA kernel's grid cannot be chunked (tensor maps of the whole batch): past the limit
    a non-persistent WsConfig runs its persistent variant, or where that does not fit, the
    cp.async wgmma kernel of its tile; within the limit it stays as it is."""
    from tilepy.ops import gemm as g
    from tilepy.ops import gemm_wgmma as hw
    from tilepy.ops import gemm_wgmma_ws as ws

    cfg = ws.WsConfig(64, 64, 2, consumers=1)
    assert g._grid_safe(cfg, 3) is cfg
    assert g._grid_safe(cfg, 4) == ws.WsConfig(64, 64, 2, consumers=1, persistent=True)
    staged = ws.WsConfig(128, 256, 4, smem_epilogue=True)   # persistent: no room to stage
    assert g._grid_safe(staged, 4) == hw.WgmmaConfig(128, 256, 4)
    persistent = ws.WsConfig(64, 64, 2, consumers=1, persistent=True)
    assert g._grid_safe(persistent, 10**6) is persistent
    rng = np.random.default_rng()
    a, b = rand(rng, (4, 16, 16), "float16"), rand(rng, (16, 16), "float16")
    check(tilepy.gemm(a, b, config=cfg), f64(a) @ f64(b), "float16")
    (entry,) = g._PLANS.values()
    assert entry.bound.plan.grid == (4, 1, 1)     # persistent: the simulator's 4 SMs


# ---- GPU: full size against float64 / cuBLAS --------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_random_shapes_against_cublas(dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    tdt = getattr(torch, dtype)
    for _ in range(6):
        m, n, k = (int(x) for x in rng.integers(1, 3000, size=3))
        a = torch.randn(m, k, device="cuda", dtype=tdt)
        b = torch.randn(k, n, device="cuda", dtype=tdt)
        bias = torch.randn(n, device="cuda")
        got = tilepy.gemm(a, b, bias=bias, activation="gelu", out_dtype="float32")
        assert isinstance(got, torch.Tensor) and got.device == a.device
        ref = torch.nn.functional.gelu(a.double() @ b.double() + bias.double())
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-4, (m, n, k, err)


@pytest.mark.gpu
def test_gpu_call_with_a_converted_bias_does_not_wait_for_queued_work():
    """A float16 bias is copied to float32 on every call; that call must still only enqueue
    (Numba's array import used to synchronise the caller's stream, which cost the fused
    bias + GELU GEMM ~100 us of GPU idle time per call)."""
    torch = pytest.importorskip("torch")
    a = torch.randn(512, 512, device="cuda", dtype=torch.float16)
    b = torch.randn(512, 512, device="cuda", dtype=torch.float16)
    bias = torch.randn(512, device="cuda", dtype=torch.float16)
    out = torch.empty(512, 512, device="cuda", dtype=torch.float16)
    tilepy.gemm(a, b, bias=bias, activation="gelu", out=out)   # the plan
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)          # ~0.1 s of GPU spin queued ahead of the call
    tilepy.gemm(a, b, bias=bias, activation="gelu", out=out)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "the call waited for the GPU"
    ref = torch.nn.functional.gelu(a.double() @ b.double() + bias.double())
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-3, err


@pytest.mark.gpu
def test_gpu_cupy_batched_transposed():
    cupy = pytest.importorskip("cupy")
    a = cupy.random.standard_normal((4, 1000, 520), dtype=cupy.float32).astype(cupy.float16)
    bt = cupy.random.standard_normal((4, 1064, 520), dtype=cupy.float32).astype(cupy.float16)
    b = bt.transpose(0, 2, 1)  # column-major matrices, read in place
    got = tilepy.gemm(a, b)
    assert isinstance(got, cupy.ndarray)
    ref = cupy.matmul(a.astype(cupy.float64), b.astype(cupy.float64))
    err = float(cupy.abs(got.astype(cupy.float64) - ref).max() / cupy.abs(ref).max())
    assert err < 2e-3


@pytest.mark.gpu
def test_gpu_plan_cache_matches_numba_and_follows_new_data():
    """The cached path's parameter buffer equals Numba's own packing of the same arguments,
    and repeated calls (torch, new tensors each time, the caller's stream) stay correct."""
    torch = pytest.importorskip("torch")
    from tilepy.ops import gemm as g

    g._PLANS.clear()
    for i in range(4):
        a = torch.randn(300, 200, device="cuda", dtype=torch.float16)
        b = torch.randn(200, 504, device="cuda", dtype=torch.float16)  # rows 16-byte aligned: no copy
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            got = tilepy.gemm(a, b, alpha=1.0 + i)
        s.synchronize()
        ref = (1.0 + i) * (a.double() @ b.double())
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-3, (i, err)
    assert len(g._PLANS) == 1
    # the parameter buffer against Numba's own packing of the same arguments
    from numba import cuda

    from tilepy.ops import gemm_mma_sync as tc

    cfg = g.choose_config(300, 504, 200, 1, "float16")
    kern = tc.gemm_kernel(cfg, True, "float16")
    out = torch.empty(300, 504, device="cuda", dtype=torch.float16)
    views = [cuda.as_cuda_array(t.view(torch.int16)[None]).view(np.uint16) for t in (a, b, out)]
    bias = cuda.as_cuda_array(torch.zeros(1, device="cuda"))
    plan, args = tc.plan(kern, cfg, views[0], views[1], views[2], views[2], bias, 2.0, 0.5)
    overload = kern.overloads[tuple(kern.typeof_pyval(x) for x in args)]
    packed = []
    for t, v in zip(overload.argument_types, args):
        overload._prepare_args(t, v, 0, [], packed)
    assert plan.parameter_values() == [getattr(v, "value", v) for v in packed]


@pytest.mark.gpu
def test_gpu_batch_past_the_grid_limit():
    """70,000 matrices (CUDA's grid y limit is 65,535): the mma.sync kernel (and on sm_90 the
    Hopper default) with bias, c and a broadcast b, and the float32 kernel, batch and 16-row
    tiles both past the limit; against float64 torch."""
    torch = pytest.importorskip("torch")
    z = 70_000
    a = torch.randn(z, 16, 32, device="cuda", dtype=torch.float16)
    b = torch.randn(32, 24, device="cuda", dtype=torch.float16)
    bias = torch.randn(24, device="cuda")
    c = torch.randn(z, 16, 24, device="cuda", dtype=torch.float16)
    got = tilepy.gemm(a, b, bias=bias, c=c, beta=0.5)
    ref = a.double() @ b.double() + 0.5 * c.double() + bias.double()
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 2e-3
    bt = torch.randn(z, 24, 32, device="cuda", dtype=torch.float16)
    got = tilepy.gemm(a, bt.transpose(1, 2))     # column-major b, batched
    ref = a.double() @ bt.double().transpose(1, 2)
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 2e-3
    x = torch.randn(z, 20, 8, device="cuda")
    y = torch.randn(8, 12, device="cuda")
    got = tilepy.gemm(x, y)
    ref = x.double() @ y.double()
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # 70,001 row tiles on grid y; with two matrices the row chunks are not contiguous
    for tall in (torch.randn(16 * z + 5, 8, device="cuda"),
                 torch.randn(2, 16 * z + 5, 8, device="cuda")):
        got = tilepy.gemm(tall, y)
        ref = tall.double() @ y.double()
        assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_matrix_layout_needs_16_byte_aligned_batches():
    """Row/column layouts are taken as they are only when every matrix of a batch starts
    16-byte aligned; a batch stride of k·n + 1 elements makes the operand 'other' (copied)."""
    from numpy.lib.stride_tricks import as_strided

    from tilepy.arrays import describe
    from tilepy.ops.gemm import matrix_layout

    k, n, z = 16, 32, 3
    flat = np.ones(z * (k * n + 8), np.float16)
    ok = as_strided(flat, (z, k, n), ((k * n + 8) * 2, n * 2, 2))
    odd = as_strided(flat, (z, k, n), ((k * n + 1) * 2, n * 2, 2))
    assert matrix_layout(describe(ok, "b")) == "row"
    assert matrix_layout(describe(odd, "b")) == "other"
    assert matrix_layout(describe(odd[:1], "b")) == "row"     # one matrix: no batch stride
    got = tilepy.gemm(np.ones((z, 4, k), np.float16), odd)
    assert np.array_equal(got, np.full((z, 4, n), k, np.float16))
