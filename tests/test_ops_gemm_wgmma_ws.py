"""The warp-specialised Hopper GEMM kernel (a TMA producer warpgroup, wgmma consumer warpgroups,
mbarrier stages): in the simulator through its launch plan (the TMA, mbarrier and wgmma twins
move and multiply the bytes), its sm_90a compile (registers, no spills, the instructions), and
on the GPU at full size against torch."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import tilepy
from tilepy import arrays
from tilepy.arrays import describe, kernel_view
from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.ops import gemm_wgmma_ws as ws
from tilepy.ops.gemm_softmax_wgmma import gemm_softmax_wgmma_kernel
from tilepy.ops.gemm_wgmma_ws import WsConfig

ml_dtypes = pytest.importorskip("ml_dtypes")
NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}
# The smallest configs the design allows: one consumer of 64 rows (256 threads), and the
# two-consumer shape of the GPU configs at its smallest (384 threads).
SMALL = {"block_m": 64, "block_n": 64, "consumers": 1}
TWO = {"block_m": 128, "block_n": 128, "consumers": 2}
# the smallest cluster-of-two config: B's 64-column boxes split between the two blocks
SMALL_CLUSTER = {"block_m": 64, "block_n": 128, "consumers": 1}
# clusters of two (B multicast): the registers the producer needs (see ws.CLUSTER)
CLUSTER_KW = {"cluster": 2, "smem_epilogue": True, "producer_regs": 56, "consumer_regs": 224}


def padded(rng, shape, dtype, pad=6):
    """An array of ``shape`` whose rows are 16-byte aligned but not contiguous (TMA strides)."""
    *lead, rows, cols = shape
    width = -(-(cols + pad) // 8) * 8
    return rng.standard_normal((*lead, rows, width)).astype(NP[dtype])[..., :cols]


def views(a, b, out, b_layout, c=None):
    va = kernel_view(describe(a, "a"), 3)
    vb = kernel_view(describe(b, "b"), 3, swap_last=b_layout == "col")
    vo = kernel_view(describe(out, "out"), 3)
    vc = kernel_view(describe(c, "c"), 3) if c is not None else vo
    return va, vb, vo, vc


def run(cfg, a, b, out, b_layout, *, bias=None, c=None, alpha=1.0, beta=0.0, activation=None,
        sms=None, prefetch_maps=False):
    va, vb, vo, vc = views(a, b, out, b_layout, c)
    kind = arrays.dtype_name(out.dtype)
    kern = ws.wgmma_ws_gemm_kernel(cfg, b_layout == "row", kind, activation, bias is not None,
                                   c is not None, prefetch_maps=prefetch_maps)
    bias_v = kernel_view(describe(bias, "bias")) if bias is not None else arrays.placeholder(1)
    plan, args = ws.plan(kern, cfg, va, vb, vo, vc, bias_v, alpha, beta, sms=sms)
    plan.launch(0, args)
    return plan, args


def check(got, ref, dtype):
    got = np.asarray(got).astype(np.float64)
    assert not np.isnan(got).any(), "NaN or unwritten element"
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6)
    assert err <= TOL[dtype], err


def matmul64(a, b):
    return a.astype(np.float64) @ b.astype(np.float64)


@pytest.mark.sim
@pytest.mark.parametrize("dtype,b_layout,shape", [
    ("float16", "row", SMALL), ("bfloat16", "col", SMALL), ("float16", "col", TWO),
    pytest.param("bfloat16", "row", TWO, marks=pytest.mark.extended)])
def test_odd_shapes_both_b_layouts(dtype, b_layout, shape):
    """M, N, K = 70, 100, 258: partial tiles on every edge (TMA zero fill), five k steps through
    a two-stage ring (it wraps, both parities), out poisoned with NaN."""
    rng = np.random.default_rng()
    m, n, k = 70, 100, 258
    a = padded(rng, (m, k), dtype)
    b = padded(rng, (k, n), dtype) if b_layout == "row" else padded(rng, (n, k), dtype).T
    out = np.full((m, n), np.nan, NP[dtype])
    run(WsConfig(stages=2, dtype=dtype, **shape), a, b, out, b_layout)
    check(out, matmul64(a, b), dtype)


@pytest.mark.sim
def test_batch_broadcast_fused_epilogue_and_persistent_grid():
    """A batched A (3-D tensor map) times a broadcast B (2-D map), float32 out with bias,
    c, alpha, beta and GELU; a persistent grid of 3 blocks walks the 2 × 2 × 2 tiles (the stage
    ring and parities run on across tiles)."""
    rng = np.random.default_rng()
    z, m, n, k = 2, 70, 72, 200          # 4 k steps through 3 stages: the ring wraps mid-tile
    a = padded(rng, (z, m, k), "float16")
    b = padded(rng, (k, n), "float16")
    bias = rng.standard_normal(n).astype(np.float32)
    c = rng.standard_normal((z, m, n)).astype(np.float32)
    out = np.full((z, m, n), np.nan, np.float32)
    cfg = WsConfig(stages=3, persistent=True, **SMALL)
    plan, _ = run(cfg, a, b, out, "row", bias=bias, c=c, alpha=2.0, beta=0.5,
                  activation="gelu", sms=3)
    assert plan.grid == (3, 1, 1)
    pre = 2.0 * matmul64(a, b) + 0.5 * c + bias
    ref = 0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2)))
    check(out, ref, "float16")


@pytest.mark.sim
@pytest.mark.parametrize("dtype,b_layout,shape,splits,extra", [
    ("float16", "row", SMALL, 4, {}),
    ("bfloat16", "col", TWO, 8, {"persistent": True, "smem_epilogue": True,
                                 "tma_store": True}),
    pytest.param("float16", "col", SMALL, 3, {"persistent": True, "epilogue": True},
                 marks=pytest.mark.extended),
    # (split_cluster is config= only: gemm.SPLIT_CLUSTER is off)
    pytest.param("bfloat16", "row", SMALL, 4,
                 {"split_cluster": True, "stages": 3, "epilogue": True},
                 marks=pytest.mark.extended),
    ("float16", "col", TWO, 2, {"split_cluster": True, "smem_epilogue": True})],
    ids=["4-splits", "more-splits-than-k-steps-tma-store", "persistent-3-blocks-fused",
         "cluster-4-fused", "cluster-2-two-consumers"])
def test_split_k(dtype, b_layout, shape, splits, extra):
    """Split-K: M, N, K = 70, 136, 328 (six k steps of 64, the last partial), the tiles' k
    ranges as separate items — 4 splits of 1-2 k steps; 8 splits of six steps (two items
    empty: zero partials) with the TMA-store epilogue; 3 splits on a persistent grid of 3
    blocks, with bias, c, alpha, beta and GELU into float32 — summed by each tile's last item.
    The result is right and the semaphores are back at zero after a launch, so a second
    launch finds its last items again and gives the same bits (in the simulator's fixed block
    order; the order-independence of the sum is the GPU test's). ``split_cluster``: the
    splits of a tile as one cluster (4 with the fused epilogue; 2 over two
    consumers' 64-row halves with the staged epilogue in the freed stages), summed in the
    first split's shared memory — no workspace; the same bits on a second launch."""
    rng = np.random.default_rng()
    m, n, k = 70, 136, 328
    extra = dict(extra)
    fused = extra.pop("epilogue", False)
    cfg = WsConfig(stages=extra.pop("stages", 2), dtype=dtype, splits=splits, **shape, **extra)
    a = padded(rng, (m, k), dtype)
    b = padded(rng, (k, n), dtype) if b_layout == "row" else padded(rng, (n, k), dtype).T
    kw, ref = {}, matmul64(a, b)
    out_dtype = np.float32 if fused else NP[dtype]
    if fused:
        bias = rng.standard_normal(n).astype(np.float32)
        c = rng.standard_normal((m, n)).astype(np.float32)
        kw = dict(bias=bias, c=c, alpha=2.0, beta=0.5, activation="gelu", sms=3)
        pre = 2.0 * ref + 0.5 * c + bias
        ref = 0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2)))
    out = np.full((m, n), np.nan, out_dtype)
    plan, args = run(cfg, a, b, out, b_layout, **kw)
    check(out, ref, dtype)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    if not cfg.persistent:
        assert plan.grid[0] == tiles * splits      # a block per item
    elif fused:
        assert plan.grid[0] == 3
    if cfg.split_cluster:
        assert plan.cluster == splits and not hasattr(plan, "counter_for")
    else:
        counters = np.asarray(plan.counter_for(0))
        assert counters.shape[0] >= tiles and not counters.any()
    first = out.copy()
    out[:] = np.nan
    plan.launch(0, args)
    assert np.array_equal(out.view(np.uint8), first.view(np.uint8))
    if not cfg.split_cluster:
        assert not np.asarray(plan.counter_for(0)).any()


@pytest.mark.sim
@pytest.mark.parametrize("extra,sms", [({"splits": 2}, None), pytest.param(
    {"persistent": True}, 2, marks=pytest.mark.extended)],
                         ids=["split-k-grid", "persistent-2-blocks"])
def test_traced_kernel_marks_its_phases_and_computes_the_same(extra, sms):
    """``trace=True``: the kernel takes a trace array and marks every block's phases
    (tilepy.tile.trace) in order — entry, barriers met, first stage landed, first item's
    main loop, its split-K step, its epilogue, the block's end —
    counts each block's items (all the grid's items once), and computes what the untraced
    kernel does. Over M, N, K = 70, 72, 200: 2 × 2 tiles of 64, 4 k steps."""
    from tilepy.tile import trace as TR

    rng = np.random.default_rng()
    m, n, k = 70, 72, 200
    a, b = padded(rng, (m, k), "float16"), padded(rng, (k, n), "float16")
    cfg = WsConfig(stages=2, **SMALL, **extra)
    out = np.full((m, n), np.nan, np.float16)
    va, vb, vo, vc = views(a, b, out, "row")
    kern = ws.wgmma_ws_gemm_kernel(cfg, True, "float16", trace=True)
    g = ws.grid(cfg, m, n, 1, sms)
    rows = g[0] * g[1]
    trace = np.zeros((rows, TR.WIDTH), np.uint64)
    with pytest.raises(ValueError, match="trace"):
        ws.plan(kern, cfg, va, vb, vo, vc, arrays.placeholder(1), sms=sms)
    with pytest.raises(ValueError, match="rows"):
        ws.plan(kern, cfg, va, vb, vo, vc, arrays.placeholder(1), sms=sms,
                trace=np.zeros((rows - 1, TR.WIDTH), np.uint64))
    from numba import cuda

    d_trace = cuda.to_device(trace)
    plan, args = ws.plan(kern, cfg, va, vb, vo, vc, arrays.placeholder(1), sms=sms,
                         trace=d_trace)
    plan.launch(0, args)
    check(out, matmul64(a, b), "float16")
    trace = d_trace.copy_to_host()

    mk = ws.TRACE_MARKS
    t = trace[:, :TR.SLOTS].astype(np.int64)
    values = trace[:, 2 * TR.SLOTS:]
    items = 4 * cfg.splits
    assert values[:, mk["items"]].sum() == items
    order = ["entry", "ready", "first_stage", "first_loop_end", "first_reduced",
             "first_item_end", "consumer_end"]
    for r in range(rows):
        times = [t[r, mk[name]] for name in order]
        assert all(x > 0 for x in times) and times == sorted(times), (r, times)
        assert t[r, mk["last_loop_start"]] <= t[r, mk["last_loop_end"]] \
            <= t[r, mk["last_item_end"]] <= t[r, mk["consumer_end"]]
        # the producer starts after the barrier that precedes the consumer's "ready" note,
        # and may issue its last load before that note (few k steps): order it after "entry"
        assert t[r, mk["producer_end"]] >= t[r, mk["entry"]]
        assert trace[r, TR.SLOTS + mk["entry"]] > 0      # the clock columns too
    s = TR.summary(trace, mk, [("main loop", "first_stage", "first_loop_end")],
                   {"items": mk["items"]})
    assert s["blocks"] == rows and s["phases"]["main loop"]["blocks"] == rows
    assert s["values"]["items"] == sorted(set(values[:, mk["items"]].tolist()))

    # the untraced kernel takes no trace
    untraced = ws.wgmma_ws_gemm_kernel(cfg, True, "float16")
    with pytest.raises(ValueError, match="trace"):
        ws.plan(untraced, cfg, va, vb, vo, vc, arrays.placeholder(1), sms=sms, trace=trace)


def padded_out(shape, np_dtype, pad=4):
    """NaN-poisoned output whose rows are 16-byte multiples (the vector stores' case)."""
    *lead, rows, cols = shape
    width = -(-(cols + pad) // 8) * 8
    return np.full((*lead, rows, width), np.nan, np_dtype)[..., :cols]


@pytest.mark.sim
@pytest.mark.parametrize("dtype,b_layout,shape,persistent,out_kind,out_rows16", [
    ("float16", "row", SMALL, False, "same", True),
    pytest.param("bfloat16", "col", TWO, False, "same", True, marks=pytest.mark.extended),
    ("float16", "col", SMALL, True, "float32", True),
    ("bfloat16", "row", {"block_m": 128, "block_n": 64, "consumers": 1}, True, "same", False),
    pytest.param("float16", "row", TWO, True, "float32", False, marks=pytest.mark.extended)],
    ids=["f16-row-64x64", "bf16-col-128x128", "f16-col-64x64-persistent-f32out",
         "bf16-row-128x64-persistent-misaligned-rows", "f16-row-128x128-persistent-f32out"])
def test_smem_epilogue_odd_shapes(monkeypatch, dtype, b_layout, shape, persistent, out_kind,
                                  out_rows16):
    """smem_epilogue=True at M, N, K = 70, 100, 258 with bias, GELU and beta·c: the staged tile,
    the named barriers and the 16-byte stores against float64 NumPy, outputs poisoned with NaN.
    Cases: one and two consumers, one consumer of 128 rows (two m64 accumulators), 16-bit and
    float32 out (two staging passes), the stage buffers reused (not persistent) and a buffer of
    its own (persistent: the producer runs ahead into the next tile), output rows 16-byte
    aligned (vector stores except at the right edge) or not (16-bit out of 100 columns: rows of
    200 bytes, odd rows fall back to element stores)."""
    from tilepy.ptx import vector as V

    vec = {"n": 0, "bias": 0}
    for name, what in (("st_global_v4_b32", "n"), ("st_global_v4_f32", "n"),
                       ("ld_shared_v2_f32", "bias")):
        orig = getattr(V, name)

        def counted(*args, _orig=orig, _what=what):
            vec[_what] += 1
            return _orig(*args)
        monkeypatch.setattr(V, name, counted)

    rng = np.random.default_rng()
    m, n, k = 70, 100, 258
    a = padded(rng, (m, k), dtype)
    b = padded(rng, (k, n), dtype) if b_layout == "row" else padded(rng, (n, k), dtype).T
    odt = np.float32 if out_kind == "float32" else NP[dtype]
    out = padded_out((m, n), odt) if out_rows16 else np.full((m, n), np.nan, odt)
    c = rng.standard_normal((m, n)).astype(odt)
    bias = rng.standard_normal(n).astype(np.float32)
    cfg = WsConfig(stages=2, dtype=dtype, persistent=persistent, smem_epilogue=True, **shape)
    run(cfg, a, b, out, b_layout, bias=bias, c=c, alpha=0.5, beta=-0.75, activation="gelu",
        sms=3)
    pre = 0.5 * matmul64(a, b) - 0.75 * c.astype(np.float64) + bias
    ref = 0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2)))
    check(out, ref, dtype)
    # not persistent: the bias columns come from shared memory (the producer's idle warps
    # put them there), one pair per accumulator pair's n8 block
    assert (vec["bias"] > 0) == (not persistent), vec
    per_row = 16 // np.dtype(odt).itemsize
    full_vectors_per_row = n // per_row
    if out_rows16 or (n * np.dtype(odt).itemsize) % 16 == 0:
        assert vec["n"] == m * full_vectors_per_row, vec
    else:
        assert 0 < vec["n"] < m * full_vectors_per_row, vec


TMA_STORE = dict(TWO, stages=2, persistent=True, smem_epilogue=True, tma_store=True)


def fused_epilogue(rng, ref, fused, dtype):
    """``(run keywords, float64 result)``: none and ``ref`` as it is, or with ``fused`` a
    random c and bias, alpha 0.5, beta -0.75 and GELU, applied to ``ref`` (m, n)."""
    if not fused:
        return {}, ref
    m, n = ref.shape[-2:]
    c = rng.standard_normal((m, n)).astype(NP[dtype])
    bias = rng.standard_normal(n).astype(np.float32)
    pre = 0.5 * ref - 0.75 * c.astype(np.float64) + bias
    return (dict(bias=bias, c=c, alpha=0.5, beta=-0.75, activation="gelu"),
            0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2))))


@pytest.mark.sim
@pytest.mark.parametrize("dtype,b_layout,batch,epilogue,block_n,n", [
    ("float16", "row", 1, True, 128, 120), ("bfloat16", "col", 2, False, 256, 200)],
    ids=["f16-row-bias-gelu-c", "bf16-col-batched-plain-two-passes"])
def test_tma_store_epilogue(monkeypatch, dtype, b_layout, batch, epilogue, block_n, n):
    """tma_store=True: the finished tile goes through the 128-byte-swizzled staging and TMA
    stores (2-D map for one matrix, 3-D for a batch; a 256-column tile in two passes of 128),
    rows past M and columns past N dropped by the copy; every output element against float64
    NumPy, out poisoned with NaN, rows 16-byte multiples but not contiguous."""
    from tilepy.ptx import tma as T

    stores = {"n": 0}
    for name in ("tma_store_2d", "tma_store_3d"):
        orig = getattr(T, name)

        def counted(*args, _orig=orig):
            stores["n"] += 1
            return _orig(*args)
        monkeypatch.setattr(T, name, counted)
    rng = np.random.default_rng()
    m, k = 70, 136
    lead = (batch,) if batch > 1 else ()
    a = padded(rng, (*lead, m, k), dtype)
    b = padded(rng, (k, n), dtype) if b_layout == "row" else padded(rng, (n, k), dtype).T
    out = padded_out((*lead, m, n), NP[dtype])
    kw, ref = fused_epilogue(rng, matmul64(a, b), epilogue, dtype)
    run(WsConfig(dtype=dtype, **dict(TMA_STORE, block_n=block_n)), a, b, out, b_layout, sms=3,
        **kw)
    check(out, ref, dtype)
    # one 64 × 64 box per consumer and 64 columns that start inside N
    assert stores["n"] == batch * -(-m // 128) * 2 * -(-n // 64), stores


@pytest.mark.sim
@pytest.mark.sim
@pytest.mark.parametrize("dtype,b_layout,tile,splits,m,extra", [
    ("float16", "row", (64, 16), 1, 13, {}),
    ("bfloat16", "col", (128, 32), 2, 20, {"epilogue": True}),
    ("float16", "row", (128, 64), 3, 40, {"batch": 2, "persistent": True}),
    pytest.param("bfloat16", "col", (64, 16), 4, 1, {"batch": 2}, marks=pytest.mark.extended)],
    ids=["f16-row-m13", "bf16-col-two-consumers-split2-fused", "f16-row-batched-persistent",
         "bf16-col-m1-batched-split4"])
def test_swapped_operands(dtype, b_layout, tile, splits, m, extra):
    """``swap_ab``: outᵀ = bᵀ · aᵀ, B's columns on the wgmma's 64-row side (a row-major B as
    the MN-major A operand, a column-major one K-major), the few rows of ``a`` on its n side
    of 16, 32 or 64, the register epilogue writing the tile transposed. N = 150 (partial
    64-column tiles), K = 200 (four k steps, the last partial, through two stages), out
    poisoned; split-K's partials summed by each tile's last item; the fused epilogue (bias
    along out's columns, c, alpha, beta, GELU into float32); a batched A times a broadcast B
    on a persistent grid of 2 blocks; the first case with its tensor maps prefetched at entry
    (``prefetch_maps``)."""
    rng = np.random.default_rng()
    extra = dict(extra)
    fused, batch = extra.pop("epilogue", False), extra.pop("batch", 1)
    bm, bn = tile
    n, k = 150, 200
    lead = (batch,) if batch > 1 else ()
    a = padded(rng, (*lead, m, k), dtype)
    b = padded(rng, (k, n), dtype) if b_layout == "row" else padded(rng, (n, k), dtype).T
    cfg = WsConfig(bm, bn, 2, dtype, consumers=bm // 64, splits=splits, swap_ab=True, **extra)
    kw, ref = {}, matmul64(a, b)
    out = padded_out((*lead, m, n), np.float32 if fused else NP[dtype])
    if fused:
        bias = rng.standard_normal(n).astype(np.float32)
        c = rng.standard_normal((m, n)).astype(np.float32)
        kw = dict(bias=bias, c=c, alpha=2.0, beta=0.5, activation="gelu")
        pre = 2.0 * ref + 0.5 * c + bias
        ref = 0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2)))
    plan, args = run(cfg, a, b, out, b_layout, sms=2 if cfg.persistent else None,
                     prefetch_maps=splits == 1, **kw)
    check(out, ref, dtype)
    tiles = -(-n // bm) * -(-m // bn) * batch
    assert plan.grid[0] == (2 if cfg.persistent else tiles * splits // batch)
    if splits > 1:   # the semaphores are back at zero; a second launch gives the same bits
        assert not np.asarray(plan.counter_for(0)).any()
        first = out.copy()
        out[:] = np.nan
        plan.launch(0, args)
        assert np.array_equal(out.view(np.uint8), first.view(np.uint8))


def test_swapped_config_validation_grid_and_maps():
    """``swap_ab`` takes block_n 16, 32 or 64, 64 rows a consumer, no cluster and the register
    epilogue; its grid counts tiles of out's columns × rows; its maps are B's (64-row side:
    64 × 64 boxes of a row-major B, block_m × 64 of a column-major one) then A's (block_n ×
    64); the op's rule (:func:`tilepy.ops.gemm.swapped_config`) sizes the tile to the rows and
    splits K while the items stay within one an SM."""
    from tilepy.ops import gemm as g

    for bad in ({"block_n": 128}, {"block_n": 8}, {"block_m": 128, "consumers": 1},
                {"smem_epilogue": True}, {"splits": 2, "split_cluster": True}):
        kw = {"block_m": 64, "block_n": 16, "consumers": 1, "swap_ab": True, **bad}
        with pytest.raises(ValueError, match="swap_ab|rows per consumer"):
            WsConfig(**kw)
    cfg = WsConfig(64, 16, 8, consumers=1, splits=4, swap_ab=True)
    assert "operands swapped" in cfg.describe()
    assert ws.grid(cfg, 16, 4096) == (64 * 4, 1)              # 64 column tiles x 4 splits
    assert ws.grid(cfg, 40, 4096, 2) == (64 * 3 * 4, 2)       # 3 row tiles of 16, batch 2
    a = np.zeros((1, 16, 4096), np.uint16)
    la, lb = ws.layouts(cfg, True, a, np.zeros((1, 4096, 1024), np.uint16))
    assert la[2] == (16, 64) and lb[2] == (64, 64)
    _, lb = ws.layouts(cfg, False, a, np.zeros((1, 1024, 4096), np.uint16))
    assert lb[2] == (64, 64)
    _, lb = ws.layouts(WsConfig(128, 32, 4, swap_ab=True), False, a,
                       np.zeros((1, 1024, 4096), np.uint16))
    assert lb[2] == (128, 64)
    assert g.swapped_config(16, 4096, 4096, 1, "bfloat16") == WsConfig(
        128, 16, 6, "bfloat16", consumers=2, splits=4, swap_ab=True)   # 32 tiles x 4
    big = g.swapped_config(32, 28672, 8192, 1, "bfloat16")     # 224 tiles: no split
    assert (big.block_n, big.splits) == (32, 1)
    assert g.swapped_config(1, 4096, 256, 1, "float16").splits == 1   # 4 k steps only
    assert g.swapped_config(64, 4096, 4096, 1, "float16").block_n == 64


@pytest.mark.sim
def test_swapped_config_through_the_op():
    """``tilepy.gemm(..., config=WsConfig(swap_ab=True))``: one row times a column-major B
    (a transposed view) with a bias, c and beta — the op passes the views and the maps in
    the swapped order."""
    rng = np.random.default_rng()
    a = rng.standard_normal((1, 72)).astype(np.float16)
    bt = rng.standard_normal((80, 72)).astype(np.float16)
    bias = rng.standard_normal(80).astype(np.float16)
    c = rng.standard_normal((1, 80)).astype(np.float16)
    cfg = WsConfig(64, 16, 2, consumers=1, swap_ab=True)
    got = tilepy.gemm(a, bt.T, bias=bias, c=c, beta=0.5, config=cfg)
    check(got, matmul64(a, bt.T) + bias.astype(np.float64) + 0.5 * c, "float16")


@pytest.mark.sim
@pytest.mark.parametrize("dtype,b_layout,tile,stages,extra,sms", [
    ("float16", "row", (64, 64), 3, {}, 3),
    ("bfloat16", "col", (64, 128), 2, {"smem_epilogue": True, "tma_store": True,
                                       "epilogue": True}, 2),
    pytest.param("float16", "col", (128, 64), 3, {"smem_epilogue": True}, 3,
                 marks=pytest.mark.extended),
    pytest.param("bfloat16", "row", (64, 128), 2, {"cluster": 2, "producer_regs": 56,
                                                   "consumer_regs": 224}, 2,
                 marks=pytest.mark.extended)],
    ids=["f16-row-register-epilogue", "bf16-col-tma-store-fused", "f16-col-128-rows-staged",
         "bf16-row-cluster-2"])
def test_pingpong_consumers(dtype, b_layout, tile, stages, extra, sms):
    """``pingpong``: the two consumers take turns over a persistent block's items, a whole tile
    each. M, N, K = 200 (4 row tiles of 64 — 2 of 128 — the last partial), 100 or 136, 328
    (six k steps, the last partial: an item starts two ring rounds on from the one before,
    the parity the turn protects); 3 blocks over 8 tiles (3, 3 and 2 items: consumer 1 has
    one fewer than consumer 0 in two blocks), or 2 blocks (clusters: one of two blocks);
    the TMA-store epilogue with bias, c, alpha, beta and GELU. Out poisoned, rows 16-byte
    multiples but not contiguous."""
    rng = np.random.default_rng()
    extra = dict(extra)
    fused = extra.pop("epilogue", False)
    bm, bn = tile
    m, k = 200, 328
    n = 100 if bn == 64 else 136
    a = padded(rng, (m, k), dtype)
    b = padded(rng, (k, n), dtype) if b_layout == "row" else padded(rng, (n, k), dtype).T
    out = padded_out((m, n), NP[dtype])
    kw, ref = fused_epilogue(rng, matmul64(a, b), fused, dtype)
    cfg = WsConfig(bm, bn, stages, dtype, persistent=True, pingpong=True, **extra)
    assert cfg.rows_per_consumer == bm and cfg.stage_bytes == (bm + bn) * 64 * 2
    plan, _ = run(cfg, a, b, out, b_layout, sms=sms, **kw)
    assert plan.grid[0] == sms
    check(out, ref, dtype)


def test_pingpong_config():
    """The ping-pong schedule's rules, shared memory (a stage is one consumer's tile: 64 × 256
    keeps 4 stages beside the TMA-store staging) and named barriers (a turn each way)."""
    cfg = WsConfig(64, 256, 4, persistent=True, smem_epilogue=True, tma_store=True,
                   pingpong=True)
    assert cfg.stage_bytes == 40 * 1024 and cfg.smem_bytes <= 227 * 1024
    assert cfg.stage_releasers == 1 and WsConfig().stage_releasers == 2
    assert cfg.named_barriers.threads["turn"] == 256 and "ping-pong" in cfg.describe()
    assert cfg.tile_count(200, 300) == 4 * 2
    for bad, match in (({"persistent": False}, "pingpong needs"),
                       ({"splits": 2}, "pingpong needs"),
                       ({"consumers": 1}, "pingpong needs"),
                       ({"block_m": 256}, "pingpong: block_m")):
        kw = dict(block_m=64, block_n=128, persistent=True, pingpong=True)
        kw.update(bad)
        with pytest.raises(ValueError, match=match):
            WsConfig(**kw)
    with pytest.raises(ValueError, match="softmax mode"):
        from tilepy.ops.gemm_softmax_wgmma import check_softmax_config
        check_softmax_config(WsConfig(64, 128, persistent=True, smem_epilogue=True,
                                      pingpong=True), "float16")


def test_tma_store_through_the_op():
    """tilepy.gemm with a tma_store config: the op encodes the output's tensor map; an out
    TMA cannot store (rows of 100 halves: 200 bytes) or a float32 out is refused before
    launch for a config the caller gave."""
    rng = np.random.default_rng()
    a = rng.standard_normal((40, 72)).astype(np.float16)
    b = rng.standard_normal((72, 64)).astype(np.float16)
    cfg = WsConfig(**TMA_STORE)
    out = np.full((40, 64), np.nan, np.float16)
    assert tilepy.gemm(a, b, out=out, config=cfg) is out
    check(out, matmul64(a, b), "float16")
    b100 = rng.standard_normal((72, 100)).astype(np.float16)
    with pytest.raises(ValueError, match="tma_store needs a 16-bit out"):
        tilepy.gemm(a, b100, config=cfg)
    with pytest.raises(ValueError, match="tma_store needs a 16-bit out"):
        tilepy.gemm(a, b, out_dtype="float32", config=cfg)


@pytest.mark.sim
def test_dependent_launch_through_the_op(monkeypatch):
    """``tilepy.ops.gemm.PDL``: the op's plan for the warp-specialised kernel launches with
    programmatic stream serialisation (split-K: the counters and partials of the call before
    are only touched after it has finished) and computes the same; off, a plain launch. Two
    calls in a row, the second reading the first's result."""
    from tilepy.ops import gemm as g

    rng = np.random.default_rng()
    a = rng.standard_normal((40, 72)).astype(np.float16)
    b = rng.standard_normal((72, 64)).astype(np.float16)
    cfg = WsConfig(stages=2, splits=2, **SMALL)
    for pdl in (True, False):
        monkeypatch.setattr(g, "PDL", pdl)
        g._PLANS.clear()
        first = tilepy.gemm(a, b, config=cfg)
        check(first, matmul64(a, b), "float16")
        (entry,) = g._PLANS.values()
        assert entry.bound.plan.dependent is pdl
        second = tilepy.gemm(first[:, :64], b[:64], config=cfg)
        check(second, matmul64(first[:, :64], b[:64]), "float16")


def test_tma_store_config():
    cfg = WsConfig(128, 256, 4, persistent=True, smem_epilogue=True, tma_store=True)
    assert "TMA-store" in cfg.describe() and cfg.smem_bytes <= 227 * 1024
    assert cfg.epilogue_bytes == 2 * 64 * 128 * 2          # 128 columns a pass: 4 stages fit
    for bad in ({"persistent": False}, {"smem_epilogue": False},
                {"block_m": 64, "consumers": 1}):
        kw = dict(block_m=128, block_n=256, stages=4, persistent=True, smem_epilogue=True,
                  tma_store=True)
        kw.update(bad)
        with pytest.raises(ValueError, match="tma_store needs"):
            WsConfig(**kw)
    with pytest.raises(ValueError, match="16-bit outputs"):
        ws.wgmma_ws_gemm_kernel(cfg, True, "float32")
    with pytest.raises(ValueError, match="16-byte-aligned rows"):
        ws.out_layout(kernel_view(describe(np.zeros((8, 12), np.float16), "out"), 3))


def test_smem_epilogue_config():
    """Not persistent: the staging reuses the stage buffers (no extra shared memory).
    Persistent: a buffer of its own, which does not fit beside 4 stages of 128×256."""
    cfg = WsConfig(smem_epilogue=True)
    # ... but a place for the tile's bias columns and their mbarrier after the mbarriers
    base = WsConfig()
    bias = cfg.layout.offset("bias")
    assert cfg.bias_in_smem and not base.bias_in_smem and cfg.layout.offset("staging") == 0
    assert bias >= base.smem_bytes and bias % 16 == 0
    assert cfg.smem_bytes == bias + 4 * 256 <= base.smem_bytes + 1024 + 24
    assert cfg.epilogue_bytes == 2 * 64 * (32 * 16 + 32)
    assert "smem epilogue" in cfg.describe() and "smem epilogue" not in WsConfig().describe()
    with pytest.raises(ValueError, match="own 69632 B staging buffer.*fewer stages"):
        WsConfig(persistent=True, smem_epilogue=True)
    p = WsConfig(stages=3, persistent=True, smem_epilogue=True)
    assert not p.bias_in_smem
    assert p.smem_bytes == 3 * 48 * 1024 + 69632 + 48
    assert p.layout.offset("barriers") == 3 * 48 * 1024 + 69632
    assert "own buffer" in p.describe()
    WsConfig(256, 128, stages=3, persistent=True, smem_epilogue=True)


@pytest.mark.sim
def test_bound_plan_reencodes_tensor_maps_for_new_pointers():
    """A launch plan bound to operands (as tilepy.gemm's plan cache does) called with other
    arrays of the same signature: the tensor maps follow the new pointers (batched B: 3-D)."""
    rng = np.random.default_rng()
    z, m, n, k = 2, 40, 64, 72
    cfg = WsConfig(stages=2, **SMALL)
    a1, b1 = padded(rng, (m, k), "float16"), padded(rng, (z, k, n), "float16")
    out1 = np.full((z, m, n), np.nan, np.float16)
    plan, _ = run(cfg, a1, b1, out1, "row")
    check(out1, matmul64(a1, b1), "float16")
    bound = plan.bind([(0, a1.ctypes.data), (1, b1.ctypes.data), (2, out1.ctypes.data),
                       (2, out1.ctypes.data), None])   # a, b, out, c (= out), bias (constant)
    a2, b2 = padded(rng, (m, k), "float16"), padded(rng, (z, k, n), "float16")
    out2 = np.full((z, m, n), np.nan, np.float16)
    before = plan.maps_encoded
    bound(0, [a2.ctypes.data, b2.ctypes.data, out2.ctypes.data], (1.0, 0.0))
    assert plan.maps_encoded == before + 1
    check(out2, matmul64(a2, b2), "float16")
    bound(0, [a2.ctypes.data, b2.ctypes.data, out2.ctypes.data], (1.0, 0.0))  # cached maps
    assert plan.maps_encoded == before + 1


@pytest.mark.sim
def test_tensor_maps_through_the_allocator_and_the_map_writer(monkeypatch):
    """Maps come from the plan's allocation callback (here 16 bytes off a 64-byte boundary:
    aligned inside a larger allocation) and are written by the map writer on the launch
    stream: the first launch and a bound call with new pointers give the bits a fresh plan
    gives. During a capture (stream_capturing patched to say so) new pointers get maps that
    are not cached but kept, and cached maps a capture uses are kept too."""
    from tilepy.tile import device_write

    requests = []

    def alloc(nbytes):
        requests.append(nbytes)
        base = np.zeros(nbytes + 128, np.uint8)
        view = base[-base.ctypes.data % 64 + 16:][:nbytes]
        return view, view.ctypes.data

    rng = np.random.default_rng()
    m, n, k = 40, 64, 72
    cfg = WsConfig(stages=2, **SMALL)
    arrays_ = [(padded(rng, (m, k), "float16"), padded(rng, (k, n), "float16"),
                np.full((m, n), np.nan, np.float16)) for _ in range(3)]
    a1, b1, out1 = arrays_[0]
    va, vb, vo, vc = views(a1, b1, out1, "row")
    kern = ws.wgmma_ws_gemm_kernel(cfg, True, "float16")
    plan, args = ws.plan(kern, cfg, va, vb, vo, vc, arrays.placeholder(1), 1.0, 0.0,
                         alloc=alloc)
    plan.launch(0, args)
    check(out1, matmul64(a1, b1), "float16")
    assert requests == [256, 256 + 63]
    bound = plan.bind([(0, a1.ctypes.data), (1, b1.ctypes.data), (2, out1.ctypes.data),
                       (2, out1.ctypes.data), None])

    def call(i):
        a, b, out = arrays_[i]
        bound(0, [a.ctypes.data, b.ctypes.data, out.ctypes.data], (1.0, 0.0))
        check(out, matmul64(a, b), "float16")

    call(1)
    assert plan.maps_encoded == 2 and len(plan._maps) == 2
    assert all(buf.ptr % 64 == 0 for buf in plan._maps.values())
    a2, b2, out2 = arrays_[1]
    fresh = np.full((m, n), np.nan, np.float16)
    run(cfg, a2, b2, fresh, "row")
    assert np.array_equal(fresh.view(np.uint16), out2.view(np.uint16))
    monkeypatch.setattr(device_write, "stream_capturing", lambda stream: True)
    call(2)                                   # new pointers during a capture
    assert plan.maps_encoded == 3 and len(plan._maps) == 2 and len(plan._kept) == 1
    (kept,) = plan._kept.values()
    assert kept.ptr % 64 == 0 and kept not in plan._maps.values()
    call(1)                                   # cached maps used by a capture: kept too
    assert plan.maps_encoded == 3 and len(plan._kept) == 2
    assert plan._maps[(0, (a2.ctypes.data, b2.ctypes.data))] in plan._kept.values()


@pytest.mark.sim
def test_capture_reads_settled_maps(monkeypatch):
    """Maps an eager launch wrote, once that write is known to have run (in the simulator at
    the next launch), are read by a capture on another stream with the same pointers: nothing
    encoded or written in the graph, the buffer kept for the process. A capture with other
    pointers still writes its own."""
    from tilepy.tile import device_write

    rng = np.random.default_rng()
    m, n, k = 40, 64, 72
    cfg = WsConfig(stages=2, **SMALL)
    a, b = padded(rng, (m, k), "float16"), padded(rng, (k, n), "float16")
    out = np.full((m, n), np.nan, np.float16)
    va, vb, vo, vc = views(a, b, out, "row")
    kern = ws.wgmma_ws_gemm_kernel(cfg, True, "float16")
    plan, args = ws.plan(kern, cfg, va, vb, vo, vc, arrays.placeholder(1), 1.0, 0.0)
    plan.launch(0, args)               # the maps encoded at build, written on stream 0
    plan.launch(0, args)               # a hit, which finds that write done
    (eager,) = plan._maps.values()
    assert plan._settled and not plan._unsettled
    monkeypatch.setattr(device_write, "stream_capturing", lambda stream: True)
    out[:] = np.nan
    plan.launch(7, args)               # captured on another stream
    check(out, matmul64(a, b), "float16")
    assert plan.maps_encoded == 1 and list(plan._kept.values()) == [eager]
    b2 = padded(rng, (k, n), "float16")
    bound = plan.bind([(0, a.ctypes.data), (1, b.ctypes.data), (2, out.ctypes.data),
                       (2, out.ctypes.data), None])
    bound(7, [a.ctypes.data, b2.ctypes.data, out.ctypes.data], (1.0, 0.0))
    check(out, matmul64(a, b2), "float16")
    assert plan.maps_encoded == 2 and len(plan._kept) == 2


@pytest.mark.sim
def test_split_cluster_falls_back_where_clusters_cannot_run(monkeypatch):
    """A device that cannot hold a cluster of the splits: the caller's split_cluster config is
    refused before launch; the op's own choice runs the workspace reduction instead."""
    from tilepy import launch
    from tilepy.ops import gemm as g

    cfg = WsConfig(64, 64, 2, consumers=1, splits=2, split_cluster=True)
    monkeypatch.setattr(launch.LaunchPlan, "max_active_clusters", lambda self: 0)
    monkeypatch.setattr(g, "hopper_config", lambda *args, **kw: cfg)
    g._PLANS.clear()
    rng = np.random.default_rng()
    a = rng.standard_normal((20, 136)).astype(np.float16)
    b = rng.standard_normal((136, 64)).astype(np.float16)
    with pytest.raises(ValueError, match="cannot run a cluster of 2 blocks"):
        tilepy.gemm(a, b, config=cfg)
    got = tilepy.gemm(a, b)
    check(got, matmul64(a, b), "float16")
    (entry,) = g._PLANS.values()
    assert entry.bound.plan.cluster == 1


def test_split_cluster_config_validation():
    """split_cluster: 2 … 8 splits, a grid of one item per block, no B multicast, the other
    splits' accumulators within the stage buffers; the launch's cluster is the splits."""
    cfg = WsConfig(64, 128, 8, consumers=1, splits=4, split_cluster=True)
    assert cfg.launch_cluster == 4 and cfg.split_region_bytes == 3 * 64 * 128 * 4
    assert "reduced in a cluster" in cfg.describe()
    assert WsConfig(64, 128, 8, consumers=1, splits=4).launch_cluster == 1
    for bad, match in (({"splits": 1}, "splits in 2"), ({"splits": 9}, "splits in 2"),
                       ({"persistent": True}, "persistent=False"),
                       ({"cluster": 2, "block_n": 128}, "splits > 1 needs cluster=1"),
                       ({"stages": 2, "splits": 8}, "do not fit")):
        kw = dict(block_m=64, block_n=128, stages=8, consumers=1, splits=4,
                  split_cluster=True)
        kw.update(bad)
        with pytest.raises(ValueError, match=match):
            WsConfig(**kw)


def test_split_k_config_validation():
    """splits: an int 1 … 64 (not a bool), not with clusters; gemm_softmax's mode (whose
    consumers walk every k step of a chunk) refuses it."""
    from tilepy.ops.gemm_softmax_wgmma import check_softmax_config

    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match="splits"):
            WsConfig(splits=bad)
    with pytest.raises(ValueError, match="cluster"):
        WsConfig(splits=2, **CLUSTER_KW)
    with pytest.raises(ValueError, match="split-K"):
        check_softmax_config(WsConfig(128, 128, 3, persistent=True, smem_epilogue=True,
                                      splits=2), "float16")
    assert "split-K 3" in WsConfig(splits=3).describe()


def test_config_validation():
    with pytest.raises(ValueError, match="rows per consumer warpgroup"):
        WsConfig(block_m=64, consumers=2)
    with pytest.raises(ValueError, match="accumulators exceed"):
        WsConfig(block_m=256, block_n=256)
    with pytest.raises(ValueError, match="exceeds the 232448 B of sm_90"):
        WsConfig(stages=5)
    with pytest.raises(ValueError, match="register file"):
        WsConfig(producer_regs=56, consumer_regs=240)
    cfg = WsConfig()
    assert cfg.threads == 384 and cfg.smem_bytes == 4 * 48 * 1024 + 64 and cfg.setmaxnreg
    assert not WsConfig(**SMALL).setmaxnreg
    assert ws.grid(cfg, 4096, 4096) == (16 * 32, 1)
    assert ws.grid(WsConfig(persistent=True), 4096, 4096, 1, 132) == (132, 1)
    assert ws.grid(WsConfig(persistent=True), 100, 100, 1, 132) == (1, 1)


def test_cluster_config_and_grid():
    """cluster=2: validation, grids that count whole clusters (the persistent grid also capped
    by the clusters the device runs at once), column-major B's boxes halved (each block loads
    half of the stage's B rows)."""
    with pytest.raises(ValueError, match="cluster must be 1 or 2"):
        WsConfig(cluster=4)
    with pytest.raises(ValueError, match="block_n must be a multiple of 128"):
        WsConfig(block_n=192, cluster=2)
    with pytest.raises(ValueError, match="softmax mode needs"):
        gemm_softmax_wgmma_kernel(dataclasses.replace(ws.CLUSTER, persistent=True, stages=3),
                                  True, "float16")
    cfg = ws.CLUSTER
    assert "clusters of 2" in cfg.describe()
    assert ws.grid(cfg, 4096, 4096) == (16 * 32, 1)          # 8 row pairs x 16 columns x 2
    assert ws.grid(cfg, 1100, 700, 3) == (2 * 5 * 3, 3)      # 9 row blocks: 5 pairs
    assert ws.grid(cfg, 70, 100) == (2, 1)
    pcfg = ws.CLUSTER_TMA_STORE
    assert ws.grid(pcfg, 4096, 4096, 1, 132) == (132, 1)
    assert ws.grid(pcfg, 4096, 4096, 1, 133) == (132, 1)     # whole clusters only
    assert ws.grid(pcfg, 4096, 4096, 1, 132, clusters=60) == (120, 1)
    assert ws.grid(pcfg, 300, 300, 1, 132) == (8, 1)   # 2 x 2 cluster tiles: 4 clusters
    b = np.zeros((1, 520, 200), np.uint16)
    _, lb = ws.layouts(cfg, False, np.zeros((1, 300, 200), np.uint16), b)
    assert lb[2] == (128, 64)
    _, lb = ws.layouts(WsConfig(), False, np.zeros((1, 300, 200), np.uint16), b)
    assert lb[2] == (256, 64)


@pytest.mark.sim
@pytest.mark.parametrize("dtype,b_layout,shape,batch,extra", [
    ("float16", "row", SMALL_CLUSTER, 2, {}),
    ("bfloat16", "col", SMALL_CLUSTER, 1, {"persistent": True}),
    pytest.param("float16", "col", TWO, 1, {"persistent": True, "smem_epilogue": True,
                                            "tma_store": True}, marks=pytest.mark.extended)],
    ids=["f16-row-batched", "bf16-col-persistent", "f16-col-persistent-tma-store"])
def test_cluster_of_two_shares_b(dtype, b_layout, shape, batch, extra):
    """Clusters of two in the simulator (their blocks run at the same time there): each block
    loads half of every stage's B by multicast into both, stages are freed on both blocks'
    barriers. Three row blocks (the second cluster's rank 1 has no rows), partial tiles on
    every edge, three k steps through two stages, out poisoned with NaN; the persistent grid
    of one cluster (2 SMs: the simulator's cost grows with the blocks alive at once) walks
    every cluster tile; a batch on the grid's y (the simulator reaches every y before the
    next x: clusters start whole)."""
    rng = np.random.default_rng()
    rows = shape["block_m"]
    m, n, k = 2 * rows + rows // 2 + 3, 100, 130
    lead = (batch,) if batch > 1 else ()
    a = padded(rng, (*lead, m, k), dtype)
    b = padded(rng, (k, n), dtype) if b_layout == "row" else padded(rng, (n, k), dtype).T
    out = padded_out((*lead, m, n), NP[dtype])
    cfg = WsConfig(stages=2, dtype=dtype, cluster=2, **shape, **extra)
    plan, _ = run(cfg, a, b, out, b_layout, sms=2)
    assert plan.cluster == 2 and plan.grid[0] % 2 == 0
    check(out, matmul64(a, b), dtype)


def test_tensor_map_layouts():
    """2-D maps for one matrix, 3-D (batch outermost, box depth 1) for a batch; B row-major in
    64 × 64 boxes (MN-major atoms), B column-major in block_n × 64 boxes."""
    cfg = WsConfig(256, 128)
    a = np.zeros((1, 300, 200), np.uint16)
    b = np.zeros((3, 200, 136), np.uint16)[:, :, :130]
    la, lb = ws.layouts(cfg, True, a, b)
    assert la == ((300, 200), (400, 2), (256, 64))
    assert lb == ((3, 200, 130), (200 * 272, 272, 2), (1, 64, 64))
    _, lb = ws.layouts(cfg, False, a, np.zeros((1, 130, 200), np.uint16))
    assert lb == ((130, 200), (400, 2), (128, 64))
    with pytest.raises(ValueError, match="multiples of 16"):
        ws.layouts(cfg, True, np.zeros((1, 30, 20), np.uint16)[:, :, :20], b)
    with pytest.raises(ValueError, match="last dimension contiguous"):
        ws.layouts(cfg, True, np.zeros((1, 30, 40), np.uint16)[:, :, ::2], b)


# ---- offline compile for sm_90a ----------------------------------------------------------------

@pytest.fixture(scope="module")
def reports():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reps = run_in_subprocess("tilepy.ops.gemm_wgmma_ws:compile_reports")
    reps.update(run_in_subprocess("tilepy.ops.gemm_wgmma_ws:compile_reports_epilogues"))
    reps.update(run_in_subprocess("tilepy.ops.gemm_softmax_wgmma:compile_reports"))
    return reps


@pytest.mark.compile
@pytest.mark.xdist_group("gemm_wgmma_ws_reports")
def test_kernels_divide_no_64_bit_integers(reports):
    """The tile walk's index arithmetic in 32-bit unsigned divisions: a 64-bit one by a
    run-time value is a call, and where the kernel is linked without LTO ptxas then serialises
    every wgmma (C7509; tilepy.tile.schedule.udiv)."""
    for name, rep in reports.items():
        if name.startswith("gemm_ws"):
            assert rep["counts"]["div64"] == 0, (name, rep["counts"])


@pytest.mark.compile
@pytest.mark.xdist_group("gemm_wgmma_ws_reports")   # one worker compiles them (-n 2)
def test_compiles_for_sm90a_without_spills(reports):
    """The default reports are the staged epilogues (test_smem_epilogue_compiles_without_spills)
    and split-K (test_split_k_compiles_without_spills)."""
    assert set(reports) == set(SMEM_EPI_BARRIERS) | {"gemm_ws_64x256_bcol_splitk3"}
    for name, rep in reports.items():
        assert "error" not in rep and rep["arch"].startswith("sm_90a"), (name, rep)


@pytest.mark.compile
@pytest.mark.extended
def test_register_epilogue_kernels_compile_without_spills():
    """The register epilogue of the unswapped tiles (config= only): no spills, local memory or
    barrier past the set-up one, at most the 168 registers a 384-thread launch allows, the TMA
    loads, mbarriers and setmaxnreg; the kernel without setmaxnreg compiles."""
    reps = run_in_subprocess("tilepy.ops.gemm_wgmma_ws:compile_reports_register")
    with_regs = {k: v for k, v in reps.items() if not k.endswith("_noreg")}
    assert set(with_regs) == {"gemm_ws_128x256_brow", "gemm_ws_128x256_bcol",
                              "gemm_ws_128x256_brow_bias_gelu", "gemm_ws_256x128_brow",
                              "gemm_ws_128x256_brow_persistent"}
    assert "error" not in reps["gemm_ws_128x256_brow_noreg"]
    for name, rep in with_regs.items():
        assert rep["counts"]["div64"] == 0, (name, rep["counts"])
        assert rep["arch"].startswith("sm_90a")
        c = rep["counts"]
        assert c["wgmma.mma_async"] >= 4 and c["cp.async.bulk.tensor"] >= 2, (name, c)
        assert c["cp.async"] == 0 and c["ld.local"] == 0 and c["st.local"] == 0, (name, c)
        assert c["bar.sync"] == 1, (name, c)   # the set-up barrier only
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["local_bytes"] == 0
        # 3 warpgroups: at most 168 per thread at launch; setmaxnreg moves 40 / 232
        assert rep["registers"] <= 168, (name, rep["registers"])
        assert "C7510" not in rep["ptxas_log"] and "C7511" not in rep["ptxas_log"]
        ops = set(rep["ops"])
        assert {"cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
                "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
                "mbarrier.arrive.expect_tx.shared::cta.b64", "mbarrier.arrive.shared::cta.b64",
                "mbarrier.try_wait.parity.shared::cta.b64",
                "fence.proxy.tensormap::generic.acquire.gpu",
                "setmaxnreg.dec.sync.aligned.u32", "setmaxnreg.inc.sync.aligned.u32",
                "wgmma.wait_group.sync.aligned"} <= ops, (name, ops)
        n = 128 if name.startswith(("gemm_ws_256x128", "gemm_ws_128x128")) else 256
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16" in ops


@pytest.mark.compile
@pytest.mark.xdist_group("gemm_wgmma_ws_reports")
def test_split_k_compiles_without_spills(reports):
    """Split-K (64 x 256, one consumer, staged epilogue): no serialised wgmmas, spills bounded
    (the reduction tail's), the partials' 16-byte stores."""
    rep = reports["gemm_ws_64x256_bcol_splitk3"]
    assert "error" not in rep, rep.get("error")
    c = rep["counts"]
    # The main loop's accumulators stay in registers (no C75xx note: no serialised wgmma);
    # the reduction's written-out sum of every partial spills ~170 bytes at 255 registers
    # (a known cost of the tail, run once per tile by its last item).
    assert rep["spill_stores"] <= 256 and rep["spill_loads"] <= 256, rep["spill_stores"]
    assert "C75" not in rep["ptxas_log"], rep["ptxas_log"]
    assert c["wgmma.mma_async"] >= 4, c
    assert "st.global.v4.f32" in set(rep["ops"]), rep["ops"]


@pytest.mark.compile
@pytest.mark.xdist_group("gemm_wgmma_ws_reports")
def test_traced_kernels_compile_and_untraced_ones_read_no_timer(reports):
    """Tracing off leaves no timer read in any kernel; on, the marks compile into the
    persistent TMA-store kernel and the split-K one without serialised wgmmas and with no
    spill that the untraced kernels lack."""
    assert all(rep["timer_reads"] == 0 for rep in reports.values() if "timer_reads" in rep)
    traced = run_in_subprocess("tilepy.ops.gemm_wgmma_ws:compile_reports_trace")
    for name, rep in traced.items():
        assert "error" not in rep, rep.get("error")
        assert rep["timer_reads"] >= 8, (name, rep["timer_reads"])
        assert "C75" not in rep["ptxas_log"], rep["ptxas_log"]
    rep = traced["gemm_ws_128x256_brow_persistent_tmastore_trace"]
    assert rep["registers"] <= 168
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["stack_frame"] == 0
    # split-K's one consumer at 255 registers: the marks' timestamps (eight 8-byte values and
    # their addresses) add at most a few spilled words to its tail's
    split = traced["gemm_ws_64x256_bcol_splitk3_trace"]
    assert split["spill_stores"] <= reports["gemm_ws_64x256_bcol_splitk3"]["spill_stores"] + 96


@pytest.fixture(scope="module")
def small_reports():
    return run_in_subprocess("tilepy.ops.gemm_wgmma_ws:compile_reports_small")


@pytest.mark.compile
@pytest.mark.xdist_group("gemm_wgmma_ws_reports")
def test_cluster_split_k_compiles_without_a_workspace(reports, small_reports):
    """split_cluster (4 splits of 64 x 128): the partials go to the first split's shared
    memory (st.shared::cluster) between cluster barriers — no global partials, no atomic —
    with no serialised wgmma and no more spill than the workspace reduction's."""
    rep = small_reports["gemm_ws_64x128_bcol_splitk4_cluster"]
    assert "error" not in rep, rep.get("error")
    ops = set(rep["ops"])
    assert {"st.shared::cluster.v4.f32", "mapa.shared::cluster.u32",
            "barrier.cluster.arrive.release", "barrier.cluster.wait.acquire"} <= ops, ops
    assert "st.global.v4.f32" not in ops and not any(o.startswith("atom.") for o in ops), ops
    assert "C75" not in rep["ptxas_log"], rep["ptxas_log"]
    assert rep["spill_stores"] <= reports["gemm_ws_64x256_bcol_splitk3"]["spill_stores"]


@pytest.mark.compile
@pytest.mark.xdist_group("gemm_wgmma_ws_reports")
def test_dependent_launch_kernel_waits_before_global_memory(reports, small_reports):
    """``pdl`` (split-K's config, both triggers): griddepcontrol.wait and launch_dependents
    are in the kernel, the wait before its first tensor-map fence, TMA load, global store and
    atomic; the early trigger right after the wait, the late one after the loads are issued;
    registers and spills as without it."""
    plain = reports["gemm_ws_64x256_bcol_splitk3"]
    assert "griddepcontrol.wait" not in plain["ops"]
    for trigger in ("early", "late"):
        rep = small_reports[f"gemm_ws_64x256_bcol_splitk3_pdl_{trigger}"]
        assert "error" not in rep, rep.get("error")
        first = rep["first"]
        assert first["wait"] is not None and first["trigger"] is not None, first
        for kind in ("tensormap_fence", "tma_load", "st_global", "atom"):
            assert first[kind] is not None and first["wait"] < first[kind], (kind, first)
        if trigger == "late":   # after the loads are issued (the producer's is its last)
            assert rep["last"]["trigger"] > first["tma_load"], first
        else:
            assert first["trigger"] < first["tensormap_fence"], first
        # (at the 255-register limit the allocator's choices move a word or two either way)
        assert rep["spill_stores"] <= plain["spill_stores"] + 16 and rep["registers"] <= 255
        assert "C75" not in rep["ptxas_log"], rep["ptxas_log"]


@pytest.mark.compile
@pytest.mark.xdist_group("gemm_wgmma_ws_reports")
def test_swapped_kernels_compile_without_spills(small_reports):
    """``swap_ab``: m64n16 / m64n32 wgmmas, A (B's columns) transposed from a row-major B and
    K-major from a column-major one, B (the rows) K-major; no spill, none serialised."""
    forms = {"gemm_ws_128x16_brow_swap_splitk4":
             ["wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 1,1,1,0"],
             "gemm_ws_64x32_bcol_swap_splitk2_bias_gelu":
             ["wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 1,1,0,0"]}
    for name, want in forms.items():
        rep = small_reports[name]
        assert "error" not in rep, rep.get("error")
        assert rep["wgmma_forms"] == want, rep["wgmma_forms"]
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep["ptxas_log"]
        assert "C75" not in rep["ptxas_log"], rep["ptxas_log"]


@pytest.mark.compile
@pytest.mark.extended   # (config= only until measured: not a path the op takes)
def test_pingpong_kernels_compile_without_spills():
    """The ping-pong candidates: no spill or local memory, the turn's two named barriers (one
    ``bar.arrive`` and one ``bar.sync`` beside the set-up barrier and the epilogue's own), the
    full-width wgmmas (m64n256 a consumer; 128 × 128: m64n128)."""
    reps = run_in_subprocess("tilepy.ops.gemm_wgmma_ws:compile_reports_pingpong")
    assert set(reps) == {"gemm_ws_pp_64x256_brow_tmastore",
                         "gemm_ws_pp_64x256_bcol_tmastore_bias_gelu",
                         "gemm_ws_pp_64x256_brow_registers", "gemm_ws_pp_128x128_brow_registers"}
    for name, rep in reps.items():
        assert "error" not in rep, rep.get("error")
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["local_bytes"] == 0
        assert "C75" not in rep["ptxas_log"], (name, rep["ptxas_log"])
        assert rep["counts"]["bar.arrive"] >= 1 and rep["counts"]["bar.sync"] >= 2, name
        n = 128 if "128x128" in name else 256
        assert any(f"m64n{n}k16" in f for f in rep["wgmma_forms"]), rep["wgmma_forms"]


@pytest.mark.compile
@pytest.mark.xdist_group("gemm_wgmma_ws_reports")
def test_prefetched_maps_come_before_the_barriers(small_reports):
    """``prefetch_maps``: both maps acquired and prefetched ahead of the mbarrier set-up and of
    the first TMA load, no spill or register added to the kernel without it; refused with
    ``pdl`` (its blocks may start before the maps' writer has finished)."""
    rep = small_reports["gemm_ws_128x16_brow_swap_splitk4_prefetch"]
    plain = small_reports["gemm_ws_128x16_brow_swap_splitk4"]
    assert "error" not in rep, rep.get("error")
    first, last = rep["first"], rep["last"]
    assert first["prefetch"] is not None and last["prefetch"] > first["prefetch"], first
    assert first["fence"] < first["prefetch"] < last["prefetch"] < first["mbarrier_init"] \
        < first["tma_load"], (first, last)
    assert rep["spill_stores"] == plain["spill_stores"] == 0
    assert rep["registers"] <= plain["registers"] + 8
    with pytest.raises(ValueError, match="prefetch_maps"):
        ws.wgmma_ws_gemm_kernel(WsConfig(**SMALL), True, "float16", pdl="late",
                                prefetch_maps=True)


# bar.sync per kernel: the set-up syncthreads, the consumers' barrier before they overwrite the
# stages (not persistent), and two per staging pass (float32 out: two passes)
SMEM_EPI_BARRIERS = {"gemm_ws_128x256_brow_smemepi": 4, "gemm_ws_128x256_bcol_smemepi_f32out": 6,
                     "gemm_ws_128x256_brow_smemepi_bias_gelu": 4,
                     "gemm_ws_256x128_brow_smemepi": 4,
                     "gemm_ws_128x256_brow_persistent_smemepi": 3,
                     # + one per chunk (the quads' max) and three at the end (sum, the
                     # statistics, the rescale factors)
                     "gemm_ws_128x256_brow_smemepi_softmax": 7,
                     # the TMA-store epilogue: two per pass (staging free, staging written),
                     # two passes of 128 columns
                     "gemm_ws_128x256_brow_persistent_tmastore": 5,
                     "gemm_ws_128x256_brow_persistent_tmastore_bias_gelu": 5,
                     # per chunk: the quads' max, the staging's two; the last chunk: the
                     # consumers' barrier (stages free), the quads' sum; the rescale: the
                     # factors', one per rescaled chunk
                     "gemm_ws_128x256_brow_smemepi_softmax_tmaout": 8,
                     # the chunk step written three times (a pair in the loop, the tail) and
                     # the last chunk twice; C75xx notes (serialised wgmmas) refused
                     "gemm_ws_128x128_brow_smemepi_softmax_overlap": 25}


@pytest.mark.compile
@pytest.mark.xdist_group("gemm_wgmma_ws_reports")
@pytest.mark.parametrize("name", sorted(SMEM_EPI_BARRIERS))
def test_smem_epilogue_compiles_without_spills(reports, name):
    """The staged epilogue: no spills or local memory, registers within the 168 a 384-thread
    launch allows (setmaxnreg then gives consumers 232), named barriers, 16-byte shared loads
    and global stores (and element stores for the edges)."""
    rep = reports[name]
    assert "error" not in rep, rep.get("error")
    assert rep["arch"].startswith("sm_90a")
    c = rep["counts"]
    assert c["wgmma.mma_async"] >= 4 and c["ld.local"] == 0 and c["st.local"] == 0, c
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["local_bytes"] == 0
    assert rep["registers"] <= 168, rep["registers"]
    assert "C7510" not in rep["ptxas_log"] and "C7511" not in rep["ptxas_log"]
    assert c["bar.sync"] == SMEM_EPI_BARRIERS[name], c
    ops = set(rep["ops"])
    wide = name.endswith("f32out")
    want = ({"ld.shared.v4.f32", "st.global.v4.f32", "st.shared.v2.f32", "st.global.f32"}
            if wide else {"ld.shared.v4.b32", "st.global.v4.b32", "st.shared.b32",
                          "st.global.u16"})
    if "tmastore" in name:        # no stores by the threads: TMA, swizzled staging (stmatrix)
        want = {"stmatrix.sync.aligned.m8n8.x4.shared.b16",
                "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group",
                "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group",
                "cp.async.bulk.wait_group.read"}
        assert not {op for op in ops if op.startswith("st.global")}, ops
    assert "C75" not in rep["ptxas_log"], rep["ptxas_log"]
    if name.endswith(("tmaout", "overlap")):   # no stores by the threads: TMA, swizzled staging
        want = {"st.shared.b32", "ld.shared.v4.b32", "st.shared.v4.b32",
                "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group.L2::cache_hint",
                "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                ".L2::cache_hint",
                "cp.async.bulk.wait_group.read", "cp.async.bulk.wait_group"}
        assert not {op for op in ops if op.startswith("st.global")}, ops
    assert want <= ops, (name, ops)
    assert {"setmaxnreg.dec.sync.aligned.u32", "setmaxnreg.inc.sync.aligned.u32"} <= ops
    print(f"{name}: {rep['registers']} registers, 0 spills, {c['bar.sync']} bar.sync")


@pytest.fixture(scope="module")
def cluster_reports():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    return run_in_subprocess("tilepy.ops.gemm_wgmma_ws:compile_reports_cluster")


@pytest.mark.compile
@pytest.mark.xdist_group("gemm_wgmma_ws_cluster_reports")
def test_cluster_kernels_compile_with_multicast_and_without_spills(cluster_reports):
    """Clusters of two: B arrives by multicast (no plain B load: A's loads are the only plain
    2-D/3-D ones), stages are freed on both blocks' barriers (mapa + a cluster-scope arrive),
    the cluster barrier after the inits and before exit, no spills at the 56 / 224 register
    split (40 / 232 spilled 48 bytes in the producer)."""
    assert set(cluster_reports) == {"gemm_ws_128x256_brow_smemepi_cluster2",
                                    "gemm_ws_128x256_bcol_smemepi_cluster2",
                                    "gemm_ws_128x256_brow_persistent_tmastore_cluster2"}
    for name, rep in cluster_reports.items():
        assert "error" not in rep, rep.get("error")
        assert rep["arch"].startswith("sm_90a")
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["local_bytes"] == 0
        assert rep["registers"] <= 168
        assert "C75" not in rep["ptxas_log"], rep["ptxas_log"]
        ops = set(rep["ops"])
        mc = ".multicast::cluster"
        load = "cp.async.bulk.tensor.{}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        assert {load.format(2) + mc, load.format(3) + mc, load.format(2), load.format(3),
                "mapa.shared::cluster.u32",
                "mbarrier.arrive.shared::cluster.b64",
                "barrier.cluster.arrive.release", "barrier.cluster.wait.acquire",
                "setmaxnreg.dec.sync.aligned.u32", "setmaxnreg.inc.sync.aligned.u32"} <= ops, ops
        assert "mbarrier.arrive.shared::cta.b64" not in ops   # every release is cluster-wide
        c = rep["counts"]
        assert c["ld.local"] == 0 and c["st.local"] == 0, c


# ---- hardware ----------------------------------------------------------------------------------

def _torch_views(torch, cuda, *ts):
    return [cuda.as_cuda_array(t.view(torch.int16)[None] if t.dim() == 2 else
                               t.view(torch.int16)).view(np.uint16) for t in ts]


def _gpu_run(torch, cfg, a, b, b_col, bias=None):
    """out = a @ b (+ bias) through the kernel's launch plan, torch tensors in and out."""
    from numba import cuda

    m, n = a.shape[-2], b.shape[-1]
    out = torch.full((*a.shape[:-2], m, n), float("nan"), device="cuda", dtype=a.dtype)
    bk = b.transpose(-1, -2) if b_col else b          # col: the (N, K) row-major tensor
    va, vb, vo = _torch_views(torch, cuda, a, bk, out)
    bias_v = cuda.as_cuda_array(bias if bias is not None else torch.zeros(1, device="cuda"))
    kern = ws.wgmma_ws_gemm_kernel(cfg, not b_col, cfg.dtype, None, bias is not None)
    plan, args = ws.plan(kern, cfg, va, vb, vo, vo, bias_v)
    plan.launch(0, args)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_swapped_operands_through_the_op(monkeypatch, dtype):
    """``tilepy.gemm`` with the swapped-operand configs of :func:`tilepy.ops.gemm.
    swapped_config`: rows 1 … 64 (tiles of 16, 32 and 64 rows of outᵀ, split-K as the rule
    chooses; up to :data:`~tilepy.ops.gemm.SWAP_MAX_M` rows the op's own choice) at Llama's
    (N, K) and at odd N, K, both B layouts, plain and with a bias + GELU, against float64; a
    split config's result the same bits on a second call (the ordered sum of the partials);
    with the tensor maps prefetched at entry (``gemm.PREFETCH_MAPS``) too."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    from tilepy.ops import gemm as g

    assert g.hopper_config(16, 4096, 1, dtype, k=4096) == g.swapped_config(16, 4096, 4096, 1,
                                                                           dtype)
    tdt = getattr(torch, dtype)
    for m, n, k, b_col in ((1, 4096, 4096, False), (16, 4096, 4096, True),
                           (7, 14336, 4096, False), (33, 4096, 14336, True),
                           (64, 1000, 776, False), (20, 1000, 776, True)):
        cfg = g.swapped_config(m, n, k, 1, dtype)
        a = _padded(torch, m, k, tdt)
        b = _padded(torch, n, k, tdt).t() if b_col else _padded(torch, k, n, tdt)
        ref = a.double() @ b.double()
        out = torch.full((m, n), float("nan"), device="cuda", dtype=tdt)
        tilepy.gemm(a, b, out=out, config=cfg)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < TOL[dtype], (m, n, k, b_col, cfg.describe(), err)
        if cfg.splits > 1:
            first = out.clone()
            tilepy.gemm(a, b, out=out, config=cfg)
            assert torch.equal(out.view(torch.int16), first.view(torch.int16)), cfg.describe()
        bias = torch.randn(n, device="cuda", dtype=tdt)
        got = tilepy.gemm(a, b, bias=bias, activation="gelu", config=cfg)
        want = torch.nn.functional.gelu(ref + bias.double())
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < TOL[dtype], ("bias+gelu", m, n, k, b_col, err)
    # the tensor maps prefetched at entry (gemm.PREFETCH_MAPS), the op's own configs: a
    # swapped one and a one-wave one
    monkeypatch.setattr(g, "PREFETCH_MAPS", True)
    for m in (16, 100):
        a = _padded(torch, m, 4096, tdt)
        b = _padded(torch, 4096, 4096, tdt)
        out = torch.full((m, 4096), float("nan"), device="cuda", dtype=tdt)
        tilepy.gemm(a, b, out=out)
        ref = a.double() @ b.double()
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < TOL[dtype], ("prefetch_maps", m, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_tma_store_epilogue(dtype):
    """tma_store=True at full size and at edges (rows of 16-byte multiples: what TMA stores),
    plain and with a bias, against torch in float32 (bias + GELU + beta·c: the simulator)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    tdt = getattr(torch, dtype)
    cfg = dataclasses.replace(ws.TMA_STORE, dtype=dtype)
    for (m, n, k), b_col in [((4096, 4096, 4096), False), ((4096, 4096, 4096), True),
                             ((3000, 2056, 1000), False), ((2500, 4000, 776), True),
                             ((70, 104, 258), False)]:
        a = _padded(torch, m, k, tdt)
        b = _padded(torch, n, k, tdt).t() if b_col else _padded(torch, k, n, tdt)
        ref = a.float() @ b.float()
        got = _gpu_run(torch, cfg, a, b, b_col)
        assert not bool(torch.isnan(got).any())
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        assert err <= TOL[dtype], (m, n, k, b_col, err)
        bias = torch.randn(n, device="cuda", dtype=torch.float32)
        got = _gpu_run(torch, cfg, a, b, b_col, bias=bias)
        want = ref + bias
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err <= TOL[dtype], ("bias", m, n, k, b_col, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_pingpong_consumers(dtype):
    """The ping-pong candidates (:data:`~tilepy.ops.gemm_wgmma_ws.PINGPONG_TMA_STORE`, the
    register-epilogue 64 × 256 and 128 × 128 ones, clusters of two) at full size and at edges,
    both B layouts, plain and with a bias, against torch in float32, out poisoned with NaN."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    tdt = getattr(torch, dtype)
    cfgs = [dataclasses.replace(c, dtype=dtype) for c in
            (ws.PINGPONG_TMA_STORE, ws.PINGPONG_REGISTERS, ws.PINGPONG_128)]
    cfgs.append(dataclasses.replace(ws.PINGPONG_TMA_STORE, dtype=dtype, cluster=2,
                                    producer_regs=56, consumer_regs=224))
    for cfg in cfgs:
        for (m, n, k), b_col in [((4096, 4096, 4096), False), ((4096, 4096, 4096), True),
                                 ((3000, 2056, 1000), False), ((1100, 704, 300), True)]:
            a = _padded(torch, m, k, tdt)
            b = _padded(torch, n, k, tdt).t() if b_col else _padded(torch, k, n, tdt)
            ref = a.float() @ b.float()
            got = _gpu_run(torch, cfg, a, b, b_col)
            assert not bool(torch.isnan(got).any()), (cfg.describe(), m, n, k, b_col)
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            assert err <= TOL[dtype], (cfg.describe(), m, n, k, b_col, err)
            bias = torch.randn(n, device="cuda", dtype=torch.float32)
            got = _gpu_run(torch, cfg, a, b, b_col, bias=bias)
            want = ref + bias
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            assert err <= TOL[dtype], ("bias", cfg.describe(), m, n, k, b_col, err)


def _padded(torch, rows, cols, dt):
    """A (rows, cols) view of a (rows, cols rounded up to 8) tensor: TMA needs 16-byte rows,
    so odd widths come as views of padded storage (the op copies other operands)."""
    return torch.randn(rows, -(-cols // 8) * 8, device="cuda", dtype=dt)[:, :cols]


GPU_CASES = [((4096, 4096, 4096), False), ((4096, 4096, 4096), True), ((3000, 2056, 1000), False),
             ((2500, 4000, 776), True), ((70, 100, 258), False), ((70, 100, 258), True),
             ((1100, 700, 300), True)]   # 9 row blocks: a cluster pair's second block idle


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg_kw", [
    {}, {"block_m": 256, "block_n": 128}, {"persistent": True},
    {"smem_epilogue": True}, {"block_m": 256, "block_n": 128, "smem_epilogue": True},
    {"persistent": True, "stages": 3, "smem_epilogue": True},
    dict(CLUSTER_KW), dict(CLUSTER_KW, smem_epilogue=False),
    dict(CLUSTER_KW, persistent=True, stages=3),
    dict(CLUSTER_KW, persistent=True, tma_store=True),
    dict(CLUSTER_KW, block_m=256, block_n=128, smem_epilogue=False),
    {"splits": 4}, {"block_m": 64, "consumers": 1, "stages": 5, "splits": 3,
                    "smem_epilogue": True},
    {"persistent": True, "smem_epilogue": True, "tma_store": True, "splits": 2}],
    ids=["128x256", "256x128", "persistent", "128x256-smem-epilogue", "256x128-smem-epilogue",
         "persistent-s3-smem-epilogue",
         "cluster2-smem-epilogue", "cluster2", "cluster2-persistent-s3-smem-epilogue",
         "cluster2-persistent-tma-store", "cluster2-256x128", "split4", "64x256-split3",
         "persistent-tma-store-split2"])
def test_gpu_against_torch(dtype, cfg_kw):
    """The shared-memory epilogue cases meet odd N (edge element stores) and 70 × 100, whose
    200-byte output rows are only 8-byte aligned (element stores on odd rows)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    tdt = getattr(torch, dtype)
    cfg = WsConfig(dtype=dtype, **cfg_kw)
    for (m, n, k), b_col in GPU_CASES:
        if cfg.tma_store and n * 2 % 16:
            continue   # TMA stores need 16-byte output rows (test_gpu_tma_store_epilogue)
        a = _padded(torch, m, k, tdt)
        b = _padded(torch, n, k, tdt).t() if b_col else _padded(torch, k, n, tdt)
        bias = torch.randn(n, device="cuda")
        got = _gpu_run(torch, cfg, a, b, b_col, bias)
        ref = a.double() @ b.double() + bias.double()
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < TOL[dtype], (m, n, k, b_col, err)


@pytest.mark.gpu
def test_gpu_dependent_launches_chained_in_a_graph(monkeypatch):
    """``gemm.PDL``: a chain of split-K GEMMs, each reading the one before's output (and its
    counters and partials), eager and replayed from a CUDA graph: the same bits as plain
    launches (a kernel touching memory before the one ahead finished would differ)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    from tilepy.ops import gemm as g

    cfg = WsConfig(64, 128, 8, "bfloat16", consumers=1, smem_epilogue=True, splits=4)
    x0 = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    bufs = [torch.empty(16, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(6)]

    def chain():
        x = x0
        for buf in bufs:
            x = tilepy.gemm(x, w, out=buf, config=cfg)
        return x

    results = {}
    for pdl in (False, True):
        monkeypatch.setattr(g, "PDL", pdl)
        g._PLANS.clear()
        results[pdl] = chain().clone()
        if pdl:
            graph = torch.cuda.CUDAGraph()
            for buf in bufs:
                buf.fill_(float("nan"))
            with torch.cuda.graph(graph):
                chain()
            for _ in range(3):
                for buf in bufs:
                    buf.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(bufs[-1].view(torch.int16), results[False].view(torch.int16))
    assert torch.equal(results[True].view(torch.int16), results[False].view(torch.int16))
    assert torch.isfinite(results[False]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", [False, True], ids=["workspace", "cluster"])
def test_gpu_split_k_same_bits_every_run(cluster):
    """Split-K at a decode shape (M 16, K 4096 cut in 8; in a cluster, 4): ten launches give
    the same bits (the partials are added in split order whichever block finishes a tile
    last; or, reduced in a cluster, by its first split whenever the others arrive)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    cfg = WsConfig(64, 128, 8, "bfloat16", consumers=1, smem_epilogue=True, splits=4,
                   split_cluster=True) if cluster else \
        WsConfig(64, 256, 5, "bfloat16", consumers=1, smem_epilogue=True, splits=8)
    a = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    first = tilepy.gemm(a, b, config=cfg)
    ref = a.double() @ b.double()
    assert ((first.double() - ref).abs().max() / ref.abs().max()).item() < TOL["bfloat16"]
    for _ in range(10):
        assert torch.equal(tilepy.gemm(a, b, config=cfg).view(torch.int16),
                           first.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg,m", [
    (dataclasses.replace(ws.TMA_STORE, dtype="bfloat16"), 2048),
    (WsConfig(64, 128, 8, "bfloat16", consumers=1, smem_epilogue=True, splits=4), 16)],
    ids=["persistent-tma-store", "split-k"])
def test_gpu_traced_kernel_same_bits_and_ordered_marks(cfg, m):
    """The traced kernel at full size (N = K = 4096) gives the untraced kernel's bits, and
    every block's marks are on the global timer in order (bench/trace_gemm.py reads them)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    from numba import cuda

    from tilepy.tile import trace as TR

    a = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    outs, trace = [], None
    for traced in (False, True):
        out = torch.full((m, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)
        va, vb, vo, vc = views(a, b, out, "row")
        kern = ws.wgmma_ws_gemm_kernel(cfg, True, "bfloat16", trace=traced)
        g = ws.grid(cfg, m, 4096, 1, ws.sm_count(ws.SMS) if cfg.persistent else None)
        if traced:
            trace = cuda.to_device(np.zeros((g[0] * g[1], 40), np.uint64))
        plan, args = ws.plan(kern, cfg, va, vb, vo, vc, arrays.placeholder(1),
                             alloc=arrays.byte_allocator(describe(a, "a")), trace=trace)
        plan.launch(torch.cuda.current_stream().cuda_stream, args)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    ref = a.double() @ b.double()
    assert ((outs[0].double() - ref).abs().max() / ref.abs().max()).item() < TOL["bfloat16"]
    t = trace.copy_to_host()[:, :TR.SLOTS].astype(np.int64)
    mk = ws.TRACE_MARKS
    order = [mk[x] for x in ("entry", "ready", "first_stage", "first_loop_end",
                             "first_reduced", "consumer_end")]
    assert (t[:, order] > 0).all()
    assert (np.diff(t[:, order], axis=1) >= 0).all()
    assert trace.copy_to_host()[:, 2 * TR.SLOTS + mk["items"]].sum() == \
        -(-m // cfg.block_m) * (4096 // cfg.block_n) * cfg.splits


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [WsConfig(), ws.CLUSTER, ws.CLUSTER_TMA_STORE],
                         ids=["plain", "cluster2", "cluster2-persistent-tma-store"])
@pytest.mark.parametrize("b_col", [False, True], ids=["b-row", "b-col"])
def test_gpu_batched_3d_tensor_maps(cfg, b_col):
    """3-D maps (a batch), and with clusters the multicast 3-D loads; B broadcast over A's
    batch too (a 2-D B map beside a 3-D A map)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    a = torch.randn(3, 1000, 520, device="cuda", dtype=torch.float16)
    for b in (torch.randn(3, 520, 1064, device="cuda", dtype=torch.float16),
              torch.randn(520, 1064, device="cuda", dtype=torch.float16)):
        if b_col:
            b = b.transpose(-1, -2).contiguous().transpose(-1, -2)
        got = _gpu_run(torch, cfg, a, b, b_col)
        ref = a.double() @ b.double()
        assert not bool(torch.isnan(got).any())
        assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < TOL["float16"]


@pytest.mark.sim
def test_through_the_op_with_a_cached_plan():
    """tilepy.gemm(config=WsConfig(...)): the first call builds the launch plan, later calls
    with new arrays of the same signature reuse it (new tensor maps for the new pointers)."""
    from tilepy.ops import gemm as g

    rng = np.random.default_rng()
    g._PLANS.clear()
    for _ in range(3):
        a = rng.standard_normal((70, 264)).astype(np.float16)[:, :258]
        b = rng.standard_normal((258, 104)).astype(np.float16)[:, :100]
        out = np.full((70, 100), np.nan, np.float16)
        tilepy.gemm(a, b, out=out, config=WsConfig(64, 64, 2, consumers=1))
        ref = a.astype(np.float64) @ b.astype(np.float64)
        assert not np.isnan(out.astype(np.float64)).any()
        assert np.abs(out - ref).max() / np.abs(ref).max() < 2e-3
    assert len(g._PLANS) == 1
