"""Block masks (FlexAttention's ``BlockMask``): ``tilepy.create_block_mask`` against the
block lists NumPy derives from the full mask matrix; ``flash_attention(block_mask=)`` on the
mma.sync kernel and the grid TMA kernel against float64 attention with the mask; that the
kernels visit exactly the listed blocks and skip the mask function on full ones; the
block-sparse backward (lists and transposed lists) against float64 gradients; the mask the
op makes and keeps for a ``mask_mod`` of no array; bad input refused before launch."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import tilepy
from tilepy.ops import attention_block_mask as abm
from tilepy.ops import attention_wgmma as aw
from tilepy.testing.reference import softmax_rows


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def same_document(b, h, q_idx, kv_idx, doc):
    """Document masking over a (batch, seq) id table; bounds the indices itself (edge tiles
    pass positions past the sequences)."""
    n = doc.shape[1]
    return q_idx < n and kv_idx < n and doc[b, q_idx] == doc[b, kv_idx]


def matrix(mask_mod, b, h, sq, sk, mod_args=()):
    """The (b, h, sq, sk) bool mask of ``mask_mod``."""
    out = np.zeros((b, h, sq, sk), bool)
    for z in range(b):
        for y in range(h):
            for i in range(sq):
                for j in range(sk):
                    out[z, y, i, j] = mask_mod(z, y, i, j, *mod_args)
    return out


def lists(visible, bq, bk):
    """Per (b, h, query block): the partial and the full key blocks, ascending."""
    b, h, sq, sk = visible.shape
    res = {}
    for z in range(b):
        for y in range(h):
            for qb in range(-(-sq // bq)):
                part, full = [], []
                for kb in range(-(-sk // bk)):
                    blk = visible[z, y, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
                    if blk.all():
                        full.append(kb)
                    elif blk.any():
                        part.append(kb)
                res[z, y, qb] = (part, full)
    return res


def mask_lists(bm):
    num, idx, fnum, fidx = (np.asarray(x) for x in (bm.kv_num_blocks, bm.kv_indices,
                                                    bm.full_kv_num_blocks, bm.full_kv_indices))
    return {(z, y, qb): (list(idx[z, y, qb, :num[z, y, qb]]),
                         list(fidx[z, y, qb, :fnum[z, y, qb]]))
            for z in range(num.shape[0]) for y in range(num.shape[1])
            for qb in range(num.shape[2])}


def mask_lists_transposed(bm):
    num, idx, fnum, fidx = (np.asarray(x) for x in bm.q_arrays)
    return {(z, y, kb): (list(idx[z, y, kb, :num[z, y, kb]]),
                         list(fidx[z, y, kb, :fnum[z, y, kb]]))
            for z in range(num.shape[0]) for y in range(num.shape[1])
            for kb in range(num.shape[2])}


def reference(q, k, v, visible, scale=None):
    """(O, LSE) in float64, (B, H, S, D), GQA by repeating K / V heads."""
    g = q.shape[1] // k.shape[1]
    kd = np.repeat(k.astype(np.float64), g, axis=1)
    vd = np.repeat(v.astype(np.float64), g, axis=1)
    s = q.astype(np.float64) @ kd.transpose(0, 1, 3, 2) * (scale or 1 / math.sqrt(q.shape[-1]))
    p, lse = softmax_rows(np.where(visible, s, -np.inf))
    return p @ vd, lse


def check(got, lse, want, want_lse):
    got = got.astype(np.float64)
    assert not np.isnan(got).any()
    assert np.abs(got - want).max() <= 2e-3 * max(1.0, np.abs(want).max())
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    fin = np.isfinite(want_lse)
    assert np.abs(lse[fin] - want_lse[fin]).max() <= 1e-4 * max(1, np.abs(want_lse).max())


def documents(rng, b, s):
    """int32 (b, s) ids of consecutive documents of random lengths (some of one token)."""
    ids = np.zeros((b, s), np.int32)
    for z in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s), size=min(4, s - 1), replace=False))
        ids[z] = np.searchsorted(cuts, np.arange(s), side="right")
    return ids


@pytest.mark.sim
@pytest.mark.parametrize("batch,heads,block", [(2, None, (16, 32)), (None, 3, 32)])
def test_create_block_mask_lists_partial_and_full_blocks(batch, heads, block):
    """Lengths that are not multiples of a block; a mask shared by every batch or head (None);
    per-batch ids through mod_args; counts and lists as NumPy derives them."""
    rng = np.random.default_rng()
    sq, sk = 45, 70
    doc = documents(rng, 2, 70)
    if batch is None:   # one mask for every batch: the first batch's documents
        doc = doc[:1]
    bm = tilepy.create_block_mask(same_document, batch, heads, sq, sk, mod_args=(doc,),
                                  block_size=block)
    b, h = batch or 1, heads or 1
    assert bm.shape == (b, h, sq, sk)
    assert bm.block_size == (tuple(block) if isinstance(block, tuple) else (block, block))
    assert np.asarray(bm.kv_indices).dtype == np.int32
    bq, bk = bm.block_size
    want = lists(matrix(same_document, b, h, sq, sk, (doc,)), bq, bk)
    assert mask_lists(bm) == want
    # the transposed lists (the backward's): per key block, the query blocks listing it
    nq, nk = -(-sq // bq), -(-sk // bk)
    transposed = {(z, y, kb): tuple([qb for qb in range(nq) if kb in want[z, y, qb][i]]
                                    for i in (0, 1))
                  for z in range(b) for y in range(h) for kb in range(nk)}
    assert mask_lists_transposed(bm) == transposed
    again = tilepy.create_block_mask(causal, 1, 1, 0, 5, like=doc)        # no query: empty
    assert np.asarray(again.kv_num_blocks).shape == (1, 1, 0)


@pytest.mark.sim
@pytest.mark.parametrize("kernel", ["mma_sync", "tma"])
def test_block_sparse_attention_against_float64(kernel):
    """Document masking with a block mask: GQA, lengths not multiples of a block, LSE; on the
    mma.sync kernel (16-row tiles under 32-row mask blocks) and the grid TMA kernel (64-key
    tiles, two per 128-key mask block); out poisoned with NaN first."""
    rng = np.random.default_rng()
    if kernel == "tma":
        b, hq, hk, s, d, block = 1, 2, 1, 150, 64, (64, 128)
        cfg = aw.WgmmaAttentionConfig(64, 64, 64, "float16", overlap=True, tma=True)
    else:
        b, hq, hk, s, d, block = 2, 2, 1, 53, 32, (32, 16)
        cfg = None
    q = rng.standard_normal((b, hq, s, d)).astype(np.float16)
    k, v = (rng.standard_normal((b, hk, s, d)).astype(np.float16) for _ in range(2))
    doc = documents(rng, b, s)
    bm = tilepy.create_block_mask(same_document, b, None, s, s, mod_args=(doc,),
                                  block_size=block)
    out = np.full(q.shape, np.nan, np.float16)
    got, lse = tilepy.flash_attention(q, k, v, block_mask=bm, out=out, return_lse=True,
                                      config=cfg)
    assert got is out
    vis = matrix(same_document, b, 1, s, s, (doc,))
    check(got, lse, *reference(q, k, v, vis))


@pytest.mark.sim
def test_block_sparse_persistent_kernel_against_float64():
    """The persistent TMA kernel under a block mask: 6 tiles (GQA 2 / 1, 300 rows of 128-row
    tiles) over the simulator's 4 SM slots, so slots walk several tiles with the K/V ring
    counted on across them; per-head lists in which query block 1 of head 1 sees no key
    (zeros, LSE -inf: the producer's count of 0), keys 128 … 255 are listed nowhere and NaN
    (a step word pointing there spreads NaN), 64-key tiles two to a 128-key mask block; out
    poisoned with NaN."""
    rng = np.random.default_rng()
    b, hq, hk, s, d = 1, 2, 1, 300, 64
    cfg = aw.WgmmaAttentionConfig(64, 128, 64, "float16", overlap=True, tma=True,
                                  producer=True, persistent=True)
    q = rng.standard_normal((b, hq, s, d)).astype(np.float16)
    k, v = (rng.standard_normal((b, hk, s, d)).astype(np.float16) for _ in range(2))
    k[:, :, 128:256] = np.nan
    v[:, :, 128:256] = np.nan
    doc = documents(rng, b, s)

    def hidden(bb, h, q_idx, kv_idx, ids):
        return (kv_idx < 128 or kv_idx >= 256) and not (h == 1 and 128 <= q_idx < 256) and \
            same_document(bb, h, q_idx, kv_idx, ids)

    bm = tilepy.create_block_mask(hidden, b, hq, s, s, mod_args=(doc,), block_size=128)
    out = np.full((b, hq, s, d), np.nan, np.float16)
    got, lse = tilepy.flash_attention(q, k, v, block_mask=bm, out=out, return_lse=True,
                                      config=cfg)
    assert got is out
    vis = matrix(hidden, b, hq, s, s, (doc,))
    want, want_lse = reference(q, np.nan_to_num(k), np.nan_to_num(v), vis)
    assert not vis[:, 1, 128:256].any()
    with np.errstate(invalid="ignore"):
        want = np.nan_to_num(want)
    check(got, lse, want, want_lse)
    assert (got[:, 1, 128:256].astype(np.float32) == 0).all()


def unpacked_bits(bm, sq, sk):
    """A mask's ``partial_bits`` as a bool (b, h, sq, sk) array."""
    words = np.asarray(bm.partial_bits)
    assert words.dtype == np.uint32
    bits = (words[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(*words.shape[:3], -1)[:, :, :sq, :sk].astype(bool)


def partial_pairs(bm, sq, sk):
    """A bool (b, h, sq, sk) array of the pairs inside the mask's partial blocks."""
    num, idx = np.asarray(bm.kv_num_blocks), np.asarray(bm.kv_indices)
    bq, bk = bm.block_size
    out = np.zeros((*num.shape[:2], sq, sk), bool)
    for z, y, qb in np.ndindex(*num.shape):
        for kb in idx[z, y, qb, :num[z, y, qb]]:
            out[z, y, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk] = True
    return out


@pytest.mark.sim
@pytest.mark.parametrize("kernel", ["tma", "mma_sync"])
def test_partial_bits_are_the_function_and_the_forward_reads_them(kernel):
    """``partial_bits``: made by default for a mask function that reads an array, equal to
    the function on every pair of the partial blocks (GQA, lengths not multiples of a block,
    per-head lists); the forward reads them in place of the function — bits changed by hand
    (the function untouched) change the result to the bits' mask, also when the call passes
    the mask's own ``mod_args`` again — but not when it gives other arrays, which the function
    then reads; the bits by key equal them. On the grid TMA kernel (64-key tiles,
    two per 128-key mask block: the word-at-a-time form) and the mma.sync kernel (16-key
    tiles: a word per score). Out poisoned with NaN."""
    rng = np.random.default_rng()
    if kernel == "tma":
        b, hq, hk, s, d, block = 1, 2, 1, 150, 64, (64, 128)
        cfg = aw.WgmmaAttentionConfig(64, 64, 64, "float16", overlap=True, tma=True)
    else:
        b, hq, hk, s, d, block = 2, 2, 1, 53, 16, (32, 32)
        cfg = None
    q = rng.standard_normal((b, hq, s, d)).astype(np.float16)
    k, v = (rng.standard_normal((b, hk, s, d)).astype(np.float16) for _ in range(2))
    doc = documents(rng, b, s)

    def doc_causal(bb, h, q_idx, kv_idx, ids):
        return kv_idx <= q_idx + 3 * h and same_document(bb, h, q_idx, kv_idx, ids)

    bm = tilepy.create_block_mask(doc_causal, b, hq, s, s, mod_args=(doc,), block_size=block)
    assert bm.partial_bits is not None
    vis = matrix(doc_causal, b, hq, s, s, (doc,))
    inside = partial_pairs(bm, s, s)
    assert inside.any()
    np.testing.assert_array_equal(unpacked_bits(bm, s, s)[inside], vis[inside])

    def run(mask, **kw):
        out = np.full(q.shape, np.nan, np.float16)
        got, lse = tilepy.flash_attention(q, k, v, block_mask=mask, out=out, return_lse=True,
                                          config=cfg, **kw)
        assert got is out
        return got, lse

    check(*run(bm), *reference(q, k, v, vis))
    # every other visible pair of the partial blocks hidden in the bits only
    words = np.asarray(bm.partial_bits).copy()
    rows, cols = np.nonzero(vis[0, 1] & inside[0, 1])
    for i, j in zip(rows[::2], cols[::2]):
        words[0, 1, i, j // 32] &= ~np.uint32(1 << (j % 32))
    changed = dataclasses.replace(bm, partial_bits=words)
    fewer = vis.copy()
    fewer[0, 1, rows[::2], cols[::2]] = False
    check(*run(changed), *reference(q, k, v, fewer))
    # the mask's own mod_args passed again: still the bits; other arrays (a copy of the
    # ids): the function, not the bits
    check(*run(changed, mod_args=(doc,)), *reference(q, k, v, fewer))
    check(*run(changed, mod_args=(doc.copy(),)), *reference(q, k, v, vis))
    # the bits by key (the backward's): the same bits
    by_key = np.asarray(bm.partial_bits_t)
    t = ((by_key[..., None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(
        *by_key.shape[:3], -1)[:, :, :s, :s].astype(bool)
    np.testing.assert_array_equal(t.transpose(0, 1, 3, 2)[inside], vis[inside])


@pytest.mark.sim
def test_partial_bits_by_default_only_where_they_pay():
    """None (the default) keeps bits for a function reading an array within the size limit,
    not for one of numbers only, nor past the limit, nor for key blocks that are not multiples
    of 32; True / False force; bad values and bad bits refused before launch."""
    x = np.zeros((1, 2, 40, 16), np.float16)
    doc = np.zeros((1, 40), np.int32)
    assert tilepy.create_block_mask(same_document, 1, None, 40, 40, mod_args=(doc,),
                                    block_size=32).partial_bits.shape == (1, 1, 64, 2)
    assert tilepy.create_block_mask(causal, 1, None, 40, 40, like=x,
                                    block_size=32).partial_bits is None
    assert tilepy.create_block_mask(causal, 1, None, 40, 40, like=x, block_size=32,
                                    partial_bits=True).partial_bits is not None
    assert tilepy.create_block_mask(same_document, 1, None, 40, 40, mod_args=(doc,),
                                    block_size=(32, 16)).partial_bits is None
    assert tilepy.create_block_mask(same_document, 1, None, 40, 40, mod_args=(doc,),
                                    block_size=32, partial_bits=False).partial_bits is None
    with pytest.MonkeyPatch.context() as mp:
        # (the two bitmaps: 64 rows × 2 words and 64 keys × 2 words, 4 bytes each)
        for limit, kept in ((2 * 64 * 2 * 4, True), (2 * 64 * 2 * 4 - 1, False)):
            mp.setattr(abm, "PARTIAL_BITS_LIMIT", limit)
            assert (tilepy.create_block_mask(same_document, 1, None, 40, 40, mod_args=(doc,),
                                             block_size=32).partial_bits is not None) == kept
    with pytest.raises(ValueError, match=r"multiples of 32, got \(32, 16\)"):
        tilepy.create_block_mask(causal, 1, 1, 40, 40, like=x, block_size=(32, 16),
                                 partial_bits=True)
    with pytest.raises(TypeError, match="partial_bits must be None, True or False"):
        tilepy.create_block_mask(causal, 1, 1, 40, 40, like=x, partial_bits="yes")
    bm = tilepy.create_block_mask(same_document, 1, None, 40, 40, mod_args=(doc,),
                                  block_size=32)
    for bad, err in ((np.zeros((1, 1, 40, 2), np.uint32), "partial_bits must have shape"),
                     (np.zeros((1, 1, 64, 2), np.int32), "partial_bits: dtype int32")):
        with pytest.raises((TypeError, ValueError), match=err):
            tilepy.flash_attention(x, x, x, block_mask=dataclasses.replace(bm,
                                                                           partial_bits=bad))


def document_hidden(b, h, q_idx, kv_idx, doc, lo, hi):
    """Document masking in which no query sees keys lo … hi - 1 (a key block no list names)
    and head 1 no key from 80 on (per-head lists under GQA)."""
    return (kv_idx < lo or kv_idx >= hi) and (h == 0 or kv_idx < 80) and \
        same_document(b, h, q_idx, kv_idx, doc)


def gradients64(q, k, v, do, vis):
    """(dq, dk, dv) in float64 of attention under the bool mask ``vis`` (GQA by repeating):
    P from the rows' visible keys, dP = dO Vᵀ, dS = P (dP − rowsum(dO ∘ O))."""
    b, hq, s, d = q.shape
    g = hq // k.shape[1]
    kd, vd = (np.repeat(x.astype(np.float64), g, axis=1) for x in (k, v))
    sc = 1 / math.sqrt(d)
    p, _ = softmax_rows(np.where(vis, q.astype(np.float64) @ kd.transpose(0, 1, 3, 2) * sc,
                                 -np.inf))
    o = p @ vd
    dod = do.astype(np.float64)
    ds = p * (dod @ vd.transpose(0, 1, 3, 2) - (dod * o).sum(-1, keepdims=True))
    hk = k.shape[1]
    return (ds @ kd * sc, (ds.transpose(0, 1, 3, 2) @ q.astype(np.float64) * sc).reshape(
        b, hk, g, k.shape[2], d).sum(2), (p.transpose(0, 1, 3, 2) @ dod).reshape(
        b, hk, g, k.shape[2], d).sum(2))


#: The wgmma backward kernels under a block mask (their twins): dK / dV over 64 keys then
#: dQ's own kernel over 64-key steps, 64 x 64 mask blocks; the warp-specialised kernel (two
#: 64-key consumers, dQ by bulk reductions; its unused dQ kernel's 128 rows do not count)
#: with 64 x 128 blocks.
WGMMA_SPARSE = {
    "wgmma": (dict(block_m=64, key_groups=1, dq_groups=1, dq_block_n=64), (64, 64), 85, 64),
    "wgmma_ws": (dict(block_m=64, key_groups=2, dq_atomic=True, producer=True), (64, 128), 170,
                 64),
    # past head_dim 128: the split-column kernel by query halves (64-key blocks, one slot)
    "wgmma_wide": (dict(block_m=64, key_groups=1, dq_atomic=True, producer=True,
                        split_columns=True, query_halves=True), (64, 64), 150, 136),
}


@pytest.mark.sim
@pytest.mark.parametrize("made", ["caller", pytest.param("caller64", marks=pytest.mark.extended),
                                  "op", "wgmma", "wgmma_ws",
                                  pytest.param("wgmma_wide", marks=pytest.mark.extended)])
def test_block_sparse_backward_against_float64(made):
    """The backward under a block mask walks its lists (dQ) and its transposed lists (dK /
    dV): gradients against a float64 derivation — GQA 2 / 1 with a mask per query head, 85
    rows (a mask query block past the last row), document masking in which no query sees one
    key block, whose K and V are NaN (a kernel visiting it would spread NaN: dS = P · (dP − D)
    with dP = dO · Vᵀ), dK and dV of those keys zero. ``made``: the caller's mask
    (``create_block_mask``) of 64 × 32 blocks (keys 32 … 63 hidden), of 64 × 64 (keys 0 … 63
    hidden; two 32-key kernel blocks a mask block, the last wholly past seq_k), or the op's own
    for a ``mask_mod`` of no array (the ids a closure constant; keys 32 … 63 hidden); or the
    caller's mask on the wgmma kernels (:data:`WGMMA_SPARSE`; the last mask key block
    hidden)."""
    from tilepy.ops.attention_backward_wgmma import WgmmaBackwardConfig

    rng = np.random.default_rng()
    b, hq, hk, s, d = 1, 2, 1, 85, 32
    lo, hi, block = (0, 64, (64, 64)) if made == "caller64" else (32, 64, (64, 32))
    bw_kw = {}
    if made in WGMMA_SPARSE:
        fields, block, s, d = WGMMA_SPARSE[made]
        lo, hi = block[1], 2 * block[1]
        bw_kw = dict(config=WgmmaBackwardConfig(d, **fields))
    q = rng.standard_normal((b, hq, s, d)).astype(np.float16)
    k, v = (rng.standard_normal((b, hk, s, d)).astype(np.float16) for _ in range(2))
    k[:, :, lo:hi] = np.nan
    v[:, :, lo:hi] = np.nan
    doc = documents(rng, b, s)
    do = rng.standard_normal(q.shape).astype(np.float16)
    if made == "op":
        ids = doc.copy()

        def own(bb, h, q_idx, kv_idx):
            return (kv_idx < 32 or kv_idx >= 64) and (h == 0 or kv_idx < 80) and \
                q_idx < s and kv_idx < s and ids[bb, q_idx] == ids[bb, kv_idx]

        kw = dict(mask_mod=own)
    else:
        bm = tilepy.create_block_mask(document_hidden, b, hq, s, s, mod_args=(doc, lo, hi),
                                      block_size=block)
        kw = dict(block_mask=bm)
    vis = matrix(document_hidden, b, hq, s, s, (doc, lo, hi))
    out, lse = tilepy.flash_attention(q, k, v, return_lse=True, **kw)
    check(out, lse, *reference(np.nan_to_num(q), np.nan_to_num(k), np.nan_to_num(v), vis))
    dq, dk, dv = tilepy.flash_attention_backward(do, q, k, v, out, lse, **kw, **bw_kw)
    want = gradients64(q, np.nan_to_num(k), np.nan_to_num(v), do, vis)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        got = got.astype(np.float64)
        assert not np.isnan(got).any(), name
        assert np.abs(got - ref).max() <= 1e-2 * max(1.0, np.abs(ref).max()), name
    assert (dk[:, :, lo:hi] == 0).all() and (dv[:, :, lo:hi] == 0).all()


@pytest.mark.sim
def test_backward_reads_both_bitmaps():
    """The backward reads a block mask's bitmaps in place of its function — by query row in
    dQ's own kernel (``deterministic=True``), by key in the dK / dV kernel: with every other
    visible pair of the partial blocks hidden in both bitmaps (the function untouched),
    forward and gradients are those of the bits' mask against float64; with the function's
    bits, identical to the function's gradients."""
    rng = np.random.default_rng()
    b, hq, hk, s, d = 1, 2, 1, 70, 32
    q = rng.standard_normal((b, hq, s, d)).astype(np.float16)
    k, v = (rng.standard_normal((b, hk, s, d)).astype(np.float16) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float16)
    doc = documents(rng, b, s)

    def doc_causal(bb, h, q_idx, kv_idx, ids):
        return kv_idx <= q_idx and same_document(bb, h, q_idx, kv_idx, ids)

    bm = tilepy.create_block_mask(doc_causal, b, None, s, s, mod_args=(doc,), block_size=32)
    vis = matrix(doc_causal, b, 1, s, s, (doc,))
    fn = dataclasses.replace(bm, partial_bits=None, partial_bits_t=None)
    out, lse = tilepy.flash_attention(q, k, v, block_mask=bm, return_lse=True)
    got = tilepy.flash_attention_backward(do, q, k, v, out, lse, block_mask=bm,
                                          deterministic=True)
    want = tilepy.flash_attention_backward(do, q, k, v, out, lse, block_mask=fn,
                                           deterministic=True)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)
    rows, cols = np.nonzero(vis[0, 0] & partial_pairs(bm, s, s)[0, 0])
    assert len(rows) > 20
    words, words_t = (np.asarray(x).copy() for x in (bm.partial_bits, bm.partial_bits_t))
    for i, j in zip(rows[::2], cols[::2]):
        words[0, 0, i, j // 32] &= ~np.uint32(1 << (j % 32))
        words_t[0, 0, j, i // 32] &= ~np.uint32(1 << (i % 32))
    changed = dataclasses.replace(bm, partial_bits=words, partial_bits_t=words_t)
    fewer = vis.copy()
    fewer[0, 0, rows[::2], cols[::2]] = False
    out, lse = tilepy.flash_attention(q, k, v, block_mask=changed, return_lse=True)
    check(out, lse, *reference(q, k, v, fewer))
    grads = tilepy.flash_attention_backward(do, q, k, v, out, lse, block_mask=changed,
                                            deterministic=True)
    for name, x, ref in zip(("dq", "dk", "dv"), grads, gradients64(q, k, v, do, fewer)):
        x = x.astype(np.float64)
        assert not np.isnan(x).any(), name
        assert np.abs(x - ref).max() <= 1e-2 * max(1.0, np.abs(ref).max()), name


def hand_mask(like, block, seq, partial, full, n_kb):
    """A BlockMask of one query block per list entry: ``partial`` / ``full`` lists of key
    blocks per query block (with ``n_kb`` entries per row)."""
    nq = len(partial)
    arr = [np.zeros((1, 1, nq), np.int32), np.zeros((1, 1, nq, n_kb), np.int32),
           np.zeros((1, 1, nq), np.int32), np.zeros((1, 1, nq, n_kb), np.int32)]
    for qb in range(nq):
        for cnt, ix, lst in ((arr[0], arr[1], partial[qb]), (arr[2], arr[3], full[qb])):
            cnt[0, 0, qb] = len(lst)
            ix[0, 0, qb, :len(lst)] = lst
    return abm.BlockMask(*arr, block, seq, mask_mod=None)


@pytest.mark.sim
@pytest.mark.parametrize("kernel", ["mma_sync", "tma"])
def test_kernels_visit_exactly_the_listed_blocks(kernel):
    """A hand-made mask is obeyed: a key block listed nowhere is never seen (even where the
    mask function sees it), a full block skips the mask function (which hides the odd keys
    here), a partial one applies it; on the mma.sync kernel also an out-of-range index
    (clamped) and a count past the lists (cut) — never read out of bounds."""
    rng = np.random.default_rng()
    if kernel == "tma":     # 64-row query blocks over 64-key blocks (the TMA kernel's tiles)
        s, d, bq, bk = 192, 64, 64, 64
        cfg = aw.WgmmaAttentionConfig(64, 64, 64, "float16", overlap=True, tma=True)
    else:
        s, d, bq, bk = 96, 16, 32, 16
        cfg = None
    q, k, v = (rng.standard_normal((1, 1, s, d)).astype(np.float16) for _ in range(3))

    def nothing_but_even(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 0

    # query block 0 sees key block 0 (partial: even keys) and 1 (full: every key, though the
    # function hides the odd ones); query block 1 sees block 2 (partial) then 0 (partial) and
    # 1 (full); query block 2 sees nothing (zeros, LSE -inf); other key blocks listed nowhere
    n_kb = s // bk
    bm = hand_mask(q, (bq, bk), (s, s), [[0], [2, 0], []], [[1], [1], []], n_kb)
    bm = abm.BlockMask(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                       bm.full_kv_indices, bm.block_size, bm.seq_lengths, nothing_but_even)
    got, lse = tilepy.flash_attention(q, k, v, block_mask=bm, return_lse=True, config=cfg)
    vis = np.zeros((1, 1, s, s), bool)
    vis[..., :2 * bq, 0:bk:2] = True                     # partial block 0: even keys
    vis[..., :2 * bq, bk:2 * bk] = True                  # full block 1: every key
    vis[..., bq:2 * bq, 2 * bk:3 * bk:2] = True          # second query block: partial block 2
    check(got, lse, *reference(q, k, v, vis))
    assert (got[..., 2 * bq:, :].astype(np.float32) == 0).all()
    if kernel == "tma":
        return
    # an index past the last key block (clamped to the last, 5) and a count past the list's
    # length (cut to its 6 entries): no fault, no NaN
    bm2 = hand_mask(q, (32, 16), (s, s), [[], [], []], [[9], [1], [0]], n_kb)
    bm2.full_kv_num_blocks[0, 0, 1] = 99
    bm2 = abm.BlockMask(bm2.kv_num_blocks, bm2.kv_indices, bm2.full_kv_num_blocks,
                        bm2.full_kv_indices, bm2.block_size, bm2.seq_lengths, causal)
    got = tilepy.flash_attention(q, k, v, block_mask=bm2)
    assert not np.isnan(got.astype(np.float32)).any()


def with_transposed(bm, n_qb):
    """``bm`` (one batch and head, NumPy lists) with its transposed lists made in NumPy: per
    key block the query blocks that list it, partial and full, ascending."""
    n_kb = bm.kv_indices.shape[-1]
    arrs = []
    for cnt, idx in ((bm.kv_num_blocks, bm.kv_indices),
                     (bm.full_kv_num_blocks, bm.full_kv_indices)):
        num = np.zeros((1, 1, n_kb), np.int32)
        ix = np.zeros((1, 1, n_kb, n_qb), np.int32)
        for kb in range(n_kb):
            qbs = [qb for qb in range(n_qb) if kb in idx[0, 0, qb, :cnt[0, 0, qb]]]
            num[0, 0, kb] = len(qbs)
            ix[0, 0, kb, :len(qbs)] = qbs
        arrs += [num, ix]
    return dataclasses.replace(bm, q_num_blocks=arrs[0], q_indices=arrs[1],
                               full_q_num_blocks=arrs[2], full_q_indices=arrs[3])


@pytest.mark.sim
def test_backward_skips_the_mask_function_on_full_blocks():
    """The backward treats a mask's blocks as the forward does: a full block's scores are all
    visible whatever mask_mod says of them (here it hides the odd keys), a partial block's
    take mask_mod, an unlisted block is never seen — in both kernels (dQ walks the lists,
    dK / dV the transposed ones). Gradients against a float64 derivation of that visibility
    (with mask_mod applied on the full block too, dK / dV of its odd keys would be zero and
    the test fails)."""
    rng = np.random.default_rng()
    s, d, bq, bk = 96, 16, 32, 32
    q, k, v, do = (rng.standard_normal((1, 1, s, d)).astype(np.float16) for _ in range(4))

    def nothing_but_even(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 0

    bm = hand_mask(q, (bq, bk), (s, s), [[0], [2, 0], []], [[1], [1], []], s // bk)
    bm = with_transposed(dataclasses.replace(bm, mask_mod=nothing_but_even), s // bq)
    vis = np.zeros((1, 1, s, s), bool)
    vis[..., :2 * bq, 0:bk:2] = True                     # partial block 0: even keys
    vis[..., :2 * bq, bk:2 * bk] = True                  # full block 1: every key
    vis[..., bq:2 * bq, 2 * bk:3 * bk:2] = True          # second query block: partial block 2
    out, lse = tilepy.flash_attention(q, k, v, block_mask=bm, return_lse=True)
    check(out, lse, *reference(q, k, v, vis))
    dq, dk, dv = tilepy.flash_attention_backward(do, q, k, v, out, lse, block_mask=bm)
    sc = 1 / math.sqrt(d)
    qd, kd, vd, dod = (x.astype(np.float64) for x in (q, k, v, do))
    with np.errstate(invalid="ignore"):
        p, _ = softmax_rows(np.where(vis, qd @ kd.transpose(0, 1, 3, 2) * sc, -np.inf))
    p = np.nan_to_num(p)                                  # the third query block sees nothing
    o = p @ vd
    ds = p * (dod @ vd.transpose(0, 1, 3, 2) - (dod * o).sum(-1, keepdims=True))
    want = (ds @ kd * sc, ds.transpose(0, 1, 3, 2) @ qd * sc, p.transpose(0, 1, 3, 2) @ dod)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        got = got.astype(np.float64)
        assert not np.isnan(got).any(), name
        assert np.abs(got - ref).max() <= 1e-2 * max(1.0, np.abs(ref).max()), name
    assert np.abs(dk[..., bk + 1:2 * bk:2, :].astype(np.float64)).max() > 0   # odd keys seen


@pytest.mark.sim
def test_mask_made_and_kept_per_shape():
    """A mask_mod of no array argument: the op makes the block mask once per shape (kept:
    the next call makes none), with numbers among mod_args part of its key; results against
    float64 on both calls."""
    rng = np.random.default_rng()
    s, d = 40, 16
    q, k, v = (rng.standard_normal((1, 2, s, d)).astype(np.float16) for _ in range(3))

    def prefix(b, h, q_idx, kv_idx, n):
        return kv_idx <= q_idx or kv_idx < n

    from tilepy.ops import attention as at

    abm._CACHE.clear()
    vis = matrix(prefix, 1, 1, s, s, (7,))
    for _ in range(2):
        at._PLANS.clear()      # (the mask cache itself, not a recorded plan, serves the next)
        got, lse = tilepy.flash_attention(q, k, v, mask_mod=prefix, mod_args=(7,),
                                          return_lse=True)
        check(got, lse, *reference(q, k, v, vis))
        assert len(abm._CACHE) == 1
    tilepy.flash_attention(q, k, v, mask_mod=prefix, mod_args=(9,))
    assert len(abm._CACHE) == 2
    mask = list(abm._CACHE.values())[0]
    assert mask_lists(mask) == lists(matrix(prefix, 1, 2, s, s, (7,)), *mask.block_size)


@pytest.mark.sim
def test_bad_block_masks_are_refused_before_launch():
    x = np.zeros((1, 2, 40, 16), np.float16)
    bm = tilepy.create_block_mask(causal, None, None, 40, 40, like=x, block_size=16)
    with pytest.raises(ValueError, match="causal=True or a window"):
        tilepy.flash_attention(x, x, x, block_mask=bm, causal=True)
    with pytest.raises(ValueError, match="flash_attention_backward: block_mask with causal"):
        tilepy.flash_attention_backward(x, x, x, x, x, np.zeros((1, 2, 40), np.float32),
                                        block_mask=bm, window=(3, 0))
    import dataclasses
    short = dataclasses.replace(bm, q_indices=np.zeros((1, 1, 3, 2), np.int32))
    with pytest.raises(ValueError, match=r"block_mask.q_indices must have shape .*3, 3"):
        tilepy.flash_attention(x, x, x, block_mask=short)
    # FlashAttention's "no window", (-1, -1), is no window
    np.testing.assert_array_equal(tilepy.flash_attention(x, x, x, block_mask=bm),
                                  tilepy.flash_attention(x, x, x, block_mask=bm,
                                                         window=(-1, -1)))
    with pytest.raises(ValueError, match="is not the block mask's"):
        tilepy.flash_attention(x, x, x, block_mask=bm, mask_mod=lambda b, h, i, j: True)
    with pytest.raises(ValueError, match=r"made for \(seq_q, seq_k\) = \(40, 40\)"):
        tilepy.flash_attention(x[:, :, :30], x, x, block_mask=bm)
    with pytest.raises(TypeError, match="must be a tilepy BlockMask"):
        tilepy.flash_attention(x, x, x, block_mask=object())
    wrong = abm.BlockMask(*(np.asarray(a, np.int64) for a in (
        bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)),
        bm.block_size, bm.seq_lengths, causal)
    with pytest.raises(TypeError, match="block_mask.kv_num_blocks: dtype int64"):
        tilepy.flash_attention(x, x, x, block_mask=wrong)
    three = tilepy.create_block_mask(causal, 1, 3, 40, 40, like=x, block_size=16)
    with pytest.raises(ValueError, match=r"heads 2 or 1"):
        tilepy.flash_attention(x, x, x, block_mask=three)
    for size in (8, 24, (16, 2000), (True, 16)):
        with pytest.raises(ValueError, match="multiples of 16"):
            tilepy.create_block_mask(causal, 1, 1, 40, 40, like=x, block_size=size)
    with pytest.raises(TypeError, match="must take 4 positional parameters"):
        tilepy.create_block_mask(lambda b, h, i: True, 1, 1, 40, 40, like=x)
    with pytest.raises(TypeError, match="pass like="):
        tilepy.create_block_mask(causal, 1, 1, 40, 40)
    with pytest.raises(ValueError, match="batch must be a positive int or None"):
        tilepy.create_block_mask(causal, 0, 1, 40, 40, like=x)
    cfg = aw.WgmmaAttentionConfig(64, 64, 64, "float16", overlap=True, tma=True)
    y = np.zeros((1, 1, 40, 64), np.float16)
    m32 = tilepy.create_block_mask(causal, 1, 1, 40, 40, like=y, block_size=32)
    with pytest.raises(ValueError, match="do not divide the block mask's"):
        tilepy.flash_attention(y, y, y, block_mask=m32, config=cfg)


@pytest.mark.compile
@pytest.mark.parametrize("group", ["core", pytest.param("extended", marks=pytest.mark.extended)])
def test_block_sparse_kernels_compile_without_spills(group):
    """Offline sm_90a: the block-sparse TMA kernels (d128, ping-pong, producer; persistent —
    the default — and, extended, grid with one and two key tiles a mask block; with the mask
    function and reading a bitmap, with a load per word) and the block-sparse mma.sync kernel
    (d128) with a causal mask function and LSE, and the block mask's kernel (with and without
    the bitmap): no spill, no local memory, the TMA kernel's wgmmas and TMA loads present, no
    serialised wgmmas; the backward's block-sparse dK / dV and dQ kernels (d128; extended
    d64) spill at most 96 B more than the dense ones with the hook, the warp-specialised
    wgmma one (d128) at most 128 B."""
    from tilepy.offline import find_ptxas, run_in_subprocess

    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reps = run_in_subprocess("tilepy.ops.attention_block_mask:compile_reports"
                             + ("_extended" if group == "extended" else ""))
    every = [n for n, *_ in abm.SPARSE_REPORTS + abm.SPARSE_BACKWARD_REPORTS]
    assert len(reps) == (len(abm.EXTENDED_REPORTS) if group == "extended"
                         else len(every) - len(abm.EXTENDED_REPORTS) + 3)
    for name, rep in reps.items():
        assert "error" not in rep, rep
        assert rep["local_bytes"] == 0 and rep["counts"]["ld.local"] == 0, rep
        if name == abm.WS_SPARSE_REPORT:
            # the warp-specialised backward under a block mask: its steps counted by one
            # thread and handed to the consumers by the producer (84 B; 404 when every
            # thread walked the lists; the dense kernel with the same hook 48)
            assert rep["spill_stores"] <= 128, rep
            continue
        if "_bits_" in name:
            # the bitmap read a word per 32 keys of a row: 4 words for each of a thread's 2
            # rows, in each of the kernel's two calls of the hook, on top of the loads of the
            # same kernel with the causal function (whose test reads no memory)
            fn = reps[name.replace("_bits_", "_")]
            assert rep["counts"]["ld.global"] <= fn["counts"]["ld.global"] + 2 * 2 * 4, rep
        if name.startswith("attention_backward") and name.endswith("_sparse"):
            # the backward's block-sparse kernels against the dense ones with the same hook
            # (at head_dim 128 those spill already): at most 96 B more (d128 dK / dV: 120 B
            # against 32 since full blocks take the hook without mask_mod, a second hook
            # body; measured at 7x the dense walk on the GPU with it, bench/NOTES.md)
            dense = reps[name.replace("_sparse", "_dense")]
            assert rep["spill_stores"] <= dense["spill_stores"] + 96, (rep, dense)
        elif name.startswith("attention_backward"):
            continue
        elif "producer" in name:
            # as the dense kernel's (tests/test_ops_attention_wgmma.py): setmaxnreg's 168 at
            # entry; values computed before the warpgroups part may be spilled there
            assert rep["registers"] == 168 and rep["spill_stores"] <= 64, rep
            assert rep["counts"]["wgmma.mma_async"] >= 128 // 16 + 128 // 16
            assert rep["counts"]["cp.async.bulk.tensor"] >= 3
            assert not rep["ptxas_wgmma_notes"], rep["ptxas_wgmma_notes"]
        else:
            assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep


# ---- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_block_masks_against_sdpa(d):
    """B2 H8 S3000 (partial blocks) bf16 on the built-in configs (sm_90: the block-sparse grid
    TMA kernel): causal document masking through a block mask made by create_block_mask,
    against SDPA with the explicit mask in float32, reading the mask's bitmap and (without it)
    the function; causal written as mask_mod (the op's own block mask) against the built-in
    causal=True; out poisoned with NaN first."""
    torch = pytest.importorskip("torch")
    b, h, s = 2, 8, 3000
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    doc = torch.from_numpy(documents(np.random.default_rng(0), b, s)).cuda()

    def doc_causal(bb, hh, q_idx, kv_idx, ids):
        return kv_idx <= q_idx and q_idx < ids.shape[1] and kv_idx < ids.shape[1] and \
            ids[bb, q_idx] == ids[bb, kv_idx]

    bm = tilepy.create_block_mask(doc_causal, b, None, s, s, mod_args=(doc,))
    out = torch.full_like(q, float("nan"))
    got = tilepy.flash_attention(q, k, v, block_mask=bm, out=out)
    i = torch.arange(s, device="cuda")
    vis = (i[None, :] <= i[:, None])[None] & (doc[:, :, None] == doc[:, None, :])
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=vis[:, None])
    assert got is out and not torch.isnan(got).any()
    assert (got.float() - want).abs().max().item() <= 2e-2
    # the forward read the mask's bitmap; without it, the function on the partial blocks
    assert bm.partial_bits is not None
    fn = tilepy.flash_attention(q, k, v, block_mask=dataclasses.replace(bm, partial_bits=None))
    assert (fn.float() - want).abs().max().item() <= 2e-2
    mine = tilepy.flash_attention(q, k, v, mask_mod=causal)
    builtin = tilepy.flash_attention(q, k, v, causal=True)
    assert (mine.float() - builtin.float()).abs().max().item() <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("d,deterministic", [(128, False), (128, True), (64, False)])
def test_gpu_block_sparse_backward_against_sdpa(d, deterministic):
    """The block-sparse backward of a causal document mask (B2 H8 S3000 bf16, a block mask
    from create_block_mask, its bitmaps read in place of the function) against SDPA's float32
    autograd with the explicit mask: at head_dim 128 the warp-specialised kernel (the
    producer's step words) and the deterministic pair, at 64 the built-in choice; the same
    gradients with the function evaluated instead of the bitmaps."""
    torch = pytest.importorskip("torch")
    b, h, s = 2, 8, 3000
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    doc = torch.from_numpy(documents(np.random.default_rng(1), b, s)).cuda()

    def doc_causal(bb, hh, q_idx, kv_idx, ids):
        return (kv_idx <= q_idx) & (ids[bb, min(q_idx, 2999)] == ids[bb, min(kv_idx, 2999)])

    bm = tilepy.create_block_mask(doc_causal, b, None, s, s, mod_args=(doc,))
    assert bm.partial_bits_t is not None
    out, lse = tilepy.flash_attention(q, k, v, block_mask=bm, return_lse=True)
    grads = tilepy.flash_attention_backward(do, q, k, v, out, lse, block_mask=bm,
                                            deterministic=deterministic)
    i = torch.arange(s, device="cuda")
    vis = (i[None, :] <= i[:, None])[None] & (doc[:, :, None] == doc[:, None, :])
    x = [t.float().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*x, attn_mask=vis[:, None])
    ref.backward(do.float())
    for name, got, want in zip(("dq", "dk", "dv"), grads, (t.grad for t in x)):
        assert not torch.isnan(got).any(), name
        err = (got.float() - want).abs().max().item()
        assert err <= 2e-2 * max(1.0, want.abs().max().item()), (name, err)
    fn = dataclasses.replace(bm, partial_bits=None, partial_bits_t=None)
    again = tilepy.flash_attention_backward(do, q, k, v, out, lse, block_mask=fn,
                                            deterministic=deterministic)
    for got, other in zip(grads, again):
        assert (got.float() - other.float()).abs().max().item() <= 1e-2


def test_sparse_configs_divide_the_mask_and_stay_valid(monkeypatch):
    """The Hopper configs a block mask of 64, 128 or 192 query rows gets: tiles that divide it,
    a producer warpgroup and ping-pong only at 128 rows or more; with SPARSE_PERSISTENT (on by
    default) persistent where a producer warpgroup and the persistent kernel's tiles allow it
    (head dims 64 and 128), else never; a caller's config kept as given."""
    from tilepy.ops import attention as at

    for persistent in (False, True):
        monkeypatch.setattr(at, "SPARSE_PERSISTENT", persistent)
        for d in (64, 128, 192, 256):
            for block in ((64, 64), (128, 128), (192, 128), (64, 256)):
                cfg = at.sparse_config(at.hopper_config(d, "bfloat16", False), block)
                assert block[0] % cfg.block_m == 0 and block[1] % cfg.block_n == 0
                assert cfg.block_m >= 128 or not cfg.producer
                assert cfg.persistent == (persistent and cfg.producer and d <= 128
                                          and (aw.tile_width(d), cfg.block_n)
                                          in aw.PERSISTENT_OVERLAP_FITS), (d, block, cfg)
    grid = aw.WgmmaAttentionConfig(128, 128, 128, "bfloat16", overlap=True, tma=True,
                                   pingpong=True, producer=True)
    assert at.sparse_config(grid, (128, 128), given=True) is grid

