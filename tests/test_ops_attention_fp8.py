"""``tilepy.flash_attention`` on float8_e4m3fn inputs (FlashAttention-3's FP8 forward): against
float64 attention on the dequantised inputs (descales per tensor and per (batch, K/V head),
causal, GQA, windows, soft cap, both layouts, head dims 32 / 128 / 256 and V's own, rows that
see no key, lengths that are not multiples of a block), V's transpose pre-pass, bad input
refused before launch; the GPU against float32 attention."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tilepy
from tilepy.ops import attention_fp8 as af
from tilepy.testing.reference import softmax_rows
from tilepy.tile.transpose import reference_rows

ml_dtypes = pytest.importorskip("ml_dtypes")
E4M3 = ml_dtypes.float8_e4m3fn


def reference(q, k, v, dq, dk, dv, causal=False, window=None, softcap=0.0, scale=None):
    """(O, LSE, bound) in float64 of (B, H, S, D) codes times their descales (() or (B, Hkv)).

    ``bound`` is what the kernel's rounding of P to e4m3 may move each output by: P keeps its
    float32 row sums and each p is rounded to three mantissa bits (relative error at most
    2**-4), so |O - O_ref| <= 2**-4 · Σ p|v| / l, plus bfloat16's rounding of O (2**-8
    relative) and 1e-3 of V's largest value for e4m3's subnormal p and float32 sums. A
    misplaced key, scale or descale moves O by a large part of Σ p|v| / l itself."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    g = hq // hk

    def per_head(x):
        return np.broadcast_to(np.asarray(x, np.float64).reshape(
            (b, hk) if np.ndim(x) == 2 else ()), (b, hk))[:, :, None, None]

    qd = q.astype(np.float64) * np.repeat(per_head(dq), g, axis=1)
    kd = np.repeat(k.astype(np.float64) * per_head(dk), g, axis=1)
    vd = np.repeat(v.astype(np.float64) * per_head(dv), g, axis=1)
    s = qd @ kd.transpose(0, 1, 3, 2) * (scale or 1 / math.sqrt(d))
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    left, right = window if window is not None else (-1, -1)
    right = 0 if causal else right
    seen = np.ones((sq, sk), bool)
    if right is not None and right >= 0:
        seen &= j <= i + right
    if left is not None and left >= 0:
        seen &= j >= i - left
    p, lse = softmax_rows(np.where(seen, s, -np.inf))
    o = p @ vd
    return o, lse, 2.0**-4 * (p @ np.abs(vd)) + 2.0**-8 * np.abs(o) + 1e-3 * np.abs(vd).max()


def codes(rng, shape):
    return (rng.standard_normal(shape) * 2).astype(E4M3)


@pytest.mark.sim
@pytest.mark.parametrize("case", [
    # (b, hq, hk, sq, sk, d, dv, causal, window, softcap, layout, per-head descales)
    (1, 2, 1, 65, 130, 128, 128, True, None, 0.0, "bhsd", True),
    (1, 2, 2, 40, 77, 256, 128, False, (20, 5), 30.0, "bshd", False),
    (1, 1, 1, 100, 40, 32, 32, True, None, 0.0, "bhsd", False),   # rows with no key
], ids=["d128-causal-gqa-per-head", "d256-v128-window-softcap-bshd", "d32-sq>sk"])
def test_against_float64(case):
    """P is rounded to e4m3 (three mantissa bits) for P·V: O within that rounding's bound
    (``reference``; a misplaced key, scale or descale is off by tens of per cent); the LSE
    (from float32 scores) to 1e-5; outputs poisoned with NaN first. (The last case twice, on
    fresh arrays: the second call replays the first one's recorded launches from its
    pointers.)"""
    b, hq, hk, sq, sk, d, dv, causal, window, cap, layout, per_head = case
    for _ in range(2 if d == 32 else 1):
        check_case(b, hq, hk, sq, sk, d, dv, causal, window, cap, layout, per_head)


def check_case(b, hq, hk, sq, sk, d, dv, causal, window, cap, layout, per_head, config=None):
    rng = np.random.default_rng()
    q, k, v = codes(rng, (b, hq, sq, d)), codes(rng, (b, hk, sk, d)), codes(rng, (b, hk, sk, dv))
    if per_head:
        ds = [rng.uniform(lo, hi, (b, hk)).astype(np.float32)
              for lo, hi in ((0.2, 0.6), (0.2, 0.6), (0.5, 2))]
    else:
        ds = [np.asarray(np.float32(x)) for x in (0.3, 0.5, 1.5)]

    def to_layout(x):
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if layout == "bshd" else x

    out = np.full(to_layout(np.empty((b, hq, sq, dv))).shape, np.nan, ml_dtypes.bfloat16)
    got, lse = tilepy.flash_attention(to_layout(q), to_layout(k), to_layout(v), causal=causal,
                                      window=window, softcap=cap, descale_q=ds[0],
                                      descale_k=ds[1], descale_v=ds[2], return_lse=True,
                                      out=out, layout=layout, config=config)
    assert got is out
    got = to_layout(got.astype(np.float64))
    want, want_lse, bound = reference(q, k, v, *ds, causal=causal, window=window, softcap=cap)
    assert not np.isnan(got).any() and not np.isnan(lse).any()
    assert (np.abs(got - want) <= bound).all()
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    assert np.abs(lse[finite] - want_lse[finite]).max() <= 1e-5 * max(1, np.abs(want_lse).max())
    if sq > sk and causal:     # the first sq - sk rows see no key: zeros
        assert (got[:, :, :sq - sk] == 0).all()


@pytest.mark.sim
def test_exponentials_on_the_fma_pipe():
    """``WgmmaAttentionConfig(fma_exp_every=2)``: every other 8-key tile's exponentials by the
    FMA-pipe cubic (relative error 8e-5, far inside e4m3's rounding of P) — the same bounds as
    the default kernel, rows with no key included."""
    import dataclasses

    cfg = dataclasses.replace(af.default_config(32, 32), fma_exp_every=2)
    check_case(1, 2, 1, 100, 40, 32, 32, True, None, 0.0, "bhsd", True, config=cfg)
    with pytest.raises(ValueError, match="fma_exp_every must be 0 or an int in 2"):
        dataclasses.replace(cfg, fma_exp_every=1)


@pytest.mark.sim
def test_edges():
    """No key (zeros and LSE -inf, no launch); a q whose rows are not 16-byte aligned (an
    aligned copy first); a non-positive descale_q · descale_k (NaN for that head, never a
    silently wrong result)."""
    rng = np.random.default_rng()
    q, k, v = codes(rng, (1, 2, 16, 16)), codes(rng, (1, 2, 0, 16)), codes(rng, (1, 2, 0, 16))
    o, lse = tilepy.flash_attention(q, k, v, return_lse=True)
    assert (o.astype(np.float32) == 0).all() and np.isneginf(lse).all()
    k, v = codes(rng, (1, 2, 20, 16)), codes(rng, (1, 2, 20, 16))
    buf = codes(rng, (1 + 2 * 16 * 16,))
    q = buf[1:].reshape(1, 2, 16, 16)                      # base 1 byte past an aligned one
    got = tilepy.flash_attention(q, k, v).astype(np.float64)
    want, _, bound = reference(q, k, v, 1.0, 1.0, 1.0)
    assert (np.abs(got - want) <= bound).all()
    dk = np.array([[1.0, -1.0]], np.float32)               # head 1's product negative
    got = tilepy.flash_attention(q, k, v, descale_k=dk).astype(np.float64)
    assert np.isnan(got[:, 1]).all() and (np.abs(got[:, 0] - want[:, 0]) <= bound[:, 0]).all()


@pytest.mark.sim
@pytest.mark.parametrize("s,d,offset,words", [(37, 24, 0, True), (150, 80, 0, True),
                                              (37, 24, 1, False)])
def test_v_transpose_orders_the_keys(s, d, offset, words):
    """Vᵀ's last axis holds the keys in FP8_KEY_ORDER per 16, zeros past seq_k; a strided
    (bshd) V read in place. By words (:func:`tilepy.tile.transpose.transpose_words_kernel`;
    150 keys × 80 columns: tiles cut in both axes), and by bytes where V's data is not 4-byte
    aligned (``offset``)."""
    from tilepy.tile import transpose as TR

    rng = np.random.default_rng()
    v = rng.integers(1, 255, (2, s, 3, d + offset), dtype=np.uint8)[..., offset:]   # no 0
    view = v.transpose(0, 2, 1, 3)                                  # (b, h, s, d)
    r16 = -(-s // 16) * 16
    vt = np.full((2, 3, d, r16), 255, np.uint8)
    plan, _ = TR.launch_plan(view, vt, key_order=True)
    assert (plan.dispatcher is TR.transpose_words_kernel(True)) == words
    af.transpose_v(view, vt, 0)
    keys = reference_rows(r16, s)
    want = np.where(keys >= 0, view[:, :, np.maximum(keys, 0), :].transpose(0, 1, 3, 2), 0)
    np.testing.assert_array_equal(vt, want)


def test_errors_are_raised_before_launch():
    q = np.zeros((1, 2, 8, 64), E4M3)
    with pytest.raises(TypeError, match="k: dtype float16 is not supported"):
        tilepy.flash_attention(q, q.astype(np.float16), q)
    with pytest.raises(ValueError, match="head_dim 24 is not supported on float8"):
        x = np.zeros((1, 2, 8, 24), E4M3)
        tilepy.flash_attention(x, x, x)
    with pytest.raises(ValueError, match=r"descale_k must hold one value .* \(1, 2\)"):
        tilepy.flash_attention(q, q, q, descale_k=np.ones(3, np.float32))
    with pytest.raises(TypeError, match="descale_v must be float32"):
        tilepy.flash_attention(q, q, q, descale_v=np.ones((), np.float16))
    with pytest.raises(ValueError, match="out must be bfloat16"):
        tilepy.flash_attention(q, q, q, out=np.zeros((1, 2, 8, 64), np.float32))
    with pytest.raises(NotImplementedError, match="alibi_slopes, score_mod"):
        tilepy.flash_attention(q, q, q, alibi_slopes=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="heads_q .3. must be a multiple of heads_kv .2."):
        tilepy.flash_attention(np.zeros((1, 3, 8, 64), E4M3), q, q)
    with pytest.raises(TypeError, match="descale_q / descale_k / descale_v are for float8"):
        h = np.zeros((1, 2, 8, 64), np.float16)
        tilepy.flash_attention(h, h, h, descale_q=np.ones((), np.float32))
    from tilepy.ops.attention_wgmma import WgmmaAttentionConfig
    with pytest.raises(ValueError, match="needs block_n 64 or 128"):
        WgmmaAttentionConfig(128, 128, 96, "float8_e4m3fn", overlap=True, tma=True,
                             producer=True)
    with pytest.raises(ValueError, match="past head_dim 128 needs block_n=64"):
        WgmmaAttentionConfig(256, 128, 128, "float8_e4m3fn", overlap=True, tma=True,
                             producer=True)
    with pytest.raises(ValueError, match="config must be a WgmmaAttentionConfig of dtype"):
        tilepy.flash_attention(q, q, q, config=WgmmaAttentionConfig(64))


# ---- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,hk", [(128, True, 8), (256, False, 32), (64, True, 4)])
def test_gpu_against_float32(d, causal, hk):
    """B2 H32 S2000 (partial blocks), GQA, descales per (batch, K/V head) and per tensor,
    against float32 attention on the dequantised inputs (within e4m3's P rounding); LSE
    against float32; output poisoned with NaN first."""
    torch = pytest.importorskip("torch")
    b, h, s = 2, 32, 2000
    q = (torch.randn(b, h, s, d, device="cuda") * 2).to(torch.float8_e4m3fn)
    k = (torch.randn(b, hk, s, d, device="cuda") * 2).to(torch.float8_e4m3fn)
    v = (torch.randn(b, hk, s, d, device="cuda") * 2).to(torch.float8_e4m3fn)
    dq = torch.rand(b, hk, device="cuda") * 0.4 + 0.2
    dk, dv = torch.tensor(0.4, device="cuda"), torch.tensor(1.5, device="cuda")
    out = torch.full((b, h, s, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    got, lse = tilepy.flash_attention(q, k, v, causal=causal, descale_q=dq, descale_k=dk,
                                      descale_v=dv, return_lse=True, out=out)
    g = h // hk
    qd = q.float() * dq.repeat_interleave(g, 1)[:, :, None, None]
    kd = (k.float() * dk).repeat_interleave(g, 1)
    vd = (v.float() * dv).repeat_interleave(g, 1)
    want = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)
    mag = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd.abs(), is_causal=causal)
    sc = qd @ kd.transpose(-1, -2) / math.sqrt(d)
    if causal:
        sc = sc.masked_fill(torch.ones(s, s, device="cuda", dtype=torch.bool).triu(1),
                            float("-inf"))
    want_lse = torch.logsumexp(sc, -1)
    assert got is out and not torch.isnan(got).any()
    # the bound of ``reference`` (P rounded to e4m3, O to bfloat16), with 2e-3 of V's largest
    # value for the tensor cores' reduced-precision FP8 accumulation of the scores
    bound = 2.0**-4 * mag + 2.0**-8 * want.abs() + 2e-3 * vd.abs().max()
    excess = ((got.float() - want).abs() - bound).max().item()
    assert excess <= 0, excess
    assert (lse - want_lse).abs().max().item() <= 1e-3


@pytest.mark.compile
def test_transpose_compiles_for_sm90():
    """The byte and word transposes (V's with the key order, the FP8 GEMM's plain one): no
    spill, no local memory."""
    from tilepy.offline import find_ptxas, run_in_subprocess

    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reps = run_in_subprocess("tilepy.ops.attention_fp8:compile_reports")
    assert set(reps) == {f"transpose_{unit}{order}" for unit in ("bytes", "words")
                         for order in ("_key_order", "")}
    for rep in reps.values():
        assert "error" not in rep, rep.get("error")
        assert rep["spill_stores"] == 0 and rep["local_bytes"] == 0, rep
        assert rep["counts"]["bar.sync"] >= 1
