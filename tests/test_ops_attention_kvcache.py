"""``tilepy.flash_attention_with_kvcache``: a few query rows per sequence against a KV cache
(contiguous, or paged through a block table), new keys and values appended first, against a
float64 reference that gathers each sequence's keys from its pages (ragged lengths with 0 and
the full capacity, GQA and MQA, seq_q 1, 2, 3 and 5 aligned to each sequence's end, a window,
the keys split into runs and not, the forward kernel as the alternative config); out-of-range
lengths and pages clamped, never read out of bounds; bad input refused before launch. The
kernels' offline compile: test_ops_attention.py (``..._paged``) and the decoding kernel's
below."""

from __future__ import annotations

import numpy as np
import pytest

from tilepy import flash_attention_with_kvcache as kvcache
from tilepy.ops.attention_decode_mma_sync import DecodeConfig
from tilepy.ops.attention_mma_sync import AttentionConfig

from test_ops_attention import check, check_lse, rand, reference

sim = pytest.mark.sim
gpu = pytest.mark.gpu


def gather(cache, lens, table=None):
    """Each sequence's visible keys (its first ``lens[b]`` rows), from its pages if paged."""
    out = []
    for b, n in enumerate(lens):
        j = np.arange(int(n))
        out.append(cache[table[b, j // cache.shape[1]], j % cache.shape[1]] if table is not None
                   else cache[b, j])
    return out


def kv_reference(q, kc, vc, lens, table=None, causal=True, window=(-1, -1)):
    """float64 (out (B, Sq, Hq, D), lse (B, Hq, Sq)) of each sequence against its keys."""
    b, sq, hq, d = q.shape
    out, lse = np.zeros(q.shape), np.full((b, hq, sq), -np.inf)
    for z, (k, v) in enumerate(zip(gather(kc, lens, table), gather(vc, lens, table))):
        if len(k):
            o, l = reference(q[z:z + 1], k[None], v[None], causal, None, "bshd", window)
            out[z], lse[z] = o[0], l[0]
    return out, lse


def append_reference(kc, vc, kn, vn, lens, table=None):
    kc, vc = kc.copy(), vc.copy()
    for z in range(kn.shape[0]):
        for i in range(kn.shape[1]):
            pos = int(lens[z]) + i
            at = (table[z, pos // kc.shape[1]], pos % kc.shape[1]) if table is not None \
                else (z, pos)
            kc[at], vc[at] = kn[z, i], vn[z, i]
    return kc, vc


@sim
@pytest.mark.parametrize("sq,hq,hk,causal,window,dtype,splits", [
    # decoding, MQA, the keys split 3 ways on blocks of two warps: 4 runs, one empty
    (1, 8, 1, True, None, "float16", 3),
    # speculative rows of GQA packed into two tiles (5 rows x 4 heads), a sliding window
    (5, 8, 2, True, (20, 0), "bfloat16", None),
    (3, 2, 2, False, None, "float16", "forward"),  # the forward kernel (an AttentionConfig)
])
def test_contiguous_cache_against_float64(sq, hq, hk, causal, window, dtype, splits):
    rng = np.random.default_rng()
    b, cap, d = 3, 40, 40
    q = rand(rng, (b, sq, hq, d), dtype)
    kc, vc = rand(rng, (b, cap, hk, d), dtype), rand(rng, (b, cap, hk, d), dtype)
    lens = np.array([0, 17, cap], np.int32)    # empty, ragged, full
    out = np.full(q.shape, np.nan, q.dtype)
    extra = dict(config=AttentionConfig(d, 16, 16, 16, dtype)) if splits == "forward" \
        else dict(num_splits=splits, config=DecodeConfig(d, 16, 3, dtype, warps=2)) \
        if splits == 3 else dict(num_splits=splits)
    got, lse = kvcache(q, kc, vc, lens, causal=causal, window=window, return_lse=True, out=out,
                       **extra)
    assert got is out
    want, wl = kv_reference(q, kc, vc, lens, None, causal, window or (-1, -1))
    check(got, want, vc, dtype)
    check_lse(lse, wl)


@sim
@pytest.mark.parametrize("pdl", [True, False])
def test_programmatic_dependent_launch_of_the_combine(monkeypatch, pdl):
    """``attention_kvcache.PDL`` (the default): the split path's combine kernel launched as a
    dependent launch (waiting for the decoding kernel's results first), the decoding kernel
    letting it begin; off, the two in plain stream order. The same answer (in the simulator
    the two instructions are no-ops: the kernels' offline compile below has them, the GPU
    decides the timing)."""
    from tilepy.ops import attention_kvcache as akv

    monkeypatch.setattr(akv, "PDL", pdl)
    monkeypatch.setattr(akv, "FUSED_MERGE", False)
    rng = np.random.default_rng()
    b, cap, hq, hk, d = 2, 40, 4, 2, 32
    q = rand(rng, (b, 1, hq, d), "bfloat16")
    kc, vc = rand(rng, (b, cap, hk, d), "bfloat16"), rand(rng, (b, cap, hk, d), "bfloat16")
    lens = np.array([23, cap], np.int32)
    cfg = DecodeConfig(d, 16, 3, "bfloat16")
    steps, *_ = akv.decode_launches(q, kc, vc, lens, num_splits=2, config=cfg)
    assert [p.dependent for p, _ in steps] == [False, pdl]
    got = kvcache(q, kc, vc, lens, num_splits=2, config=cfg)
    want, _ = kv_reference(q, kc, vc, lens)
    check(got, want, vc, "bfloat16")


@sim
@pytest.mark.parametrize("page,sn,bn", [(16, 0, 0), (64, 2, 16), (16, 2, 32), (16, 0, 64)])
def test_paged_cache_with_appended_tokens(page, sn, bn):
    """Pages in a shuffled order, new tokens written through the block table at each
    sequence's end (one lands on a new page) and attended to; with appends, blocks of two
    warps, each on its own run of the keys. ``bn`` larger than the page: each key block
    gathers two or four pages (three pages a sequence: the last block's pieces past the
    table's end are never read). Twice, on fresh arrays of the same signature: the second
    call replays the first one's recorded launches (and still checks the lengths)."""
    rng = np.random.default_rng()
    b, sq, hq, hk, d, per = 3, 2, 4, 2, 32, 3
    pages = b * per + 1
    for _ in range(2):
        q = rand(rng, (b, sq, hq, d), "float16")
        kc, vc = rand(rng, (pages, page, hk, d), "float16"), rand(rng, (pages, page, hk, d),
                                                                  "float16")
        table = rng.permutation(pages)[:b * per].reshape(b, per).astype(np.int32)
        lens = np.array([page - 1, rng.integers(0, 9), per * page - sn], np.int32)
        kn, vn = rand(rng, (b, sn, hk, d), "float16"), rand(rng, (b, sn, hk, d), "float16")
        want_k, want_v = append_reference(kc, vc, kn, vn, lens, table)
        args = dict(k=kn if sn else None, v=vn if sn else None, block_table=table,
                    num_splits=2 if sn else 1, return_lse=True,
                    config=DecodeConfig(32, bn, 3, "float16", warps=2 if sn else 1)
                    if bn else None)
        got, lse = kvcache(q, kc, vc, lens, **args)
        np.testing.assert_array_equal(kc, want_k)
        np.testing.assert_array_equal(vc, want_v)
        want, wl = kv_reference(q, want_k, want_v, lens + sn, table)
        check(got, want, vc, "float16")
        check_lse(lse, wl)
        with pytest.raises(ValueError, match="exceeds the cache's capacity"):
            kvcache(q, kc, vc, lens + page, **args)


@sim
def test_padded_block_table_and_a_long_prefill():
    """Table entries past the pages the lengths use are never read (-1 padding passes the
    check); 17 query rows of 4 heads over one KV head (68 packed rows) take the forward
    kernel by default, with the same results."""
    rng = np.random.default_rng()
    q = rand(rng, (2, 17, 4, 16), "float16")
    kc, vc = rand(rng, (4, 16, 1, 16), "float16"), rand(rng, (4, 16, 1, 16), "float16")
    table = np.array([[2, 0, -1], [3, 1, -1]], np.int32)
    lens = np.array([20, 32], np.int32)
    got = kvcache(q, kc, vc, lens, block_table=table)
    want = kv_reference(q, kc, vc, lens, np.where(table < 0, 0, table))[0]
    check(got, want, vc, "float16")


@sim
def test_unchecked_lengths_and_pages_are_clamped():
    """With check_seqlens=False a length past the capacity reads the whole cache and a page
    past the pool reads the last page — never out of bounds (the simulator would raise)."""
    rng = np.random.default_rng()
    q = rand(rng, (2, 1, 2, 16), "float16")
    kc, vc = rand(rng, (3, 16, 1, 16), "float16"), rand(rng, (3, 16, 1, 16), "float16")
    table = np.array([[0, 1], [2, 7]], np.int32)
    got = kvcache(q, kc, vc, np.array([99, 20], np.int32), block_table=table,
                  check_seqlens=False, num_splits=2)
    want = kv_reference(q, kc, vc, [32, 20], np.array([[0, 1], [2, 2]], np.int32))[0]
    check(got, want, vc, "float16")


def test_errors_are_raised_before_launch():
    x = np.zeros((2, 1, 2, 16), np.float16)
    kc = np.zeros((2, 32, 1, 16), np.float16)
    lens = np.array([3, 4], np.int32)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 33 exceeds the cache's "
                                         r"capacity of 32 keys"):
        kvcache(x, kc, kc, np.array([3, 33], np.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 31 plus 2 appended tokens"):
        kvcache(x, kc, kc, np.array([31, 0], np.int32), k=kc[:, :2], v=kc[:, :2])
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 5 is not a page \(0 … 1\)"):
        kvcache(x, kc, kc, lens, block_table=np.array([[0], [5]], np.int32))
    with pytest.raises(ValueError, match="page size .* must be a positive multiple of 16"):
        kvcache(x, kc[:, :24], kc[:, :24], lens, block_table=np.zeros((2, 1), np.int32))
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        kvcache(x, kc, kc, lens.astype(np.int64))
    with pytest.raises(ValueError, match="one entry per sequence"):
        kvcache(x, kc, kc, lens[:1])
    with pytest.raises(ValueError, match="k_cache has 2 sequences, q 1"):
        kvcache(x[:1], kc, kc, lens[:1])
    with pytest.raises(ValueError, match="pass both or neither"):
        kvcache(x, kc, kc, lens, k=kc[:, :1])
    with pytest.raises(ValueError, match="num_splits must be in 1 … 1024"):
        kvcache(x, kc, kc, lens, num_splits=0)
    with pytest.raises(TypeError, match="num_splits must be an int or None"):
        kvcache(x, kc, kc, lens, num_splits=True)
    with pytest.raises(ValueError, match="num_splits > 1 needs the decoding kernel"):
        kvcache(x, kc, kc, lens, num_splits=2, config=AttentionConfig(16, 16, 16, 16,
                                                                      "float16"))
    with pytest.raises(ValueError, match="block_n = 32 must divide the page size 48 or be a "
                                         "multiple of it"):
        kvcache(x, np.zeros((2, 48, 2, 16), np.float16), np.zeros((2, 48, 2, 16), np.float16),
                lens, block_table=np.zeros((2, 1), np.int32),
                config=DecodeConfig(16, 32, 3, "float16"))
    with pytest.raises(ValueError, match="block_n = 64 must divide the page size 32"):
        kvcache(x, kc, kc, lens, block_table=np.zeros((2, 1), np.int32),
                config=AttentionConfig(16, 16, 64, 16, "float16"))
    with pytest.raises(ValueError, match="heads_q .3. must be a multiple of heads_kv .2."):
        kvcache(np.zeros((2, 1, 3, 16), np.float16), np.zeros((2, 32, 2, 16), np.float16),
                np.zeros((2, 32, 2, 16), np.float16), lens)



@sim
@pytest.mark.parametrize("splits,warps", [(4, 2), (1, 1)], ids=["split-2-warps", "whole"])
def test_traced_decoding_kernel_marks_each_warp(splits, warps):
    """The decoding kernel generated with ``trace=True`` (decode_launches: the op's launches
    built for a measuring tool) computes what the op does and marks each warp's phases in
    order — entry, Q landed, first key block landed, loop end, stored — with its split and
    key blocks; a warp with no keys marks entry and stored only."""
    from numba import cuda

    from tilepy.ops import attention_decode_mma_sync as dec
    from tilepy.ops.attention_kvcache import decode_launches
    from tilepy.tile import trace as TR

    rng = np.random.default_rng()
    b, sq, hq, hk, d, cap = 2, 1, 4, 2, 32, 40
    q = rand(rng, (b, sq, hq, d), "float16")
    kc, vc = rand(rng, (b, cap, hk, d), "float16"), rand(rng, (b, cap, hk, d), "float16")
    lens = np.array([0, 37], np.int32)
    cfg = DecodeConfig(d, 16, 3, "float16", warps=warps)
    g = dec.grid(sq, hq // hk, hk, b, splits, warps)
    trace = cuda.to_device(np.zeros((g[0] * g[1] * g[2] * warps, TR.WIDTH), np.uint64))
    steps, out, _, got_splits, keep = decode_launches(q, kc, vc, lens, num_splits=splits,
                                                      config=cfg, trace=trace)
    from tilepy.ops import attention_kvcache as akv

    # (no combine kernel: one split, or the opt-in merge inside the decoding kernel)
    merged = splits == 1 or (akv.FUSED_MERGE and dec.fused_fits(cfg, splits))
    assert got_splits == splits and len(steps) == (1 if merged else 2)
    for plan, args in steps:
        plan.launch(0, args)
    want = kvcache(q, kc, vc, lens, num_splits=splits, config=cfg)
    np.testing.assert_array_equal(out, want)
    t = trace.copy_to_host()
    mk = dec.TRACE_MARKS
    times = t[:, :TR.SLOTS].astype(np.int64)
    vals = t[:, 2 * TR.SLOTS:]
    order = [mk[x] for x in ("entry", "q_landed", "first_kv", "loop_end", "stored")]
    busy = vals[:, mk["key_blocks"]] > 0
    assert busy.any() and (~busy).any()         # batch 0 has no keys
    assert (times[busy][:, order] > 0).all() and (np.diff(times[busy][:, order]) >= 0).all()
    idle = times[~busy]
    assert (idle[:, mk["entry"]] > 0).all() and (idle[:, mk["q_landed"]] == 0).all()
    assert (idle[:, mk["stored"]] >= idle[:, mk["entry"]]).all()
    assert sorted(set(vals[:, mk["split"]].tolist())) == list(range(splits))
    # the three key blocks of batch 1 (37 keys of 16) over its splits, each KV head
    assert vals[busy, mk["key_blocks"]].sum() == 3 * hk


@sim
@pytest.mark.parametrize("sq,hq,hk,d,splits,warps,page", [
    (1, 8, 2, 40, 3, 1, None),      # 4 packed rows of a tile, three splits
    (5, 8, 2, 32, 4, 2, None),      # 20 rows: a full tile and one of 4; two warps a block
    (2, 4, 1, 64, 2, 1, 16),        # paged, MQA
])
def test_fused_merge_against_float64_and_the_combine_kernel(monkeypatch, sq, hq, hk, d, splits,
                                                            warps, page):
    """The splits merged by the decoding kernel itself (``FUSED_MERGE``, opt-in): one
    launch, a counted plan whose stream counter is back at zero after each call; against
    float64 (out and LSE; a sequence with no key, one with a key block per split at most,
    the full capacity) and within float32 rounding of the combine kernel's merge; the same
    bits on a second call with the same inputs."""
    from tilepy.ops import attention_decode_mma_sync as dec
    from tilepy.ops import attention_kvcache as akv
    from tilepy.tile.stream_counter import CountedLaunchPlan

    rng = np.random.default_rng()
    b, cap = 3, 64
    dtype = "bfloat16"
    q = rand(rng, (b, sq, hq, d), dtype)
    if page:
        kc = rand(rng, (b * cap // page + 2, page, hk, d), dtype)
        table = rng.permutation(kc.shape[0])[:b * cap // page].reshape(b, -1).astype(np.int32)
    else:
        kc, table = rand(rng, (b, cap, hk, d), dtype), None
    vc = rand(rng, kc.shape, dtype)
    lens = np.array([0, 29, cap], np.int32)
    cfg = DecodeConfig(d, 16, 3, dtype, warps=warps)
    assert dec.fused_fits(cfg, splits)
    monkeypatch.setattr(akv, "FUSED_MERGE", True)
    akv._PLANS.clear()
    outs = []
    for _ in range(2):
        out = np.full(q.shape, np.nan, q.dtype)
        got, lse = kvcache(q, kc, vc, lens, block_table=table, num_splits=splits, config=cfg,
                           return_lse=True, out=out)
        outs.append(got.copy())
    (entry,) = akv._PLANS.values()
    (bound, _), = entry[0].steps            # one launch: no combine kernel
    assert isinstance(bound.plan, CountedLaunchPlan)
    counter = bound.plan.counter_for(0)
    assert counter.shape == (b * hk * -(-(sq * hq // hk) // 16),)
    np.testing.assert_array_equal(counter.copy_to_host(), 0)
    np.testing.assert_array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))
    want, wl = kv_reference(q, kc, vc, lens, table)
    check(got, want, vc, dtype)
    check_lse(lse, wl)
    assert (got[0] == 0).all() and (lse[0] == -np.inf).all()
    monkeypatch.setattr(akv, "FUSED_MERGE", False)
    comb, comb_lse = kvcache(q, kc, vc, lens, block_table=table, num_splits=splits, config=cfg,
                             return_lse=True)
    f32 = lambda x: x.astype(np.float32)
    assert np.abs(f32(comb) - f32(got)).max() <= 2 ** -7 * np.abs(f32(comb)).max()
    live = np.isfinite(comb_lse)
    np.testing.assert_array_equal(live, np.isfinite(lse))
    assert np.abs(comb_lse[live] - lse[live]).max() < 1e-5


@sim
def test_a_nan_query_gives_a_nan_row_and_lse(monkeypatch):
    """A NaN in one query head's row: that row and its LSE are NaN (not zeros and -inf, "no
    key"), the other heads untouched — unsplit, split with the fused merge and with the
    combine kernel."""
    from tilepy.ops import attention_kvcache as akv

    rng = np.random.default_rng()
    q = rand(rng, (1, 1, 4, 32), "float16")
    q[0, 0, 1, 5] = np.nan
    kc = rand(rng, (1, 48, 2, 32), "float16")
    lens = np.array([48], np.int32)
    cfg = DecodeConfig(32, 16, 3, "float16")
    for fused, splits in ((True, 1), (True, 3), (False, 3)):
        monkeypatch.setattr(akv, "FUSED_MERGE", fused)
        out, lse = kvcache(q, kc, kc, lens, num_splits=splits, config=cfg, return_lse=True)
        assert np.isnan(out[0, 0, 1]).all() and np.isnan(lse[0, 1, 0]), (fused, splits)
        keep = [0, 2, 3]
        assert np.isfinite(out[0, 0, keep]).all() and np.isfinite(lse[0, keep]).all()


@sim
def test_fused_merge_falls_back_to_the_combine_kernel(monkeypatch):
    """With the fused merge on, splits whose weights do not fit a warp's shared memory (64
    bytes each) take the combine kernel: two launches."""
    from tilepy.ops import attention_decode_mma_sync as dec
    from tilepy.ops import attention_kvcache as akv
    from tilepy.ops.attention_kvcache import decode_launches

    monkeypatch.setattr(akv, "FUSED_MERGE", True)
    rng = np.random.default_rng()
    cfg = DecodeConfig(16, 16, 2, "float16")
    many = cfg.warp_bytes // 64 + 1
    assert dec.fused_fits(cfg, many - 1) and not dec.fused_fits(cfg, many)
    q = rand(rng, (1, 1, 2, 16), "float16")
    kc = rand(rng, (1, 16 * many, 1, 16), "float16")
    lens = np.array([16 * many], np.int32)
    steps, out, _, splits, _ = decode_launches(q, kc, kc, lens, num_splits=many, config=cfg)
    assert splits == many and len(steps) == 2
    for plan, args in steps:
        plan.launch(0, args)
    want, _ = kv_reference(q, kc, kc, lens)
    check(out, want, kc, "float16")


@pytest.mark.compile
def test_decoding_kernels_compile_without_spills():
    """The decoding kernel (the default 32-key config split and paged — also merging its own
    splits over pages of 16 keys, two a key block —, also letting a
    dependent launch begin; four warps a block, also traced; 64-key blocks whole and
    contiguous) and the combine kernel (also waiting for the kernel ahead; one and four warps a
    row), offline for sm_90:
    per
    key block
    (head_dim 128) BN mma for Q·Kᵀ and BN for P·V, no local memory, no float64."""
    from tilepy.offline import find_ptxas, run_in_subprocess

    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reports = run_in_subprocess("tilepy.ops.attention_decode_mma_sync:compile_reports")
    assert len(reports) == 10
    for name, rep in reports.items():
        assert "error" not in rep, rep.get("error")
        # programmatic dependent launch: the trigger / the wait only where generated
        want = 1 if name.endswith(("_trigger", "_wait")) else 0
        assert rep["counts"]["griddepcontrol"] == want, (name, rep["counts"])
        # the traced kernel's phase marks, and no timer read in the others
        assert (rep["timer_reads"] > 0) == name.endswith("_trace"), (name, rep["timer_reads"])
        c = rep["counts"]
        if "combine" not in name:
            bn = 64 if name == "decode_d128_f16_causal" else 32
            assert c["mma"] >= 2 * bn, (name, c)
            assert c["cp.async"] >= 1 and c["cp.async.wait"] >= 2, (name, c)
        assert c["ld.local"] == 0 and c["st.local"] == 0, (name, c)
        # the kernel sits at 255 registers: the traced one's shared-memory row address spills
        # a few bytes (a measuring tool's cost)
        most = 32 if name.endswith("_trace") else 0
        assert rep["spill_stores"] <= most and rep["spill_loads"] <= most, rep
        assert rep["f64"] == 0, "64-bit float arithmetic in the kernel"
        assert 0 < rep["registers"] <= 255
        print(f"{name}: {rep['registers']} registers, {rep['config']}")

@sim
@pytest.mark.parametrize("n,ways,d", [(5, 1, 80), (6, 2, 40), (41, 2, 80), (70, 4, 40),
                                     (70, 8, 40)])
def test_combine_kernel_against_float64(n, ways, d):
    """The combine kernel alone: ``n`` partials merged by ``ways`` warps a row (four-split
    steps and the splits left over; rows past the last in a block's last row slot), against
    float64 — a split that saw no key (-inf), a row no split saw (zeros, LSE -inf); every
    output element written (poisoned first). Blocks of two warps (the simulator's default),
    four (the GPU's) for four ways, eight for eight."""
    from tilepy.arrays import device_view
    from tilepy.ops import attention_decode_mma_sync as dec

    warps = max(ways, 2)
    rng = np.random.default_rng()
    b, hk, sq, g = 2, 2, 1, 3
    parts = rng.standard_normal((n, b, hk, sq, g, d)).astype(np.float32)
    plse = (rng.standard_normal((n, b, hk, g, sq)) * 3).astype(np.float32)
    plse[1, 0, 0] = -np.inf                 # a split that saw no key, for (b 0, hk 0)
    plse[:, 1, 1, 2, 0] = -np.inf           # (b 1, hk 1, g 2): no key at all
    o = np.full((b, hk, sq, g, d), 0x7FC1, np.uint16)      # a NaN's bits
    lse = np.full((b, hk, g, sq), np.nan, np.float32)
    kern = dec.combine_kernel(d, "bfloat16", True, ways=ways, warps=warps)
    kern[dec.combine_grid(sq, g, hk, b, ways, warps), dec.combine_threads(warps)](
        *(device_view(x) for x in (parts, plse, o, lse)))
    top = plse.max(0).astype(np.float64)
    safe = np.where(np.isfinite(top), top, 0)
    tot = safe + np.log(np.exp(plse - safe).sum(0))              # (b, hk, g, sq)
    with np.errstate(invalid="ignore"):     # (-inf - -inf: the row with no key, NaN -> 0)
        w = np.exp(plse - tot)                                    # (n, b, hk, g, sq)
    want = np.einsum("sbhgi,sbhigd->bhigd", np.nan_to_num(w), parts.astype(np.float64))
    got = (o.astype(np.uint32) << 16).view(np.float32)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max()
    assert (got[1, 1, 0, 2] == 0).all() and lse[1, 1, 2, 0] == -np.inf
    live = np.isfinite(tot)
    assert np.abs(lse[live] - tot[live]).max() < 1e-4 and live.sum() == lse.size - 1


@gpu
@pytest.mark.parametrize("page,fused", [(None, False), (16, False), (256, False), (None, True)],
                         ids=["contiguous", "page16", "page256", "contiguous-fused"])
def test_gpu_decoding_against_sdpa_and_a_graph_replay(monkeypatch, page, fused):
    """Full size (B 8, 32 query heads over 8, head_dim 128, bf16, 4096 cached keys of ragged
    lengths, seq_q 1 and 4) against SDPA over each sequence's gathered keys — the splits
    merged by the combine kernel as a programmatic dependent launch (the default), or with
    ``fused`` inside the decoding kernel; then one CUDA graph captured with k / v appended
    and replayed with new lengths and contents (the fused merge's counter: one of the
    capture's own, zeroed in the graph)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from tilepy.ops import attention_kvcache as akv

    monkeypatch.setattr(akv, "FUSED_MERGE", fused)
    b, hq, hk, d, cap = 8, 32, 8, 128, 4096
    dev, dt = "cuda", torch.bfloat16
    if page is None:
        kc = torch.randn(b, cap, hk, d, device=dev, dtype=dt)
        table = None
    else:
        kc = torch.randn(b * cap // page + 3, page, hk, d, device=dev, dtype=dt)
        table = torch.randperm(kc.shape[0], device=dev)[:b * cap // page].view(b, -1).int()
    vc = torch.randn_like(kc)

    def want(q, lens):
        outs = []
        for z in range(b):
            n = int(lens[z])
            j = torch.arange(n, device=dev)
            k = kc[table[z, j // page], j % page] if page else kc[z, :n]
            v = vc[table[z, j // page], j % page] if page else vc[z, :n]
            sq = q.shape[1]
            mask = (torch.arange(n, device=dev)[None] <= torch.arange(sq, device=dev)[:, None]
                    + n - sq)
            outs.append(F.scaled_dot_product_attention(
                q[z:z + 1].transpose(1, 2).float(), k[None].transpose(1, 2).float(),
                v[None].transpose(1, 2).float(), attn_mask=mask,
                enable_gqa=True).transpose(1, 2))
        return torch.cat(outs)

    for sq in (1, 4):
        q = torch.randn(b, sq, hq, d, device=dev, dtype=dt)
        lens = torch.randint(sq, cap + 1, (b,), device=dev, dtype=torch.int32)
        lens[0] = cap
        got = kvcache(q, kc, vc, lens, block_table=table)
        assert (got.float() - want(q, lens)).abs().max().item() < 2e-2
    # a captured decoding step: append one token, attend; replayed with new lengths
    q = torch.randn(b, 1, hq, d, device=dev, dtype=dt)
    kn, vn = torch.randn(b, 1, hk, d, device=dev, dtype=dt), torch.randn(b, 1, hk, d,
                                                                         device=dev, dtype=dt)
    lens = torch.full((b,), 100, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)
    kvcache(q, kc, vc, lens, k=kn, v=vn, block_table=table, out=out)   # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kvcache(q, kc, vc, lens, k=kn, v=vn, block_table=table, out=out)
    for step in range(2):
        lens.copy_(torch.randint(0, cap - 1, (b,), device=dev, dtype=torch.int32))
        q.normal_(), kn.normal_(), vn.normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert (out.float() - want(q, lens + 1)).abs().max().item() < 2e-2, step


def test_split_rule_fills_whole_waves():
    """choose_splits: waves x (longest run + 2) over 132 SMs x 4 resident splits = 528 slots,
    the fewest splits within 2% of the least, a multiple of the warps, each split at least 4
    key blocks long."""
    from tilepy.ops.attention_decode_mma_sync import choose_splits

    assert choose_splits(64, 8, 1, 128, 132, 4) == 1           # 512 of 528 slots, 1 x 130
    assert choose_splits(8, 8, 1, 1024, 132, 4) == 8           # 8 x 64 = 512, 1 x 130
    assert choose_splits(1, 8, 1, 1024, 132, 4) == 64          # 1 x 18 (63: runs of 17, 1 x 19)
    assert choose_splits(1, 8, 1, 4096, 132, 4) == 64          # 1 x 66 (66: 1 x 65, within 2%)
    assert choose_splits(1, 8, 1, 4096, 132, 4, step=4) == 64  # multiples of 4
    assert choose_splits(1, 8, 1, 40, 132, 4) == 10            # capped: 4 key blocks a split
    assert choose_splits(75, 8, 1, 1024, 132, 4) == 6          # 7 x 173 (7: 8 x 149, within 2%)


@sim
def test_split_runs_are_even_and_cover_the_keys():
    """Splits that do not divide the key blocks (7 runs of 10 blocks: lengths 1 and 2, none
    empty) and more splits than blocks (some runs empty): the merged answer is float64's."""
    rng = np.random.default_rng()
    b, cap, hq, hk, d = 2, 160, 4, 1, 32
    q = rand(rng, (b, 1, hq, d), "bfloat16")
    kc, vc = rand(rng, (b, cap, hk, d), "bfloat16"), rand(rng, (b, cap, hk, d), "bfloat16")
    lens = np.array([cap, 37], np.int32)
    cfg = DecodeConfig(d, 16, 3, "bfloat16")
    for splits in (7, 12):
        got = kvcache(q, kc, vc, lens, num_splits=splits, config=cfg)
        want, _ = kv_reference(q, kc, vc, lens)
        check(got, want, vc, "bfloat16")
