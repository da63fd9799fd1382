"""Softmax: ``tilepy.softmax`` against ``torch.softmax``, a Triton fused softmax and a
device-to-device copy, same run.

Bandwidth-bound: throughput is GB/s of one read and one write of the tensor. The copy moves
the same bytes, so its ratio (``copy_ms / ms``, the ``fraction_of_copy``) is how close an
implementation gets to the memory ceiling. tilepy and Triton write into a preallocated
``out``; ``torch.softmax`` allocates its result (from PyTorch's cache). Tensors that fit in
L2 are timed with the cache flushed before each run (``bench/measure.py``).

Shapes of issue 6: 16384×4096, 32768×1024, 4096×32768 in float32 and float16; the row sweep
of Triton's tutorial (4096 rows, 256 … 32768 columns); ``log_softmax`` at 16384×4096 float32;
``tilepy.gemm_softmax`` against ``tilepy.gemm`` + ``tilepy.softmax`` and against PyTorch
(matmul + softmax) at M=16384, K=1024, N ∈ {1024, 4096}.

The backward (``tilepy.ops.softmax_backward``: ``softmax_backward`` / ``log_softmax_backward``)
against ``torch._softmax_backward_data`` / ``torch._log_softmax_backward_data`` at the same
shapes, sweep and log case: GB/s of reading ``dy`` and ``y`` and writing ``dx``; its ceiling
is an elementwise ``torch.add(dy, y, out=...)``, which moves the same bytes.
Select parts with ``-k``: ``-k shapes``, ``-k sweep``, ``-k log``, ``-k gemm_softmax``,
``-k backward`` (``-k "not backward"`` for the forward only).
"""

import pytest
from measure import (
    checked_timing,
    fits_in_l2,
    gpu_time,
    max_abs_err,
    record_throughput,
    triton_peers,
    try_peer,
)

SHAPES = [(16384, 4096), (32768, 1024), (4096, 32768)]
DTYPES = ["float32", "float16"]
SWEEP = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
TORCH = "torch"
COPY = "copy (ceiling)"
ADD = "add (ceiling)"


def tolerance(dtype, log):
    """Max abs error: softmax values are ≤ 1; log-softmax values are about -log(n)."""
    base = 1e-5 if dtype == "float32" else 2e-3
    return base * (20 if log else 1)


def backward_plan_of(cols, dtype):
    """tilepy's backward kernel choice for rows of ``cols`` values, described (or '?')."""
    try:
        from tilepy.arrays import ITEMSIZE
        from tilepy.ops.softmax_backward import plan

        p = plan(cols, itemsize=ITEMSIZE[dtype])
        return f"{p.path}, {p.threads} threads, {p.per_thread} per thread"
    except Exception:  # noqa: BLE001 — a description, never a reason to fail
        return "?"


def plan_of(cols):
    """tilepy's kernel choice for rows of ``cols`` values, described (or '?')."""
    try:
        from tilepy.ops.softmax import plan

        p = plan(cols)
        return f"{p.path}, {p.threads} threads, {p.per_thread} per thread"
    except Exception:  # noqa: BLE001 — a description, never a reason to fail
        return "?"


def softmax_case(torch, record, gpu_name, rows, cols, dtype, log=False, **info):
    """Check tilepy against PyTorch once, time tilepy / torch / Triton / copy, record; return
    the tilepy call for benchmark.pedantic."""
    import tilepy

    ours_fn = tilepy.log_softmax if log else tilepy.softmax
    torch_fn = torch.log_softmax if log else torch.softmax
    x = torch.randn(rows, cols, device="cuda", dtype=getattr(torch, dtype))
    out = torch.empty_like(x)
    flush = fits_in_l2(torch, x, out)
    ours_fn(x, out=out)  # compile
    want = torch_fn(x.float(), -1)
    err = max_abs_err(out, want)
    assert err < tolerance(dtype, log), err

    notes = {}
    copy = torch.empty_like(x)
    timings = {"tilepy": gpu_time(torch, lambda: ours_fn(x, out=out), flush=flush),
               TORCH: gpu_time(torch, lambda: torch_fn(x, -1), flush=flush)}
    timings["Triton"] = try_peer(notes, "Triton", lambda: checked_timing(
        torch, lambda o: triton_peers().softmax(x, out=o, log=log), want.to(x.dtype),
        tolerance(dtype, log), flush=flush, err=max_abs_err))
    timings[COPY] = gpu_time(torch, lambda: copy.copy_(x), flush=flush)
    record_throughput(record, work=2 * x.numel() * x.element_size(), unit="GB/s",
                      timings=timings, main=TORCH, notes=notes, gpu=gpu_name,
                      shape=f"{rows}x{cols}", dtype=dtype, plan=plan_of(cols),
                      max_abs_err=err, **info)
    return lambda: (ours_fn(x, out=out), torch.cuda.synchronize())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_softmax_shapes(benchmark, record, torch, gpu_name, shape, dtype):
    run = softmax_case(torch, record, gpu_name, *shape, dtype, table="Softmax",
                       case=f"{shape[0]}×{shape[1]} {dtype}")
    benchmark.pedantic(run, rounds=3, iterations=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", SWEEP)
def test_softmax_row_sweep(benchmark, record, torch, gpu_name, cols, dtype):
    run = softmax_case(torch, record, gpu_name, 4096, cols, dtype,
                       table="Softmax: 4096 rows, row-length sweep", case=f"{cols} {dtype}",
                       figure=f"softmax_sweep_{dtype}", x=cols, xlabel="row length (4096 rows)")
    benchmark.pedantic(run, rounds=3, iterations=1)


def test_log_softmax(benchmark, record, torch, gpu_name):
    run = softmax_case(torch, record, gpu_name, 16384, 4096, "float32", log=True,
                       table="Log-softmax", case="16384×4096 float32")
    benchmark.pedantic(run, rounds=3, iterations=1)


def backward_case(torch, record, gpu_name, rows, cols, dtype, log=False, **info):
    """The backward: check tilepy against PyTorch's backward (float32, of the same inputs)
    once, time tilepy / torch / an elementwise add of dy and y (the same bytes: two reads, one
    write), record; return the tilepy call for benchmark.pedantic. ``y`` is the forward's
    output (``torch.softmax`` / ``torch.log_softmax``), ``dy`` random."""
    from tilepy.ops.softmax_backward import log_softmax_backward, softmax_backward

    ours_fn = log_softmax_backward if log else softmax_backward
    torch_fn = torch._log_softmax_backward_data if log else torch._softmax_backward_data
    tdt = getattr(torch, dtype)
    x = torch.randn(rows, cols, device="cuda", dtype=tdt)
    y = (torch.log_softmax if log else torch.softmax)(x, -1)
    dy = torch.randn(rows, cols, device="cuda", dtype=tdt)
    out = torch.empty_like(dy)
    flush = fits_in_l2(torch, dy, y, out)
    ours_fn(dy, y, out=out)  # compile
    want = torch_fn(dy.float(), y.float(), -1, torch.float32)
    err = max_abs_err(out, want)
    assert err < tolerance(dtype, log), err

    ceiling = torch.empty_like(dy)
    timings = {"tilepy": gpu_time(torch, lambda: ours_fn(dy, y, out=out), flush=flush),
               TORCH: gpu_time(torch, lambda: torch_fn(dy, y, -1, tdt), flush=flush),
               ADD: gpu_time(torch, lambda: torch.add(dy, y, out=ceiling), flush=flush)}
    record_throughput(record, work=3 * dy.numel() * dy.element_size(), unit="GB/s",
                      timings=timings, main=TORCH, gpu=gpu_name, shape=f"{rows}x{cols}",
                      dtype=dtype, plan=backward_plan_of(cols, dtype), max_abs_err=err, **info)
    return lambda: (ours_fn(dy, y, out=out), torch.cuda.synchronize())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_softmax_backward_shapes(benchmark, record, torch, gpu_name, shape, dtype):
    run = backward_case(torch, record, gpu_name, *shape, dtype, table="Softmax backward",
                        case=f"{shape[0]}×{shape[1]} {dtype}")
    benchmark.pedantic(run, rounds=3, iterations=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", SWEEP)
def test_softmax_backward_row_sweep(benchmark, record, torch, gpu_name, cols, dtype):
    run = backward_case(torch, record, gpu_name, 4096, cols, dtype,
                        table="Softmax backward: 4096 rows, row-length sweep",
                        case=f"{cols} {dtype}", figure=f"softmax_backward_sweep_{dtype}",
                        x=cols, xlabel="row length (4096 rows)")
    benchmark.pedantic(run, rounds=3, iterations=1)


def test_log_softmax_backward(benchmark, record, torch, gpu_name):
    run = backward_case(torch, record, gpu_name, 16384, 4096, "float32", log=True,
                        table="Log-softmax backward", case="16384×4096 float32")
    benchmark.pedantic(run, rounds=3, iterations=1)


@pytest.mark.parametrize("kernel", ["builtin", "mma_sync"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1024, 4096])
def test_gemm_softmax_vs_unfused(benchmark, record, torch, gpu_name, n, dtype, kernel):
    """Issue 6: one fused launch against tilepy.gemm followed by tilepy.softmax (the main
    peer; the goal is a ratio >= 1.3 at N=1024) and against torch.matmul + torch.softmax.
    ``kernel="builtin"``: the built-in choice (on sm_90 the TMA + wgmma kernel's softmax
    mode); ``"mma_sync"``: the mma.sync kernel that is the choice elsewhere."""
    import tilepy
    from tilepy.ops import gemm_softmax as gs

    cfg = gs.choose_config(n, dtype, hopper=False) if kernel == "mma_sync" else None
    m, k, scale = 16384, 1024, 0.05
    tdt = getattr(torch, dtype)
    a = torch.randn(m, k, device="cuda", dtype=tdt)
    b = torch.randn(k, n, device="cuda", dtype=tdt)
    out, tmp = torch.empty(m, n, device="cuda", dtype=tdt), torch.empty(m, n, device="cuda",
                                                                         dtype=tdt)
    tilepy.gemm_softmax(a, b, scale=scale, out=out, config=cfg)
    want = torch.softmax(scale * (a.float() @ b.float()), -1)
    err = max_abs_err(out, want)
    assert err < 2e-2, err

    def unfused():
        tilepy.gemm(a, b, alpha=scale, out=tmp)
        tilepy.softmax(tmp, out=tmp)

    timings = {"tilepy": gpu_time(torch, lambda: tilepy.gemm_softmax(a, b, scale=scale,
                                                                     out=out, config=cfg)),
               "tilepy gemm + softmax": gpu_time(torch, unfused),
               TORCH: gpu_time(torch, lambda: torch.softmax(scale * torch.matmul(a, b), -1))}
    record_throughput(record, work=2 * m * n * k, unit="TFLOPS", timings=timings,
                      main="tilepy gemm + softmax", gpu=gpu_name, shape=f"{m}x{n}x{k}",
                      dtype=dtype, max_abs_err=err, table="Fused GEMM + softmax",
                      case=f"{m}×{n}×{k} {dtype}" + (" (mma.sync kernel)" if cfg else ""))
    benchmark.pedantic(lambda: (tilepy.gemm_softmax(a, b, scale=scale, out=out, config=cfg),
                                torch.cuda.synchronize()), rounds=3, iterations=1)
