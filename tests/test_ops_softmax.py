"""tilepy softmax / log_softmax: results against float64 NumPy (simulator, a few rows; GPU,
full size against PyTorch), the three kernels forced in turn, special values, layouts, and
every user error raised before launch.

In the simulator every CUDA thread is a Python thread and every warp shuffle a block barrier:
the inputs here have few rows (a block costs ~0.3 s), and the long-row kernels are forced on
short rows by lowering the module's thresholds.
"""

import numpy as np
import pytest

from tilepy import arrays
from tilepy.launch import PlanCache
from tilepy.ops import softmax as sm
from tilepy.ops.softmax import log_softmax, softmax

ml_dtypes = pytest.importorskip("ml_dtypes")

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
# Relative tolerance per output dtype: rounding of the output (f16 2**-11, bf16 2**-8) plus
# float32 arithmetic (ex2.approx ~2 ulp, the argument's rounding, the sum). Absolute floor:
# float16's subnormal spacing (results below 6e-8 round to 0); float32 / bfloat16 flush
# results below 2**-126 to 0 (ex2.approx.ftz).
RTOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
ATOL = {"float32": 2.0**-126, "float16": 2.0**-24, "bfloat16": 2.0**-126}
FUNCS = {"softmax": softmax, "log_softmax": log_softmax}

# numpy warns on -inf - -inf inside the simulated kernels (all -inf rows, idle warps)
pytestmark = [pytest.mark.sim, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def reference(x, axis=-1, log=False):
    """float64 softmax / log_softmax, computed the naive way (NaN and -inf rows included)."""
    x = np.asarray(x).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = np.max(x, axis=axis, keepdims=True)
        z = x - m
        s = np.sum(np.exp(z), axis=axis, keepdims=True)
        return z - np.log(s) if log else np.exp(z) / s


def check(got, ref, dtype, log=False):
    """Same NaN and ±inf pattern; elsewhere |got - ref| <= rtol · |ref| + atol for softmax and
    rtol · max(1, |ref|) for log_softmax (whose ``x - max`` is exact or within an ulp)."""
    got = np.asarray(got).astype(np.float64)
    assert got.shape == ref.shape
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan), "NaN pattern differs (or an unwritten element)"
    inf = np.isinf(ref)                                 # log_softmax of -inf is -inf
    assert np.array_equal(got[inf], ref[inf])
    ok = ~nan & ~inf
    assert np.isfinite(got[ok]).all()
    tol = RTOL[dtype]
    err = np.abs(got[ok] - ref[ok])
    if log:
        bound = tol * np.maximum(1.0, np.abs(ref[ok]))
    else:
        bound = tol * np.abs(ref[ok]) + ATOL[dtype]
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


def poisoned(shape, dtype):
    return np.full(shape, np.nan, NP[dtype])


@pytest.fixture
def force(monkeypatch):
    """force(path): make every row length take ``path``."""

    def put(path):
        short, medium = {"warp": (1 << 30, 1 << 30), "block": (0, 1 << 30),
                         "online": (0, 0)}[path]
        monkeypatch.setattr(sm, "SHORT_MAX", short)
        monkeypatch.setattr(sm, "MEDIUM_MAX", medium)
        monkeypatch.setattr(sm, "_PLANS", PlanCache())   # plans made under other thresholds

    return put


def special_rows(n, dtype, rng):
    """Rows: random; -inf in the first half; all -inf; one NaN; ±1e4 mixed with small values."""
    x = (3 * rng.standard_normal((5, n))).astype(np.float32)
    x[1, : max(1, n // 2)] = -np.inf
    if n == 1:
        x[1, 0] = 0.5          # keep row 1 finite when there is only one element
    x[2, :] = -np.inf
    x[3, n // 3] = np.nan
    x[4, :] = np.where(rng.random(n) < 0.5, 1e4, -1e4) + rng.standard_normal(n)
    x[4, 0] = 1e4
    return x.astype(NP[dtype])


# ---- the launch-plan cache ---------------------------------------------------------------------

def test_repeated_calls_reuse_the_plan_with_new_data(monkeypatch):
    monkeypatch.setattr(sm, "_PLANS", PlanCache())
    rng = np.random.default_rng()
    for i in range(3):
        x = rng.standard_normal((3, 40)).astype(np.float32)
        out = poisoned((3, 40), "float32") if i == 2 else None
        got = softmax(x, out=out) if out is not None else softmax(x)
        check(got, reference(x), "float32")
        got = log_softmax(x)
        check(got, reference(x, log=True), "float32", log=True)
    assert len(sm._PLANS) == 3   # softmax, log_softmax, softmax with out=


# ---- the kernel choice -------------------------------------------------------------------------

def test_plan_picks_the_path_by_row_length():
    for n in (1, 3, 31, 32, 33, 1000, 1024):
        p = sm.plan(n, simulator=False)
        assert p.path == "warp" and 32 * p.per_thread >= n and p.per_thread <= 32
    for item in (4, 2):
        for n in (1025, 5000, 16384, 16385, 32768):
            p = sm.plan(n, simulator=False, itemsize=item)
            assert p.path == "block" and p.threads * p.per_thread >= n and p.threads <= 1024
            # 64 bytes per thread, 128 at the longest rows of a 512- or 1024-thread block
            assert 64 <= p.per_thread * item <= 128
    for n in (32769, 1 << 20, 3 << 20):
        assert sm.plan(n, simulator=False).path == "online"
    # simulator blocks stay small
    assert sm.plan(5000, simulator=True).threads <= sm.SIM_MEDIUM_MAX_THREADS
    # a bounded number of kernels: one per power-of-two bucket
    buckets = {sm.plan(n, simulator=False) for n in range(1, 20000, 7)}
    assert len(buckets) <= 12


def test_block_plans_hold_the_same_bytes_per_thread_for_16_bit_rows():
    """The shapes of issue 6 (GPU plans): 16-bit rows get as many bytes per thread as float32
    ones (kept two values per register), long rows two 512-thread blocks per SM."""
    P = sm.Plan
    want = {  # (n, itemsize): plan
        (2048, 4): P("block", 4, 16), (2048, 2): P("block", 2, 32),
        (4096, 4): P("block", 8, 16), (4096, 2): P("block", 4, 32),
        (8192, 4): P("block", 16, 16), (8192, 2): P("block", 8, 32),
        (16384, 4): P("block", 16, 32), (16384, 2): P("block", 16, 32),
        (32768, 4): P("block", 32, 32), (32768, 2): P("block", 16, 64),
    }
    for (n, item), p in want.items():
        assert sm.plan(n, simulator=False, itemsize=item) == p, (n, item)
        assert sm.plan(n // 2 + 1, simulator=False, itemsize=item) == p, (n // 2 + 1, item)
    # around the thresholds: the next bucket up
    assert sm.plan(8193, simulator=False).per_thread == 32            # f32 512 x 32
    assert sm.plan(16385, simulator=False).threads == 1024            # f32 1024 x 32
    assert sm.plan(16385, simulator=False, itemsize=2).per_thread == 64
    assert sm.plan(32769, simulator=False, itemsize=2).path == "online"
    # two blocks per SM (64 registers) for the 512-thread vector kernels; a scalar 16-bit
    # kernel of 64 float32 registers per thread keeps one
    assert sm.launch_bounds(want[32768, 2], "float16", 8) == (512, 2)
    assert sm.launch_bounds(want[16384, 4], "float32", 4) == (512, 2)
    assert sm.launch_bounds(want[32768, 2], "float16", 1) == 512
    assert sm.launch_bounds(want[32768, 4], "float32", 4) == 1024
    assert sm.launch_bounds(want[32768, 2], "float16", 8, log=True) == 512
    assert sm.launch_bounds(want[16384, 2], "float16", 8, log=True) == (512, 2)
    assert sm.packs_registers("float16", 8) and sm.packs_registers("bfloat16", 8)
    assert not sm.packs_registers("float16", 1) and not sm.packs_registers("float32", 4)
    # the simulator uses the dtype too, within its small blocks
    assert sm.plan(5000, simulator=True, itemsize=2).threads <= sm.SIM_MEDIUM_MAX_THREADS


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("path,n,width", [("warp", 8, 8), ("warp", 9, 16), ("warp", 63, 64),
                                          ("block", 255, 256), ("block", 256, 256),
                                          ("block", 257, 264), ("block", 263, 264)])
def test_packed_16_bit_rows_around_group_edges(force, widths, path, n, width, dtype):
    """The packed 16-bit register rows (two values per word): n at, just below and just past
    a multiple of the 8-value groups (one or two groups per thread, some wholly past the
    row), odd n (a word half inside the row), special rows, softmax and log_softmax into a
    NaN-poisoned output, and nothing written past the row."""
    force(path)
    rng = np.random.default_rng(n + 17)
    base = aligned(5, width, dtype, rng)
    base[:, :n] = special_rows(n, dtype, rng)
    x = base[:, :n]
    for log in (False, True):
        out = aligned(5, width, dtype, rng)
        out[...] = np.nan
        FUNCS["log_softmax" if log else "softmax"](x, out=out[:, :n])
        check(out[:, :n], reference(x, log=log), dtype, log=log)
        assert np.isnan(out[:, n:].astype(np.float32)).all(), "wrote past the row"
    assert set(widths) == {8}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_packed_rows_with_several_groups_per_thread(force, monkeypatch, dtype):
    """A block of 32 threads × 32 values (4 groups of 8 per thread), rows that fill every
    group (the straight-line loads) and rows that end inside a thread's last groups."""
    force("block")
    monkeypatch.setattr(sm, "SIM_MEDIUM_MAX_THREADS", 32)
    rng = np.random.default_rng(21)
    for n in (1024, 1023, 1000, 777):
        assert sm.plan(n, itemsize=2) == sm.Plan("block", 1, 32)
        x = aligned(3, 1024, dtype, rng)[:, :n]
        x[1] = special_rows(n, dtype, rng)[3]          # a NaN row
        out = poisoned(x.shape, dtype)
        softmax(x, out=out)
        check(out, reference(x), dtype)
        check(log_softmax(x), reference(x, log=True), dtype, log=True)


# ---- lengths, as the issue lists them ---------------------------------------------------------

@pytest.mark.parametrize("n,path", [(1, "warp"), (3, "warp"), (31, "warp"), (1000, "warp"),
                                    (1025, "block"), (5000, "block")])
def test_lengths(n, path):
    assert sm.plan(n).path == path
    rng = np.random.default_rng(n)
    x = (4 * rng.standard_normal((2, n))).astype(np.float32)
    out = poisoned(x.shape, "float32")
    assert softmax(x, out=out) is out
    check(out, reference(x), "float32")


@pytest.mark.parametrize("n", [3, 1000, 1025])
def test_log_softmax_lengths(n):
    rng = np.random.default_rng(n + 1)
    x = (4 * rng.standard_normal((2, n))).astype(np.float32)
    check(log_softmax(x), reference(x, log=True), "float32", log=True)


# ---- each kernel forced, with the special rows --------------------------------------------------

@pytest.mark.parametrize("fn", list(FUNCS))
@pytest.mark.parametrize("path,n", [("warp", 70), ("block", 200), ("online", 300),
                                    ("online", 1)])
def test_each_kernel_with_special_rows(force, path, n, fn):
    """Random rows, a half -inf row, an all -inf row (NaN), a NaN row, and ±1e4 (finite).

    The online kernel steps over 128 values at a time in the simulator (2 warps × 2), so
    n = 300 rescales its running sums twice, and the half -inf row starts with -inf steps."""
    force(path)
    rng = np.random.default_rng(7)
    x = special_rows(n, "float32", rng)
    assert sm.plan(n).path == path
    out = poisoned(x.shape, "float32")
    FUNCS[fn](x, out=out)
    ref = reference(x, log=fn == "log_softmax")
    assert np.isnan(out[2]).all() and np.isnan(out[3]).all()
    assert np.isfinite(out[[0, 1, 4]][np.isfinite(ref[[0, 1, 4]])]).all()
    check(out, ref, "float32", log=fn == "log_softmax")


# ---- dtypes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("path", ["warp", "block"])
def test_dtypes(force, dtype, path):
    force(path)
    rng = np.random.default_rng(3)
    x = special_rows(45, dtype, rng)[[0, 1, 2, 4]]
    out = poisoned(x.shape, dtype)
    softmax(x, out=out)
    assert out.dtype == NP[dtype]
    check(out, reference(x), dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_online_and_log(force, dtype):
    force("online")
    rng = np.random.default_rng(4)
    x = special_rows(150, dtype, rng)[[0, 4]]
    check(log_softmax(x), reference(x, log=True), dtype, log=True)
    check(softmax(x), reference(x), dtype)


def test_ones_give_uniform_and_sums_are_one():
    x = np.ones((2, 37), np.float32)
    np.testing.assert_allclose(softmax(x), np.full(x.shape, 1 / 37), rtol=1e-6)
    rng = np.random.default_rng(5)
    y = softmax((5 * rng.standard_normal((2, 700))).astype(np.float32))
    np.testing.assert_allclose(y.astype(np.float64).sum(axis=1), 1.0, rtol=1e-5)


# ---- 16-byte vector accesses and their scalar fallback -------------------------------------------

def aligned(rows, width, dtype, rng, offset=0):
    """A (rows, width) array of ``dtype`` whose data start ``offset`` elements past a 16-byte
    boundary (NumPy's own alignment is not relied on)."""
    item = np.dtype(NP[dtype]).itemsize
    raw = np.zeros(rows * width * item + 64, np.uint8)
    start = (-raw.ctypes.data) % 16 + offset * item
    x = raw[start:start + rows * width * item].view(NP[dtype]).reshape(rows, width)
    x[...] = (3 * rng.standard_normal((rows, width))).astype(NP[dtype])
    return x


@pytest.fixture
def widths(monkeypatch):
    """The vector widths the launches of the test pick (1: scalar kernels)."""
    seen = []
    real = sm.vector_width
    monkeypatch.setattr(sm, "vector_width", lambda *a: seen.append(real(*a)) or seen[-1])
    monkeypatch.setattr(sm, "_PLANS", PlanCache())
    return seen


def test_vector_width_conditions():
    rng = np.random.default_rng(12)

    def view(a):
        return arrays.kernel_view(arrays.describe(a, "x"))

    for dtype, v in (("float32", 4), ("float16", 8), ("bfloat16", 8)):
        kind = dtype
        base = aligned(3, 64, dtype, rng)
        assert sm.vector_width(kind, view(base)) == v
        assert sm.vector_width(kind, view(base[:, :45])) == v          # tail: scalar in kernel
        assert sm.vector_width(kind, view(base[:, 1:])) == 1            # misaligned base
        assert sm.vector_width(kind, view(base[:, 1:]), view(base)) == 1
        assert sm.vector_width(kind, view(base[:1, 1:])) == 1
        assert sm.vector_width(kind, view(base[:, : v - 1])) == 1       # shorter than a vector
        odd = aligned(3, 64 + 1, dtype, rng)                          # row stride not 16 B
        assert sm.vector_width(kind, view(odd[:, :64])) == 1
        assert sm.vector_width(kind, view(odd[:1, :64])) == v           # one row: no stride
    assert sm.natural_width("float32") == 4 and sm.natural_width("float16") == 8


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("path,n,width", [("warp", 45, 64), ("warp", 64, 64),
                                          ("block", 203, 208), ("online", 1100, 1104)])
def test_vector_kernels_with_tails(force, widths, path, n, width, dtype):
    """Aligned rows: the vector kernels, with n not a multiple of the vector (a scalar tail)
    except for n = 64; the simulator's vector twins refuse a misaligned access. The online
    kernel steps 64 threads × 1 or 2 groups, so n = 1100 takes several steps and a tail."""
    force(path)
    rng = np.random.default_rng(n)
    base = aligned(5, width, dtype, rng)
    base[:, :n] = special_rows(n, dtype, rng)
    x = base[:, :n]
    out = aligned(5, width, dtype, rng)
    out[...] = np.nan
    softmax(x, out=out[:, :n])
    assert widths == [sm.natural_width(dtype)]
    check(out[:, :n], reference(x), dtype)
    assert np.isnan(out[:, n:].astype(np.float32)).all(), "wrote past the row"
    got = log_softmax(x)
    check(got, reference(x, log=True), dtype, log=True)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("path", ["warp", "block"])
def test_misaligned_rows_fall_back_to_scalar(force, widths, path, dtype):
    force(path)
    rng = np.random.default_rng(13)
    base = aligned(3, 72, dtype, rng)
    x = base[:, 1:70]                                  # base 1 element past 16 B
    softmax(x, out=(out := poisoned(x.shape, dtype)))
    check(out, reference(x), dtype)
    odd = aligned(3, 67, dtype, rng)[:, :64]          # row stride of 67 elements
    check(softmax(odd), reference(odd), dtype)
    assert widths == [1, 1]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_rows_of_one_and_in_place_vector(widths, dtype):
    rng = np.random.default_rng(14)
    one = aligned(4, 1, dtype, rng)
    got = softmax(one)
    assert np.all(np.asarray(got, np.float32) == 1.0)
    x = aligned(3, 96, dtype, rng)
    ref = reference(x)
    assert softmax(x, out=x) is x                      # in place, vector kernel
    check(x, ref, dtype)
    assert widths[-1] == sm.natural_width(dtype)


# ---- layouts -------------------------------------------------------------------------------------

def test_strided_rows_are_read_in_place(monkeypatch):
    rng = np.random.default_rng(6)
    base = rng.standard_normal((6, 70)).astype(np.float32)
    keep = base.copy()
    x = base[::2, 3:50]                                   # row stride 140, unit element stride
    assert sm._rows_layout(arrays.describe(x, "x").shape, arrays.describe(x, "x").strides)
    copies = []
    real = sm._contiguous_moved
    monkeypatch.setattr(sm, "_contiguous_moved", lambda *a: copies.append(1) or real(*a))
    out = np.full((47, 3), np.nan, np.float32).T          # a transposed out: written back
    assert softmax(x, out=out) is out
    check(out, reference(x), "float32")
    assert not copies, "a row-strided input must be read in place"
    assert np.array_equal(base, keep)                     # input untouched


def test_3d_last_axis_collapses_rows():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 17)).astype(np.float16)
    check(softmax(x), reference(x), "float16")
    y = x[:, ::2, :]                                      # rows that do not collapse: copied
    assert sm._rows_layout(y.shape, tuple(s // 2 for s in y.strides)) is None
    check(log_softmax(y), reference(y, log=True), "float16", log=True)


@pytest.mark.parametrize("axis", [0, 1, -3])
def test_other_axes(axis):
    rng = np.random.default_rng(9)
    x = (2 * rng.standard_normal((3, 4, 2))).astype(np.float32)
    out = poisoned(x.shape, "float32")
    softmax(x, axis=axis, out=out)
    check(out, reference(x, axis=axis), "float32")
    check(log_softmax(x, axis), reference(x, axis=axis, log=True), "float32", log=True)


def test_transposed_input_and_bfloat16_axis0(monkeypatch):
    rng = np.random.default_rng(10)
    base = rng.standard_normal((40, 3)).astype(ml_dtypes.bfloat16)
    keep = base.copy()
    x = base.T                                            # (3, 40), strides (1, 3)
    check(softmax(x), reference(x), "bfloat16")           # last stride 3: copied
    monkeypatch.setattr(sm, "_contiguous_moved", None)     # axis 0 has unit stride: in place
    check(softmax(x, axis=0), reference(x, axis=0), "bfloat16")
    check(log_softmax(x, 0), reference(x, axis=0, log=True), "bfloat16", log=True)
    assert np.array_equal(base.view(np.uint16), keep.view(np.uint16)), "input modified"


def test_in_place_and_out_given():
    rng = np.random.default_rng(11)
    x = (3 * rng.standard_normal((3, 100))).astype(np.float32)
    ref = reference(x)
    assert softmax(x, out=x) is x                        # out may be x itself
    check(x, ref, "float32")
    y = (3 * rng.standard_normal((2, 3, 4))).astype(np.float16)
    ref = reference(y, axis=1, log=True)
    assert log_softmax(y, axis=1, out=y) is y            # through the copy, in place
    check(y, ref, "float16", log=True)


def test_zero_size_and_0d():
    for shape, axis in [((0, 5), -1), ((3, 0), -1), ((2, 0, 3), 1), ((2, 0, 3), 0), ((0,), 0)]:
        x = np.ones(shape, np.float32)
        got = softmax(x, axis=axis)
        assert got.shape == shape and got.dtype == np.float32
        assert log_softmax(x, axis=axis, out=np.empty(shape, np.float32)).shape == shape
    x = np.array(3.0, np.float32)
    assert softmax(x).shape == () and float(softmax(x)) == 1.0
    assert float(log_softmax(x, axis=0)) == 0.0
    assert np.isnan(softmax(np.array(-np.inf, np.float32)))


# ---- errors, before launch ----------------------------------------------------------------------

def test_errors_are_raised_before_launch(monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(sm, "launch", no_launch)
    x = np.ones((4, 8), np.float32)
    with pytest.raises(TypeError, match="x: dtype float64"):
        softmax(x.astype(np.float64))
    with pytest.raises(TypeError, match="x: dtype int32"):
        log_softmax(x.astype(np.int32))
    with pytest.raises(TypeError, match="x: expected"):
        softmax([[1.0, 2.0]])
    with pytest.raises(ValueError, match=r"axis 2 is out of range.*2 dimensions"):
        softmax(x, axis=2)
    with pytest.raises(ValueError, match=r"axis -3 is out of range"):
        softmax(x, axis=-3)
    with pytest.raises(ValueError, match=r"axis 1 is out of range.*0 dimensions"):
        softmax(np.array(1.0, np.float32), axis=1)
    with pytest.raises(TypeError, match="axis must be an integer"):
        softmax(x, axis=1.0)
    with pytest.raises(TypeError, match="axis must be an integer"):
        softmax(x, axis=None)
    with pytest.raises(ValueError, match=r"out must have shape \(4, 8\)"):
        softmax(x, out=np.empty((4, 9), np.float32))
    with pytest.raises(ValueError, match="out must have dtype float32"):
        softmax(x, out=np.empty((4, 8), np.float16))
    with pytest.raises(TypeError, match="out: dtype float64"):
        softmax(x, out=np.empty((4, 8), np.float64))
    with pytest.raises(ValueError, match="out has overlapping elements"):
        softmax(x, out=np.broadcast_to(np.empty(8, np.float32), (4, 8)))
    # a NumPy array on a machine with a GPU
    monkeypatch.setattr(arrays, "SIMULATOR", False)
    with pytest.raises(TypeError, match="x: a NumPy array lives on the host"):
        softmax(x)


# ---- offline compile (no GPU, no simulator: a subprocess) ------------------------------------

@pytest.mark.compile
def test_one_kernel_per_path_compiles_for_sm90_without_spills():
    from tilepy.offline import find_ptxas, run_in_subprocess

    if find_ptxas() is None:
        pytest.skip("ptxas not found (install the test extra)")
    reports = run_in_subprocess("tilepy.ops.softmax:compile_reports_one_per_path")
    assert set(reports) == {f"{n}:{lay}" for n in sm.ONE_PER_PATH for lay in "AC"}
    for name, rep in reports.items():
        assert "error" not in rep, rep["error"]
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, name
        assert rep["stack_frame"] == 0 and rep["local_bytes"] == 0, name
        assert rep["counts"]["ld.local"] == 0 and rep["counts"]["st.local"] == 0, name
        # a 1024-thread block must fit the 64K-register file (the launch bounds see to it)
        assert rep["maxntid"], name
        assert rep["registers"] * rep["threads"] <= 65536, (name, rep["registers"])
        assert rep["ex2"] >= 1 and rep["counts"]["shfl"] >= 10, name


@pytest.mark.compile
def test_long_16_bit_row_kernels_compile_for_sm90_with_two_blocks_per_sm():
    """The kernels of 16384 / 32768-value float16 and bfloat16 rows: 512 threads, 64
    registers at most (two blocks per SM: 2 × 512 × 64 = the register file), no spills, no
    local memory; 4 or 8 16-byte loads per thread (64 or 128 bytes in flight per thread).
    log_softmax at 32768 keeps one block per SM (launch bounds 512 only) and must not spill."""
    from tilepy.offline import find_ptxas, run_in_subprocess

    if find_ptxas() is None:
        pytest.skip("ptxas not found (install the test extra)")
    reports = run_in_subprocess("tilepy.ops.softmax:compile_reports_long_16_bit")
    assert set(reports) == {f"{n}:A" for n in sm.LONG_16_BIT}
    for name, rep in reports.items():
        assert "error" not in rep, rep["error"]
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (name, rep)
        assert rep["stack_frame"] == 0 and rep["local_bytes"] == 0, name
        assert rep["counts"]["ld.local"] == 0 and rep["counts"]["st.local"] == 0, name
        assert rep["maxntid"], name
        if name.startswith("log_softmax_float16_n32768"):
            assert rep["launch_bounds"] == 512, name
            continue
        if "n4096" in name:
            assert rep["threads"] == 128 and rep["registers"] <= 56, (name, rep["registers"])
            continue
        assert rep["threads"] == 512 and rep["launch_bounds"] == [512, 2], name
        assert rep["registers"] <= 64, (name, rep["registers"])      # two blocks per SM


# ---- GPU: full size against PyTorch ------------------------------------------------------------

def torch_or_skip():
    return pytest.importorskip("torch")


def gpu_check(got, want, dtype, log=False):
    """Against PyTorch's float32 result (of the same 16-bit input): same NaN and ±inf
    pattern, and the error within twice the simulator tolerances (PyTorch's float32 has its
    own rounding; ours uses ex2.approx)."""
    torch = torch_or_skip()
    got, want = got.double(), want.double()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN pattern differs"
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf]), "±inf differ"
    ok = ~nan & ~inf
    err = (got - want)[ok].abs()
    ref = want[ok].abs()
    tol = 2 * RTOL[dtype]
    bound = tol * torch.clamp(ref, min=1.0) if log else tol * ref + 2 * ATOL[dtype]
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(16384, 4096), (32768, 1024), (4096, 32768), (3, 1),
                                   (7, 1000), (513, 1025), (64, 16384), (33, 16385),
                                   (4, 1 << 20), (1, 3 << 20)])
def test_gpu_full_size_against_torch(shape, dtype):
    torch = torch_or_skip()
    tdt = getattr(torch, dtype)
    x = (3 * torch.randn(shape, device="cuda")).to(tdt)
    out = torch.full_like(x, float("nan"))
    assert softmax(x, out=out) is out
    gpu_check(out, torch.softmax(x.float(), -1), dtype)
    got = log_softmax(x)
    assert isinstance(got, torch.Tensor) and got.dtype == tdt and got.device == x.device
    gpu_check(got, torch.log_softmax(x.float(), -1), dtype, log=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 100, 1024, 4096, 16384, 16385, 100000])
def test_gpu_special_rows_like_torch(n):
    torch = torch_or_skip()
    rng = np.random.default_rng(n)
    x = torch.from_numpy(special_rows(n, "float32", rng)).cuda()
    gpu_check(softmax(x), torch.softmax(x, -1), "float32")
    gpu_check(log_softmax(x), torch.log_softmax(x, -1), "float32", log=True)
    assert bool(torch.isfinite(softmax(x)[4]).all())


@pytest.mark.gpu
def test_gpu_layouts_axes_and_streams():
    torch = torch_or_skip()
    x = torch.randn(64, 3000, 5, device="cuda", dtype=torch.float16)
    gpu_check(softmax(x, axis=1), torch.softmax(x.float(), 1), "float16")
    y = torch.randn(300, 2000, device="cuda")[::3, 7:1500]  # strided rows, read in place
    gpu_check(log_softmax(y), torch.log_softmax(y, -1), "float32", log=True)
    t = torch.randn(2000, 300, device="cuda").t()            # transposed: copied
    gpu_check(softmax(t), torch.softmax(t, -1), "float32")
    s = torch.cuda.Stream()
    big = torch.randn(8192, 4096, device="cuda")
    with torch.cuda.stream(s):
        big2 = big * 2                                       # ordered on s before softmax
        got = softmax(big2)
    s.synchronize()
    gpu_check(got, torch.softmax(big * 2, -1), "float32")


@pytest.mark.gpu
def test_gpu_cupy_and_numba_arrays():
    cupy = pytest.importorskip("cupy")
    from numba import cuda

    x = cupy.random.standard_normal((100, 5000), dtype=cupy.float32)
    got = softmax(x)
    assert isinstance(got, cupy.ndarray)
    ref = cupy.exp(x - x.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    assert float(cupy.abs(got - ref).max()) < 1e-6
    h = np.random.default_rng(0).standard_normal((6, 50, 7)).astype(np.float32)
    d = cuda.to_device(h)
    got = softmax(d, axis=1)                                # Numba array, copy path
    assert hasattr(got, "copy_to_host")
    check(got.copy_to_host(), reference(h, axis=1), "float32")


@pytest.mark.gpu
def test_gpu_repeated_calls_on_the_callers_stream():
    """The cached launch plan (calls 2…) follows new tensors and the caller's stream."""
    torch = pytest.importorskip("torch")
    sm._PLANS.clear()
    s = torch.cuda.Stream()
    for _ in range(3):
        with torch.cuda.stream(s):
            x = torch.randn(999, 3000, device="cuda", dtype=torch.float16)
            got = softmax(x)
        s.synchronize()
        err = (got.float() - torch.softmax(x.float(), -1)).abs().max().item()
        assert err < 2e-3
    assert len(sm._PLANS) == 1
