"""The online-softmax update of FlashAttention, on mma accumulator fragments in registers.

A warp streams over key blocks. For each block it has the scores ``S = Q Kᵀ`` of its
``mi*16`` query rows against the block's ``ni*8`` keys as an accumulator fragment, and keeps
per row a running max ``m`` and a running sum ``l``. With ``c = scale_log2`` (the softmax
scale times log2(e)) the softmax of row ``r`` is ``exp2(c·s - c·m) / l``;
:func:`online_softmax_update` turns each block's scores into ``p = exp2(c·s - c·m_new)`` in
place, and gives the factor ``alpha = exp2(c·(m_old - m_new))`` by which the caller rescales
the output accumulator rows before adding ``p @ V``. :func:`online_softmax_finalize` divides
the output rows by ``l`` at the end::

    m[:] = -inf; l[:] = 0; acc_o[:] = 0
    for each key block:
        S = Q @ K_blockᵀ                                   (scores: acc[mi, ni, 4])
        update(S, m, l, alpha, scale_log2)                 (S now holds p)
        acc_o[i, :, 2h:2h+2] *= alpha[i, h]; acc_o += p @ V_block
    finalize(acc_o, l)

Layouts: ``scores`` (mi, ni, 4) and ``acc_o`` (mi, nd, 4) float32 local arrays in the m16n8
accumulator layout (:mod:`tilepy.ptx.fragments`; lane ``4g + t`` holds rows ``g`` in
``[..., 0:2]`` and ``g + 8`` in ``[..., 2:4]`` of each m16 tile); the row statistics are
(mi, 2) float32 local arrays, ``[i, h]`` for row ``16 i + g + 8 h`` of the warp tile, equal on
the 4 lanes of a quad. Who calls: one warp, all 32 lanes together (quad shuffles). A wgmma
kernel's flat accumulators are viewed in this layout with :func:`accumulator_fragment` (mi = 1:
each warp's 16-row strip of the warpgroup's 64 rows).

Fully masked rows (every score so far -inf) stay clean, as in FlashAttention: ``m`` stays
-inf, ``alpha`` is 1, ``p`` is 0, ``l`` is 0, and the finalized row is 0 — no NaN. A NaN
score makes its row NaN. Scores of +inf are not supported (inf - inf).

Accuracy: ``p`` is computed as ``ex2.approx(s·c - m·c)`` (one FMA per element on the GPU, as
FlashAttention does), so besides ex2's 2**-22 relative error the argument carries a rounding
error of about ``2**-24 · (|s·c| + |m·c|)`` — relative error ~7e-8 per unit of ``|s·c|``; with
``|s·c|`` ~ 1e3 that is ~1e-4.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ..inline import inline_device, written_out
from ..ptx.math import ex2_approx, f32_as_u32, u32_as_f32
from .reduce import _check_count, fragment_row_reduce, quad_row_reduce

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)

# exp2_fma: 1.5 · 2**23 rounds a float32 of magnitude below 2**22 to an integer in its low
# mantissa bits (``t``'s bits minus _ROUND_BITS are that integer); 2**f on [-1/2, 1/2] by a
# cubic fitted for relative error (at most 8e-5: far below bfloat16's and e4m3's steps)
_ROUND = np.float32(12582912.0)
_ROUND_BITS = 0x4B400000
_C0 = np.float32(0.9999289512634277)
_C1 = np.float32(0.6932762265205383)
_C2 = np.float32(0.24260404706001282)
_C3 = np.float32(0.05508868396282196)
_LOWEST = np.float32(-125.0)     # (p · 2**n stays a normal float32 down to here)
_HIGHEST = np.float32(127.0)


@inline_device
def exp2_fma(x):
    """``2**x`` for a float32 ``x`` on the FMA and integer pipes, no MUFU ``ex2``: ``x = n + f``
    (``n`` the nearest integer by the 1.5·2**23 rounding trick, ``|f| ≤ 1/2``), a cubic for
    ``2**f`` (relative error at most 8e-5), ``n`` added to its exponent bits. ``x < -125``
    (-inf included) gives +0 (``ex2.approx.ftz`` flushes only below -126: the difference is
    below 2**-125) and NaN stays NaN; ``x > 127`` gives 2**127 (the softmax's exponents stay
    far below). What :func:`online_softmax_update`'s
    ``fma_exp_every`` moves off the MUFU pipe, which the 8-bit kernels' exponentials fill."""
    xc = min(max(x, _LOWEST), _HIGHEST)
    t = xc + _ROUND
    f = xc - (t - _ROUND)
    p = ((_C3 * f + _C2) * f + _C1) * f + _C0
    n = np.int64(f32_as_u32(t)) - _ROUND_BITS
    bits = (np.int64(f32_as_u32(p)) + (n << 23)) & 0xFFFFFFFF
    y = u32_as_f32(np.uint32(bits))
    if x < _LOWEST:
        y = _ZERO
    if x != x:
        y = x
    return y


@functools.cache
def online_softmax_update(mi: int, ni: int, quad_sum: bool = True, max_chains: int = 1,
                          rescale_threshold: float | None = None, p_scale_log2: int = 0,
                          fma_exp_every: int = 0):
    """``update(scores, row_max, row_sum, out_acc_scale, scale_log2)`` for one key block; one warp.

    * ``scores``: (mi, ni, 4) float32 fragment of S for this key block (``mi*16`` rows,
      ``ni*8`` keys); overwritten with ``p = exp2(s·c - m_new·c)``, ``c = scale_log2``.
      Masked keys are -inf (p = 0).
    * ``row_max``: (mi, 2) running max of the raw scores; start at -inf. Becomes
      ``m_new = max(m_old, max of this block's row)`` (quad-reduced: all 4 lanes hold it).
    * ``row_sum``: (mi, 2) running sum; start at 0. Becomes ``row_sum·alpha + Σ_row p``.
      With ``quad_sum=False`` it holds each lane's partial sum over its own columns (saving
      ``mi*4`` shuffles per block); then finalize with the same ``quad_sum=False``.
    * ``out_acc_scale``: (mi, 2) output: ``alpha = exp2((m_old - m_new)·c)``, the factor for
      the rows of the output accumulator (0 on a row's first unmasked block, 1 while a row
      is fully masked).
    * ``scale_log2``: float32 > 0 (softmax scale · log2(e)).

    * ``rescale_threshold`` (lazy rescaling, log2 units, e.g. 8): a row keeps its old max
      unless the block's raises it by more than this (``(m_new - m_old)·c > threshold``), so
      ``alpha`` is exactly 1 on most blocks and the caller can skip rescaling its output rows
      (``p`` is then at most ``2**threshold`` up to rounding, so at most 15 for float16 P;
      the sum and output are divided by the same
      stale max's sum at the end, so the result is the same softmax). ``row_max`` is the max
      in use, which the LSE and later blocks take as it is.

    * ``p_scale_log2`` (an int ``e``, 0 … 16): ``p`` and the row sums come out scaled by
      ``2**e`` (``p = exp2(s·c - m_new·c + e)``: folded into the subtraction each score has
      anyway, no extra instruction) — for a P rounded to a format whose normal range starts
      above the small probabilities (e4m3). The caller divides what it derives by ``2**e``
      where it needs the true sums (the LSE); the output ``Σ p·v / Σ p`` needs nothing.

    * ``fma_exp_every`` (an int ``k``, 0 or 2 … ``ni``): the exponentials of every ``k``-th
      8-key column tile (``j % k == k - 1``) by :func:`exp2_fma` on the FMA pipe instead of
      ``ex2`` on the MUFU pipe, which then shares the softmax's exponentials with it
      (FlashAttention-4's remedy where MMAs outrun the MUFU); 0 (the default): all ``ex2``.

    Shuffles: ``mi*4`` for the max, ``mi*4`` more for the sum with ``quad_sum``. ex2:
    ``mi * (ni*4 + 2)`` (fewer with ``fma_exp_every``).
    """
    _check_count("online_softmax_update", "mi", mi)
    _check_count("online_softmax_update", "ni", ni)
    LAZY = rescale_threshold is not None
    if LAZY and not (0 < float(rescale_threshold) <= 15):
        raise ValueError("online_softmax_update: rescale_threshold must be in (0, 15] (log2 "
                         "units: p is at most about 2**threshold, which float16 must hold); "
                         f"got {rescale_threshold!r}")
    THRESHOLD = np.float32(rescale_threshold if LAZY else 0)
    if not (isinstance(p_scale_log2, (int, np.integer)) and 0 <= p_scale_log2 <= 16):
        raise ValueError("online_softmax_update: p_scale_log2 must be an int in 0 … 16, got "
                         f"{p_scale_log2!r}")
    SHIFT = np.float32(p_scale_log2)
    if not (isinstance(fma_exp_every, (int, np.integer)) and not isinstance(fma_exp_every, bool)
            and (fma_exp_every == 0 or 2 <= fma_exp_every <= ni)):
        raise ValueError(f"online_softmax_update: fma_exp_every must be 0 or an int in 2 … "
                         f"{ni} (ni), got {fma_exp_every!r}")
    EVERY = int(fma_exp_every)
    max_into = fragment_row_reduce("max", mi, ni, accumulate=True, chains=max_chains)
    sum_into = fragment_row_reduce("sum", mi, ni, accumulate=True, quad=bool(quad_sum))

    @inline_device
    def update(scores, row_max, row_sum, out_acc_scale, scale_log2):
        c = np.float32(scale_log2)
        for i in range(mi):
            for h in range(2):
                out_acc_scale[i, h] = row_max[i, h]  # m_old, until alpha replaces it
        max_into(scores, row_max)
        for i in range(mi):
            for h in range(2):
                m_new = row_max[i, h]
                if LAZY:
                    # selects, no branch: the max in use stays unless it grows past the
                    # threshold (a NaN max too: that row's p are NaN all the same)
                    m_old = out_acc_scale[i, h]
                    alpha = ex2_approx((m_old - m_new) * c)
                    if not ((m_new - m_old) * c > THRESHOLD):
                        m_new = m_old
                        alpha = _ONE
                    row_max[i, h] = m_new
                    if m_new == _NEG_INF:
                        alpha = _ONE
                    m_scaled = m_new * c - SHIFT if m_new != _NEG_INF else _ZERO
                elif m_new == _NEG_INF:
                    # Nothing unmasked yet: exp2(-inf - -inf) would be NaN.
                    alpha = _ONE
                    m_scaled = _ZERO
                else:
                    alpha = ex2_approx((out_acc_scale[i, h] - m_new) * c)
                    m_scaled = m_new * c - SHIFT
                out_acc_scale[i, h] = alpha
                row_sum[i, h] = row_sum[i, h] * alpha
                for j in range(ni):
                    if EVERY and j % EVERY == EVERY - 1:
                        scores[i, j, 2 * h] = exp2_fma(scores[i, j, 2 * h] * c - m_scaled)
                        scores[i, j, 2 * h + 1] = exp2_fma(scores[i, j, 2 * h + 1] * c -
                                                           m_scaled)
                    else:
                        scores[i, j, 2 * h] = ex2_approx(scores[i, j, 2 * h] * c - m_scaled)
                        scores[i, j, 2 * h + 1] = ex2_approx(scores[i, j, 2 * h + 1] * c -
                                                             m_scaled)
        sum_into(scores, row_sum)

    return update


@functools.cache
def online_softmax_finalize(mi: int, ni: int, quad_sum: bool = True):
    """``finalize(acc_o, row_sum)``: divide the output accumulator rows by their sums; one warp.

    ``acc_o`` is the (mi, ni, 4) float32 output accumulator (``ni*8`` output columns, e.g. the
    head dimension — not the key block's ``ni``), ``row_sum`` the (mi, 2) running sum of
    :func:`online_softmax_update` built with the same ``quad_sum``. With ``quad_sum=False``
    the lanes' partial sums are first combined across the quad (``mi*2`` … ``mi*4`` shuffles)
    and ``row_sum`` is overwritten with the row totals. A row whose sum is 0 (fully masked)
    is set to 0; a NaN sum gives NaN.
    """
    _check_count("online_softmax_finalize", "mi", mi)
    _check_count("online_softmax_finalize", "ni", ni)
    across = quad_row_reduce("sum")
    quad_sum = bool(quad_sum)
    # row i's half h of the output times inv, written out (tilepy.inline.written_out)
    scale_row = written_out("scale_row(acc_o, i, h, inv)",
                            [f"acc_o[i, {j}, 2 * h + {e}] = acc_o[i, {j}, 2 * h + {e}] * inv"
                             for j in range(ni) for e in range(2)],
                            {}, f"online_softmax_finalize({mi}, {ni}) scale_row")

    @inline_device
    def finalize(acc_o, row_sum):
        for i in range(mi):
            for h in range(2):
                s = row_sum[i, h]
                if not quad_sum:
                    s = across(s)
                    row_sum[i, h] = s
                inv = _ONE / s if s != _ZERO else _ZERO
                scale_row(acc_o, i, h, inv)

    return finalize


# ---- wgmma accumulators as fragments -------------------------------------------------------

@functools.cache
def accumulator_fragment(n: int):
    """``(to_fragment, to_accumulators)``: one thread's m64nN wgmma accumulators (``acc``, a
    flat float32 local array of ``n // 2``) as the (1, n / 8, 4) m16n8 fragment that
    :func:`online_softmax_update`, :func:`online_softmax_finalize` and the attention pieces
    (:mod:`tilepy.tile.attention`) take, and back.

    Per warp, a wgmma accumulator is the mma.sync C layout of the warp's 16 × n strip
    (:func:`tilepy.ptx.wgmma_layout.accumulator_position`: ``acc[4 j + e]`` holds row
    ``16 w + g + 8 (e // 2)``, column ``8 j + 2 t + e % 2``), so ``frag[0, j, e] = acc[4 j +
    e]`` and the strip's rows are the fragment's rows ``g`` and ``g + 8``. Both copies are
    register renames (no instructions once inlined); each thread of a warpgroup for itself.

    * ``to_fragment(frag, acc)``: ``frag[0, j, e] = acc[4 j + e]``;
    * ``to_accumulators(acc, frag)``: the reverse.
    """
    if n % 8 or n <= 0:
        raise ValueError(f"accumulator_fragment: n={n!r} is not a positive multiple of 8 "
                         "(the wgmma N)")
    NT = n // 8
    # written out: constant indices at any n (tilepy.inline.written_out)
    pairs = [(j, e) for j in range(NT) for e in range(4)]
    to_fragment = written_out("to_fragment(frag, acc)",
                              [f"frag[0, {j}, {e}] = acc[{4 * j + e}]" for j, e in pairs],
                              {}, f"accumulator_fragment({n}) to_fragment")
    to_accumulators = written_out("to_accumulators(acc, frag)",
                                  [f"acc[{4 * j + e}] = frag[0, {j}, {e}]" for j, e in pairs],
                                  {}, f"accumulator_fragment({n}) to_accumulators")
    return to_fragment, to_accumulators


# ---- offline compile check ----------------------------------------------------------------

def streaming_kernel(mi: int, ni: int, nd: int, quad_sum: bool = True, fma_exp_every: int = 0):
    """A kernel streaming the update over ``nblocks`` key blocks, for the offline check.

    ``kernel(s, out, nblocks, scale_log2)``, one warp: block ``kb``'s scores for lane ``L``
    are ``s[kb, L, 0 : mi*ni*4]`` (fragment order); the output accumulator (mi, nd, 4) is
    rescaled by alpha and gets ``p`` added (a stand-in for ``p @ V`` that uses every value),
    then is finalized and stored to ``out[L, :]``.
    """
    update = online_softmax_update(mi, ni, quad_sum, fma_exp_every=fma_exp_every)
    finalize = online_softmax_finalize(mi, nd, quad_sum)

    def kernel(s, out, nblocks, scale_log2):
        lane = cuda.threadIdx.x & 31
        acc = cuda.local.array((mi, nd, 4), np.float32)
        scores = cuda.local.array((mi, ni, 4), np.float32)
        m = cuda.local.array((mi, 2), np.float32)
        lsum = cuda.local.array((mi, 2), np.float32)
        alpha = cuda.local.array((mi, 2), np.float32)
        for i in range(mi):
            for h in range(2):
                m[i, h] = _NEG_INF
                lsum[i, h] = _ZERO
            for j in range(nd):
                for e in range(4):
                    acc[i, j, e] = _ZERO
        for kb in range(nblocks):
            for i in range(mi):
                for j in range(ni):
                    for e in range(4):
                        scores[i, j, e] = s[kb, lane, (i * ni + j) * 4 + e]
            update(scores, m, lsum, alpha, scale_log2)
            for i in range(mi):
                for j in range(nd):
                    for e in range(4):
                        acc[i, j, e] = acc[i, j, e] * alpha[i, e // 2] + scores[i, j % ni, e]
        finalize(acc, lsum)
        for i in range(mi):
            for j in range(nd):
                for e in range(4):
                    out[lane, (i * nd + j) * 4 + e] = acc[i, j, e]

    return kernel


def compile_reports():
    """Offline reports (sm_90) of :func:`streaming_kernel` for mi=2, ni=8, nd=8 (a 32-row
    warp tile, 64-key blocks, head dim 64), with the sum reduced per block and deferred, and
    deferred with every other tile's exponentials on the FMA pipe (``fma_exp_every=2``).

    Run with the simulator off: ``tilepy.offline.run_in_subprocess(
    "tilepy.tile.online_softmax:compile_reports")``.
    """
    import re

    from numba import types

    from ..offline import compile_kernel

    argtypes = (types.float32[:, :, ::1], types.float32[:, ::1], types.int32, types.float32)
    out = []
    for quad_sum, every in ((True, 0), (False, 0), (False, 2)):
        name = (f"online_softmax_2x8_{'quad_sum' if quad_sum else 'deferred_sum'}"
                + (f"_fma_exp_{every}" if every else ""))
        entry = {"name": name, "mi": 2, "ni": 8, "nd": 8, "quad_sum": quad_sum}
        try:
            rep = compile_kernel(name, streaming_kernel(2, 8, 8, quad_sum, every), argtypes,
                                 (9, 0))
        except Exception as e:  # reported; the test fails on it
            entry["error"] = f"{type(e).__name__}: {e}"
        else:
            entry.update(registers=rep.registers, spill_stores=rep.spill_stores,
                         spill_loads=rep.spill_loads, stack_frame=rep.stack_frame,
                         local_bytes=rep.local_bytes, counts=rep.counts,
                         ex2=len(re.findall(r"^\s*ex2\.approx", rep.ptx, re.M)))
        out.append(entry)
    return out


__all__ = ["accumulator_fragment", "exp2_fma", "online_softmax_finalize", "online_softmax_update"]
