"""GEMM: tilepy against cuBLAS (through PyTorch and CuPy), Triton and plain Numba, same run.

* ``test_gemm_kernel_*``: the bare mma.sync kernel (default config, prebuilt Numba arrays),
  M = N = K ∈ {4096, 8192}: what the kernel does without the op's host path.
* ``test_gemm_op_square``: the public op ``tilepy.gemm(a, b, out=out)`` on PyTorch tensors,
  fp16 and bf16, M = N = K ∈ {4096, 8192}.
* ``test_gemm_op_llm``: fp16, M ∈ {4096, 16384} × (N, K) of LLM projections.
* ``test_gemm_shape_grid``: bf16, M ∈ {1 … 4096} × Llama-3's (N, K) pairs, and 2048³: the
  GPU time of both sides from CUDA-graph replays of 20 calls (``measure.graph_ms``), and
  as called.
* ``test_gemm_op_small``: 512³ (inputs fit in L2: flushed before each run); the CPU cost of
  one call (``host_us``) matters as much as the GPU time here.
* ``test_gemm_bias_gelu``: the fused epilogue ``gemm(a, b, bias=bias, activation="gelu")``
  against ``gelu(matmul(a, b) + bias)`` in PyTorch (and the same epilogue fused in Triton).
* ``test_gemm_numba_simt_f32``: the plain Numba shared-memory float32 GEMM (no tensor cores;
  ``tilepy.gemm`` on float32 inputs runs it) beside cuBLAS float32 and tilepy fp16: what the
  tile library adds to Numba.

The main peer of every op result is cuBLAS through ``torch.matmul`` (``ratio``); ``ratios``
holds the others. Every implementation is timed GPU only and as called (``bench/measure.py``);
ratios use each one's slower time, so a wrapper whose host cost exceeds its kernel's time
shows in them. Every implementation writes into a preallocated output where it can. Each
tilepy result is checked once against PyTorch (max relative error) before it is timed.
Select parts with ``-k``: ``-k kernel``, ``-k square``, ``-k llm``, ``-k small``, ``-k gelu``,
``-k simt``.
"""

import numpy as np
import pytest
from measure import (
    checked_timing,
    fits_in_l2,
    gpu_time,
    graph_timing,
    max_rel_err,
    optional_module,
    record_throughput,
    triton_peers,
    try_peer,
)

SIZES = [4096, 8192]
DTYPES = ["float16", "bfloat16"]
LLM_M = [4096, 16384]
LLM_NK = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)]
CUBLAS = "cuBLAS (torch)"
TOLERANCE = 2e-2  # max relative error of a 16-bit result with float32 accumulation


def operands(torch, m, n, k, dtype):
    tdt = getattr(torch, dtype)
    a = torch.randn(m, k, device="cuda", dtype=tdt)
    b = torch.randn(k, n, device="cuda", dtype=tdt)
    return a, b, torch.empty(m, n, device="cuda", dtype=tdt)


def config_of(m, n, k, dtype):
    """The op's heuristic config, described (or '?' if that API moved)."""
    try:
        from tilepy.ops.gemm import choose_config

        return choose_config(m, n, k, 1, dtype).describe()
    except Exception:  # noqa: BLE001 — a description, never a reason to fail
        return "?"


def gemm_peers(torch, a, b, want, flush, notes):
    """Timings of cuBLAS through PyTorch and CuPy and of the Triton matmul on ``a @ b``; a
    peer that cannot run (not installed, dtype unsupported, wrong answer) is None + a note."""
    out = torch.empty_like(want)
    timings = {CUBLAS: gpu_time(torch, lambda: torch.matmul(a, b, out=out), flush=flush)}

    def cupy_peer():
        cupy = optional_module("cupy")
        if cupy is None:
            raise ImportError("cupy is not importable")
        ca, cb, cout = (cupy.asarray(t) for t in (a, b, out))
        return gpu_time(torch, lambda: cupy.matmul(ca, cb, out=cout), flush=flush)

    timings["cuBLAS (CuPy)"] = try_peer(notes, "cuBLAS (CuPy)", cupy_peer)
    timings["Triton"] = try_peer(notes, "Triton", lambda: checked_timing(
        torch, lambda o: triton_peers().matmul(a, b, out=o), want, TOLERANCE, flush=flush))
    return timings


def op_case(torch, record, gpu_name, m, n, k, dtype, **info):
    """Check tilepy.gemm once against torch.matmul, time it and its peers, record."""
    import tilepy

    a, b, out = operands(torch, m, n, k, dtype)
    flush = fits_in_l2(torch, a, b, out)
    tilepy.gemm(a, b, out=out)  # compile
    want = torch.matmul(a, b)
    err = max_rel_err(out, want)
    assert err < TOLERANCE, err
    notes = {}
    timings = {"tilepy": gpu_time(torch, lambda: tilepy.gemm(a, b, out=out), flush=flush)}
    timings.update(gemm_peers(torch, a, b, want, flush, notes))
    record_throughput(record, work=2 * m * n * k, unit="TFLOPS", timings=timings, main=CUBLAS,
                      notes=notes, gpu=gpu_name, dtype=dtype, shape=f"{m}x{n}x{k}",
                      config=config_of(m, n, k, dtype), max_rel_err=err, **info)
    return lambda: (tilepy.gemm(a, b, out=out), torch.cuda.synchronize())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_gemm_kernel_vs_cublas(benchmark, record, torch, gpu_name, n, dtype):
    from numba import cuda

    from tilepy.ops.gemm_mma_sync import gemm_kernel, launch
    from tilepy.tile.config import GemmConfig

    a, b, out = operands(torch, n, n, n, dtype)
    bias = torch.zeros(1, device="cuda", dtype=torch.float32)
    cfg = GemmConfig(dtype=dtype)
    kern = gemm_kernel(cfg, True, dtype)
    args = [cuda.as_cuda_array(t.view(torch.int16)[None]).view(np.uint16) for t in (a, b, out)]
    args += [args[2], cuda.as_cuda_array(bias)]
    launch(kern, cfg, *args)  # compile + allow smem
    torch.cuda.synchronize()
    err = max_rel_err(out, torch.matmul(a, b))
    assert err < TOLERANCE, err

    def ours():
        launch(kern, cfg, *args)  # GPU-only time and, as called, the host cost of launch()

    peer_out = torch.empty_like(out)
    timings = {"tilepy": gpu_time(torch, ours),
               CUBLAS: gpu_time(torch, lambda: torch.matmul(a, b, out=peer_out))}
    record_throughput(record, work=2 * n**3, unit="TFLOPS", timings=timings, main=CUBLAS,
                      gpu=gpu_name, dtype=dtype, shape=f"{n}x{n}x{n}", config=cfg.describe(),
                      max_rel_err=err, table="GEMM: the bare mma.sync kernel (default config)",
                      case=f"{n}³ {dtype}", figure=f"gemm_kernel_{dtype}", x=n,
                      xlabel="M = N = K")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_gemm_op_square(benchmark, record, torch, gpu_name, n, dtype):
    run = op_case(torch, record, gpu_name, n, n, n, dtype,
                  table="GEMM: tilepy.gemm, square", case=f"{n}³ {dtype}",
                  figure=f"gemm_square_{dtype}", x=n, xlabel="M = N = K")
    benchmark.pedantic(run, rounds=3, iterations=1)


@pytest.mark.parametrize("nk", LLM_NK, ids=lambda nk: f"N{nk[0]}_K{nk[1]}")
@pytest.mark.parametrize("m", LLM_M)
def test_gemm_op_llm(benchmark, record, torch, gpu_name, m, nk):
    n, k = nk
    run = op_case(torch, record, gpu_name, m, n, k, "float16",
                  table="GEMM: tilepy.gemm, LLM shapes (float16)", case=f"{m}x{n}x{k}",
                  figure=f"gemm_llm_M{m}_float16", x=f"N={n} K={k}", xlabel="(N, K)")
    benchmark.pedantic(run, rounds=3, iterations=1)


GRID_M = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096]
GRID_NK = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]
GRID = [(m, n, k) for n, k in GRID_NK for m in GRID_M] + [(2048, 2048, 2048)]


@pytest.mark.parametrize("mnk", GRID, ids=lambda s: "x".join(map(str, s)))
def test_gemm_shape_grid(benchmark, record, torch, gpu_name, mnk):
    import tilepy

    m, n, k = mnk
    a, b, out = operands(torch, m, n, k, "bfloat16")
    out.fill_(float("nan"))
    tilepy.gemm(a, b, out=out)
    err = max_rel_err(out, torch.matmul(a.float(), b.float()))
    assert err < TOLERANCE, err
    peer = torch.empty_like(out)
    timings = {"tilepy": graph_timing(torch, lambda: tilepy.gemm(a, b, out=out)),
               CUBLAS: graph_timing(torch, lambda: torch.matmul(a, b, out=peer))}
    from tilepy.ops import gemm as op   # the other launch kind beside (tilepy.ops.gemm.PDL)

    def flipped(flag, on, off):   # the op with one of its module flags the other way
        was = getattr(op, flag)
        try:
            setattr(op, flag, not was)
            timings[on if not was else off] = graph_timing(
                torch, lambda: tilepy.gemm(a, b, out=out))
        finally:
            setattr(op, flag, was)

    flipped("PDL", "tilepy, PDL", "tilepy, no PDL")      # (op.PDL_TRIGGER: "late")
    trigger = op.PDL_TRIGGER
    try:   # the other trigger point
        op.PDL_TRIGGER = "early" if trigger == "late" else "late"
        flipped("PDL", f"tilepy, PDL {op.PDL_TRIGGER}", f"tilepy, no PDL ({op.PDL_TRIGGER})")
    finally:
        op.PDL_TRIGGER = trigger
    cfg = op.hopper_config(m, n, 1, "bfloat16", k=k)
    if cfg is not None and getattr(cfg, "splits", 1) > 1 and not cfg.swap_ab:
        # split-K: the other reduction
        flipped("SPLIT_CLUSTER", "tilepy, cluster split-K", "tilepy, workspace split-K")
    if m <= op.SWAP_MAX_M:   # few rows: the swapped-operand kernel (or not) beside
        flipped("SWAP_SMALL_M", "tilepy, swapped", "tilepy, not swapped")
    if m <= 256:   # the tensor maps prefetched at entry (or not): the first stage's wait
        flipped("PREFETCH_MAPS", "tilepy, maps prefetched", "tilepy, maps not prefetched")
    extra = {}
    if m <= 16:
        # bound by reading B (the issue: "measure it also as bandwidth against a device
        # copy"): the operands' and the result's bytes per second of each side's GPU-only time,
        # beside a device-to-device copy of B's bytes timed the same way
        nbytes = 2 * (m * k + k * n + m * n)
        src = torch.empty(k * n, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        copy_ms = graph_timing(torch, lambda: dst.copy_(src)).ms
        extra = {"bandwidth_gbps": {
            "tilepy": nbytes / timings["tilepy"].ms / 1e6,
            CUBLAS: nbytes / timings[CUBLAS].ms / 1e6,
            "device copy of B": 2 * 2 * k * n / copy_ms / 1e6},
            "bandwidth_note": "bytes read and written per second, GPU-only; the copy reads "
                              "and writes B's bytes"}
        del src, dst
    record_throughput(record, work=2 * m * n * k, unit="TFLOPS", timings=timings, main=CUBLAS,
                      gpu=gpu_name, dtype="bfloat16", shape=f"{m}x{n}x{k}", max_rel_err=err,
                      **extra,
                      table="GEMM: tilepy.gemm, shape grid (bfloat16; GPU time from CUDA-graph "
                            "replays of 20 calls)", case=f"{m}x{n}x{k}")
    benchmark.pedantic(lambda: (tilepy.gemm(a, b, out=out), torch.cuda.synchronize()),
                       rounds=3, iterations=1)


def test_gemm_op_small(benchmark, record, torch, gpu_name):
    run = op_case(torch, record, gpu_name, 512, 512, 512, "float16",
                  table="GEMM: tilepy.gemm, small (L2 flushed; host µs per call)",
                  case="512³ float16", figure="gemm_square_float16", x=512,
                  xlabel="M = N = K")
    benchmark.pedantic(run, rounds=3, iterations=1)


def test_gemm_bias_gelu(benchmark, record, torch, gpu_name):
    import tilepy

    n, dtype = 4096, "float16"
    a, b, out = operands(torch, n, n, n, dtype)
    bias = torch.randn(n, device="cuda", dtype=a.dtype)
    gelu = torch.nn.functional.gelu

    def ours():
        return tilepy.gemm(a, b, bias=bias, activation="gelu", out=out)

    ours()  # compile
    want = gelu(torch.matmul(a, b) + bias)
    err = max_rel_err(out, want)
    assert err < TOLERANCE, err
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours),
               "torch (unfused)": gpu_time(torch, lambda: gelu(torch.matmul(a, b) + bias))}
    timings["Triton (fused)"] = try_peer(notes, "Triton (fused)", lambda: checked_timing(
        torch, lambda o: triton_peers().matmul(a, b, out=o, bias=bias, gelu=True), want,
        TOLERANCE))
    record_throughput(record, work=2 * n**3, unit="TFLOPS", timings=timings,
                      main="torch (unfused)", notes=notes, gpu=gpu_name, dtype=dtype,
                      shape=f"{n}x{n}x{n}", max_rel_err=err,
                      table="GEMM: fused bias + GELU epilogue", case=f"{n}³ {dtype}")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


def test_gemm_numba_simt_f32(benchmark, record, torch, gpu_name):
    """Plain Numba (shared-memory tiles, CUDA cores, float32) vs cuBLAS float32 (TF32 off)
    and vs tilepy's tensor-core path in fp16 on the same problem."""
    import tilepy

    n = 4096
    a, b, out = operands(torch, n, n, n, "float32")
    tilepy.gemm(a, b, out=out)  # compile
    torch.backends.cuda.matmul.allow_tf32 = False
    want = torch.matmul(a, b)
    err = max_rel_err(out, want)
    assert err < 1e-4, err
    a16, b16, out16 = a.half(), b.half(), torch.empty(n, n, device="cuda", dtype=torch.float16)
    tilepy.gemm(a16, b16, out=out16)
    peer_out = torch.empty_like(out)
    timings = {"Numba SIMT f32": gpu_time(torch, lambda: tilepy.gemm(a, b, out=out)),
               "cuBLAS f32": gpu_time(torch, lambda: torch.matmul(a, b, out=peer_out)),
               "tilepy f16": gpu_time(torch, lambda: tilepy.gemm(a16, b16, out=out16))}
    record_throughput(record, work=2 * n**3, unit="TFLOPS", timings=timings, main="cuBLAS f32",
                      ours="Numba SIMT f32", gpu=gpu_name, dtype="float32",
                      shape=f"{n}x{n}x{n}", max_rel_err=err,
                      table="GEMM: plain Numba float32 (no tensor cores)", case=f"{n}³")
    benchmark.pedantic(lambda: (tilepy.gemm(a, b, out=out), torch.cuda.synchronize()),
                       rounds=3, iterations=1)


def test_grouped_gemm(benchmark, record, torch, gpu_name):
    """``tilepy.grouped_gemm`` (issue 27's grouped case): 8 experts, 32768 routed rows split
    unevenly (multinomial over random weights, seed 0), K 4096, N 14336, bf16, the experts'
    weights (E, N, K) read as their transposed view; against ``torch._grouped_mm`` (main
    peer, where this PyTorch has it) and a loop of cuBLAS calls, one ``torch.matmul`` per
    expert into slices of one output (the group sizes known on the host). Offsets checked on
    the host once, outside the timing."""
    import tilepy

    e, m, k, n = 8, 32768, 4096, 14336
    rng = np.random.default_rng(0)
    sizes = rng.multinomial(m, rng.dirichlet(np.ones(e)))
    ends = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bounds = [0] + np.cumsum(sizes).tolist()

    def ours(check=False):
        return tilepy.grouped_gemm(a, w.mT, ends, out=out, check_offsets=check)

    ours(True)
    for g in (0, e - 1):
        s, t = bounds[g], bounds[g + 1]
        assert max_rel_err(out[s:t], a[s:t] @ w[g].T) < 2e-2, g
    ref = torch.empty_like(out)

    def loop():
        for g in range(e):
            torch.matmul(a[bounds[g]:bounds[g + 1]], w[g].T, out=ref[bounds[g]:bounds[g + 1]])

    from tilepy.ops.gemm_kmajor_wgmma import KMajorConfig

    def ours_registers():     # the register epilogue (grouped_gemm.TMA_STORE off)
        return tilepy.grouped_gemm(a, w.mT, ends, out=out, check_offsets=False,
                                   config=KMajorConfig(tma_store=False))

    ours_registers()
    for g in (0, e - 1):
        s, t = bounds[g], bounds[g + 1]
        assert max_rel_err(out[s:t], a[s:t] @ w[g].T) < 2e-2, g
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours), "cuBLAS loop": gpu_time(torch, loop),
               "tilepy, register epilogue": gpu_time(torch, ours_registers)}
    # the same weights stored (E, K, N): B's tiles MN-major
    w_rows = w.mT.contiguous()

    def ours_b_rows():
        return tilepy.grouped_gemm(a, w_rows, ends, out=out, check_offsets=False)

    ours_b_rows()
    for g in (0, e - 1):
        s, t = bounds[g], bounds[g + 1]
        assert max_rel_err(out[s:t], a[s:t] @ w[g].T) < 2e-2, g
    timings["tilepy, b row-major"] = gpu_time(torch, ours_b_rows)
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is not None:
        timings["torch._grouped_mm"] = try_peer(notes, "torch._grouped_mm", lambda: gpu_time(
            torch, lambda: grouped_mm(a, w.mT, offs=ends)))
    else:
        notes["torch._grouped_mm"] = "not in this PyTorch"
    main = "torch._grouped_mm" if timings.get("torch._grouped_mm") else "cuBLAS loop"
    record_throughput(record, work=2 * m * n * k, unit="TFLOPS", timings=timings, main=main,
                      notes=notes, gpu=gpu_name, dtype="bfloat16",
                      shape=f"E{e} M{m} K{k} N{n}", table="Grouped GEMM",
                      case=f"{e} experts, {m} rows, K{k} N{n} bfloat16",
                      sizes=[int(x) for x in sizes])
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


def test_grouped_gemm_weight_grad(benchmark, record, torch, gpu_name):
    """The grouped GEMM's gradient in ``b`` (issue 27): ``out[g] = a[rows of g]ᵀ @ dout[rows
    of g]`` for 8 experts over 32768 rows split as ``test_grouped_gemm``'s, K 4096, N 14336,
    bf16 — one launch (``one_launch=True``: the mma.sync kernel, offsets read on the device;
    the path a captured backward takes) against the per-group ``tilepy.gemm`` calls
    (``one_launch=False``, offsets read on the host) and a loop of cuBLAS calls (main peer)."""
    from tilepy.ops.grouped_gemm import grouped_gemm_weight_grad

    e, m, k, n = 8, 32768, 4096, 14336
    rng = np.random.default_rng(0)
    sizes = rng.multinomial(m, rng.dirichlet(np.ones(e)))
    ends = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(e, k, n, device="cuda", dtype=torch.bfloat16)
    ref = torch.empty_like(out)
    bounds = [0] + np.cumsum(sizes).tolist()

    def one():
        return grouped_gemm_weight_grad(a, dout, ends, e, out=out, one_launch=True)

    def per_group():
        return grouped_gemm_weight_grad(a, dout, ends, e, out=out, one_launch=False)

    def loop():
        for g in range(e):
            torch.matmul(a[bounds[g]:bounds[g + 1]].T, dout[bounds[g]:bounds[g + 1]],
                         out=ref[g])

    one()
    loop()
    for g in (0, e - 1):
        assert max_rel_err(out[g], ref[g]) < 2e-2, g
    notes = {}
    timings = {"tilepy, one launch": gpu_time(torch, one), "cuBLAS loop": gpu_time(torch, loop),
               "tilepy, per group": gpu_time(torch, per_group)}
    record_throughput(record, work=2 * m * n * k, unit="TFLOPS", timings=timings,
                      main="cuBLAS loop", ours="tilepy, one launch", notes=notes, gpu=gpu_name,
                      dtype="bfloat16",
                      shape=f"E{e} M{m} K{k} N{n}", table="Grouped GEMM, gradient in b",
                      case=f"{e} experts, {m} rows, K{k} N{n} bfloat16",
                      sizes=[int(x) for x in sizes])
    benchmark.pedantic(lambda: (one(), torch.cuda.synchronize()), rounds=3, iterations=1)


@pytest.mark.parametrize("gran", ["tensor", "row", (1, 128), (128, 128)],
                         ids=["tensor", "row", "1x128", "128x128"])
def test_quantize_fp8(benchmark, record, torch, gpu_name, gran):
    """``tilepy.quantize_fp8`` of an 8192 × 8192 bf16 matrix to e4m3 as bandwidth (bf16 read
    plus codes and scales written, per second) against a device-to-device copy moving as many
    bytes (main ratio) and the same quantisation written in PyTorch (amax, scale, times the
    scale's float32 reciprocal, saturate, cast: tilepy's rounding rule), same run."""
    import tilepy

    m = k = 8192
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gr, gc = {"tensor": (m, k), "row": (1, k)}.get(gran, gran)

    def ours():
        return tilepy.quantize_fp8(x, granularity=gran)

    def eager():
        g = x.float().view(m // gr, gr, k // gc, gc)
        s = g.abs().amax(dim=(1, 3), keepdim=True) / 448.0
        s = torch.where(s == 0, torch.ones_like(s), s)
        return (g * s.reciprocal()).clamp(-448, 448).to(torch.float8_e4m3fn), s

    values, scales = ours()
    want, _ = eager()
    assert torch.equal(values.view(torch.uint8), want.view(m, k).view(torch.uint8))
    nbytes = 3 * m * k + 4 * scales.numel()
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours),
               "device copy": gpu_time(torch, lambda: dst.copy_(src)),
               "torch": try_peer(notes, "torch", lambda: gpu_time(torch, eager))}
    record_throughput(record, work=nbytes, unit="GB/s", timings=timings, main="device copy",
                      notes=notes, gpu=gpu_name, dtype="bfloat16", table="FP8 quantisation",
                      shape=f"{m}x{k}", case=f"quantize_fp8 {m}x{k} bf16 -> e4m3 {gran}")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


@pytest.mark.parametrize("n", [4096, 8192])
def test_gemm_fp8(benchmark, record, torch, gpu_name, n):
    """``tilepy.gemm`` on e4m3 inputs with row- and column-wise scales (bf16 out) against
    ``torch._scaled_mm`` (cuBLASLt's FP8 GEMM) and the bf16 ``torch.matmul`` of the same
    shape, M = N = K = ``n``."""
    import tilepy

    a = (torch.randn(n, n, device="cuda") * 3).to(torch.float8_e4m3fn)
    w = (torch.randn(n, n, device="cuda") * 3).to(torch.float8_e4m3fn)
    sa = torch.rand(n, 1, device="cuda") + 0.5
    sb = torch.rand(1, n, device="cuda") + 0.5
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    sa1, sb1 = sa[:, 0].contiguous(), sb[0].contiguous()

    def ours():
        return tilepy.gemm(a, w.t(), scale_a=sa1, scale_b=sb1, out=out)

    want = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    assert max_rel_err(ours(), want) < 2e-2
    notes = {}
    ab, wb = a.bfloat16(), w.bfloat16()
    timings = {"tilepy": gpu_time(torch, ours),
               "torch._scaled_mm": try_peer(notes, "torch._scaled_mm", lambda: gpu_time(
                   torch, lambda: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb,
                                                   out_dtype=torch.bfloat16))),
               "bf16 matmul": gpu_time(torch, lambda: torch.matmul(ab, wb.t()))}
    record_throughput(record, work=2 * n ** 3, unit="TFLOPS", timings=timings,
                      main="torch._scaled_mm", notes=notes, gpu=gpu_name, dtype="float8_e4m3fn",
                      table="FP8 GEMM", shape=f"{n}^3",
                      case=f"fp8 e4m3 {n}^3 row/col scales -> bf16")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)
