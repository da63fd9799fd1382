"""tilepy softmax_backward / log_softmax_backward: results against a float64 NumPy reference
(the gradient formulas of PyTorch's ``_softmax_backward_data`` / ``_log_softmax_backward_data``
applied to the kernels' own inputs, ``y`` coming from a float64 softmax), the three kernels,
16-byte and scalar accesses, layouts, ``out``, NaN, the launch-plan cache, and every user
error raised before launch.

In the simulator every CUDA thread is a Python thread and every warp shuffle a block barrier:
the inputs have few rows, and the block and two-pass kernels run on short rows through
``config=Plan(...)`` with one or two warps per block.
"""

import numpy as np
import pytest

from tilepy import arrays
from tilepy.launch import PlanCache
from tilepy.ops import softmax as sm
from tilepy.ops import softmax_backward as sb
from tilepy.ops.softmax import Plan
from tilepy.ops.softmax_backward import log_softmax_backward, softmax_backward

ml_dtypes = pytest.importorskip("ml_dtypes")

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
DTYPES = ["float32", "float16", "bfloat16"]
OPS = {"softmax": softmax_backward, "log_softmax": log_softmax_backward}
# |got - ref| <= RTOL · scale + ATOL, where scale bounds |dx| and the float32 error terms
# (see reference()): the output's rounding (float16 2**-11, bfloat16 2**-8 of |dx|) plus
# float32 sums of up to ~1000 terms and ex2.approx (~2 ulp, and |y|·2**-24 from its argument).
RTOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
# float16 results below 2**-14 are subnormal (spacing 2**-24)
ATOL = {"float32": 1e-30, "float16": 2.0**-24, "bfloat16": 1e-30}

pytestmark = [pytest.mark.sim, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


# ---- inputs and the reference -------------------------------------------------------------------

def forward64(x, axis=-1, log=False):
    """float64 softmax / log_softmax."""
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    z = x - m
    s = np.sum(np.exp(z), axis=axis, keepdims=True)
    return z - np.log(s) if log else np.exp(z) / s


def reference(dy, y, axis=-1, log=False):
    """``(dx, scale)`` in float64 from the kernels' inputs: dx by PyTorch's formulas, scale ≥
    |dx| bounding the error of a float32 computation of it (the condition of the row sum)."""
    dy = np.asarray(dy).astype(np.float64)
    y = np.asarray(y).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        if log:
            e = np.exp(y)
            dx = dy - e * np.sum(dy, axis=axis, keepdims=True)
            ey = np.where(e > 0, e * np.maximum(1.0, np.abs(y)), e)   # y = -inf: 0
            scale = np.abs(dy) + ey * np.sum(np.abs(dy), axis=axis, keepdims=True)
        else:
            dx = y * (dy - np.sum(dy * y, axis=axis, keepdims=True))
            scale = np.abs(y) * (np.abs(dy) + np.sum(np.abs(dy * y), axis=axis, keepdims=True))
    return dx, scale


def check(got, dy, y, dtype, log, axis=-1):
    """Same NaN pattern as the reference, finite elsewhere and within tolerance."""
    ref, scale = reference(dy, y, axis, log)
    got = np.asarray(got).astype(np.float64)
    assert got.shape == ref.shape
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan), "NaN pattern differs (or an unwritten element)"
    ok = ~nan
    assert np.isfinite(got[ok]).all()
    err = np.abs(got[ok] - ref[ok])
    bound = RTOL[dtype] * scale[ok] + ATOL[dtype]
    assert (err <= bound).all(), (f"max error {err.max():.3g}, worst ratio "
                                  f"{(err / bound).max():.3g}")


def aligned(rows, width, dtype, offset=0):
    """A zeroed (rows, width) array of ``dtype`` whose data start ``offset`` elements past a
    16-byte boundary (NumPy's own alignment is not relied on)."""
    item = np.dtype(NP[dtype]).itemsize
    raw = np.zeros(rows * width * item + 64, np.uint8)
    start = (-raw.ctypes.data) % 16 + offset * item
    return raw[start:start + rows * width * item].view(NP[dtype]).reshape(rows, width)


def inputs(rows, n, dtype, log, rng, width=None, offset=0):
    """``(dy, y)`` of ``rows`` × ``n`` (views into padded ``width``-column buffers: rows
    16-byte aligned when ``width`` is a multiple of 8 and ``offset`` 0), ``y`` the rounded
    float64 forward of random logits, ``dy`` fresh random gradients."""
    width = width or n
    x = 3 * rng.standard_normal((rows, n))
    dy, y = aligned(rows, width, dtype, offset), aligned(rows, width, dtype, offset)
    dy[:, :n] = rng.standard_normal((rows, n)).astype(NP[dtype])
    y[:, :n] = forward64(x, log=log).astype(NP[dtype])
    return dy[:, :n], y[:, :n]


def poisoned(shape, dtype):
    return np.full(shape, np.nan, NP[dtype])


@pytest.fixture
def widths(monkeypatch):
    """The vector widths the launches of the test pick (1: scalar kernels)."""
    seen = []
    real = sb.vector_width
    monkeypatch.setattr(sb, "vector_width", lambda *a: seen.append(real(*a)) or seen[-1])
    monkeypatch.setattr(sb, "_PLANS", PlanCache())
    return seen


# ---- the kernel choice (no kernel runs) ---------------------------------------------------------

def test_plans_by_row_length():
    for item in (4, 2):
        for n in (1, 7, 33, 257, 512):
            p = sb.plan(n, simulator=False, itemsize=item)
            assert p.path == "warp" and 32 <= 32 * p.per_thread and p.per_thread <= 16
            assert 32 * p.per_thread >= n
        for n in (513, 1024, 5000, 8192, 16384):
            p = sb.plan(n, simulator=False, itemsize=item)
            assert p.path == "block" and p.threads * p.per_thread >= n
            assert p.threads <= 1024 and p.per_thread * sb.REGISTER_BYTES_PER_COLUMN <= 128
        for n in (16385, 32768, 1 << 20):
            assert sb.plan(n, simulator=False, itemsize=item) == Plan("online", *sm.ONLINE)
    assert sb.SHORT_MAX == 512 and sb.MEDIUM_MAX == 16384
    # two blocks of 512 threads per SM (64 registers) where the values take 128 bytes or less
    assert sb.plan(8192, simulator=False) == Plan("block", 16, 16)
    assert sb.launch_bounds(Plan("block", 16, 16), 4) == (512, 2)
    assert sb.launch_bounds(Plan("block", 32, 16), 4) == 1024
    assert sb.launch_bounds(Plan("warp", 4, 16), 8) == 128
    # the simulator's blocks stay small
    assert sb.plan(5000, simulator=True).threads <= sm.SIM_MEDIUM_MAX_THREADS
    assert sb.plan(20000, simulator=True) == Plan("online", *sm.SIM_ONLINE)


def test_config_is_checked_for_both_rows():
    sb.check_config(Plan("block", 32, 16), 16384, simulator=False)
    with pytest.raises(ValueError, match="256 bytes per thread in registers"):
        sb.check_config(Plan("block", 16, 32), 16384, simulator=False)   # the forward's plan
    with pytest.raises(ValueError, match="short of"):
        sb.check_config(Plan("warp", 4, 2), 65, simulator=False)
    with pytest.raises(TypeError, match="config must be a tilepy.ops.softmax.Plan"):
        sb.check_config(("block", 2, 4), 8)


# ---- every path, every dtype, lengths that are not multiples of anything ------------------------

@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 33, 257])
def test_warp_path_against_reference(widths, n, dtype, op):
    """Default plans (the warp path), rows in 16-byte aligned buffers: the vector kernels with
    a scalar tail (scalar ones for rows shorter than a vector), into a NaN-poisoned out
    that must be fully written and nothing past the row."""
    log = op == "log_softmax"
    rng = np.random.default_rng()
    width = -(-n // 8) * 8 + 8
    dy, y = inputs(3, n, dtype, log, rng, width)
    assert sb.plan(n).path == "warp"
    buf = aligned(3, width, dtype)
    buf[...] = np.nan
    got = OPS[op](dy, y, out=buf[:, :n])
    assert got is not None and got.dtype == NP[dtype]
    check(buf[:, :n], dy, y, dtype, log)
    assert np.isnan(buf[:, n:].astype(np.float32)).all(), "wrote past the row"
    assert widths == [sm.natural_width(dtype) if n >= sm.natural_width(dtype) else 1]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config,n,vector", [
    (Plan("block", 2, 5), 257, True),     # 64 threads, 2 groups each (the last one partial)
    (Plan("online", 2, 2), 1100, True),   # steps of 256 / 512 columns, a partial last one
    (Plan("online", 2, 2), 1001, False),  # scalar: steps of 128 columns
], ids=["block", "online", "online-scalar"])
def test_block_and_two_pass_paths(widths, config, n, vector, dtype, op):
    """The block and two-pass kernels forced on short rows, into a NaN-poisoned out (its rows
    16-byte aligned, or not: then every view takes the scalar kernels)."""
    log = op == "log_softmax"
    rng = np.random.default_rng()
    width = -(-n // 8) * 8
    dy, y = inputs(2, n, dtype, log, rng, width)
    out = aligned(2, width if vector else n, dtype)[:, :n]
    out[...] = np.nan
    assert OPS[op](dy, y, out=out, config=config) is out
    check(out, dy, y, dtype, log)
    assert widths == [sm.natural_width(dtype) if vector else 1]


def test_default_block_plan_on_a_long_row():
    """The simulator's own plan for 1100 columns: the block path, 128 threads × 16."""
    rng = np.random.default_rng()
    dy, y = inputs(2, 1100, "float32", False, rng, 1104)
    assert sb.plan(1100) == Plan("block", 4, 16)
    check(softmax_backward(dy, y), dy, y, "float32", False)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_misaligned_rows_take_the_scalar_kernels(widths, dtype):
    rng = np.random.default_rng()
    dy, y = inputs(3, 70, dtype, False, rng, 72, offset=1)   # data 1 element past 16 B
    check(softmax_backward(dy, y, config=Plan("block", 1, 3)), dy, y, dtype, False)
    dy, y = inputs(3, 64, dtype, True, rng, 67)              # row stride of 67 elements
    check(log_softmax_backward(dy, y), dy, y, dtype, True)
    assert widths == [1, 1]


# ---- NaN and other special values -------------------------------------------------------------

@pytest.mark.parametrize("config", [None, Plan("block", 1, 2), Plan("online", 1, 1)],
                         ids=["warp", "block", "online"])
def test_nan_propagates(config):
    """A NaN in dy makes its row NaN for both ops; a NaN in y its row for softmax and its own
    element for log_softmax (exp(NaN)); y = -inf (a masked column of log_softmax) gives
    dx = dy there. Other rows stay finite."""
    rng = np.random.default_rng()
    n = 45
    for log in (False, True):
        dy, y = inputs(4, n, "float32", log, rng)
        dy[1, 7] = np.nan
        y[2, 30] = np.nan
        if log:
            y[3, :5] = -np.inf
        out = poisoned(dy.shape, "float32")
        OPS["log_softmax" if log else "softmax"](dy, y, out=out, config=config)
        assert np.isnan(out[1]).all()
        assert np.isnan(out[2]).all() if not log else (np.isnan(out[2]).sum() == 1
                                                       and np.isnan(out[2, 30]))
        assert np.isfinite(out[[0, 3]]).all()
        if log:
            np.testing.assert_array_equal(out[3, :5], dy[3, :5])
        check(out, dy, y, "float32", log)


# ---- layouts, axes, out ------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1, -3])
def test_other_axes(axis):
    rng = np.random.default_rng()
    x = 2 * rng.standard_normal((3, 4, 5))
    dy = rng.standard_normal(x.shape).astype(np.float32)
    for log in (False, True):
        y = forward64(x, axis, log).astype(np.float32)
        out = poisoned(x.shape, "float32")
        OPS["log_softmax" if log else "softmax"](dy, y, axis, out=out)
        check(out, dy, y, "float32", log, axis)


def test_non_contiguous_inputs(monkeypatch):
    """dy transposed (copied), y a strided row selection and a column slice (read in place),
    out transposed (written through a copy); with row-strided inputs only, nothing is copied."""
    rng = np.random.default_rng()
    copies = []
    real = sm._contiguous_moved
    monkeypatch.setattr(sm, "_contiguous_moved", lambda *a: copies.append(1) or real(*a))
    x = 3 * rng.standard_normal((4, 40))
    dy = np.ascontiguousarray(rng.standard_normal((40, 4)).astype(np.float32)).T   # (4, 40)
    ybuf = np.zeros((8, 50), np.float32)
    ybuf[::2, 3:43] = forward64(x).astype(np.float32)
    y = ybuf[::2, 3:43]
    out = np.full((40, 4), np.nan, np.float32).T
    assert softmax_backward(dy, y, out=out) is out
    check(out, dy, y, "float32", False)
    assert copies == [1], "only dy must be copied"
    dybuf = rng.standard_normal((8, 41)).astype(np.float32)
    keep = dybuf.copy()
    dy2 = dybuf[1::2, :40]
    y_log = forward64(x, log=True).astype(np.float32)
    got = log_softmax_backward(dy2, y_log)
    check(got, dy2, y_log, "float32", True)
    assert copies == [1], "row-strided inputs are read in place"
    np.testing.assert_array_equal(dybuf, keep)                    # inputs untouched


def test_3d_bfloat16_along_axis_1_and_strided_rows():
    rng = np.random.default_rng()
    x = 2 * rng.standard_normal((2, 33, 3))
    dy = rng.standard_normal(x.shape).astype(ml_dtypes.bfloat16)
    y = forward64(x, 1).astype(ml_dtypes.bfloat16)
    check(softmax_backward(dy, y, 1), dy, y, "bfloat16", False, 1)
    z = np.zeros((2, 5, 17), np.float16)
    z[:, ::2] = forward64(3 * rng.standard_normal((2, 3, 17)), log=True)
    y2 = z[:, ::2]                                                # rows that do not collapse
    assert sm._rows_layout(y2.shape, tuple(st // 2 for st in y2.strides)) is None
    dy2 = rng.standard_normal(y2.shape).astype(np.float16)
    check(log_softmax_backward(dy2, y2), dy2, y2, "float16", True)


def test_out_may_be_dy_or_y():
    rng = np.random.default_rng()
    for log in (False, True):
        fn = OPS["log_softmax" if log else "softmax"]
        dy, y = inputs(3, 100, "float32", log, rng, 104)
        keep_dy, keep_y = dy.copy(), y.copy()
        assert fn(dy, y, out=dy) is dy                          # in place, vector kernel
        check(dy, keep_dy, keep_y, "float32", log)
        dy, y = keep_dy.copy(), keep_y.copy()
        assert fn(dy, y, out=y) is y
        check(y, keep_dy, keep_y, "float32", log)
    x = 2 * rng.standard_normal((2, 5, 3))
    dy = rng.standard_normal(x.shape).astype(np.float16)
    y = forward64(x, 1).astype(np.float16)
    keep = dy.copy()
    assert softmax_backward(dy, y, axis=1, out=dy) is dy        # through the copy
    check(dy, keep, y, "float16", False, 1)


def test_zero_size_and_0d():
    for shape, axis in [((0, 5), -1), ((3, 0), -1), ((2, 0, 3), 1), ((2, 0, 3), 0), ((0,), 0)]:
        a = np.ones(shape, np.float32)
        got = softmax_backward(a, a, axis)
        assert got.shape == shape and got.dtype == np.float32
        got = log_softmax_backward(a, a, axis, out=np.empty(shape, np.float32))
        assert got.shape == shape
    one = np.array(1.0, np.float32)
    dy = np.array(0.75, np.float32)
    assert softmax_backward(dy, one).shape == ()
    assert float(softmax_backward(dy, one)) == 0.0               # 1 · (dy - dy·1)
    assert float(log_softmax_backward(dy, np.array(0.0, np.float32), 0)) == 0.0


def test_numba_device_arrays():
    from numba import cuda

    rng = np.random.default_rng()
    dy, y = inputs(3, 50, "float32", False, rng)
    dy, y = np.ascontiguousarray(dy), np.ascontiguousarray(y)
    got = softmax_backward(cuda.to_device(dy), cuda.to_device(y))
    assert hasattr(got, "copy_to_host")
    check(got.copy_to_host(), dy, y, "float32", False)


# ---- the launch-plan cache ----------------------------------------------------------------------

def test_repeated_calls_reuse_the_plan_without_validation(monkeypatch):
    monkeypatch.setattr(sb, "_PLANS", PlanCache())
    rng = np.random.default_rng()
    real_check = sb._check
    checks = []
    monkeypatch.setattr(sb, "_check", lambda *a: checks.append(1) or real_check(*a))
    for i in range(3):
        dy, y = inputs(3, 40, "float32", False, rng, 40)
        out = poisoned((3, 40), "float32") if i == 2 else None
        got = softmax_backward(dy, y, out=out)
        check(got, dy, y, "float32", False)
        dy, y = inputs(3, 40, "float32", True, rng, 40)
        check(log_softmax_backward(dy, y), dy, y, "float32", True)
    assert len(sb._PLANS) == 3       # softmax, log_softmax, softmax with out=
    assert len(checks) == 3, "a repeated signature must not validate again"
    with pytest.raises(TypeError, match="axis must be an integer"):
        softmax_backward(dy, y, axis=True)                       # == -1 + 2, not a cache hit


def test_output_spec():
    x = np.ones((2, 3, 4), np.float16)
    assert sb.output_spec(x, x, 1) == ((2, 3, 4), "float16")
    with pytest.raises(ValueError, match="y must have shape"):
        sb.output_spec(x, x[:, :2], 1)


# ---- errors, before launch ----------------------------------------------------------------------

def test_errors_are_raised_before_launch(monkeypatch):
    from numba import cuda

    def no_launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(sb, "launch_plan", no_launch)
    monkeypatch.setattr(sb, "_PLANS", PlanCache())
    x = np.ones((4, 8), np.float32)
    wide = np.ones((2, 40), np.float32)
    cases = [
        (TypeError, "dy: dtype float64", lambda: softmax_backward(x.astype(np.float64), x)),
        (TypeError, "y: dtype int32", lambda: log_softmax_backward(x, x.astype(np.int32))),
        (TypeError, "dy: expected", lambda: softmax_backward([[1.0, 2.0]], x)),
        (TypeError, "y: expected", lambda: softmax_backward(x, None)),
        (TypeError, "inputs mix array kinds: dy is numpy, y is numba",
         lambda: softmax_backward(x, cuda.to_device(x))),
        (ValueError, r"y must have dtype float32 \(that of dy\), got float16",
         lambda: softmax_backward(x, x.astype(np.float16))),
        (ValueError, r"y must have shape \(4, 8\) \(that of dy\), got \(4, 9\)",
         lambda: softmax_backward(x, np.ones((4, 9), np.float32))),
        (ValueError, r"y must have shape", lambda: softmax_backward(x, x.T)),
        (ValueError, r"axis 2 is out of range for dy with 2 dimensions",
         lambda: softmax_backward(x, x, 2)),
        (ValueError, r"axis -3 is out of range", lambda: log_softmax_backward(x, x, -3)),
        (ValueError, r"axis 1 is out of range for dy with 0 dimensions",
         lambda: softmax_backward(np.ones((), np.float32), np.ones((), np.float32), 1)),
        (TypeError, "axis must be an integer", lambda: softmax_backward(x, x, 1.0)),
        (TypeError, "axis must be an integer", lambda: softmax_backward(x, x, None)),
        (ValueError, r"out must have shape \(4, 8\) \(that of dy\)",
         lambda: softmax_backward(x, x, out=np.empty((4, 9), np.float32))),
        (ValueError, "out must have dtype float32",
         lambda: softmax_backward(x, x, out=np.empty((4, 8), np.float16))),
        (TypeError, "out: dtype float64",
         lambda: softmax_backward(x, x, out=np.empty((4, 8), np.float64))),
        (TypeError, "out: expected", lambda: softmax_backward(x, x, out=[0.0])),
        (TypeError, "inputs mix array kinds",
         lambda: softmax_backward(x, x, out=cuda.to_device(x))),
        (ValueError, "out has overlapping elements",
         lambda: softmax_backward(x, x, out=np.broadcast_to(np.empty(8, np.float32), (4, 8)))),
        (ValueError, "covers rows of 32 values, 8 short of n = 40",
         lambda: softmax_backward(wide, wide, config=Plan("warp", 1, 1))),
        (TypeError, "config must be", lambda: softmax_backward(x, x, config="block")),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
    # a NumPy array on a machine with a GPU
    monkeypatch.setattr(arrays, "SIMULATOR", False)
    with pytest.raises(TypeError, match="dy: a NumPy array lives on the host"):
        softmax_backward(x, x)


def test_pytorch_tensors():
    """PyTorch tensors (CPU tensors stand for CUDA ones in the simulator), bfloat16 included,
    against PyTorch's own backward of the same inputs."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    for dtype, tol in ((torch.bfloat16, 8e-3), (torch.float32, 1e-5)):
        x = 3 * torch.randn(3, 70)
        for log in (False, True):
            y = (torch.log_softmax if log else torch.softmax)(x, -1).to(dtype)
            dy = torch.randn(3, 70).to(dtype)
            got = OPS["log_softmax" if log else "softmax"](dy, y)
            assert isinstance(got, torch.Tensor) and got.dtype == dtype
            fn = torch._log_softmax_backward_data if log else torch._softmax_backward_data
            want = fn(dy.float(), y.float(), -1, torch.float32)
            err = (got.float() - want).abs().max().item()
            assert err <= tol * (1 + want.abs().max().item()), err


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,dtype", [(1000, 100, "float32"), (16384, 1000, "float16"),
                                          (2000, 8193, "bfloat16"), (64, 40000, "float32"),
                                          (256, 32768, "bfloat16")])
def test_gpu_full_size_against_float64(rows, n, dtype):
    """Every path at full size on the GPU (warp, block, two-pass; an odd row length) against
    float64 formulas, with ``out`` poisoned beforehand."""
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    x = 4 * torch.randn(rows, n, device="cuda")
    for log in (False, True):
        y = (torch.log_softmax if log else torch.softmax)(x, -1).to(tdt)
        dy = torch.randn(rows, n, device="cuda").to(tdt)
        out = torch.full_like(dy, float("nan"))
        OPS["log_softmax" if log else "softmax"](dy, y, out=out)
        yd, dyd = y.double(), dy.double()
        want = dyd - yd.exp() * dyd.sum(-1, keepdim=True) if log else \
            yd * (dyd - (dyd * yd).sum(-1, keepdim=True))
        assert not torch.isnan(out).any()
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert err <= tol, (log, err)
