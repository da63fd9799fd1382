"""tilepy.flash_attention_backward in the simulator (NumPy arrays) against a float64 NumPy
derivation of FlashAttention's gradients: odd lengths, seq_q != seq_k both ways, rows that see
no key, GQA 6/2 and 6/1, causal and not, both layouts and dtypes, dQ by its own kernel and by
atomics, the wgmma kernels (their twins) with dQ by its kernel and by bulk reductions,
identical bits on repeated deterministic runs, poisoned outputs, bad input; and the offline
sm_90 / sm_90a compile checks of the kernels."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_ops_attention import alibi_like, prefix_lm

from tilepy.ops import attention_backward as ab
from tilepy.ops.attention import flash_attention
from tilepy.ops.attention_backward import choose_config, flash_attention_backward
from tilepy.ops.attention_backward_mma_sync import BackwardConfig
from tilepy.ops.attention_backward_wgmma import WgmmaBackwardConfig

ml_dtypes = pytest.importorskip("ml_dtypes")

pytestmark = pytest.mark.sim

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TOL = {"float16": 4e-3, "bfloat16": 3e-2}


def f64(x):
    return np.asarray(x).astype(np.float64)


def reference(q, k, v, do, causal, scale, window=None, cap=0.0, score_mod=None,
              score_mod_grad=None, mask_mod=None, alibi_slopes=None, mod_args=()):
    """float64 (out, dq, dk, dv) of FlashAttention for (B, H, S, D) arrays: bottom-right
    causal alignment, rows that see no key give zero output and zero gradients, GQA's dk / dv
    summed over each key/value head's query heads. ``window`` (left, right), -1 unbounded:
    key j visible to query i iff i + Sk - Sq - left <= j <= i + Sk - Sq + right (with
    ``causal``, right = 0); ``cap``: the scaled scores soft-capped (cap · tanh(s / cap)), the
    chain rule through the cap derived here; then the user functions (``score_mod`` with its
    derivative ``score_mod_grad``, ``mask_mod``) element by element with ``mod_args`` after
    their fixed parameters, as the forward applies them; ALiBi's ``-slope · |i + Sk - Sq -
    j|`` after the cap (derivative 1)."""
    q, k, v, do = map(f64, (q, k, v, do))
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    group = hq // hk
    kk, vv = np.repeat(k, group, 1), np.repeat(v, group, 1)
    s = scale * q @ kk.transpose(0, 1, 3, 2)
    dcap = 1.0
    if cap:
        th = np.tanh(s / cap)
        s, dcap = cap * th, 1 - th ** 2
    if alibi_slopes is not None:
        slopes = np.broadcast_to(f64(alibi_slopes), (b, hq))[:, :, None, None]
        s = s - slopes * np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :])
    idx = np.meshgrid(*(np.arange(n) for n in s.shape), indexing="ij")

    def each(fn, otype):
        return np.vectorize(lambda *a: fn(*a, *mod_args), otypes=[otype])

    if score_mod is not None:
        dcap = dcap * each(score_mod_grad, np.float64)(s, *idx)
        s = each(score_mod, np.float64)(s, *idx)
    if mask_mod is not None:
        s = np.where(each(mask_mod, bool)(*idx), s, -np.inf)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    diag = np.arange(sq)[:, None] + (sk - sq)
    keep = np.ones((sq, sk), bool)
    if right >= 0:
        keep &= np.arange(sk)[None, :] <= diag + right
    if left >= 0:
        keep &= np.arange(sk)[None, :] >= diag - left
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    seen = np.isfinite(m)
    e = np.exp(s - np.where(seen, m, 0))
    p = np.where(seen, e / np.where(seen, e.sum(-1, keepdims=True), 1), 0)
    out = p @ vv
    dp = do @ vv.transpose(0, 1, 3, 2)
    ds = p * (dp - (do * out).sum(-1, keepdims=True)) * dcap
    dq = scale * ds @ kk
    dk = (scale * ds.transpose(0, 1, 3, 2) @ q).reshape(b, hk, group, sk, d).sum(2)
    dv = (p.transpose(0, 1, 3, 2) @ do).reshape(b, hk, group, sk, do.shape[3]).sum(2)
    return out, dq, dk, dv


def bshd(x):
    return np.ascontiguousarray(np.swapaxes(x, 1, 2))


def close(got, want, dtype, what):
    got = f64(got)
    assert not np.isnan(got).any(), f"{what}: NaN"
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]}"


def run_case(b, hq, hk, sq, sk, d, causal, dtype="float16", layout="bhsd", seed=0,
             window=None, softcap=0.0, mods=None, dv=None, **kw):
    """One backward call against the float64 derivation (``dv``: v's head dim, default d)."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    dv = d if dv is None else dv
    q = rng.standard_normal((b, hq, sq, d)).astype(dt)
    do = rng.standard_normal((b, hq, sq, dv)).astype(dt)
    k = rng.standard_normal((b, hk, sk, d)).astype(dt)
    v = rng.standard_normal((b, hk, sk, dv)).astype(dt)
    if softcap:
        q = (q.astype(np.float32) * 2).astype(dt)     # larger scores: the cap bites
    scale = d ** -0.5
    mods = mods or {}
    variant = dict(window=window, softcap=softcap, **mods)
    _, rq, rk, rv = reference(q, k, v, do, causal, scale, window, softcap, **mods)
    args = (q, k, v, do) if layout == "bhsd" else tuple(map(bshd, (q, k, v, do)))
    out, lse = flash_attention(*args[:3], causal=causal, return_lse=True, layout=layout,
                               **variant)
    poisoned = [np.full_like(x, np.nan) for x in args[:3]]
    got = flash_attention_backward(args[3], *args[:3], out, lse, causal=causal, layout=layout,
                                   dq=poisoned[0], dk=poisoned[1], dv=poisoned[2], **variant,
                                   **kw)
    assert all(g is p for g, p in zip(got, poisoned))
    if layout == "bshd":
        got = tuple(np.swapaxes(g, 1, 2) for g in got)
    for name, g, want in zip(("dq", "dk", "dv"), got, (rq, rk, rv)):
        close(g, want, dtype, name)
    return args, out, lse, got


@pytest.mark.parametrize("b, hq, hk, sq, sk, d, causal, dtype, layout", [
    (1, 2, 1, 40, 50, 32, False, "float16", "bhsd"),     # seq_q < seq_k, GQA 2/1
    (1, 2, 2, 50, 37, 32, True, "bfloat16", "bshd"),     # seq_q > seq_k: rows see no key
    pytest.param(1, 6, 2, 33, 47, 16, True, "float16", "bhsd", marks=pytest.mark.extended),
    (2, 6, 1, 19, 24, 16, False, "bfloat16", "bhsd"),    # MQA 6/1, two batches
    (1, 1, 1, 21, 70, 64, True, "float16", "bshd"),      # head_dim 64, several key blocks
])
def test_against_float64(b, hq, hk, sq, sk, d, causal, dtype, layout):
    run_case(b, hq, hk, sq, sk, d, causal, dtype, layout)


@pytest.mark.parametrize("b, hq, hk, sq, sk, d, dv, causal, dtype, layout, kw", [
    # v narrower (DeepSeek's 192 / 128 in small): GQA, seq_q < seq_k, dQ by its own kernel
    (1, 2, 1, 40, 50, 48, 32, False, "float16", "bhsd", {}),
    # v wider, not a multiple of 16 (40 in a 48-column tile); causal with rows that see no
    # key, bshd, dQ by atomics
    (1, 2, 2, 45, 37, 24, 40, True, "bfloat16", "bshd", {"config": BackwardConfig(
        24, dtype="bfloat16", block_m=32, block_n=32, dq_block_m=32, dq_block_n=32,
        dq_atomic=True, head_dim_v=40)}),
    # the wgmma kernels (sm_90's choice): DeepSeek's 192 / 128 on the 256-column kernel by
    # query halves (the second consumer's dV columns all zero-filled, its dK's 64), causal,
    # GQA 2/1, seq_q < seq_k
    (1, 2, 1, 70, 90, 192, 128, True, "bfloat16", "bshd", {"config": WgmmaBackwardConfig(
        192, dtype="bfloat16", key_groups=1, dq_atomic=True, producer=True,
        split_columns=True, query_halves=True, head_dim_v=128)}),
    # v wider, of the 128-column class where q's is of the 64-column one, on the
    # warp-specialised kernel (dQ by bulk reductions: the accumulator and its converter in
    # the wider tiles), and v narrower on the dK / dV + dQ pair (dQ by its own kernel)
    (1, 2, 1, 90, 70, 64, 128, False, "float16", "bhsd", {"config": WgmmaBackwardConfig(
        64, block_m=64, key_groups=2, dq_atomic=True, producer=True, head_dim_v=128)}),
    (1, 2, 2, 45, 60, 64, 48, True, "float16", "bshd", {"config": WgmmaBackwardConfig(
        64, block_m=32, key_groups=1, dq_groups=1, dq_block_n=32, head_dim_v=48)}),
])
def test_head_dim_v(b, hq, hk, sq, sk, d, dv, causal, dtype, layout, kw):
    """v's head dim other than q's and k's: the kernels' tiles those of the wider (the
    mma.sync kernels' as wide, the wgmma kernels' of its class), each operand zero-filled
    past its own head dim; dV (and out, dout) in v's, dQ / dK in q's, against the float64
    derivation."""
    run_case(b, hq, hk, sq, sk, d, causal, dtype, layout, dv=dv, **kw)
    if not kw:
        assert choose_config(d, dtype, head_dim_v=dv).dv == dv


def test_head_dim_v_errors():
    """A config for another v head dim, and dout of q's shape instead of out's: clear errors
    before launch."""
    q = np.zeros((1, 2, 8, 48), np.float16)
    v = np.zeros((1, 2, 8, 32), np.float16)
    out, lse = flash_attention(q, q, v, return_lse=True)
    with pytest.raises(ValueError, match="config is for v's head_dim 48; v's is 32"):
        flash_attention_backward(out, q, q, v, out, lse, config=BackwardConfig(
            48, block_m=32, block_n=32, dq_block_m=32, dq_block_n=32))
    with pytest.raises(ValueError, match="dout must have out's shape"):
        flash_attention_backward(q, q, q, v, out, lse)
    with pytest.raises(ValueError, match="head_dim_v must be None or one of"):
        BackwardConfig(48, head_dim_v=36)


@pytest.mark.parametrize("b, hq, hk, sq, sk, causal, window, softcap, layout, kw", [
    # Mistral's sliding window under causal: rows (and a whole query block) that see no key
    (1, 4, 2, 45, 29, True, (7, 0), 0.0, "bhsd", {}),
    # bounded on both sides, seq_q < seq_k, bshd; dQ by atomics
    (1, 2, 1, 40, 77, False, (9, 4), 0.0, "bshd", {"config": BackwardConfig(
        32, block_m=32, block_n=32, dq_block_m=32, dq_block_n=32, dq_atomic=True)}),
    # a soft cap alone, and with a left-only window, bfloat16 in the second
    pytest.param(1, 2, 2, 37, 37, False, None, 3.0, "bhsd", {}, marks=pytest.mark.extended),
    (1, 2, 1, 40, 53, False, (16, -1), 2.5, "bhsd", {"dtype": "bfloat16"}),
])
def test_windows_and_softcap(b, hq, hk, sq, sk, causal, window, softcap, layout, kw):
    """The forward's variants through the backward: the window's query ranges (dK / dV) and
    key ranges (dQ), the cap's derivative chained into dS, against the float64 derivation."""
    run_case(b, hq, hk, sq, sk, 32, causal, layout=layout, window=window, softcap=softcap,
             **kw)


def user_cap(score, b, h, q_idx, kv_idx):
    return 4.0 * math.tanh(score * 0.25)


def user_cap_grad(score, b, h, q_idx, kv_idx):
    t = math.tanh(score * 0.25)
    return 1.0 - t * t


def one(score, b, h, q_idx, kv_idx):
    return 1.0


@pytest.mark.parametrize("b, hq, hk, sq, sk, causal, layout, mods, kw", [
    # a nonlinear score_mod (the user's own cap) and prefix-LM: both kernels' index maps
    (1, 2, 1, 40, 50, False, "bhsd",
     dict(score_mod=user_cap, score_mod_grad=user_cap_grad, mask_mod=prefix_lm), {}),
    # a bias (derivative 1) under causal, GQA, bshd, bfloat16; dQ by atomics
    (1, 4, 2, 45, 45, True, "bshd", dict(score_mod=alibi_like, score_mod_grad=one),
     {"dtype": "bfloat16", "config": BackwardConfig(32, dtype="bfloat16", block_m=32,
                                                    block_n=32, dq_block_m=32, dq_block_n=32,
                                                    dq_atomic=True)}),
])
def test_user_functions(b, hq, hk, sq, sk, causal, layout, mods, kw):
    """The forward's user functions through the backward (the derivative of score_mod given
    by the user, mask_mod's hidden keys out of every gradient) against the float64
    derivation with the same functions."""
    run_case(b, hq, hk, sq, sk, 32, causal, layout=layout, mods=mods, **kw)


def table_bias_grad(score, b, h, q_idx, kv_idx, doc_q, doc_k, table, span):
    return 1.0


@pytest.mark.parametrize("b, hq, hk, sq, sk, causal, layout, kw", [
    # ALiBi per head under causal, GQA; a second call with other slopes through the plan
    pytest.param(1, 2, 1, 45, 45, True, "bhsd", {}, marks=pytest.mark.extended),
    # per (batch, head) slopes, seq_q < seq_k, a cap, bshd; dQ by atomics
    (2, 2, 1, 30, 50, False, "bshd", {"config": BackwardConfig(
        32, block_m=32, block_n=32, dq_block_m=32, dq_block_n=32, dq_atomic=True)}),
])
def test_alibi_slopes(b, hq, hk, sq, sk, causal, layout, kw):
    """alibi_slopes= through the backward (the bias's derivative 1, both kernels' index maps)
    against the float64 derivation; called twice with new slopes (the cached plans take the
    new pointer)."""
    rng = np.random.default_rng()
    for seed in range(2):
        slopes = rng.uniform(0.05, 0.5, (b, hq) if b > 1 else (hq,)).astype(np.float32)
        run_case(b, hq, hk, sq, sk, 32, causal, layout=layout, seed=seed,
                 softcap=3.0 if b > 1 else 0.0, mods={"alibi_slopes": slopes}, **kw)


def test_mod_args_document_mask_and_bias_table():
    """mod_args= read by mask_mod, score_mod and score_mod_grad in both backward kernels: a
    document mask and a bias table with a number, against float64; twice with new ids and a
    new table (the cached plans take the new pointers)."""
    from test_ops_attention import documents, same_document, table_bias

    rng = np.random.default_rng()
    b, hq, hk, sq, sk = 2, 2, 1, 37, 37
    for seed in range(2):
        ids = documents(rng, b, sq, 3)
        args = (ids, ids, rng.standard_normal((hq, 9)).astype(np.float32), 4)
        run_case(b, hq, hk, sq, sk, 32, True, seed=seed, mods=dict(
            score_mod=table_bias, score_mod_grad=table_bias_grad,
            mask_mod=lambda bb, h, i, j, dq, dk, t, sp: same_document(bb, h, i, j, dq, dk),
            mod_args=args))


def test_user_functions_need_score_mod_grad():
    x = np.ones((1, 1, 8, 32), np.float16)
    lse = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(TypeError, match="a score_mod needs its derivative"):
        flash_attention_backward(x, x, x, x, x, lse, score_mod=alibi_like)
    with pytest.raises(TypeError, match="score_mod_grad was given without score_mod"):
        flash_attention_backward(x, x, x, x, x, lse, score_mod_grad=one)
    with pytest.raises(TypeError, match="score_mod_grad .*must take 5 positional"):
        flash_attention_backward(x, x, x, x, x, lse, score_mod=alibi_like,
                                 score_mod_grad=prefix_lm)


@pytest.mark.parametrize("atomic", [False, True])
def test_keys_past_the_end_stay_out_of_dq(atomic):
    """Scores all about -23 (LSE about -19): the zero-filled keys past seq_k in the last key
    block would get P = exp(19), past float16's range, and dS · K = inf · 0 = NaN in dQ
    unless they are masked out as keys, not only by the causal bound."""
    d, sq, sk = 32, 20, 50
    rng = np.random.default_rng()
    q = np.full((1, 1, sq, d), 2.0, np.float16)
    k = (-2.0 + 0.1 * rng.standard_normal((1, 1, sk, d))).astype(np.float16)
    v, do = (rng.standard_normal(x.shape).astype(np.float16) for x in (k, q))
    scale = d ** -0.5
    _, rq, rk, rv = reference(q, k, v, do, False, scale)
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert float(np.asarray(lse).max()) < -15
    cfg = BackwardConfig(32, dtype="float16", block_m=32, block_n=32, dq_block_m=32,
                         dq_block_n=32, dq_atomic=atomic)
    got = flash_attention_backward(do, q, k, v, out, lse, config=cfg)
    # dQ = scale · dS K with K ≈ -2 everywhere and Σ_j dS_ij = 0: the keys' common part
    # cancels, so dS's rounding to float16 before the product (relative 2**-11 each, as
    # FlashAttention rounds it) is not small against dQ — bounded element by element by
    # scale · |dS| @ |K| · 2**-11 (measured at most 0.37 of it over 24 seeds; a fixed 1e-2 of
    # max |dQ| failed once in CI at 1.06e-2)
    Q, K, V, dO = (f64(x)[0, 0] for x in (q, k, v, do))
    s = scale * Q @ K.T
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ds = p * (dO @ V.T - (dO * (p @ V)).sum(1, keepdims=True))
    dq_bound = scale * np.abs(ds) @ np.abs(K) * 2.0 ** -11 + 1e-3 * np.abs(rq).max()
    for name, g, want in zip(("dq", "dk", "dv"), got, (rq, rk, rv)):
        g = f64(g)
        assert np.isfinite(g).all(), f"{name}: not finite"
        if name == "dq":
            excess = (np.abs(g - want)[0, 0] / dq_bound).max()
            assert excess <= 1, f"dq: {excess:.2f} times dS's rounding bound"
        else:
            err = np.abs(g - want).max() / np.abs(want).max()
            assert err <= 1e-2, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("b, hq, hk, sq, sk, d, causal, dtype, layout, kw", [
    pytest.param(1, 2, 1, 33, 41, 24, True, "float16", "bhsd", {},   # 32-column tiles
                 marks=pytest.mark.extended),
    (1, 2, 2, 30, 37, 40, False, "bfloat16", "bshd", {"config": BackwardConfig(
        40, dtype="bfloat16", block_m=32, block_n=32, dq_block_m=32, dq_block_n=32,
        dq_atomic=True)}),                                  # 48 columns, dQ by atomics
    (1, 2, 1, 21, 30, 200, True, "bfloat16", "bshd", {}),    # past 128: 208 columns
])
def test_padded_head_dims(b, hq, hk, sq, sk, d, causal, dtype, layout, kw):
    """head_dim a multiple of 8 but not of 16: both backward kernels' tiles zero-padded to
    the next multiple of 16 by the copies, only head_dim's columns of dQ / dK / dV stored
    (the dQ accumulator of the atomic path tile_dim wide), against the float64 derivation."""
    run_case(b, hq, hk, sq, sk, d, causal, dtype, layout, **kw)


@pytest.mark.extended   # (the atomic dQ path also runs in windows, user functions, ALiBi)
def test_dq_by_atomics():
    cfg = BackwardConfig(32, dtype="float16", block_m=32, block_n=32, dq_block_m=32,
                         dq_block_n=32, dq_atomic=True)
    run_case(1, 4, 2, 45, 70, 32, True, config=cfg)


@pytest.mark.parametrize("d, cfg, case", [
    # one 64-key warpgroup, dQ by its kernel over 32-key steps; causal, seq_q > seq_k, GQA
    (64, dict(block_m=32, key_groups=1, dq_groups=1, dq_block_n=32),
     (1, 2, 1, 90, 50, True, "bfloat16", "bshd")),
    # dQ through stmatrix, wgmma partials and bulk reductions, both 64-column slices of
    # head_dim 128 from one warpgroup
    pytest.param(128, dict(block_m=64, key_groups=1, dq_groups=1, dq_block_n=32,
                           dq_atomic=True),
                 (1, 2, 2, 40, 70, False, "float16", "bhsd"), marks=pytest.mark.extended),
    # the warp-specialised kernel (cp.async producer ring, two consumer warpgroups, per-warp
    # bulk reductions): head_dim 128 splits dQ's columns between the consumers (causal, the
    # default; GQA: 4 query blocks per key block, the ring wraps), head_dim 64 gives each
    # consumer its own keys
    (128, dict(block_m=64, key_groups=2, dq_atomic=True, producer=True),
     (1, 2, 1, 70, 100, True, "float16", "bhsd")),
    pytest.param(64, dict(block_m=64, key_groups=2, dq_atomic=True, producer=True),
                 (1, 1, 1, 150, 90, True, "bfloat16", "bshd"), marks=pytest.mark.extended),
    # head_dim 128 with each consumer's dQ over its own keys and all columns (no barrier
    # between the consumers; two slices staged and reduced per warp)
    pytest.param(128, dict(block_m=64, key_groups=2, dq_atomic=True, producer=True,
                           dq_own_keys=True),
                 (1, 1, 1, 90, 140, False, "bfloat16", "bshd"), marks=pytest.mark.extended),
    # head dims between the tile widths, zero-filled by the copies, stored to their own
    # columns: 96 on the warp-specialised kernel (dQ's second slice half padding, its
    # conversion storing 32 of its 64 columns), 40 on dK / dV then dQ's own kernel
    (96, dict(block_m=64, key_groups=2, dq_atomic=True, producer=True),
     (1, 2, 1, 70, 90, True, "bfloat16", "bshd")),
    (40, dict(block_m=32, key_groups=1, dq_groups=1, dq_block_n=32),
     (1, 2, 2, 50, 40, False, "float16", "bhsd")),
    # past 128: the warp-specialised kernel with dK / dV / dQ's columns split between its
    # two consumers over the same 64 keys, dQ staged in the step's ring slot (swizzled rows,
    # the slot released a step later: GQA's several steps); each consumer computing the whole
    # Sᵀ / dPᵀ (opt-in, extended): 256 causal with GQA and seq_q > seq_k (keys past the end
    # zero-filled), 200 zero-filled to 256 (the second consumer stores 72 of its 128
    # columns, dQ's last slice half padding)
    pytest.param(256, dict(block_m=64, key_groups=1, dq_atomic=True, producer=True,
                           split_columns=True),
                 (1, 2, 1, 90, 70, True, "float16", "bhsd"), marks=pytest.mark.extended),
    pytest.param(200, dict(block_m=64, key_groups=1, dq_atomic=True, producer=True,
                           split_columns=True),
                 (1, 1, 1, 70, 130, False, "bfloat16", "bshd"), marks=pytest.mark.extended),
    # the same with Sᵀ / dPᵀ by query halves (P and dS through shared boxes, one barrier of
    # both consumers a step): 256 causal GQA (extended: causal is the packed d136 case's in
    # tests/test_ops_attention_varlen.py, GQA the d192 window's in test_wgmma_variants), 136
    # (one stored n8 block past 128)
    pytest.param(256, dict(block_m=64, key_groups=1, dq_atomic=True, producer=True,
                           split_columns=True, query_halves=True),
                 (1, 2, 1, 90, 70, True, "bfloat16", "bhsd"), marks=pytest.mark.extended),
    (136, dict(block_m=64, key_groups=1, dq_atomic=True, producer=True, split_columns=True,
               query_halves=True), (1, 1, 1, 70, 130, False, "float16", "bshd")),
], ids=["d64-causal-gqa", "d128-atomic-one-warpgroup", "d128-ws-causal", "d64-ws",
        "d128-ws-own-keys", "d96-ws-padded", "d40-padded", "d256-ws-split-columns",
        "d200-ws-split-columns-padded", "d256-ws-split-columns-halves",
        "d136-ws-split-columns-halves-padded"])
def test_wgmma_kernels(d, cfg, case):
    b, hq, hk, sq, sk, causal, dtype, layout = case
    run_case(b, hq, hk, sq, sk, d, causal, dtype, layout,
             config=WgmmaBackwardConfig(d, dtype=dtype, **cfg))


def ws_config(d, dtype="float16", **kw):
    return WgmmaBackwardConfig(d, dtype=dtype, block_m=64, key_groups=2, dq_atomic=True,
                               producer=True, **kw)


@pytest.mark.parametrize("d, cfg, case, variant", [
    # the warp-specialised kernel: a window bounded on both sides with a soft cap (a query
    # block range per key block at both ends), GQA 2/1, seq_q < seq_k
    (64, ws_config(64), (1, 2, 1, 70, 100, False, "float16", "bhsd"),
     dict(window=(20, 9), softcap=3.0)),
    # dK / dV then dQ's own kernel (deterministic): a nonlinear score_mod with its derivative,
    # prefix-LM as mask_mod and ALiBi under causal, bfloat16, bshd
    (64, WgmmaBackwardConfig(64, dtype="bfloat16", block_m=32, key_groups=1, dq_groups=1,
                             dq_block_n=32),
     (1, 2, 1, 50, 70, True, "bfloat16", "bshd"),
     dict(mods=dict(score_mod=user_cap, score_mod_grad=user_cap_grad, mask_mod=prefix_lm,
                    alibi_slopes=np.array([0.3, 0.1], np.float32)), deterministic=True)),
    # Mistral's sliding window under causal on the warp-specialised kernel at head_dim 128
    # (dQ's columns split between the consumers): whole query blocks that see no key
    pytest.param(128, ws_config(128), (1, 2, 2, 90, 60, True, "float16", "bhsd"),
                 dict(window=(7, 0)), marks=pytest.mark.extended),
    # past 128 by query halves: a window on both sides with a soft cap (each consumer's
    # 32 queries: the window's diagonal and the cap's derivative at its columns), GQA 2/1
    (192, WgmmaBackwardConfig(192, dtype="bfloat16", key_groups=1, dq_atomic=True,
                              producer=True, split_columns=True, query_halves=True),
     (1, 2, 1, 70, 100, False, "bfloat16", "bshd"), dict(window=(20, 9), softcap=3.0)),
])
def test_wgmma_variants(d, cfg, case, variant):
    """The forward's variants on the wgmma kernels (their twins): the window's query ranges
    in the dK / dV kernels and key ranges in dQ's, the cap's and the user's derivatives
    chained into dS, the hook's indices in both layouts (Sᵀ and S), against float64."""
    b, hq, hk, sq, sk, causal, dtype, layout = case
    run_case(b, hq, hk, sq, sk, d, causal, dtype, layout, config=cfg, **variant)


@pytest.mark.parametrize("cfg", [
    WgmmaBackwardConfig(64, block_m=64, key_groups=2, dq_atomic=True, producer=True),
    BackwardConfig(64, block_m=32, block_n=32, dq_block_m=32, dq_block_n=32, dq_atomic=True)],
    ids=["wgmma-fused", "mma-sync-atomic"])
def test_a_strided_or_misaligned_dq_takes_element_stores(cfg):
    """dQ's converter (the atomic paths) into a caller's ``dq`` whose head-dim elements are
    not adjacent, or whose rows are not 16-byte aligned: element stores instead of the
    16-byte vector stores (which would write the wrong elements or fault); the elements
    between untouched."""
    rng = np.random.default_rng()
    dt = DTYPES["float16"]
    q, do = (rng.standard_normal((1, 2, 70, 64)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, 80, 64)).astype(dt) for _ in range(2))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    _, want, _, _ = reference(q, k, v, do, True, 64 ** -0.5)
    stepped = np.full((1, 2, 70, 128), np.nan, dt)
    shifted = np.full((1, 2, 70, 65), np.nan, dt)
    for dq, rest in ((stepped[..., ::2], stepped[..., 1::2]),
                     (shifted[..., 1:], shifted[..., :1])):
        flash_attention_backward(do, q, k, v, out, lse, causal=True, dq=dq, config=cfg)
        close(dq, want, "float16", "dq")
        assert np.isnan(f64(rest)).all()


def test_rows_without_keys_get_zero_gradients_and_bits_repeat():
    """Whole query blocks that see no key (seq_q well past seq_k, causal): dq exactly 0 there;
    two deterministic runs give the same bits."""
    args, out, lse, got = run_case(1, 2, 1, 70, 20, 16, True, deterministic=True, seed=3)
    assert np.all(f64(got[0])[:, :, :50] == 0)
    again = flash_attention_backward(args[3], *args[:3], out, lse, causal=True,
                                     deterministic=True)
    for g, h in zip(got, again):
        assert np.array_equal(np.asarray(g).view(np.uint16), np.asarray(h).view(np.uint16))


def test_empty_key_sequence_and_cached_plan():
    rng = np.random.default_rng(1)
    q, do = (rng.standard_normal((1, 1, 17, 16)).astype(np.float16) for _ in range(2))
    k = v = np.zeros((1, 1, 0, 16), np.float16)
    out, lse = flash_attention(q, k, v, return_lse=True)
    dq, dk, dv = flash_attention_backward(do, q, k, v, out, lse)
    assert dk.shape == (1, 1, 0, 16) and np.all(f64(dq) == 0)
    # the same signature again, new contents: the cached plan with new pointers
    k2, v2 = (rng.standard_normal((1, 1, 23, 16)).astype(np.float16) for _ in range(2))
    for seed in (4, 5):
        q2 = np.random.default_rng(seed).standard_normal((1, 1, 17, 16)).astype(np.float16)
        o2, l2 = flash_attention(q2, k2, v2, return_lse=True)
        got = flash_attention_backward(do, q2, k2, v2, o2, l2)
        for name, g, want in zip(("dq", "dk", "dv"), got,
                                 reference(q2, k2, v2, do, False, 0.25)[1:]):
            close(g, want, "float16", f"{name} (seed {seed})")


@pytest.mark.parametrize("b, hq, hk, limit", [
    (3, 1, 1, 2),    # batch (grid z) past the limit
    (1, 6, 2, 2),    # GQA: the dQ kernel's groups (3 heads) larger than the limit
    pytest.param(1, 6, 1, 4, marks=pytest.mark.extended),   # one K/V head for all
])
def test_heads_and_batches_past_the_grid_limit(monkeypatch, b, hq, hk, limit):
    """Every backward launch with more heads or batches than the grid's y / z limit
    (tilepy.launch.MAX_GRID_YZ, lowered) runs in chunks; twice, the second time through the
    bound plans with new data."""
    from tilepy import launch
    from tilepy.ops import attention as at

    monkeypatch.setattr(launch, "MAX_GRID_YZ", limit)
    at._PLANS.clear()
    ab._PLANS.clear()
    try:
        for seed in (0, 1):
            run_case(b, hq, hk, 9, 12, 16, True, seed=seed)
        (entry,) = ab._PLANS.values()
        assert any(bound.plan.chunks for bound in entry[0])
    finally:
        at._PLANS.clear()
        ab._PLANS.clear()


def test_split_columns_refuse_deterministic():
    """The split-column kernel takes dQ by atomics only: a deterministic call with it is a
    clear error before anything launches."""
    with pytest.raises(NotImplementedError, match="atomics only"):
        run_case(1, 1, 1, 10, 10, 136, False, deterministic=True,
                 config=WgmmaBackwardConfig(136, key_groups=1, dq_atomic=True, producer=True,
                                            split_columns=True))
    with pytest.raises(ValueError, match="past 128"):
        WgmmaBackwardConfig(256, key_groups=2, dq_atomic=True, producer=True)


def test_config_choice_and_checks(monkeypatch):
    assert choose_config(64, "float16").head_dim == 64
    # on sm_90: the fused kernel at head_dim 128 unless deterministic, dQ's own kernel else
    monkeypatch.setattr(ab.arrays, "SIMULATOR", False)
    monkeypatch.setattr(ab.launch, "is_hopper", lambda: True)
    assert choose_config(128, "bfloat16").producer
    assert not choose_config(128, "bfloat16", deterministic=True).dq_atomic
    assert not choose_config(64, "float16").dq_atomic
    # past 128: the split-column wgmma kernel with WGMMA_WIDE unless deterministic (the
    # mma.sync kernels then, and always without the switch)
    monkeypatch.setattr(ab, "WGMMA_WIDE", True)
    wide = choose_config(192, "bfloat16")
    assert wide.split_columns and wide.query_halves and wide.width == 256 and wide.threads == 384
    assert isinstance(choose_config(256, "float16", deterministic=True), BackwardConfig)
    monkeypatch.setattr(ab, "WGMMA_WIDE", False)
    assert isinstance(choose_config(256, "float16"), BackwardConfig)
    monkeypatch.setattr(ab, "WGMMA_WIDE", True)
    # variants on the wgmma kernels there too
    assert isinstance(choose_config(128, "bfloat16", variant=True), WgmmaBackwardConfig)
    # head dims between the widths: the wgmma kernels of the wider tile from 40 up
    c96 = choose_config(96, "float16")
    assert isinstance(c96, WgmmaBackwardConfig) and c96.producer and c96.width == 128
    assert choose_config(40, "float16").width == 64
    assert isinstance(choose_config(32, "float16"), BackwardConfig)
    monkeypatch.setattr(ab, "WGMMA_PADDED", False)        # the switch back: 64 / 128 only
    assert isinstance(choose_config(96, "float16"), BackwardConfig)
    assert isinstance(choose_config(64, "float16"), WgmmaBackwardConfig)
    monkeypatch.setattr(ab, "WGMMA_PADDED", True)
    from tilepy.ops.attention_varlen import choose_backward_config

    # packed sequences: the pair whose dQ has its own kernel up to 128 (as fast there), the
    # fused kernel past it unless deterministic (the mma.sync kernels then)
    from tilepy.ops import attention_varlen as av

    for d in (64, 96, 128):
        for det in (False, True):
            packed = choose_backward_config(d, "bfloat16", det)
            assert isinstance(packed, WgmmaBackwardConfig) and not packed.dq_atomic, packed
    wide = choose_backward_config(256, "bfloat16", False)
    assert wide.split_columns and wide.query_halves, wide
    assert isinstance(choose_backward_config(256, "bfloat16", True), BackwardConfig)
    monkeypatch.setattr(av, "BACKWARD_FUSED_MIN_HEAD_DIM", 72)
    assert choose_backward_config(128, "bfloat16", False).producer
    monkeypatch.setattr(av, "BACKWARD_FUSED_MIN_HEAD_DIM", 136)
    assert isinstance(choose_backward_config(32, "bfloat16", False), BackwardConfig)
    assert isinstance(choose_backward_config(64, "bfloat16", False, 32), BackwardConfig)
    with pytest.raises(ValueError, match="producer"):
        WgmmaBackwardConfig(128, producer=True)
    with pytest.raises(ValueError, match="dq_own_keys"):
        WgmmaBackwardConfig(128, dq_own_keys=True)
    own = WgmmaBackwardConfig(128, key_groups=2, dq_atomic=True, producer=True,
                              dq_own_keys=True)
    assert own.own_keys and own.dq_jobs == 2 and own.dkdv_layout.nbytes <= 227 * 1024
    # every head dim has a valid built-in config off Hopper (the mma.sync kernels' split of
    # dQ's columns over warps; the H200 found 72 without one)
    monkeypatch.setattr(ab.launch, "is_hopper", lambda: False)
    for d in range(8, 129, 8):
        for dtype in ("float16", "bfloat16"):
            assert choose_config(d, dtype).head_dim == d
            assert choose_config(d, dtype, variant=True).head_dim == d
    monkeypatch.undo()
    with pytest.raises(ValueError, match="multiple of 16"):
        BackwardConfig(64, block_m=24)
    with pytest.raises(ValueError, match="head_dim"):
        BackwardConfig(36)


def test_bad_input_is_named():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, 9, 16)).astype(np.float16)
    out, lse = flash_attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="dout must have out's shape"):
        flash_attention_backward(q[:, :1], q, q, q, out, lse)
    with pytest.raises(ValueError, match="lse must be float32 of shape"):
        flash_attention_backward(q, q, q, q, out, lse[:, :, :4])
    with pytest.raises(TypeError, match="needs the forward's lse"):
        flash_attention_backward(q, q, q, q, out, None)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attention_backward(q, q, q, q, out, lse, deterministic=1)
    with pytest.raises(ValueError, match="dk must have k's shape"):
        flash_attention_backward(q, q, q, q, out, lse, dk=q[:, :1])
    with pytest.raises(ValueError, match="config is for head_dim 32"):
        flash_attention_backward(q, q, q, q, out, lse, config=BackwardConfig(32))
    with pytest.raises(ValueError, match="out must have shape"):
        flash_attention_backward(q, q, q, q, out[:, :1], lse)
    with pytest.raises(ValueError, match="window right must be an int >= 0"):
        flash_attention_backward(q, q, q, q, out, lse, window=(3, -5))
    with pytest.raises(ValueError, match="softcap must be 0.0"):
        flash_attention_backward(q, q, q, q, out, lse, softcap=-2.0)


@pytest.mark.compile
@pytest.mark.parametrize("part", ["core", "rest",
                                  pytest.param("extended", marks=pytest.mark.extended)])
def test_kernels_compile_without_spills(part):
    """mma.sync kernels for sm_90, wgmma ones for sm_90a: no local memory, spills only where
    measured and accepted (the mma.sync dK / dV kernel at head_dim 128, the wgmma atomic
    path at head_dim 128), no serialised wgmmas, every product on wgmma there."""
    from tilepy.offline import find_ptxas, run_in_subprocess

    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    from tilepy.ops import attention_backward_wgmma as bwg

    # core: the mma.sync kernels (two of them the window + soft-cap variants, two the packed
    # sequences: 68 B of spill stores in the dK / dV kernel at head_dim 128, offline sm_90)
    # and the wgmma ones of the built-in choices' shapes; rest: the other wgmma ones a
    # built-in choice runs; extended: those only config= reaches
    reports = run_in_subprocess(f"tilepy.ops.attention_backward_wgmma:compile_reports_{part}")
    if part == "core":
        reports.update(run_in_subprocess(
            "tilepy.ops.attention_backward_mma_sync:compile_reports"))
    assert len(reports) == {
        "core": 10 + len(bwg.CORE_COMPILED), "extended": len(bwg.EXTENDED_COMPILED),
        "rest": len(bwg.COMPILED) - len(bwg.CORE_COMPILED) - len(bwg.EXTENDED_COMPILED)}[part]
    for name, rep in reports.items():
        assert "error" not in rep, rep.get("error")
        c = rep["counts"]
        assert rep["local_bytes"] == 0 and rep["f64"] == 0, (name, rep)
        assert 0 < rep["registers"] <= 255, name
        # (d96: the 128-column tiles, as spilling as d128's)
        spills = 128 if ("d128" in name or "d96" in name) and (
            "atomic" in name or "_ws_" in name or "wgmma" not in name) else 0
        # measured and accepted: the soft cap's derivative fragment (float16 pairs) beside dK
        # / dV (104 B in the warp-specialised kernel, 64 B in the dK / dV kernel at 255
        # registers; on the H100 the window / soft-cap / ALiBi backward ran 1.7-2.0x faster
        # there than on the mma.sync kernels), and 4 B in the plain dK / dV kernel at
        # head_dim 128 (no change in its time against the tree before, bench/NOTES.md
        # "Session 32")
        spills = {"bwd_wgmma_ws_d128_bf16_window_softcap": 128,
                  "bwd_wgmma_dkdv_d128_f16_window_softcap": 80,
                  "bwd_wgmma_dkdv_d128_bf16_causal": 8,
                  # (config= only: causal blocks heaviest first, 116 B without)
                  "bwd_wgmma_dkdv_d128_f16_atomic_1wg": 144,
                  # packed sequences: the sequence's bounds and offsets held beside the
                  # 255-register loop (the mma.sync packed dK / dV kernel spills 68 B)
                  "bwd_wgmma_dkdv_d128_bf16_causal_varlen": 96,
                  # and in the warp-specialised kernel past 128 (dQ by bulk reductions),
                  # with the producer's 40 registers (WS_REGISTERS_SPARSE; 136 B in 24)
                  "bwd_wgmma_ws_d256_bf16_causal_halves_varlen": 16,
                  # past 128 (columns split between the consumers): the consumers' per-thread
                  # constants held across the loop, as at d128 (60 B at 256, 76 B at 192)
                  "bwd_wgmma_ws_d256_bf16_causal": 64,
                  "bwd_wgmma_ws_d192_f16": 80,
                  # (by query halves, the producer in 40 registers: none)
                  }.get(name, spills)
        assert rep["spill_stores"] <= spills, (name, rep["spill_stores"])
        if "wgmma" in name:
            assert rep["ptxas_wgmma_notes"] == [], (name, rep["ptxas_wgmma_notes"])
            assert c["mma"] == 0, name
            # at most one 64-bit division (a call in the machine code, which serialises every
            # wgmma where the kernel is linked without link-time optimisation): the block's
            # GQA group, once per block (in 32 bits the window / soft-cap kernel spilled 328 B
            # instead of 108 offline); the dense step walk divides in 32 bits
            assert c["div64"] <= 1, (name, c["div64"])
            # dK/dV (and the fused kernel): Sᵀ, dPᵀ (D/16 steps each), dV, dK (block_m/16
            # each) [+ dQ]; dQ: S, dP, dQ
            assert c["wgmma.mma_async"] >= (16 if "dkdv" in name or "_ws_" in name else 12), \
                (name, c)
        else:
            assert c["mma"] >= 64 and c["ldmatrix"] >= 16, (name, c)
