"""Triton peers of the benchmark suites: a matmul, a fused softmax, a fused attention forward.

Written for this repository in the standard Triton idioms (grouped tile order + ``tl.dot``
over a few autotuned configs; one row per program; FlashAttention-2 online softmax in base 2),
so that tilepy is compared with what a Triton user gets from a page of code, not with a
tuned library. Imported only where ``import triton`` works (the suites check first).

The matmul and attention take the shapes of the suites: K a multiple of 64; self-attention
(``seq_q == seq_k``) with ``seq`` a multiple of 128 and unit-stride rows. The wrappers raise
``ValueError`` outside that.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _autotune(configs, key):
    """``triton.autotune`` with a short benchmark per config (the default spends ~125 ms on
    each, which adds up over the suites' shapes)."""

    def bench(kernel_call, quantiles):
        return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)

    try:
        return triton.autotune(configs=configs, key=key, do_bench=bench)
    except TypeError:  # a Triton without the do_bench hook
        return triton.autotune(configs=configs, key=key)


# ---- matmul: C = act(A @ B + bias) ------------------------------------------------------------

def _mm_config(bm, bn, warps, stages):
    return triton.Config({"BM": bm, "BN": bn, "BK": 64, "GROUP": 8}, num_warps=warps,
                         num_stages=stages)


MATMUL_CONFIGS = [_mm_config(128, 256, 8, 3), _mm_config(256, 128, 8, 3),
                  _mm_config(128, 128, 8, 4), _mm_config(128, 128, 4, 4),
                  _mm_config(64, 128, 4, 4), _mm_config(64, 64, 4, 4)]


@_autotune(MATMUL_CONFIGS, key=["M", "N", "K", "HAS_BIAS", "GELU"])
@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                   stride_bn, stride_cm, stride_cn, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    # Programs that run together cover a band of GROUP tile rows column by column, so the
    # B tiles they read are shared through L2 instead of each being fetched GROUP times.
    in_band = GROUP * tiles_n
    band_start = (pid // in_band) * GROUP
    band_rows = tl.minimum(tiles_m - band_start, GROUP)
    tm = band_start + (pid % in_band) % band_rows
    tn = (pid % in_band) // band_rows

    rows = tm * BM + tl.arange(0, BM)
    cols = tn * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    # Out-of-range rows / columns read a valid row (wrapped) and are masked at the store.
    a_tile = a_ptr + (rows % M)[:, None] * stride_am + ks[None, :] * stride_ak
    b_tile = b_ptr + ks[:, None] * stride_bk + (cols % N)[None, :] * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(K // BK):
        acc = tl.dot(tl.load(a_tile), tl.load(b_tile), acc)
        a_tile += BK * stride_ak
        b_tile += BK * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols % N).to(tl.float32)[None, :]
    if GELU:
        acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    c = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def matmul(a, b, *, out=None, bias=None, gelu=False):
    """``gelu?(a @ b + bias)`` for 2-D ``a`` (M, K), ``b`` (K, N); float32 accumulation,
    result in ``a``'s dtype (exact erf GELU)."""
    m, k = a.shape
    k2, n = b.shape
    if k != k2 or k % 64:
        raise ValueError(f"matmul peer: needs K equal and a multiple of 64, got {a.shape} @ "
                         f"{b.shape}")
    out = a.new_empty((m, n)) if out is None else out

    def grid(meta):
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

    _matmul_kernel[grid](a, b, out, out if bias is None else bias, m, n, k, a.stride(0),
                         a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                         HAS_BIAS=bias is not None, GELU=gelu)
    return out


# ---- softmax / log-softmax over the last axis, one row per program ----------------------------

@triton.jit
def _softmax_kernel(x_ptr, y_ptr, n, x_row_stride, y_row_stride, BLOCK: tl.constexpr,
                    LOG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=-float("inf"))
    shifted = x.to(tl.float32) - tl.max(x.to(tl.float32), axis=0)
    e = tl.exp(shifted)
    total = tl.sum(e, axis=0)
    if LOG:
        y = shifted - tl.log(total)
    else:
        y = e / total
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


def softmax(x, *, out=None, log=False):
    """Softmax (or log-softmax) of a 2-D ``x`` over its last axis; the whole row in
    registers, so rows up to a few ×10⁴ values."""
    rows, n = x.shape
    if x.stride(1) != 1:
        raise ValueError("softmax peer: rows must have unit stride")
    out = x.new_empty(x.shape) if out is None else out
    block = triton.next_power_of_2(n)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    _softmax_kernel[(rows,)](x, out, n, x.stride(0), out.stride(0), BLOCK=block, LOG=log,
                             num_warps=warps)
    return out


# ---- attention forward ------------------------------------------------------------------------

def _attn_config(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


ATTENTION_CONFIGS = [_attn_config(128, 64, 4, 3), _attn_config(128, 64, 8, 3),
                     _attn_config(128, 128, 8, 3)]


@triton.jit
def _attn_blocks(acc, m_i, l_i, q, k_rows, v_rows, stride_k, stride_v, q_pos, dims, lo, hi,
                 qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Fold keys ``lo … hi`` into the running (acc, row max m_i, row sum l_i), base 2."""
    keys = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k = tl.load(k_rows + (start + keys)[:, None] * stride_k + dims[None, :])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            s = tl.where(q_pos[:, None] >= (start + keys)[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        rescale = tl.exp2(m_i - m_new)
        l_i = l_i * rescale + tl.sum(p, 1)
        v = tl.load(v_rows + (start + keys)[:, None] * stride_v + dims[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None])
        m_i = m_new
    return acc, m_i, l_i


@_autotune(ATTENTION_CONFIGS, key=["SEQ", "HEAD_DIM", "CAUSAL"])
@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, sm_scale, sqb, sqh, sqs, skb, skh, sks, svb,
                      svh, svs, sob, soh, sos, HEADS, GROUP, SEQ, HEAD_DIM: tl.constexpr,
                      CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    blk = tl.program_id(0)
    if CAUSAL:  # the longest query blocks (most keys) start first
        blk = tl.num_programs(0) - 1 - blk
    bh = tl.program_id(1)
    b = (bh // HEADS).to(tl.int64)
    h = (bh % HEADS).to(tl.int64)
    hk = h // GROUP  # grouped-query attention: GROUP query heads share one K/V head
    q_pos = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * sqb + h * sqh + q_pos[:, None] * sqs + dims[None, :])
    k_rows = k_ptr + b * skb + hk * skh
    v_rows = v_ptr + b * svb + hk * svh
    qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x · log2 e)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:
        # Key blocks left of the diagonal need no mask; the diagonal block does.
        diag = blk * BLOCK_M
        acc, m_i, l_i = _attn_blocks(acc, m_i, l_i, q, k_rows, v_rows, sks, svs, q_pos, dims,
                                     0, diag, qk_scale, BLOCK_N, False)
        acc, m_i, l_i = _attn_blocks(acc, m_i, l_i, q, k_rows, v_rows, sks, svs, q_pos, dims,
                                     diag, diag + BLOCK_M, qk_scale, BLOCK_N, True)
    else:
        acc, m_i, l_i = _attn_blocks(acc, m_i, l_i, q, k_rows, v_rows, sks, svs, q_pos, dims,
                                     0, SEQ, qk_scale, BLOCK_N, False)
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * sob + h * soh + q_pos[:, None] * sos + dims[None, :],
             out.to(o_ptr.dtype.element_ty))


def attention(q, k, v, *, causal=False, out=None, scale=None):
    """``softmax(scale · q kᵀ) v`` for (batch, heads, seq, head_dim) tensors; ``k``/``v`` may
    have fewer heads (a divisor of q's: grouped-query attention). Causal: top-left aligned."""
    b, h, s, d = q.shape
    hk = k.shape[1]
    if k.shape != (b, hk, s, d) or v.shape != k.shape or h % hk or s % 128:
        raise ValueError(f"attention peer: needs q (B, H, S, D), k/v (B, Hkv, S, D), S % 128 "
                         f"== 0; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    out = q.new_empty(q.shape) if out is None else out
    if any(t.stride(3) != 1 for t in (q, k, v, out)):
        raise ValueError("attention peer: head_dim must have unit stride")
    scale = d ** -0.5 if scale is None else scale

    def grid(meta):
        return (s // meta["BLOCK_M"], b * h)

    _attention_kernel[grid](q, k, v, out, scale, *q.stride()[:3], *k.stride()[:3],
                            *v.stride()[:3], *out.stride()[:3], h, h // hk, s, HEAD_DIM=d,
                            CAUSAL=causal)
    return out
