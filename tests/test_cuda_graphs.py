"""CUDA-graph capture of tilepy's ops with PyTorch CUDA tensors and CuPy arrays (GPU only).

Each case captures one op call (``torch.cuda.graph``; for CuPy ``Stream.begin_capture`` /
``end_capture`` on a non-default stream), then fills the static inputs with new random
contents, replays, and compares the static output with a reference computed afresh (PyTorch
float32; CuPy float64) — twice, so a replay that only repeated the capture-time result would
fail.
Capture forbids host synchronisation, allocation outside PyTorch's allocator (the graph's
private pool), copies from pageable host memory and work on other streams; the TMA kernels'
tensor maps and tile counters are made so (:mod:`tilepy.tile.device_write`).

``warmup=True``: the call of the captured signature ran eagerly before (its plan, tensor maps
and counters exist: the capture reuses them). ``warmup=False``: the captured call is the first
of its signature, so its plan, maps and counters are made during the capture — after one call
of *another* shape of the same kernel, which loads the kernels (the op's and the map writer's)
and makes the per-device placeholders (a process whose very first tilepy call is captured
would also compile and load modules during the capture, which this file does not test).
"""

from __future__ import annotations

import pytest

import tilepy

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU for PyTorch")
    return torch


def hopper(torch) -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def capture(torch, fn, warmup: bool):
    """``(graph, static output)`` of ``fn()`` captured with torch.cuda.graph, after two eager
    calls on a side stream when ``warmup`` (the pattern PyTorch documents)."""
    if warmup:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def replay_and_check(torch, graph, out, inputs, reference, check, rounds=2):
    """Per round: new random contents in ``inputs`` (in place), replay, compare ``out`` with
    ``reference()`` computed now."""
    for _ in range(rounds):
        for x in inputs:
            x.copy_(torch.randn_like(x, dtype=torch.float32).to(x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference())


# The checks take PyTorch tensors or CuPy arrays (a float16 result against a float32 or
# float64 reference: the difference is computed in the reference's precision).

def no_nan(got):
    assert not bool((got != got).any()), "NaN (or an unwritten element, or a lost tile)"


def close(got, want, rel):
    """Max error over max |want| at most ``rel`` (NaN fails)."""
    no_nan(got)
    err = float(abs(got - want).max()) / max(float(abs(want).max()), 1e-6)
    assert err <= rel, err


def abs_close(got, want, tol):
    """Max absolute error below ``tol`` (NaN fails)."""
    no_nan(got)
    assert float(abs(got - want).max()) < tol


def softmax_close(got, want):
    """float16 softmax values: each within 4e-3 relative (two roundings and float32 math) plus
    1e-5 absolute (values below float16's normal range)."""
    no_nan(got)
    bound = 4e-3 * abs(want) + 1e-5
    assert bool((abs(got - want) <= bound).all()), float((abs(got - want) / bound).max())


CHECKS = {   # float16 results, by op
    "gemm": lambda got, want: close(got, want, 2e-3),
    "softmax": softmax_close,
    "gemm_softmax": softmax_close,
    # log-probabilities of a few units: float16 spacing there is ~4e-3
    "log_softmax": lambda got, want: abs_close(got, want, 2e-2),
    "flash_attention": lambda got, want: abs_close(got, want, 1e-2),
    # test_ops_softmax_backward.py's float16 GPU tolerance
    "softmax_backward": lambda got, want: close(got, want, 2e-3),
    "log_softmax_backward": lambda got, want: close(got, want, 2e-3),
}


def global_park():
    """gemm_softmax's mma.sync kernel with rows parked in global memory (a float32 scratch
    allocated per call)."""
    from tilepy.ops import gemm_softmax as gs
    from tilepy.ops.gemm_softmax_mma_sync import GemmSoftmaxConfig

    return GemmSoftmaxConfig(gs._GLOBAL_GPU, "global")


# ---- flash_attention ------------------------------------------------------------------------

def attention_case(torch, b, h, s, d, causal):
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))

    def run():
        return tilepy.flash_attention(q, k, v, causal=causal)

    def reference():
        return torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=causal)

    return (q, k, v), run, reference, CHECKS["flash_attention"]


@pytest.mark.parametrize("d,causal", [(128, False), (128, True), (64, False), (64, True)])
@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_flash_attention(torch, d, causal, warmup):
    """The default config (on sm_90 the TMA kernels; persistent with a tile counter at head_dim
    64 and causal 128)."""
    s = 1024 if warmup else 777 + d + causal      # a signature no other case has
    if not warmup:
        tilepy.flash_attention(*attention_case(torch, 1, 2, 256, d, causal)[0], causal=causal)
    inputs, run, reference, check = attention_case(torch, 2, 8, s, d, causal)
    graph, out = capture(torch, run, warmup)
    replay_and_check(torch, graph, out, inputs, reference, check)
    # an eager call after the capture with the same arrays (the maps and counter the capture
    # made are written only by the graph: the eager call must not pick them up unwritten)
    check(run(), reference())


@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_flash_attention_fp8(torch, warmup):
    """e4m3 q, k, v with per-(batch, head) descales (inputs of the graph too: new values
    replayed), causal GQA: V's transpose into a per-call buffer and the attention kernel's
    tensor maps for it, captured."""
    if not hopper(torch):
        pytest.skip("FP8 attention needs sm_90")
    b, h, hk, d = 2, 8, 2, 128
    s = 1024 if warmup else 777
    f8 = torch.float8_e4m3fn
    q = (torch.randn(b, h, s, d, device="cuda") * 2).to(f8)
    k, v = ((torch.randn(b, hk, s, d, device="cuda") * 2).to(f8) for _ in range(2))
    dq, dk, dv = (torch.rand(b, hk, device="cuda") + 0.5 for _ in range(3))

    def run():
        return tilepy.flash_attention(q, k, v, causal=True, descale_q=dq, descale_k=dk,
                                      descale_v=dv)

    def reference():
        """(O, bound): float32 attention on the dequantised inputs, and what P's rounding to
        e4m3 may move O by (2**-4 of Σ p|v| / l, as in test_ops_attention_fp8), plus
        bfloat16's rounding of O and 2e-3 of V's largest value."""
        def deq(x, f):    # dequantised, K/V heads repeated for their query heads
            return (x.float() * f[:, :, None, None]).repeat_interleave(h // x.shape[1], 1)

        qd, kd, vd = deq(q, dq.repeat_interleave(h // hk, 1)), deq(k, dk), deq(v, dv)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        want = sdpa(qd, kd, vd, is_causal=True)
        mag = sdpa(qd, kd, vd.abs(), is_causal=True)
        return want, 2.0**-4 * mag + 2.0**-8 * want.abs() + 2e-3 * vd.abs().max()

    def check(got, reference):
        want, bound = reference
        no_nan(got)
        excess = float(((got.float() - want).abs() - bound).max())
        assert excess <= 0, excess

    if not warmup:
        run()      # compiled; the capture then makes new maps for its own buffers
    graph, out = capture(torch, run, warmup)
    for _ in range(2):     # new descales each round (positive, as quantiser scales are)
        for x in (dq, dk, dv):
            x.copy_(torch.rand_like(x) + 0.5)
        replay_and_check(torch, graph, out, (q, k, v), reference, check, rounds=1)
    check(run(), reference())


# ---- gemm ------------------------------------------------------------------------------------

@pytest.mark.parametrize("epilogue", ["plain", "bias_gelu"])
@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_gemm(torch, epilogue, warmup):
    """A plain product (on sm_90 the TMA kernel with TMA stores: maps of a, b and out) and a
    float16 bias with GELU (the staged epilogue; the bias converted to float32 per call)."""
    m = 4096 if warmup else 4096 + 128 + 64 * (epilogue == "plain")
    n, k = 2048, 1024
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16)
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    if epilogue == "plain":
        inputs = (a, b)

        def run():
            return tilepy.gemm(a, b)

        def reference():
            return a.float() @ b.float()
    else:
        inputs = (a, b, bias)

        def run():
            return tilepy.gemm(a, b, bias=bias, activation="gelu")

        def reference():
            return torch.nn.functional.gelu(a.float() @ b.float() + bias.float())
    if not warmup:   # another signature of the same kernel (4096 rows fill the SMs too)
        tilepy.gemm(a[:4096], b, **({} if epilogue == "plain" else
                                    {"bias": bias, "activation": "gelu"}))
    check = CHECKS["gemm"]
    graph, out = capture(torch, run, warmup)
    replay_and_check(torch, graph, out, inputs, reference, check)
    check(run(), reference())


@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_gemm_split_k(torch, warmup):
    """A decode-sized product (on sm_90 split-K: the tiles' semaphores and partials, a
    capture's own, zeroed in the graph). Every replay is right, which needs the semaphores
    left at zero by the one before."""
    m = 16 if warmup else 17
    a = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)

    def run():
        return tilepy.gemm(a, b)

    def reference():
        return a.float() @ b.float()

    check = CHECKS["gemm"]
    graph, out = capture(torch, run, warmup)
    replay_and_check(torch, graph, out, (a, b), reference, check)
    check(run(), reference())


def test_gemm_split_k_calls_in_one_capture_share_a_workspace(torch):
    """Three split-K products (the third reading the first's result) in one capture: on
    sm_90 the plan gets one set of semaphores and partials for the capture's stream, not one
    per call, zeroed in the graph before the first; every replay is right (each call leaves
    the semaphores at zero for the next), and a second capture gets a set of its own."""
    from tilepy.ops import gemm as gm
    from tilepy.tile.tma_plan import ScheduledTmaPlan

    m = 16
    a = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    c = torch.randn(4096, 4096, device="cuda", dtype=torch.float16) / 64

    def run():
        x = tilepy.gemm(a, b)
        y = tilepy.gemm(a, b * 1)
        return x, y, tilepy.gemm(x, c)

    def reference():
        x = a.float() @ b.float()
        return x, x, x.half().float() @ c.float()

    def capture_keys():
        plans = [e.bound.plan for e in gm._PLANS.values()
                 if isinstance(e.bound.plan, ScheduledTmaPlan)]
        return plans, {k for p in plans for k in p._counters
                       if isinstance(k, tuple) and k[0] == "capture"}

    run()
    torch.cuda.synchronize()
    before = capture_keys()[1]       # (other tests' captures of the same plan)
    graph, outs = capture(torch, run, False)
    plans, keys = capture_keys()
    if hopper(torch):
        assert plans and len(keys - before) == 1, (keys, before)
    for _ in range(2):
        for x in (a, b, c):
            x.copy_(torch.randn_like(x, dtype=torch.float32).to(x.dtype) / 8)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, reference()):
            CHECKS["gemm"](got, want)
    graph2, _ = capture(torch, run, False)
    if hopper(torch):
        assert len(capture_keys()[1] - before) == 2


# ---- gemm_softmax ----------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["default", "global_park"])
@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_gemm_softmax(torch, path, warmup):
    """The built-in choice (on sm_90 the TMA + wgmma softmax mode: maps of a, b and out) and
    the mma.sync kernel with rows parked in global memory (a float32 scratch allocated per
    call: inside the capture, from the graph's pool)."""
    m = 4096 if warmup else 4096 + 192 + 64 * (path == "default")
    n, k, scale = 1024, 512, 1 / 24
    config = None if path == "default" else global_park()
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16)

    def run():
        return tilepy.gemm_softmax(a, b, scale=scale, config=config)

    def reference():
        return torch.softmax(scale * (a.float() @ b.float()), dim=-1)

    if not warmup:
        tilepy.gemm_softmax(a[:1024], b, scale=scale, config=config)
    graph, out = capture(torch, run, warmup)
    replay_and_check(torch, graph, out, (a, b), reference, softmax_close)
    softmax_close(run(), reference())


# ---- softmax, log_softmax --------------------------------------------------------------------

@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_softmax(torch, op, warmup):
    rows = 4096 if warmup else 4096 + 320 + 64 * (op == "softmax")
    x = torch.randn(rows, 1000, device="cuda", dtype=torch.float16)
    fn = getattr(tilepy, op)
    ref = getattr(torch, op)

    def run():
        return fn(x)

    def reference():
        return ref(x.float(), dim=-1)

    check = CHECKS[op]
    if not warmup:
        fn(x[:1024])
    graph, out = capture(torch, run, warmup)
    replay_and_check(torch, graph, out, (x,), reference, check)
    check(run(), reference())


# ---- float8: quantize_fp8, then the FP8 GEMM ---------------------------------------------------

@pytest.mark.parametrize("scales", ["row", "block"])
@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_quantize_and_fp8_gemm(torch, scales, warmup):
    """x and w quantised per row (or per 1 x 128 / 128 x 128 block) and multiplied, captured
    together: the recorded quantiser calls (per-call codes and scales from the graph's pool)
    and the FP8 GEMM's tensor maps for pointers first seen in the capture."""
    if not hopper(torch):
        pytest.skip("the FP8 GEMM needs sm_90")
    m = 2048 if warmup else 2048 + 128 + 64 * (scales == "row")
    n, k = 1024, 1536
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    gx, gw = ("row", "row") if scales == "row" else ((1, 128), (128, 128))

    def run():
        xq, xs = tilepy.quantize_fp8(x, granularity=gx)
        wq, ws = tilepy.quantize_fp8(w, granularity=gw)
        return tilepy.gemm(xq, wq.t(), scale_a=xs, scale_b=ws.t() if scales == "block" else ws)

    def reference():
        return x.float() @ w.float().t()

    if not warmup:
        run()      # the kernels compiled; then a signature first seen in the capture
        x = torch.randn(m + 64, k, device="cuda", dtype=torch.bfloat16)
    graph, out = capture(torch, run, warmup)
    # e4m3 codes of both operands: a few per cent of the product's scale
    check = lambda got, want: close(got.float(), want, 6e-2)   # noqa: E731
    replay_and_check(torch, graph, out, (x, w), reference, check)
    check(run(), reference())


# ---- CuPy: capture on a cupy.cuda.Stream -----------------------------------------------------

@pytest.fixture(scope="module")
def cupy():
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("needs a CUDA GPU for CuPy")
    return cupy


def cupy_softmax(cupy, x, log=False):
    """softmax / log_softmax over the last axis, in ``x``'s precision."""
    z = x - x.max(-1, keepdims=True)
    s = cupy.exp(z).sum(-1, keepdims=True)
    return z - cupy.log(s) if log else cupy.exp(z) / s


def cupy_gelu(y):
    from cupyx.scipy.special import erf

    return 0.5 * y * (1 + erf(y / 2 ** 0.5))


def cupy_attention(cupy, q, k, v, causal):
    s = q @ k.swapaxes(-1, -2) / q.shape[-1] ** 0.5
    if causal:   # bottom-right aligned
        sq, sk = s.shape[-2:]
        s = cupy.where(cupy.tri(sq, sk, sk - sq, dtype=bool), s, -cupy.inf)
    return cupy_softmax(cupy, s) @ v


# (id, CHECKS key, rows, input shapes for `rows`, the tilepy call, its reference on float64
# inputs). Rows (attention: sequence length) are no multiple of a tile; the GEMMs have enough
# 128×256 tiles to fill an H200 (the persistent TMA kernel, as in test_gemm), every op's
# built-in choice elsewhere does not depend on the rows.
CUPY_CASES = [
    ("gemm", "gemm", 1800, lambda r: [(r, 520), (520, 2888)],
     lambda a, b: tilepy.gemm(a, b), lambda cp, a, b: a @ b),
    ("gemm_bias_gelu", "gemm", 1800, lambda r: [(r, 520), (520, 2888), (2888,)],
     lambda a, b, c: tilepy.gemm(a, b, bias=c, activation="gelu"),
     lambda cp, a, b, c: cupy_gelu(a @ b + c)),
    ("softmax", "softmax", 330, lambda r: [(r, 1000)], tilepy.softmax, cupy_softmax),
    ("log_softmax", "log_softmax", 330, lambda r: [(r, 1000)], tilepy.log_softmax,
     lambda cp, x: cupy_softmax(cp, x, log=True)),
    ("softmax_backward", "softmax_backward", 330, lambda r: [(r, 1000)] * 2,
     tilepy.softmax_backward, lambda cp, dy, y: y * (dy - (dy * y).sum(-1, keepdims=True))),
    ("log_softmax_backward", "log_softmax_backward", 330, lambda r: [(r, 1000)] * 2,
     tilepy.log_softmax_backward,
     lambda cp, dy, y: dy - cp.exp(y) * dy.sum(-1, keepdims=True)),
    ("gemm_softmax", "gemm_softmax", 700, lambda r: [(r, 264), (264, 1000)],
     lambda a, b: tilepy.gemm_softmax(a, b, scale=1 / 24),
     lambda cp, a, b: cupy_softmax(cp, (a @ b) / 24)),
    ("gemm_softmax_global_park", "gemm_softmax", 700, lambda r: [(r, 264), (264, 1000)],
     lambda a, b: tilepy.gemm_softmax(a, b, scale=1 / 24, config=global_park()),
     lambda cp, a, b: cupy_softmax(cp, (a @ b) / 24)),
    *((f"flash_attention_d{d}" + "_causal" * causal, "flash_attention", 300,
       lambda r, d=d: [(1, 3, r, d)] * 3,
       lambda q, k, v, causal=causal: tilepy.flash_attention(q, k, v, causal=causal),
       lambda cp, q, k, v, causal=causal: cupy_attention(cp, q, k, v, causal))
      for d in (128, 64) for causal in (False, True)),
]


#: Per case, constants added to its standard-normal inputs: log_softmax_backward's ``y`` is a
#: log-probability (exp(y) small), so the output is about ``dy`` and the 2e-3 relative check
#: stays tight (with y ~ N(0, 1), exp(y) · Σdy made the bound loose enough to pass a +1 error).
CUPY_SHIFTS = {"log_softmax_backward": (0.0, -8.0)}


@pytest.mark.parametrize("case", CUPY_CASES, ids=[c[0] for c in CUPY_CASES])
@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_cupy_stream_capture(cupy, case, warmup):
    """Every op on CuPy float16 arrays, captured on a non-blocking ``cupy.cuda.Stream``
    (CuPy's default capture mode, relaxed: its memory pool may cudaMalloc during the capture)
    and replayed with ``Graph.launch``, after NaN-filled arrays of many sizes were allocated
    on the capture stream: an op's temporaries (the float32 bias, the parked rows' scratch,
    aligned copies) must be kept for the graph (``tilepy.tile.device_write.
    keep_during_capture``), not handed back to CuPy's pool for such allocations to reuse."""
    _, check, rows, shapes, call, ref = case
    check = CHECKS[check]

    shifts = CUPY_SHIFTS.get(case[0], ())

    def fill(shape, i):
        x = cupy.random.standard_normal(shape, dtype=cupy.float32)
        return x + shifts[i] if i < len(shifts) else x

    def inputs_of(rows):
        return [fill(s, i).astype(cupy.float16) for i, s in enumerate(shapes(rows))]

    if not warmup:   # another signature of the same kernel, then one no other case has
        call(*inputs_of(rows))
        rows += 2 * CUPY_CASES.index(case) + 1
    inputs = inputs_of(rows)

    def reference():
        return ref(cupy, *(x.astype(cupy.float64) for x in inputs))

    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(2 if warmup else 0):
            call(*inputs)
        stream.begin_capture()
        try:
            out = call(*inputs)
        finally:
            graph = stream.end_capture()
    with stream:   # allocations on the capture stream after the capture, NaN-filled: they
        # must not get memory the graph reads (an op's temporaries are kept for the graph)
        junk = [cupy.full(1 << e, cupy.nan, cupy.float32) for e in range(7, 23)]
    for _ in range(2):
        for i, x in enumerate(inputs):
            x[...] = fill(x.shape, i)
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        check(out, reference())
    # an eager call after the capture with the same arrays (see test_flash_attention)
    check(call(*inputs), reference())
    del junk
