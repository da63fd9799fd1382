"""Attention's key ranges, masks and score hooks (tilepy.tile.attention) against NumPy.

The reference is FlashAttention's definition, written out independently here: query row ``i``
sees key ``j`` when ``i + sk - sq - left <= j <= i + sk - sq + right`` (a side with -1 is
unbounded; ``causal`` is ``right = 0``) and ``0 <= j < sk``. One-warp simulator kernels compute
each row's limits and each query block's key-block range, mask score fragments and apply a
score hook; an offline sm_90a compile of a warpgroup kernel made of the pieces checks that they
stay in registers.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from numba import cuda

from tilepy.inline import inline_device
from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.ptx.wgmma_layout import accumulator_position
from tilepy.tile.attention import (
    block_bounds,
    key_blocks,
    key_window,
    limits_shape,
    mask_key_block,
    mask_scores,
    modify_scores,
    row_limits,
)
from tilepy.tile.online_softmax import (
    accumulator_fragment,
    online_softmax_finalize,
    online_softmax_update,
)

SHAPES = [(37, 37), (45, 29), (23, 51)]          # odd; sq > sk; sq < sk
CASES = [(False, None), (True, None), (False, (-1, 0)), (False, (3, 0)), (True, (3, 0)),
         (False, (2, 5)), (False, (4, -1)), (True, (0, -1))]
NEG_INF = np.float32(-np.inf)


def visible(sq, sk, causal, window):
    """bool (sq, sk): which keys each query row sees, from the definition."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + sk - sq
    ok = np.ones((sq, sk), bool)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


# ---- the window's normal form (no kernel) ----------------------------------------------------

def test_windows_normalise_and_share_their_generators():
    assert key_window() == (-1, -1) and key_window(True) == (-1, 0)
    assert key_window(False, (3, 0)) == key_window(True, (3, -1)) == (3, 0)
    assert row_limits(1, False, (-1, 0)) is row_limits(1, True)
    assert row_limits(1, False, (-1, -1)) is row_limits(1, False)
    assert key_blocks(64, 64, True, (-1, 0)) is key_blocks(64, 64, True)
    assert mask_scores(1, 8, (-1, 5)) is mask_scores(1, 8)
    assert limits_shape(2, True) == (2, 2) and limits_shape(2, False, (3, 0)) == (2, 2, 2)
    assert modify_scores(1, 8) is modify_scores(1, 8, None)


@pytest.mark.parametrize("causal,window,match", [
    (False, (3,), "left, right"), (False, (-2, 0), "left must be an int >= 0, or -1 / None"),
    (False, (1, 2.0), "right must be an int"), (True, (3, 2), "causal=True means window right")])
def test_bad_windows_are_refused(causal, window, match):
    with pytest.raises(ValueError, match=match):
        row_limits(1, causal, window)


# ---- row limits and key-block ranges ---------------------------------------------------------

@functools.cache
def limits_kernel(mi, block_m, block_n, causal, window):
    """kernel(sq, sk, rows, tiles, needs): rows[r] = (first, last) visible key of row r (from
    row_limits; first 0 without a lower bound); tiles[qb] = block_bounds(qb); needs[qb, kb]:
    whether mask_key_block masks key block kb (given limits that mask every key)."""
    init = row_limits(mi, causal, window)
    bounds = block_bounds(block_m, block_n, causal, window)
    ns = block_n // 8
    mask_block = mask_key_block(mi, ns, block_n, window)
    shape = limits_shape(mi, causal, window)
    lower = len(shape) == 3
    rows_per_warp = 16 * mi

    @cuda.jit
    def kernel(sq, sk, rows, tiles, needs_out):
        lane = cuda.threadIdx.x
        g = lane // 4
        t = lane % 4
        limit = cuda.local.array(shape, np.int64)
        row_max = cuda.local.array((mi, 2), np.float32)
        row_sum = cuda.local.array((mi, 2), np.float32)
        for w in range((sq + rows_per_warp - 1) // rows_per_warp):
            rows0 = w * rows_per_warp
            init(limit, row_max, row_sum, rows0, g, sq, sk)
            if t == 0:
                for i in range(mi):
                    for hh in range(2):
                        r = rows0 + 16 * i + g + 8 * hh
                        if r < sq:
                            if lower:
                                rows[r, 0] = limit[i, hh, 0]
                                rows[r, 1] = limit[i, hh, 1]
                            else:
                                rows[r, 0] = 0
                                rows[r, 1] = limit[i, hh]
                            rows[r, 2] = row_max[i, hh] == NEG_INF and row_sum[i, hh] == 0
        # limits under which every key is masked: a masked block comes out all -inf
        for i in range(mi):
            for hh in range(2):
                if lower:
                    limit[i, hh, 0] = sk
                    limit[i, hh, 1] = -1
                else:
                    limit[i, hh] = -1
        frag = cuda.local.array((mi, ns, 4), np.float32)
        for qb in range(tiles.shape[0]):
            row0, kb_first, kb_end, all_first, all_see = bounds(qb, sq, sk)
            if lane == 0:
                tiles[qb, 0] = row0
                tiles[qb, 1] = kb_first
                tiles[qb, 2] = kb_end
            for kb in range(needs_out.shape[1]):
                for i in range(mi):
                    for j in range(ns):
                        for e in range(4):
                            frag[i, j, e] = 1.0
                mask_block(frag, limit, kb, t, all_first, all_see)
                if lane == 0:
                    needs_out[qb, kb] = frag[0, 0, 0] == NEG_INF

    return kernel


@pytest.mark.sim
@pytest.mark.parametrize("causal,window", CASES, ids=lambda v: str(v))
def test_row_limits_and_key_block_ranges(causal, window):
    bm, bn = 16, 8
    kern = limits_kernel(1, bm, bn, causal, window)
    for sq, sk in SHAPES:
        vis = visible(sq, sk, causal, window)
        n_qb, n_kb = -(-sq // bm), -(-sk // bn)
        rows = np.full((sq, 3), -99, np.int64)
        tiles = np.full((n_qb, 3), -99, np.int64)
        needs = np.full((n_qb, n_kb), 7, np.int64)
        kern[1, 32](sq, sk, rows, tiles, needs)
        assert (rows[:, 2] == 1).all(), "softmax state not reset"
        j = np.arange(sk)[None, :]
        got = (j >= rows[:, :1]) & (j <= rows[:, 1:2])
        assert np.array_equal(got, vis), (sq, sk)
        seen = vis.any(axis=1)
        keys = np.where(vis, j, sk)
        assert np.array_equal(rows[seen, 0], keys[seen].min(axis=1)), (sq, sk)
        assert np.array_equal(rows[seen, 1], np.where(vis, j, -1)[seen].max(axis=1))
        assert (rows[~seen, 1] < rows[~seen, 0]).all()
        for qb in range(n_qb):
            tile = vis[qb * bm:(qb + 1) * bm]
            row0, kb_first, kb_end = tiles[qb]
            assert row0 == qb * bm
            cols = np.flatnonzero(tile.any(axis=0))
            if cols.size:
                assert (kb_first, kb_end) == (cols[0] // bn, cols[-1] // bn + 1), (sq, sk, qb)
            else:
                assert kb_end <= kb_first, (sq, sk, qb)
            for kb in range(n_kb):
                block = np.zeros((tile.shape[0], bn), bool)
                part = tile[:, kb * bn:(kb + 1) * bn]
                block[:, :part.shape[1]] = part
                # the mask may be skipped exactly where every row sees every key of the block
                assert needs[qb, kb] == (not block.all()), (sq, sk, qb, kb)


@pytest.mark.sim
@pytest.mark.parametrize("causal,window,reversed_", [
    (False, None, False), (True, None, True), (False, (2, 5), True), (False, (4, -1), False)])
def test_key_blocks_run_the_heavy_query_blocks_first(causal, window, reversed_):
    """key_blocks is block_bounds of the block's query block: in reverse grid order where an
    upper bound makes later query blocks see more keys, else in grid order."""
    bounds = key_blocks(16, 8, causal, window)
    at = block_bounds(16, 8, causal, window)

    @cuda.jit
    def kernel(sq, sk, out, ref):
        x = cuda.blockIdx.x
        out[x, 0], out[x, 1], out[x, 2], out[x, 3], out[x, 4] = bounds(sq, sk)
        qb = cuda.gridDim.x - 1 - x if reversed_ else x
        ref[x, 0], ref[x, 1], ref[x, 2], ref[x, 3], ref[x, 4] = at(qb, sq, sk)

    sq, sk = 45, 29
    n_qb = -(-sq // 16)
    out, ref = np.zeros((n_qb, 5), np.int64), np.ones((n_qb, 5), np.int64)
    kernel[n_qb, 1](sq, sk, out, ref)
    assert np.array_equal(out, ref)
    assert out[0, 0] == (n_qb - 1) * 16 if reversed_ else out[0, 0] == 0


# ---- masks and score hooks -------------------------------------------------------------------

def softcap(score, q_row, k_col, batch, head, args):
    """Gemma-style soft capping of the scaled score (a plain function: wrapped by
    modify_scores)."""
    return np.float32(5.0) * math.tanh(score / np.float32(5.0))


@inline_device
def positional(score, q_row, k_col, batch, head, args):
    return score + np.float32(0.25) * (q_row - k_col) + np.float32(3 * batch - head)


def hook_reference(name, x, i, j, b, h):
    if name == "softcap":
        return 5.0 * np.tanh(x / 5.0)
    if name == "positional":
        return x + 0.25 * (i - j) + 3 * b - h
    return x


HOOKS = {"none": None, "softcap": softcap, "positional": positional}


@functools.cache
def mask_kernel(causal, window, hook):
    """kernel(s, out, sq, sk, b, h, scale): out = the masked (and modified) scores of ``s``
    (sq × n_kb·16), one warp, 16-key blocks."""
    ns, bn = 2, 16
    init = row_limits(1, causal, window)
    modify = modify_scores(1, ns, HOOKS[hook])
    mask = mask_scores(1, ns, window)
    shape = limits_shape(1, causal, window)

    @cuda.jit
    def kernel(s, out, sq, sk, b, h, scale):
        lane = cuda.threadIdx.x
        g = lane // 4
        t = lane % 4
        limit = cuda.local.array(shape, np.int64)
        row_max = cuda.local.array((1, 2), np.float32)
        row_sum = cuda.local.array((1, 2), np.float32)
        frag = cuda.local.array((1, ns, 4), np.float32)
        for w in range(s.shape[0] // 16):
            rows0 = w * 16
            init(limit, row_max, row_sum, rows0, g, sq, sk)
            for kb in range(s.shape[1] // bn):
                key0 = kb * bn + 2 * t
                for j in range(ns):
                    for e in range(4):
                        frag[0, j, e] = s[rows0 + g + 8 * (e // 2), key0 + 8 * j + e % 2]
                modify(frag, rows0 + g, key0, b, h, scale, ())
                mask(frag, limit, key0)
                for j in range(ns):
                    for e in range(4):
                        out[rows0 + g + 8 * (e // 2), key0 + 8 * j + e % 2] = frag[0, j, e]

    return kernel


@pytest.mark.sim
@pytest.mark.parametrize("causal,window,hook", [
    (False, (2, 5), "softcap"), (True, (3, 0), "positional"), (True, None, "none"),
    (False, None, "softcap"), (False, (4, -1), "none")], ids=lambda v: str(v))
def test_masks_and_score_hooks(causal, window, hook):
    rng = np.random.default_rng(7)
    scale = np.float32(0.7)
    b, h = 2, 5
    for sq, sk in SHAPES[:2]:
        rows, cols = -(-sq // 16) * 16, -(-sk // 16) * 16
        s = (rng.standard_normal((rows, cols)) * 6).astype(np.float32)
        out = np.full_like(s, np.nan)
        mask_kernel(causal, window, hook)[1, 32](s, out, sq, sk, b, h, scale)
        vis = np.zeros((rows, cols), bool)
        vis[:sq, :sk] = visible(sq, sk, causal, window)
        i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        want = hook_reference(hook, s.astype(np.float64) * float(scale), i, j, b, h) / float(scale)
        assert np.array_equal(np.isneginf(out[:sq]), ~vis[:sq]), (sq, sk)
        np.testing.assert_allclose(out[vis], want[vis], rtol=2e-6, atol=2e-6)


def test_score_mod_none_and_the_default_wrapping():
    """A plain Python score function is wrapped once (the same device function each time)."""
    assert modify_scores(1, 2, softcap) is modify_scores(1, 2, softcap)
    assert modify_scores(1, 2, positional) is not modify_scores(1, 2, softcap)


# ---- wgmma accumulators as fragments ---------------------------------------------------------

@pytest.mark.sim
def test_accumulator_fragment_is_the_wgmma_register_map():
    """One warp's m64n32 accumulators, viewed as the (1, 4, 4) m16n8 fragment, hold the
    elements tilepy.ptx.wgmma_layout.accumulator_position says; and back again."""
    n = 32
    to_fragment, to_accumulators = accumulator_fragment(n)

    @cuda.jit
    def kernel(tile, back):
        tid = cuda.threadIdx.x
        g = tid // 4
        t = tid % 4
        acc = cuda.local.array(n // 2, np.float32)
        frag = cuda.local.array((1, n // 8, 4), np.float32)
        for i in range(n // 2):
            acc[i] = tid * 1000 + i
        to_fragment(frag, acc)
        for j in range(n // 8):
            for e in range(4):
                tile[g + 8 * (e // 2), 8 * j + 2 * t + e % 2] = frag[0, j, e]
        for i in range(n // 2):
            acc[i] = -1
        to_accumulators(acc, frag)
        for i in range(n // 2):
            back[tid, i] = acc[i]

    tile = np.full((16, n), -1, np.float32)
    back = np.zeros((32, n // 2), np.float32)
    kernel[1, 32](tile, back)
    for thread in range(32):
        for i in range(n // 2):
            r, c = accumulator_position(thread, i)
            assert tile[r, c] == thread * 1000 + i
            assert back[thread, i] == thread * 1000 + i
    with pytest.raises(ValueError, match="multiple of 8"):
        accumulator_fragment(36)


# ---- offline compile: a warpgroup kernel of the pieces, sm_90a -------------------------------

#: (name, causal, window, score hook) of the kernels compile_report builds.
COMPILED = (("window_3_0_softcap", True, (3, 0), softcap),
            ("window_2_5", False, (2, 5), None),
            ("causal", True, None, None))


def windowed_softmax_kernel(causal, window, score_mod, block_m=64, block_n=64):
    """kernel(s, out, sq, sk, scale, scale_log2), one warpgroup: the key blocks of query block
    ``blockIdx.x`` (key_blocks), each block's scores from ``s[kb, tid, :]`` (flat wgmma
    accumulators) as a fragment, the score hook, the mask where the block needs it, the
    online softmax, ``p`` summed into a stand-in output; finalised into ``out[tid, :]``."""
    from numba import types

    ns = block_n // 8
    nacc = block_n // 2
    bounds = key_blocks(block_m, block_n, causal, window)
    init = row_limits(1, causal, window)
    shape = limits_shape(1, causal, window)
    modify = modify_scores(1, ns, score_mod)
    mask = mask_key_block(1, ns, block_n, window)
    update = online_softmax_update(1, ns)
    finalize = online_softmax_finalize(1, ns)
    to_fragment, to_accumulators = accumulator_fragment(block_n)
    f32, i64 = types.float32, types.int64
    zero = np.float32(0)

    def kernel(s, out, sq, sk, scale, scale_log2):
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        row0, kb_first, kb_end, all_first, all_see = bounds(sq, sk)
        rows0 = row0 + (tid // 32) * 16
        acc = cuda.local.array(nacc, f32)
        frag = cuda.local.array((1, ns, 4), f32)
        o = cuda.local.array((1, ns, 4), f32)
        limit = cuda.local.array(shape, i64)
        row_max = cuda.local.array((1, 2), f32)
        row_sum = cuda.local.array((1, 2), f32)
        alpha = cuda.local.array((1, 2), f32)
        init(limit, row_max, row_sum, rows0, g, sq, sk)
        for j in range(ns):
            for e in range(4):
                o[0, j, e] = zero
        for kb in range(kb_first, kb_end):
            for i in range(nacc):
                acc[i] = s[kb, tid, i]
            to_fragment(frag, acc)
            modify(frag, rows0 + g, kb * block_n + 2 * t, 0, cuda.blockIdx.x, scale, ())
            mask(frag, limit, kb, t, all_first, all_see)
            update(frag, row_max, row_sum, alpha, scale_log2)
            for j in range(ns):
                for e in range(4):
                    o[0, j, e] = o[0, j, e] * alpha[0, e // 2] + frag[0, j, e]
        finalize(o, row_sum)
        to_accumulators(acc, o)
        for i in range(nacc):
            out[tid, i] = acc[i]

    return kernel


def compile_report():
    """Offline sm_90a reports of :data:`COMPILED` (run with the simulator off:
    ``run_in_subprocess("tests.test_tile_attention:compile_report")``)."""
    import re

    from numba import types

    from tilepy.offline import compile_kernel

    sig = (types.float32[:, :, ::1], types.float32[:, ::1], types.int64, types.int64,
           types.float32, types.float32)
    out = []
    for name, causal, window, hook in COMPILED:
        entry = {"name": name}
        try:
            rep = compile_kernel(name, windowed_softmax_kernel(causal, window, hook), sig,
                                 (9, 0, "a"), launch_bounds=128)
        except Exception as e:  # noqa: BLE001  (reported; the test fails on it)
            entry["error"] = f"{type(e).__name__}: {e}"
        else:
            entry.update(registers=rep.registers, spill_stores=rep.spill_stores,
                         stack_frame=rep.stack_frame, local_bytes=rep.local_bytes,
                         counts=rep.counts,
                         ex2=len(re.findall(r"^\s*ex2\.approx", rep.ptx, re.M)),
                         tanh=len(re.findall(r"^\s*tanh\.approx", rep.ptx, re.M)))
        out.append(entry)
    return out


@pytest.mark.compile
def test_pieces_compile_for_sm90a_in_registers():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reps = run_in_subprocess("tests.test_tile_attention:compile_report")
    for name, _, _, hook in COMPILED:
        rep = reps[name]
        assert "error" not in rep, rep["error"]
        assert rep["local_bytes"] == 0 and rep["stack_frame"] == 0, rep
        assert rep["spill_stores"] == 0, rep
        assert rep["counts"]["ld.local"] == 0 and rep["counts"]["st.local"] == 0, rep
        assert rep["ex2"] >= 64 // 2, rep          # p of every score, one ex2 each


@pytest.mark.sim
def test_query_steps_walk_equals_random_access():
    """tilepy.tile.attention_backward.query_steps under a block mask: the one-after-the-other
    walk (first / advance, the warp-specialised backward's) visits the same (head, query
    block, partial) steps as random access (step) and as the transposed lists say — heads
    with empty lists skipped, a mask query block of two kernel query blocks, list entries
    past the end clamped; dense: head by head over the query blocks."""
    from tilepy.tile.attention_backward import query_steps

    group, n_kb, n_qm, ratio = 4, 3, 5, 2          # mask (64, 32) blocks, kernel 32 x 32
    rng = np.random.default_rng(3)
    num = rng.integers(0, 3, (1, group, n_kb)).astype(np.int32)
    full = rng.integers(0, 3, (1, group, n_kb)).astype(np.int32)
    num[0, 1, :] = 0                               # head 1: nothing, either list
    full[0, 1, :] = 0
    idx = rng.integers(0, n_qm + 2, (1, group, n_kb, n_qm)).astype(np.int32)  # some past end
    fidx = rng.integers(0, n_qm, (1, group, n_kb, n_qm)).astype(np.int32)
    lists = (num, idx, full, fidx)
    count, step, first, advance = query_steps(32, 32, (64, 32))
    dcount, dstep, dfirst, dadvance = query_steps(32, 32)

    @cuda.jit
    def kernel(qmask, kb, n_max, walked, random, dense):
        steps = count(qmask, kb, 0, 0, group, 0)
        walked[0, 0] = steps
        w = first(0, 0, qmask, kb, 0, 0, group)
        for n in range(steps):
            walked[n + 1, 0], walked[n + 1, 1], walked[n + 1, 2] = w[0], w[1], w[2]
            h, qb, part = step(n, 0, 0, qmask, kb, 0, 0, group)
            random[n + 1, 0], random[n + 1, 1], random[n + 1, 2] = h, qb, part
            w = advance(w, 0, 0, qmask, kb, 0, 0, group)
        d = dfirst(2, 3, qmask, kb, 0, 0, group)  # query blocks 2, 3, 4 of each head
        for n in range(dcount(qmask, kb, 0, 0, group, 3)):
            dense[n, 0], dense[n, 1] = d[0], d[1]
            d = dadvance(d, 2, 3, qmask, kb, 0, 0, group)

    for kb in range(n_kb):
        walked = np.full((64, 3), -1, np.int64)
        random = np.full((64, 3), -1, np.int64)
        dense = np.full((group * 3, 2), -1, np.int64)
        kernel[1, 1](lists, kb, 64, walked, random, dense)
        want = []
        for h in range(group):
            for lst, cnt, part in ((idx, num, 1), (fidx, full, 0)):
                for j in range(int(cnt[0, h, kb])):
                    m = min(max(int(lst[0, h, kb, j]), 0), n_qm - 1)
                    want += [(h, m * ratio + r, part) for r in range(ratio)]
        steps = int(walked[0, 0])
        assert steps == len(want)
        assert [tuple(x) for x in walked[1:steps + 1]] == want, kb
        assert [tuple(x) for x in random[1:steps + 1]] == want, kb
        assert [tuple(x) for x in dense] == [(h, 2 + i) for h in range(group) for i in range(3)]
