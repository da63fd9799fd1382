"""The Hopper (wgmma) FlashAttention kernel through ``tilepy.flash_attention(config=
WgmmaAttentionConfig(...))``: simulator runs against float64 (the wgmma twins read the
swizzled shared tiles the descriptors address), the sm_90a compile, and on the GPU full size
against SDPA."""

import re
import threading

import numpy as np
import pytest
from test_ops_attention import NP, check, check_lse, rand, reference

import tilepy
from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.ops.attention_wgmma import (
    FP8_REPORTS,
    FP8_SCHEDULE_REPORTS,
    HEAD_DIM_V_REPORTS,
    OVERLAP_REPORTS,
    OVERLAP_SCHEDULE_REPORTS,
    PERSISTENT_REPORTS,
    PERSISTENT_TMA_REPORTS,
    PLAIN_REPORTS,
    TMA_REPORTS,
    TMA_SCHEDULE_REPORTS,
    VARIANT_REPORTS,
    VARLEN_REPORTS,
    VARLEN_SCHEDULE_REPORTS,
    WgmmaAttentionConfig,
)

EXT = pytest.mark.extended   # deselected unless --extended (tests/conftest.py)


def run(rng, b, hq, hk, sq, sk, d, causal, layout, dtype, cfg, dv=None):
    """One call against float64 (poisoned out; ``dv``: V's head dim, default d); returns
    ``(q, k, v, out, lse)``."""
    shq = (b, hq, sq, d) if layout == "bhsd" else (b, sq, hq, d)
    shk = (b, hk, sk, d) if layout == "bhsd" else (b, sk, hk, d)
    dv = d if dv is None else dv
    q, k = rand(rng, shq, dtype), rand(rng, shk, dtype)
    v = rand(rng, shk[:-1] + (dv,), dtype)
    out = np.full(shq[:-1] + (dv,), np.nan, NP[dtype])
    o, lse = tilepy.flash_attention(q, k, v, causal=causal, return_lse=True, layout=layout,
                                    out=out, config=cfg)
    assert o is out
    ro, rl = reference(q, k, v, causal, None, layout)
    check(o, ro, v, dtype)
    check_lse(lse, rl)
    return q, k, v, out, lse


@pytest.mark.sim
@pytest.mark.parametrize("b,hq,hk,sq,sk,causal,layout,dtype,bm,bn", [
    (1, 2, 1, 65, 70, True, "bhsd", "float16", 64, 64),      # GQA, seq_q != seq_k, causal
    pytest.param(1, 1, 1, 40, 130, False, "bshd", "bfloat16", 64, 64, marks=EXT),  # three key blocks, bshd
    pytest.param(1, 1, 1, 70, 9, True, "bhsd", "float16", 64, 64, marks=EXT),  # rows that see no key
    pytest.param(1, 1, 1, 33, 150, False, "bhsd", "float16", 64, 128, marks=EXT),  # 128-key blocks
])
def test_against_float64(b, hq, hk, sq, sk, causal, layout, dtype, bm, bn):
    run(np.random.default_rng(), b, hq, hk, sq, sk, 64, causal, layout, dtype,
        WgmmaAttentionConfig(64, bm, bn, dtype))


@pytest.mark.sim
@pytest.mark.parametrize("b,hq,hk,sq,sk,causal,layout,dtype,d,bn", [
    (1, 1, 1, 1, 1, False, "bhsd", "float16", 64, 64),         # seq 1: one block, no loop
    pytest.param(1, 1, 1, 1, 7, True, "bshd", "bfloat16", 128, 64, marks=EXT),  # one query row, causal
    pytest.param(1, 2, 1, 7, 7, True, "bshd", "bfloat16", 64, 64, marks=EXT),  # GQA, seq 7
    (1, 1, 1, 65, 200, True, "bhsd", "float16", 64, 64),       # four key blocks, causal
    pytest.param(1, 2, 1, 65, 200, False, "bhsd", "float16", 128, 64, marks=EXT),  # GQA, d128, four key blocks
    pytest.param(1, 1, 1, 200, 65, True, "bhsd", "bfloat16", 128, 64, marks=EXT),  # seq_q > seq_k, no-key rows
    pytest.param(1, 1, 1, 70, 9, True, "bhsd", "float16", 64, 128, marks=EXT),  # rows that see no key
    (1, 1, 1, 33, 200, False, "bshd", "bfloat16", 64, 128),    # 128-key blocks, ragged end
])
def test_overlap_against_float64(b, hq, hk, sq, sk, causal, layout, dtype, d, bn):
    """The pipelined kernel (softmax of key block j+1 beside the P·V wgmmas of block j)."""
    run(np.random.default_rng(), b, hq, hk, sq, sk, d, causal, layout, dtype,
        WgmmaAttentionConfig(d, 64, bn, dtype, overlap=True))


def test_overlap_config():
    cfg = WgmmaAttentionConfig(128, 128, 64, overlap=True)
    assert "overlap=True" in repr(cfg) and "overlapped" in cfg.describe()
    assert cfg.smem_bytes == WgmmaAttentionConfig(128, 128, 64).smem_bytes + 16
    assert WgmmaAttentionConfig(64).overlap is False
    assert "overlapped" not in WgmmaAttentionConfig(64).describe()
    WgmmaAttentionConfig(128, 128, 128, overlap=True)   # fits since the copies were reshaped
    with pytest.raises(ValueError, match="overlap must be a bool"):
        WgmmaAttentionConfig(64, 128, 64, overlap=1)
    for d, bn in ((64, 64), (64, 128), (128, 64)):
        WgmmaAttentionConfig(d, 128, bn, "bfloat16", overlap=True)


@pytest.mark.sim
@pytest.mark.parametrize("b,hq,hk,sq,sk,causal,layout,dtype,bn,overlap", [
    pytest.param(1, 2, 1, 130, 70, False, "bhsd", "float16", 64, False, marks=EXT),  # 6 tiles over 4 blocks
    pytest.param(1, 3, 1, 100, 9, True, "bhsd", "bfloat16", 64, False, marks=EXT),  # tiles that see no key
    (1, 3, 1, 150, 60, True, "bhsd", "float16", 64, True),      # overlap, no-key tiles
    pytest.param(1, 2, 2, 130, 140, True, "bshd", "float16", 64, True, marks=EXT),  # overlap, bshd, 3 key blocks
    pytest.param(1, 3, 1, 70, 130, False, "bhsd", "bfloat16", 128, True, marks=EXT),  # GQA, 128-key blocks
])
def test_persistent_against_float64(b, hq, hk, sq, sk, causal, layout, dtype, bn, overlap):
    """The persistent kernel: the simulator's 4 SM slots walk several tiles each, loading the
    next tile's Q, K and V during the last key block (and skipping tiles that see no key)."""
    run(np.random.default_rng(), b, hq, hk, sq, sk, 64, causal, layout, dtype,
        WgmmaAttentionConfig(64, 64, bn, dtype, overlap=overlap, persistent=True))


@pytest.mark.sim
@pytest.mark.parametrize("b,hq,hk,sq,sk,causal,layout,dtype,d,bn", [
    (1, 1, 1, 1, 1, False, "bhsd", "float16", 64, 64),          # one key, one block
    (1, 2, 1, 65, 200, True, "bshd", "bfloat16", 64, 64),       # GQA, bshd (4-D maps), 4 blocks
    (1, 1, 1, 150, 60, True, "bhsd", "float16", 64, 64),        # a block that sees no key
    (1, 2, 1, 40, 130, False, "bhsd", "float16", 128, 64),      # d128: two boxes per tile
    (1, 1, 1, 33, 300, True, "bshd", "float16", 64, 128),       # 128-key blocks, ragged end
])
def test_tma_against_float64(b, hq, hk, sq, sk, causal, layout, dtype, d, bn):
    """The TMA-fed kernel: thread 0 loads Q, K and V through 4-D tensor maps into the swizzled
    slots, the warpgroups wait on mbarriers (no block barrier per key block)."""
    run(np.random.default_rng(), b, hq, hk, sq, sk, d, causal, layout, dtype,
        WgmmaAttentionConfig(d, 64, bn, dtype, overlap=True, tma=True))


@pytest.mark.sim
@pytest.mark.parametrize("b,hq,hk,sq,sk,causal,layout,dtype,d,bn,bm,pingpong,producer", [
    (1, 1, 1, 130, 200, True, "bshd", "bfloat16", 64, 64, 128, True, True),  # 4 key blocks
    (1, 1, 1, 150, 60, True, "bhsd", "float16", 64, 64, 128, True, False),   # no-key block
    pytest.param(1, 1, 1, 40, 60, False, "bhsd", "float16", 64, 64, 128, True, False, marks=EXT),  # one turn each
    (1, 1, 1, 33, 300, True, "bshd", "float16", 64, 128, 128, False, True),  # producer alone
    (1, 1, 1, 200, 200, True, "bhsd", "float16", 64, 128, 192, True, True),   # 3 consumers
    pytest.param(1, 1, 1, 70, 9, False, "bshd", "bfloat16", 64, 64, 192, False, True, marks=EXT),  # 3, no-key rows
    pytest.param(1, 1, 1, 40, 100, False, "bhsd", "float16", 64, 128, 192, True, True, marks=EXT),  # 3, one turn each
    # causal: a warpgroup stops at its own last key block and releases the rest (drain)
    (1, 1, 1, 192, 192, True, "bhsd", "float16", 64, 64, 192, False, True),  # 1, 2, 3 blocks
    (1, 1, 1, 128, 128, True, "bshd", "bfloat16", 64, 64, 128, False, False),  # thread 0 loads
    # head dims other than 64 / 128: 64-column sub-tiles, TMA's zero fill past head_dim
    (1, 2, 1, 70, 150, True, "bshd", "bfloat16", 40, 64, 64, False, False),  # odd n8 count
    (1, 2, 1, 70, 150, False, "bhsd", "float16", 96, 80, 64, False, False),  # 80-key blocks
    (1, 2, 1, 70, 150, True, "bshd", "bfloat16", 200, 80, 128, True, True),  # 256-col tiles
])
def test_tma_schedules_against_float64(b, hq, hk, sq, sk, causal, layout, dtype, d, bn, bm,
                                       pingpong, producer):
    """The TMA kernel's schedules: the consumer warpgroups (two, or three at block_m 192)
    taking turns to issue their wgmmas (pingpong), the loads from a producer warpgroup of
    their own (producer); and head dims that are not whole 64-column sub-tiles (Q·Kᵀ over
    ceil(d / 16) k16 steps, P·V m64n{d}, O stored from the fragments where d / 8 is odd)."""
    run(np.random.default_rng(), b, hq, hk, sq, sk, d, causal, layout, dtype,
        WgmmaAttentionConfig(d, bm, bn, dtype, overlap=True, tma=True, pingpong=pingpong,
                             producer=producer))


@pytest.mark.sim
@pytest.mark.parametrize("d,dv,sq,sk,causal,layout,dtype,persistent", [
    # V wider: 64- and 128-column tiles, odd NO; the persistent kernel (its own V loads)
    (40, 72, 70, 100, True, "bshd", "bfloat16", True),
    (136, 64, 20, 70, False, "bhsd", "float16", False),   # V narrower: 192 and 64 columns
])
def test_head_dim_v_against_float64(d, dv, sq, sk, causal, layout, dtype, persistent):
    """V's head dim other than Q's and K's (head_dim_v, e.g. DeepSeek's 192 / 128) through
    the op's default (the simulator picks a TMA config for it) or the persistent TMA kernel
    with a producer warpgroup: out ends in V's head dim, against float64; GQA 2/1 (its
    backward: tests/test_ops_attention_backward.py::test_head_dim_v)."""
    cfg = WgmmaAttentionConfig(d, 128, 128, dtype, overlap=True, tma=True, producer=True,
                               persistent=True, head_dim_v=dv) if persistent else None
    run(np.random.default_rng(), 1, 2, 1, sq, sk, d, causal, layout, dtype, cfg, dv)


@pytest.mark.sim
def test_head_dim_v_errors():
    q = np.zeros((1, 2, 8, 64), np.float16)
    v = np.zeros((1, 2, 8, 32), np.float16)
    with pytest.raises(ValueError, match=r"out must have shape \(1, 2, 8, 32\) \(that of q "
                                         r"with v's head_dim 32\)"):
        tilepy.flash_attention(q, q, v, out=np.zeros_like(q))
    with pytest.raises(ValueError, match="config is for v's head_dim 64"):
        tilepy.flash_attention(q, q, v, config=WgmmaAttentionConfig(64, 64, 64, overlap=True,
                                                                    tma=True))
    with pytest.raises(ValueError, match="v's head_dim 260 is not supported"):
        tilepy.flash_attention(q, q, np.zeros((1, 2, 8, 260), np.float16))
    with pytest.raises(ValueError, match="head_dim_v needs tma=True"):
        WgmmaAttentionConfig(64, head_dim_v=32)
    cfg = WgmmaAttentionConfig(192, 128, 112, overlap=True, tma=True, producer=True,
                               head_dim_v=128)
    assert (cfg.dv, cfg.tile_dim_v, cfg.fit_dim) == (128, 128, 192)
    assert cfg.smem_bytes == 128 * 192 * 2 + 2 * 112 * (192 + 128) * 2 + 16 + 9 * 8
    assert "d192/v128" in cfg.describe()


@pytest.mark.sim
@pytest.mark.parametrize("b,hq,hk,sq,sk,causal,layout,dtype,bn,bm,pingpong", [
    (1, 3, 1, 130, 130, True, "bhsd", "float16", 64, 128, True),     # 6 tiles on 4 blocks
    pytest.param(1, 2, 1, 100, 130, False, "bshd", "bfloat16", 128, 192, False, marks=EXT),  # 3 consumers, GQA
    (1, 2, 1, 300, 60, True, "bhsd", "float16", 64, 128, True),      # tiles that see no key
])
def test_tma_persistent_against_float64(b, hq, hk, sq, sk, causal, layout, dtype, bn, bm,
                                        pingpong):
    """The persistent TMA kernel: the simulator's 4 SM slots walk several tiles each; the
    producer warpgroup runs ahead through the same tiles (two Q buffers, the K/V ring counted
    on across tiles), the consumers hold a tile's last K/V slot until its O is stored."""
    run(np.random.default_rng(), b, hq, hk, sq, sk, 64, causal, layout, dtype,
        WgmmaAttentionConfig(64, bm, bn, dtype, overlap=True, tma=True, pingpong=pingpong,
                             producer=True, persistent=True))


@pytest.mark.sim
@pytest.mark.parametrize("hq,hk,sq,sk,causal,window,cap,layout,dtype,bm,bn,pp,prod,persist", [
    # Mistral's window on the grid kernel with its producer and turns: query block 1 starts
    # at key block 1, warpgroups stop at their own last block (rows 192… see none of theirs)
    (1, 1, 150, 150, True, (40, 0), 0.0, "bhsd", "float16", 128, 64, True, True, False),
    # two-sided window and a cap on the persistent kernel, GQA, seq_q < seq_k, bshd
    (2, 1, 140, 170, False, (30, 20), 2.0, "bshd", "bfloat16", 128, 64, True, True, True),
    # left-only window and a cap, thread 0 loading, one warpgroup: rows 128… start at block 1
    (1, 1, 130, 130, False, (20, -1), 3.0, "bhsd", "float16", 64, 64, False, False, False),
])
def test_tma_window_and_softcap_against_float64(hq, hk, sq, sk, causal, window, cap, layout,
                                                dtype, bm, bn, pp, prod, persist):
    """window= / softcap= on the TMA kernels (generator parameters: a tile's key blocks from
    the first any of its rows sees, the producer loading only those, the score hook before
    the mask) against float64, with the LSE of the capped scores, poisoned outputs."""
    from tilepy.tile.attention import key_window

    rng = np.random.default_rng()
    d = 64
    shq = (1, hq, sq, d) if layout == "bhsd" else (1, sq, hq, d)
    shk = (1, hk, sk, d) if layout == "bhsd" else (1, sk, hk, d)
    q = (rand(rng, shq, dtype).astype(np.float32) * 2).astype(NP[dtype])   # the cap bites
    k, v = rand(rng, shk, dtype), rand(rng, shk, dtype)
    out = np.full(shq, np.nan, NP[dtype])
    cfg = WgmmaAttentionConfig(d, bm, bn, dtype, overlap=True, tma=True, pingpong=pp,
                               producer=prod, persistent=persist)
    o, lse = tilepy.flash_attention(q, k, v, causal=causal, window=window, softcap=cap,
                                    return_lse=True, layout=layout, out=out, config=cfg)
    ro, rl = reference(q, k, v, causal, None, layout, key_window(causal, window), cap)
    check(o, ro, v, dtype)
    check_lse(lse, rl)


@pytest.mark.sim
def test_tma_user_functions_against_float64():
    """score_mod= / mask_mod= on the grid TMA kernel with turns (rows 128… of the second tile
    under prefix-LM, their key blocks all visited), against float64 with the same functions."""
    from test_ops_attention import alibi_like, prefix_lm

    rng = np.random.default_rng()
    q, k, v = (rand(rng, (1, 1, 140, 64), "bfloat16") for _ in range(3))
    out = np.full(q.shape, np.nan, NP["bfloat16"])
    cfg = WgmmaAttentionConfig(64, 128, 64, "bfloat16", overlap=True, tma=True, pingpong=True)
    o, lse = tilepy.flash_attention(q, k, v, score_mod=alibi_like, mask_mod=prefix_lm,
                                    return_lse=True, out=out, config=cfg)
    ro, rl = reference(q, k, v, False, None, "bhsd", (-1, -1), 0.0, alibi_like, prefix_lm)
    check(o, ro, v, "bfloat16")
    check_lse(lse, rl)


@pytest.mark.sim
def test_tma_alibi_and_mod_args_against_float64():
    """alibi_slopes= and a document mask from mod_args= on the grid TMA kernel (its tensor
    maps between the operands and the hook's arrays in the plan; one warpgroup, thread 0
    loading), called twice with new slopes and ids through the cached plan, against
    float64."""
    from test_ops_attention import documents, same_document

    rng = np.random.default_rng()
    q = rand(rng, (1, 2, 80, 64), "float16")
    k, v = (rand(rng, (1, 1, 80, 64), "float16") for _ in range(2))
    cfg = WgmmaAttentionConfig(64, 64, 64, "float16", overlap=True, tma=True)
    for _ in range(2):
        slopes = rng.uniform(0.05, 0.5, 2).astype(np.float32)
        ids = documents(rng, 1, 80, 3)
        out = np.full(q.shape, np.nan, NP["float16"])
        o, lse = tilepy.flash_attention(q, k, v, causal=True, alibi_slopes=slopes,
                                        mask_mod=same_document, mod_args=(ids, ids),
                                        return_lse=True, out=out, config=cfg)
        ro, rl = reference(q, k, v, True, None, "bhsd", (-1, 0), 0.0, None, same_document,
                           alibi=slopes, mod_args=(ids, ids))
        check(o, ro, v, "float16")
        check_lse(lse, rl)


def test_tma_variants_share_generators_and_others_refuse():
    """A causal kernel is the window (-1, 0) kernel; a variant on a wgmma config without TMA
    is a NotImplementedError naming the config."""
    from tilepy.ops.attention_wgmma import wgmma_attention_kernel
    from tilepy.tile.attention import softcap_score

    cfg = WgmmaAttentionConfig(64, 128, 64, overlap=True, tma=True)
    assert wgmma_attention_kernel(cfg, True) is wgmma_attention_kernel(cfg, False, False,
                                                                       (-1, 0))
    assert wgmma_attention_kernel(cfg, True, False, (4, None)) is \
        wgmma_attention_kernel(cfg, False, False, (4, 0))
    plain = WgmmaAttentionConfig(64, 128, 64, overlap=True)
    with pytest.raises(NotImplementedError, match="TMA kernels only"):
        wgmma_attention_kernel(plain, False, False, (4, 4))
    with pytest.raises(NotImplementedError, match="TMA kernels only"):
        wgmma_attention_kernel(plain, False, False, None, softcap_score(2.0))


@pytest.mark.sim
def test_tma_persistent_new_pointers_and_a_capture(monkeypatch):
    """The persistent TMA kernel through tilepy.flash_attention, three calls with new q, k, v
    and out (6 tiles on the simulator's 4 blocks): one plan; the maps of each call's pointers
    written by the map writer into 64-byte-aligned buffers from the caller's allocator (NumPy
    here); the stream's tile ticket counter zeroed once, set back to zero by the last block
    out of each call and reused; another stream (and the per-thread default stream in
    another host thread) gets a counter of its own. The third call runs "during a capture"
    (stream_capturing patched to say so): its maps and a tile counter of its own are made,
    zeroed and kept, not cached, and the stream's counter is not touched. Then with a capture
    id (``capture_id`` patched): two calls in one capture share one new counter, left at zero
    between them; another stream of that capture and another capture get their own."""
    from tilepy.ops import attention as at
    from tilepy.ops import attention_wgmma as aw
    from tilepy.tile import device_write

    at._PLANS.clear()
    cfg = WgmmaAttentionConfig(64, 128, 64, "float16", overlap=True, tma=True, producer=True,
                               persistent=True)
    rng = np.random.default_rng()
    keep = []

    def call():
        q = rand(rng, (1, 3, 129, 64), "float16")
        k, v = rand(rng, (1, 1, 64, 64), "float16"), rand(rng, (1, 1, 64, 64), "float16")
        out = np.full(q.shape, np.nan, np.float16)
        keep.append((q, k, v, out))   # alive: the next call's arrays are new allocations
        assert tilepy.flash_attention(q, k, v, out=out, config=cfg) is out
        check(out, reference(q, k, v, False, None, "bhsd")[0], v, "float16")

    call()
    (entry,) = at._PLANS.values()
    plan = entry[0].plan
    assert isinstance(plan, aw.ScheduledTmaPlan) and plan.grid[0] == 4
    counter = plan.counter_for(0)
    call()
    assert len(at._PLANS) == 1 and plan.maps_encoded == 2 and len(plan._maps) == 2
    for buf in plan._maps.values():
        assert buf.ptr % 64 == 0 and isinstance(buf.owner, np.ndarray)
    assert plan.counter_for(0) is counter and len(plan._counters) == 1
    np.testing.assert_array_equal(counter.copy_to_host(), [0, 0])
    known = set(plan._counters)
    other = 0x5EED   # a raw stream handle (the simulator's streams have none)
    assert plan.counter_for(other) is not counter
    assert plan.counter_for(other) is plan.counter_for(other)
    theirs = []      # the per-thread default stream (handle 2): another stream per host thread
    worker = threading.Thread(target=lambda: theirs.append(plan.counter_for(2)))
    worker.start()
    worker.join()
    assert theirs[0] is not plan.counter_for(2) and plan.counter_for(2) is plan.counter_for(2)
    for key in set(plan._counters) - known:   # the capture below counts the stream's only
        del plan._counters[key]
    counter._ary[:] = 7   # a capture must not use (or zero) the stream's counter
    monkeypatch.setattr(device_write, "stream_capturing", lambda stream: True)
    call()
    assert len(at._PLANS) == 1 and plan.maps_encoded == 3 and len(plan._maps) == 2
    kept = list(plan._kept.values())
    assert len(kept) == 2                    # the maps and a counter, both new
    maps, cbuf = kept
    assert maps.ptr % 64 == 0 and maps not in plan._maps.values()
    np.testing.assert_array_equal(cbuf.view((2,), np.int32).copy_to_host(), [0, 0])
    assert cbuf.ptr != counter._ary.ctypes.data and len(plan._counters) == 1
    np.testing.assert_array_equal(counter.copy_to_host(), [7, 7])
    # two launches in one capture (the driver's capture id) share one counter, zeroed
    # before the first; a second capture gets its own
    monkeypatch.setattr(device_write, "capture_id", lambda stream: 41)
    call()
    call()
    assert len(plan._kept) == 2 + 2 + 1      # two more maps, one more counter
    shared = plan._counters[("capture", 41, 0)]
    assert shared[0].ptr != cbuf.ptr
    np.testing.assert_array_equal(shared[1].copy_to_host(), [0, 0])
    assert plan._counter(other, True) is not shared       # another stream of the capture
    assert plan._counter(0, True) is shared
    monkeypatch.setattr(device_write, "capture_id", lambda stream: 42)
    call()
    assert len(plan._kept) == 2 + 3 + 3 and plan._counters[("capture", 42, 0)] is not shared
    np.testing.assert_array_equal(counter.copy_to_host(), [7, 7])


def test_tma_config():
    cfg = WgmmaAttentionConfig(128, 128, 128, overlap=True, tma=True)
    assert "TMA" in cfg.describe()
    assert cfg.smem_bytes == WgmmaAttentionConfig(128, 128, 128, overlap=True).smem_bytes + 72
    with pytest.raises(ValueError, match="tma needs overlap=True"):
        WgmmaAttentionConfig(128, 128, 128, tma=True)
    with pytest.raises(ValueError, match="persistent with tma needs producer=True"):
        WgmmaAttentionConfig(64, 128, 64, overlap=True, persistent=True, tma=True)
    walk = WgmmaAttentionConfig(128, 128, 128, overlap=True, persistent=True, tma=True,
                                pingpong=True, producer=True)
    # a second Q buffer, three more mbarriers (Q full of buffer 1, Q empty of both) and the
    # two buffers' tile numbers
    assert walk.smem_bytes == (WgmmaAttentionConfig(128, 128, 128, overlap=True, tma=True,
                                                    producer=True).smem_bytes + 128 * 128 * 2
                               + 3 * 8 + 2 * 4)
    assert walk.smem_bytes <= 227 * 1024 and "persistent" in walk.describe()
    with pytest.raises(ValueError, match="tma must be a bool"):
        WgmmaAttentionConfig(64, overlap=True, tma="yes")
    with pytest.raises(ValueError, match="pingpong and producer need tma=True"):
        WgmmaAttentionConfig(128, 128, 128, overlap=True, producer=True)
    with pytest.raises(ValueError, match="pingpong needs block_m of 128 or 192"):
        WgmmaAttentionConfig(64, 64, 64, overlap=True, tma=True, pingpong=True)
    with pytest.raises(ValueError, match="block_m=192 needs producer=True"):
        WgmmaAttentionConfig(64, 192, 128, overlap=True, tma=True, pingpong=True)
    with pytest.raises(ValueError, match="block_m=192 needs tile_dim 64"):
        WgmmaAttentionConfig(128, 192, 128, overlap=True, tma=True, producer=True)
    with pytest.raises(ValueError, match="block_m must be 64, 128 or 192"):
        WgmmaAttentionConfig(64, 256, 128, overlap=True, tma=True, producer=True)
    three = WgmmaAttentionConfig(64, 192, 128, overlap=True, tma=True, pingpong=True,
                                 producer=True)
    assert (three.threads, three.consumers, three.registers) == (512, 384, (32, 160))
    assert sum(n * r for n, r in zip((128, 384), three.registers)) <= 65536
    with pytest.raises(ValueError, match="producer must be a bool"):
        WgmmaAttentionConfig(64, overlap=True, tma=True, producer=1)
    both = WgmmaAttentionConfig(128, 128, 128, overlap=True, tma=True, pingpong=True,
                                producer=True)
    assert (both.threads, both.consumers, cfg.threads) == (384, 256, 256)
    assert both.registers == (56, 224) and cfg.registers is None
    assert "ping-pong" in both.describe() and "producer warpgroup" in both.describe()


def test_persistent_config():
    cfg = WgmmaAttentionConfig(128, persistent=True)
    assert cfg.smem_bytes == WgmmaAttentionConfig(128).smem_bytes + cfg.q_bytes
    assert "persistent" in cfg.describe() and "persistent" not in WgmmaAttentionConfig(
        128).describe()
    with pytest.raises(ValueError, match="persistent with overlap .* spills"):
        WgmmaAttentionConfig(128, 128, 64, overlap=True, persistent=True)
    with pytest.raises(ValueError, match="persistent must be a bool"):
        WgmmaAttentionConfig(64, persistent=1)
    WgmmaAttentionConfig(64, 128, 128, overlap=True, persistent=True)


def test_config_validation():
    with pytest.raises(ValueError, match="head_dim must be one of"):
        WgmmaAttentionConfig(96)
    with pytest.raises(ValueError, match="block_n must be 64 or 128"):
        WgmmaAttentionConfig(64, 128, 32)
    assert WgmmaAttentionConfig(128).threads == 256
    # the TMA kernels: any multiple of 8 up to 256, tiles of whole 64-column sub-tiles
    wide = WgmmaAttentionConfig(200, 128, 80, overlap=True, tma=True, producer=True)
    assert wide.tile_dim == 256 and wide.q_bytes == 128 * 256 * 2
    assert WgmmaAttentionConfig(40, 64, 64, overlap=True, tma=True).tile_dim == 64
    for bad, what in (((264,), "multiple of 8 from 8 to 256"), ((36,), "multiple of 8"),
                      ((128, 128, 72), "block_n must be one of"),
                      ((256, 128, 128), "overlap needs"),         # the stages do not fit
                      ((160, 192, 64), "block_m=192 needs tile_dim 64")):
        with pytest.raises(ValueError, match=what):
            WgmmaAttentionConfig(*bad, overlap=True, tma=True, producer=True)
    with pytest.raises(ValueError, match="block_m=192 needs tile_dim 64"):   # V's width too
        WgmmaAttentionConfig(64, 192, 64, overlap=True, tma=True, producer=True, head_dim_v=128)
    q = np.zeros((1, 1, 8, 64), np.float16)
    with pytest.raises(ValueError, match="config is for head_dim 128"):
        tilepy.flash_attention(q, q, q, config=WgmmaAttentionConfig(128))


@pytest.mark.compile
@pytest.mark.parametrize("group", [
    "tma",                                              # the built-in choices' family
    "tma_variants",                                     # with windows, FP8, packed, ...
    "cp_async",                                         # the TMA configs' fallback tiles
    # schedules reachable through config= only
    pytest.param("tma_schedules", marks=pytest.mark.extended),
    pytest.param("cp_async_schedules", marks=pytest.mark.extended)])
def test_compiles_for_sm90a_without_spills(group):
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reps = run_in_subprocess(f"tilepy.ops.attention_wgmma:compile_reports_{group}")
    assert len(reps) == {
        "tma": len(TMA_REPORTS) + len(PERSISTENT_TMA_REPORTS),
        "tma_variants": len(VARIANT_REPORTS) + len(HEAD_DIM_V_REPORTS) + len(FP8_REPORTS)
        + len(VARLEN_REPORTS),
        "tma_schedules": len(TMA_SCHEDULE_REPORTS) + len(FP8_SCHEDULE_REPORTS)
        + len(VARLEN_SCHEDULE_REPORTS),
        "cp_async": len(OVERLAP_REPORTS),
        "cp_async_schedules": len(PLAIN_REPORTS) + len(OVERLAP_SCHEDULE_REPORTS)
        + len(PERSISTENT_REPORTS)}[group]
    for name, rep in reps.items():
        assert "error" not in rep, rep.get("error")
        # at least one key block's wgmmas: head_dim / k for S, block_n / k for P·V (k 16, 32
        # for 8-bit inputs)
        d = int(re.search(r"_d(\d+)", name).group(1))
        m = re.search(r"_(?:128|192)x(\d+)", name)
        bn = int(m.group(1)) if m else 128
        kw = 32 if "_fp8_" in name else 16
        assert rep["counts"]["wgmma.mma_async"] >= d // kw + bn // kw, name
        assert rep["counts"]["ld.local"] == 0
        if "producer" in name:
            # 384 (512) threads: ptxas allocates 168 (128) registers at entry, setmaxnreg moves
            # them to the consumers (224, 160). A few values computed before the warpgroups
            # part ways may be spilled there and reloaded once per block (entry and epilogue,
            # not in the key loop): 20-32 B in session 8, 0-8 B (causal + LSE) since the
            # warpgroup index is warp-uniform (session 9)
            assert rep["registers"] == (128 if "_192x" in name else 168)
            assert rep["spill_stores"] <= 64 and rep["local_bytes"] == 0, rep
            assert rep["counts"]["setmaxnreg"] == 2
        elif "tma_persistent" in name:
            # the tile loop's state (tile, ring and Q-buffer counters, shapes) is spilled and
            # reloaded once per tile, not in the key loop (SASS of 2026-11-30, session 9:
            # 120-208 B of stores, none between the key loop's wgmmas)
            assert rep["registers"] == (128 if "_192x" in name else 168)
            assert rep["spill_stores"] <= 256 and rep["local_bytes"] == 0, rep
            assert rep["counts"]["setmaxnreg"] == 2
        else:
            assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0
            assert rep["local_bytes"] == 0
        assert rep["registers"] <= 255
        if "pingpong" in name:   # the turn passed on, and warpgroup 1's first pass
            assert rep["counts"]["bar.arrive"] >= 2 and rep["counts"]["bar.sync"] >= 2
        if "tma" in name:      # the loads are TMA's: no cp.async left
            assert rep["counts"]["cp.async.bulk.tensor"] >= max(d // (2 * kw), 1) * 3
            assert rep["counts"]["cp.async"] == 0
        if "overlap" in name or "persistent" in name or "tma" in name:
            # no serialised wgmmas, no waits injected by ptxas
            assert rep["ptxas_wgmma_notes"] == [], rep["ptxas_wgmma_notes"]
            # the softmax (block_n / 2 + 2 ex2 per thread, the row-max shuffles) sits between
            # wait_group(1) and wait_group(0) in the machine code: it overlaps the P·V wgmmas
            # (a soft cap's tanh is ex2 and rcp instructions of its own)
            if "ex2_in_flight" in rep and ("overlap" in name or "tma" in name) \
                    and "softcap" not in name:
                bn = int(name.split("x")[1].split("_")[0])
                # (FP8 with exponentials on the FMA pipe, fma_exp_every=2: half of them ex2)
                ex2 = bn // 4 if name.endswith("_fma_exp_2") else bn // 2
                assert rep["ex2_in_flight"] == [ex2 + 2], (name, rep["ex2_in_flight"])
                assert rep["shfl_in_flight"][0] >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(64, False), (128, False), (128, True)])
def test_gpu_against_sdpa(d, causal):
    gpu_against_sdpa(d, causal, WgmmaAttentionConfig(d))


@pytest.mark.gpu
@pytest.mark.parametrize("d,bn,causal", [(64, 64, False), (64, 128, True), (128, 64, False),
                                         (128, 64, True), (128, 128, False), (128, 128, True)])
def test_gpu_overlap_against_sdpa(d, bn, causal):
    gpu_against_sdpa(d, causal, WgmmaAttentionConfig(d, 128, bn, overlap=True))


@pytest.mark.gpu
@pytest.mark.parametrize("d,bn,overlap,causal", [(128, 128, False, False),
                                                 (128, 128, True, True), (128, 128, True, False),
                                                 (64, 64, False, True), (64, 128, True, False)])
def test_gpu_persistent_against_sdpa(d, bn, overlap, causal):
    # 4 x 32 heads x 8 query blocks: several tiles for each of the ~132 blocks
    gpu_against_sdpa(d, causal, WgmmaAttentionConfig(d, 128, bn, overlap=overlap,
                                                     persistent=True), b=4, hk=16)


@pytest.mark.gpu
@pytest.mark.parametrize("d,bn,causal", [(128, 128, False), (128, 128, True), (64, 64, False),
                                         (64, 64, True)])
def test_gpu_tma_against_sdpa(d, bn, causal):
    gpu_against_sdpa(d, causal, WgmmaAttentionConfig(d, 128, bn, overlap=True, tma=True))


@pytest.mark.gpu
@pytest.mark.parametrize("d,bm,bn,causal,pingpong,producer", [
    (128, 128, 128, True, True, False), (128, 128, 128, False, False, True),
    (128, 128, 128, True, True, True), (64, 128, 64, False, True, True),
    (64, 128, 128, True, True, True), (64, 192, 128, False, True, True),
    (64, 192, 128, True, False, True), (64, 192, 64, True, True, True)])
def test_gpu_tma_schedules_against_sdpa(d, bm, bn, causal, pingpong, producer):
    gpu_against_sdpa(d, causal, WgmmaAttentionConfig(d, bm, bn, overlap=True, tma=True,
                                                     pingpong=pingpong, producer=producer))


@pytest.mark.gpu
@pytest.mark.parametrize("d,bm,causal,pingpong", [
    (128, 128, False, True), (128, 128, True, True), (64, 192, False, False),
    (64, 192, True, False)])
def test_gpu_tma_persistent_against_sdpa(d, bm, causal, pingpong):
    gpu_against_sdpa(d, causal, WgmmaAttentionConfig(d, bm, 128, overlap=True, tma=True,
                                                     pingpong=pingpong, producer=True,
                                                     persistent=True))


@pytest.mark.gpu
def test_gpu_tma_persistent_concurrent_streams():
    """The persistent TMA kernel on two streams at once, several launches each through the
    cached plan: each stream's tile counter is its own, so no launch loses tiles to the other
    (a lost tile leaves its NaN-poisoned rows in the output)."""
    torch = pytest.importorskip("torch")
    from tilepy.launch import compute_capability

    if compute_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    cfg = WgmmaAttentionConfig(64, 192, 128, overlap=True, tma=True, producer=True,
                               persistent=True)
    streams = [torch.cuda.Stream() for _ in range(2)]
    q, k, v = (torch.randn(4, 16, 2048, 64, device="cuda", dtype=torch.float16)
               for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    outs = [[torch.full_like(q, float("nan")) for _ in range(4)] for _ in streams]
    for i in range(4):
        for s, out in zip(streams, outs):
            with torch.cuda.stream(s):
                tilepy.flash_attention(q, k, v, causal=True, config=cfg, out=out[i])
    torch.cuda.synchronize()
    for out in outs:
        for got in out:
            assert (got.float() - want.float()).abs().max().item() < 1e-2   # NaN fails


def gpu_against_sdpa(d, causal, cfg, b=2, hk=4, sq=1000, sk=1100):
    torch = pytest.importorskip("torch")
    from tilepy.launch import compute_capability

    if compute_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    q = torch.randn(b, 2 * hk, sq, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.float16)
    got = tilepy.flash_attention(q, k, v, causal=causal, config=cfg)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    if causal:   # bottom-right alignment, as tilepy documents
        i = torch.arange(sq, device="cuda")[:, None]
        j = torch.arange(sk, device="cuda")[None, :]
        mask = j <= i + sk - sq
        want = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    else:
        want = torch.nn.functional.scaled_dot_product_attention(q, kk, vv)
    assert (got.float() - want.float()).abs().max().item() < 1e-2


def test_short_causal_sequences_choose_64_row_tiles():
    """The built-in Hopper choice: a plain causal call at the 64-column class with seq_q up to
    SHORT_CAUSAL_SEQ takes 64 x 64 tiles of one warpgroup; longer, non-causal, a variant, or a
    wider class keep the table's config."""
    from tilepy.ops.attention import SHORT_CAUSAL_SEQ, hopper_config

    for d in (40, 64):
        short = hopper_config(d, "float16", True, seq_q=SHORT_CAUSAL_SEQ)
        assert (short.block_m, short.block_n, short.producer, short.tma) == (64, 64, False, True)
        assert short.head_dim == d
    table = hopper_config(64, "float16", True)
    assert table.block_m == 192
    for kw in (dict(seq_q=SHORT_CAUSAL_SEQ + 1), dict(seq_q=100, variant=True)):
        assert hopper_config(64, "float16", True, **kw) == table
    assert hopper_config(64, "float16", False, seq_q=100) == hopper_config(64, "float16")
    assert hopper_config(128, "float16", True, seq_q=100) == hopper_config(128, "float16", True)


@pytest.mark.gpu
@pytest.mark.parametrize("d,sq,sk", [(64, 512, 512), (40, 300, 420), (64, 1, 77)])
def test_gpu_short_causal_default_against_sdpa(d, sq, sk):
    """The short-sequence causal tiles through the built-in choice (seq_q <= 512), GQA, ragged
    lengths and seq_q != seq_k, against SDPA with the bottom-right mask."""
    from tilepy.ops.attention import choose_config

    gpu_against_sdpa(d, True, None, sq=sq, sk=sk)
    assert choose_config(d, "float16", True, seq_q=sq).block_m == 64


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(40, True), (80, False), (96, False), (96, True),
                                      (160, True), (192, False), (192, True), (200, False),
                                      (256, False), (256, True)])
def test_gpu_head_dims_on_the_defaults_against_sdpa(d, causal):
    """Every head dim class through the built-in Hopper choice (a TMA kernel of the head dim
    rounded up to 64 columns, zero-filled by TMA), GQA, seq_q != seq_k, against SDPA."""
    from tilepy.launch import compute_capability
    from tilepy.ops.attention import choose_config

    if compute_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    cfg = choose_config(d, "float16", causal)
    assert isinstance(cfg, WgmmaAttentionConfig) and cfg.tma and cfg.head_dim == d
    gpu_against_sdpa(d, causal, None)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv,causal", [(192, 128, True), (192, 128, False), (64, 256, False),
                                         (128, 64, True)])   # the persistent kernel
def test_gpu_head_dim_v_against_sdpa(d, dv, causal):
    """V's head dim other than Q's (DeepSeek's 192 / 128) through the built-in Hopper choice,
    GQA, seq_q != seq_k, bf16, against SDPA (which takes a different V head dim)."""
    torch = pytest.importorskip("torch")
    from tilepy.launch import compute_capability

    if compute_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    dt = torch.bfloat16
    q = torch.randn(2, 8, 1000, d, device="cuda", dtype=dt)
    k = torch.randn(2, 4, 1100, d, device="cuda", dtype=dt)
    v = torch.randn(2, 4, 1100, dv, device="cuda", dtype=dt)
    got = tilepy.flash_attention(q, k, v, causal=causal)
    assert got.shape == (2, 8, 1000, dv)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mask = None
    if causal:   # bottom-right alignment, as tilepy documents
        i = torch.arange(1000, device="cuda")[:, None]
        mask = torch.arange(1100, device="cuda")[None, :] <= i + 100
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), kk.float(), vv.float(),
                                                            attn_mask=mask)
    assert (got.float() - want).abs().max().item() < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(128, False), (64, True)])
def test_gpu_user_functions_on_the_defaults_against_sdpa(d, causal):
    """score_mod= (ALiBi's shape) and mask_mod= (prefix-LM) through the built-in Hopper configs
    (the grid kernel at d128, the persistent one at d64) at full size, GQA, seq_q != seq_k,
    against SDPA with the same bias and mask as a float32 attn_mask."""
    torch = pytest.importorskip("torch")
    from test_ops_attention import alibi_like, prefix_lm

    from tilepy.launch import compute_capability

    if compute_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    b, hq, hk, sq, sk = 2, 8, 4, 1000, 1100
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
    got = tilepy.flash_attention(q, k, v, causal=causal, score_mod=alibi_like,
                                 mask_mod=prefix_lm)
    i = torch.arange(sq, device="cuda")[:, None]
    j = torch.arange(sk, device="cuda")[None, :]
    heads = torch.arange(hq, device="cuda", dtype=torch.float32)[:, None, None]
    bias = -(heads + 1) * 0.25 * (i - j).abs().float()   # on the scaled scores
    visible = (j <= i) | (j < 7)
    if causal:
        visible &= j <= i + sk - sq
    bias = bias.masked_fill(~visible, float("-inf"))
    kk, vv = (x.repeat_interleave(hq // hk, 1).float() for x in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), kk, vv, attn_mask=bias)
    assert not got.isnan().any()
    assert (got.float() - want).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(128, False), (64, True)])
def test_gpu_alibi_and_mod_args_on_the_defaults_against_sdpa(d, causal):
    """alibi_slopes= (per head) and a document mask reading its ids through mod_args= on the
    built-in Hopper configs at full size, GQA, seq_q != seq_k, against SDPA with the same bias
    and mask; a second call with new slopes and ids through the cached plan."""
    torch = pytest.importorskip("torch")

    from tilepy.launch import compute_capability

    if compute_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")

    def same_doc(b, h, q_idx, kv_idx, doc_q, doc_k):
        return doc_q[b, min(q_idx, 999)] == doc_k[b, min(kv_idx, 1099)]

    b, hq, hk, sq, sk = 2, 8, 4, 1000, 1100
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
    i = torch.arange(sq, device="cuda")[:, None]
    j = torch.arange(sk, device="cuda")[None, :]
    kk, vv = (x.repeat_interleave(hq // hk, 1).float() for x in (k, v))
    for n_docs in (3, 7):
        slopes = torch.rand(hq, device="cuda") * 0.2
        doc_k = torch.sort(torch.randint(0, n_docs, (b, sk), device="cuda"), 1).values.to(
            torch.int32)
        doc_q = doc_k[:, sk - sq:].contiguous()   # the queries are the last sq keys
        got = tilepy.flash_attention(q, k, v, causal=causal, alibi_slopes=slopes,
                                     mask_mod=same_doc, mod_args=(doc_q, doc_k))
        bias = -slopes[:, None, None] * (i + sk - sq - j).abs().float()
        visible = doc_q[:, None, :, None] == doc_k[:, None, None, :]
        if causal:
            visible = visible & (j <= i + sk - sq)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.float(), kk, vv, attn_mask=bias.masked_fill(~visible, float("-inf")))
        assert not got.isnan().any()
        assert (got.float() - want).abs().max().item() < 2e-2


@pytest.mark.sim
def test_tma_default_falls_back_when_maps_cannot_be_encoded(monkeypatch):
    """A built-in TMA config whose tensor maps the encoder refuses runs without TMA (same
    result); a TMA config the caller gave raises instead."""
    from tilepy.ops import attention as A
    from tilepy.tile import tma as host_tma

    def refuse(*args, **kwargs):
        raise ValueError("strides: refused for the test")

    # the d64 built-in's schedule (three consumer warpgroups and a producer): the fallback
    # runs the cp.async kernel with two
    cfg = WgmmaAttentionConfig(64, 192, 64, "float16", overlap=True, tma=True, producer=True)
    monkeypatch.setattr(host_tma, "encode_tiled", refuse)
    monkeypatch.setattr(A, "choose_config", lambda d, dtype, causal=False, variant=False,
                        head_dim_v=None, seq_q=None: cfg)
    rng = np.random.default_rng()
    q, k, v = (rand(rng, (1, 1, 40, 64), "float16") for _ in range(3))
    out = tilepy.flash_attention(q, k, v, causal=True)
    check(out, reference(q, k, v, True, None, "bhsd")[0], v, "float16")
    with pytest.raises(ValueError, match="refused for the test"):
        tilepy.flash_attention(q, k, v, causal=True, config=cfg)
