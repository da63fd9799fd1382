"""The pieces of attention's backward pass, as device-function generators.

FlashAttention-2's backward recomputes each block of probabilities from the forward's
log-sum-exp instead of storing them. Per query row ``i`` and key ``j`` (``s = q_i · k_j``):

* ``P_ij = exp(scale · s_ij - lse_i) = exp2(scale_log2 · s_ij - lse2_i)`` with
  ``lse2 = lse · log2(e)``; a row that sees no key has ``lse = -inf`` and gets ``lse2 = +inf``
  (every ``P`` of it 0, never ``exp(+inf)``) — the rows pre-pass writes that;
* ``dP = dO · Vᵀ``, ``D_i = Σ_d dO_id · O_id`` (the same pre-pass), and
  ``dS_ij = P_ij · (dP_ij - D_i)``;
* ``dV = Pᵀ · dO``, ``dK = scale · dSᵀ · Q``, ``dQ = scale · dS · K``.

Fragments are mma.sync accumulators in the m16n8 layout (:mod:`tilepy.ptx.fragments`): a
float32 local array (mi, ns, 4), lane ``4g + t`` holding rows ``16 i + g`` (entries 0, 1) and
``16 i + g + 8`` (entries 2, 3), columns ``8 j + 2 t`` and ``8 j + 2 t + 1``. A kernel that
walks query rows per warp (the dQ kernel) has the query index along the rows (``by="rows"``:
the per-row ``lse2`` / ``D`` are two values per lane in registers); one that walks keys per warp
(the dK / dV kernel) computes ``Sᵀ = K · Qᵀ`` with the query index along the columns
(``by="cols"``: ``lse2`` / ``D`` read from shared memory per column pair).

Generators (each cached on its arguments):

* :func:`softmax_gradient` — ``probabilities`` (S → P in place) and ``gradients``
  (dP → dS in place);
* :func:`query_blocks` — a key block's range of query blocks (the dK / dV kernels' loop;
  causal or a window);
* :func:`row_state` — a lane's rows' ``lse2``, ``delta`` and key limits (the dQ kernels);
* :func:`mask_transposed` — the causal mask of a transposed score block (rows = keys);
  :func:`mask_transposed_window` a window's (both bounds);
* :func:`score_functions` (:func:`softcap_scores` for the cap alone) — the forward's score
  modifications and their derivative (``dS`` in the raw score);
* :func:`a_fragment` — an accumulator fragment rounded to 16 bits as the A operand of the next
  product (P or dS straight from registers);
* :func:`store_accumulators` / :func:`atomic_add_accumulators` — a fragment, scaled, to a 2-D
  global view (16-bit stores, or float32 atomic adds: dQ's reduction over key blocks).
* :func:`mask_keys_past` — the zero-filled keys past the sequence's end out of ``Sᵀ``.
* :func:`key_block_coords` — a key-block kernel's block: lengths, batch, K/V head, group size
  and first key; :func:`key_block_order` the same with causal blocks taken heaviest first.
* :func:`transpose_to_shared` — a warpgroup's ``dSᵀ``, packed to 16 bits as an A fragment, as
  the K-major shared tile of ``dS`` (stmatrix.trans): the A operand of ``dQ = dS K``.
* :func:`stage_float32` — a warpgroup's float32 accumulator into a shared tile of padded (or
  swizzled) rows, the source of a bulk reduction into global memory; :func:`blocked_row` the
  row of the blocked accumulator those reductions add into.
* :func:`key_block_scores` / :func:`query_block_scores` — a variant's whole treatment of one
  block of scores (causal or window masks, the soft cap, ALiBi, user functions, the keys past
  the end) in a dK / dV kernel (``Sᵀ``) and a dQ kernel (``S``), with the derivative chained
  into ``dS``; :func:`query_steps` — a dK / dV kernel's (query head, query block) steps, dense
  or over a block mask's transposed lists. Every backward kernel family (mma.sync, wgmma)
  takes its variants from these.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ..inline import device_namespace, inline_device
from ..ptx.math import (cvt_bf16x2_f32, cvt_f16x2_f32, ex2_approx, tanh_approx,
                        unpack_f16x2_f32)
from ..ptx.ldmatrix import stmatrix_x4_trans
from ..ptx.vector import ld_shared_b32, ld_shared_v2_f32, st_shared_b32, st_shared_v2_f32
from .attention import (bitmap_word, block_mask_row, key_block_at, key_block_partial, key_blocks,
                        key_window, mask_key_block)
from .config import DTYPES
from .schedule import heavy_first, udiv

_NEG_INF = np.float32(-np.inf)

#: log2(e): ``lse2 = lse · LOG2E``.
LOG2E = 1.4426950408889634


def _pack(dtype: str):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return cvt_f16x2_f32 if dtype == "float16" else cvt_bf16x2_f32


@functools.cache
def softmax_gradient(mi: int, ns: int, by: str):
    """The softmax part of the backward on one lane's (mi, ns, 4) fragments.

    ``by="rows"`` (query rows along the fragment's rows):

    * ``probabilities(s, lse2, scale_log2)``: ``s ← exp2(scale_log2 · s - lse2[i, h])``;
      ``lse2`` a (mi, 2) float32 local array, the lane's rows ``16 i + g + 8 h``;
    * ``gradients(dp, p, delta)``: ``dp ← p · (dp - delta[i, h])``.

    ``by="cols"`` (queries along the columns, as in ``Sᵀ``): the same with ``lse2`` and ``delta``
    the 32-bit shared addresses of the block's per-query float32 values at column 0 (read two
    adjacent columns at a time, 8-byte aligned) and ``t`` the lane's column pair:
    ``probabilities(s, lse2_addr, scale_log2, t)``, ``gradients(dp, p, delta_addr, t)``.

    Returns a namespace (``grad.probabilities(...)``)."""
    if by not in ("rows", "cols"):
        raise ValueError(f"softmax_gradient: by must be 'rows' or 'cols', got {by!r}")
    if by == "rows":
        @inline_device
        def probabilities(s, lse2, scale_log2):
            for i in range(mi):
                for j in range(ns):
                    for e in range(4):
                        s[i, j, e] = ex2_approx(s[i, j, e] * scale_log2 - lse2[i, e // 2])

        @inline_device
        def gradients(dp, p, delta):
            for i in range(mi):
                for j in range(ns):
                    for e in range(4):
                        dp[i, j, e] = p[i, j, e] * (dp[i, j, e] - delta[i, e // 2])
    else:
        @inline_device
        def probabilities(s, lse2_addr, scale_log2, t):
            for j in range(ns):
                l0, l1 = ld_shared_v2_f32(lse2_addr + 4 * (8 * j + 2 * t))
                for i in range(mi):
                    s[i, j, 0] = ex2_approx(s[i, j, 0] * scale_log2 - l0)
                    s[i, j, 1] = ex2_approx(s[i, j, 1] * scale_log2 - l1)
                    s[i, j, 2] = ex2_approx(s[i, j, 2] * scale_log2 - l0)
                    s[i, j, 3] = ex2_approx(s[i, j, 3] * scale_log2 - l1)

        @inline_device
        def gradients(dp, p, delta_addr, t):
            for j in range(ns):
                d0, d1 = ld_shared_v2_f32(delta_addr + 4 * (8 * j + 2 * t))
                for i in range(mi):
                    dp[i, j, 0] = p[i, j, 0] * (dp[i, j, 0] - d0)
                    dp[i, j, 1] = p[i, j, 1] * (dp[i, j, 1] - d1)
                    dp[i, j, 2] = p[i, j, 2] * (dp[i, j, 2] - d0)
                    dp[i, j, 3] = p[i, j, 3] * (dp[i, j, 3] - d1)

    return device_namespace(f"softmax_gradient_{mi}x{ns}_{by}", probabilities=probabilities,
                            gradients=gradients, BY=by)


def query_blocks(block_m: int, causal: bool = False, window=None, block_n=None):
    """``bounds(key0, sq, sk) -> (qb0, count)``: the query blocks (of ``block_m`` rows) that
    see any key of a key block starting at ``key0`` — all of them, or with an upper bound
    (causal, or a window's ``right``; bottom-right alignment: query ``i`` sees key ``j`` only
    if ``j <= i + sk - sq + right``) those from the one holding query ``key0 - (sk - sq) -
    right`` on, and with a lower bound (a window's ``left``: ``j >= i + sk - sq - left``) those
    up to the one holding query ``key0 + block_n - 1 - (sk - sq) + left``; ``count`` 0 when
    none does. ``causal`` / ``window`` as :func:`tilepy.tile.attention.key_window`;
    ``block_n`` (the key block's length) is needed with a lower bound. Block-uniform; any
    thread."""
    left, right = key_window(causal, window)
    if left >= 0 and not block_n:
        raise ValueError("query_blocks: a window with a left bound needs block_n")
    return _query_blocks(block_m, left, right, int(block_n or 0) if left >= 0 else 0)


@functools.cache
def _query_blocks(block_m: int, left: int, right: int, block_n: int):
    BM, BN, L, R = block_m, block_n, left, right
    UPPER, LOWER = right >= 0, left >= 0

    @inline_device
    def bounds(key0, sq, sk):
        n_qb = (sq + BM - 1) // BM
        qb0 = 0
        if UPPER:
            qb0 = min(max(key0 - (sk - sq) - R, 0) // BM, n_qb)
        if LOWER:
            last_q = min(min(key0 + BN, sk) - 1 - (sk - sq) + L, sq - 1)
            qb_end = last_q // BM + 1 if last_q >= 0 else 0
            return qb0, max(qb_end - qb0, 0)
        return qb0, n_qb - qb0

    return bounds


def row_state(causal: bool = False, window=None):
    """``load(lse2, delta, l2, dl, limit, b, h, rows0, g, sq, sk)``: for the lane's two rows
    ``rows0 + g`` and ``rows0 + g + 8`` (a warp's 16-row strip), ``l2[0, h8]`` and
    ``dl[0, h8]`` from the (B, H, SqP) float32 ``lse2`` / ``delta`` (rows past ``sq`` are the
    padding the rows pre-pass wrote) and in ``limit`` the keys the row sees, as
    :func:`tilepy.tile.attention.row_limits` writes them (shape
    :func:`tilepy.tile.attention.limits_shape` of ``mi = 1``: the last key, ``(1, 2)``, or with
    a window's left bound the first and the last, ``(1, 2, 2)``) — the ``limit`` that
    :func:`tilepy.tile.attention.mask_scores` takes. ``l2``, ``dl`` (1, 2) float32 and
    ``limit`` int64 local arrays."""
    left, right = key_window(causal, window)
    return _row_state(left, right)


@functools.cache
def _row_state(left: int, right: int):
    UPPER, LOWER = right >= 0, left >= 0
    R1, L = right + 1, left

    @inline_device
    def load(lse2, delta, l2, dl, limit, b, h, rows0, g, sq, sk):
        for hh in range(2):
            r = rows0 + g + 8 * hh
            l2[0, hh] = lse2[b, h, r]
            dl[0, hh] = delta[b, h, r]
            if UPPER:
                last = min(sk, r + (sk - sq) + R1) - 1
            else:
                last = sk - 1
            if LOWER:
                limit[0, hh, 0] = max(0, r + (sk - sq) - L)
                limit[0, hh, 1] = last
            else:
                limit[0, hh] = last

    return load


@functools.cache
def mask_transposed(mi: int, ns: int):
    """``mask(s, first)``: causal masking of a transposed score block ``Sᵀ`` (rows = keys,
    columns = queries): key ``k`` is seen by query ``i`` iff ``i >= k - shift``. ``first``: for
    the lane's key row ``16·0 + g`` of the fragment, the first visible query relative to the
    lane's column 0 (``key - shift - query0``, with ``query0`` the query of column ``2t``);
    rows ``16 i + 8 h`` further down have it ``16 i + 8 h`` later. Entries left of it become
    -inf (``P = 0``). 32-bit compares, clamped to the block."""
    lo, hi = np.int64(0), np.int64(8 * ns)

    @inline_device
    def mask(s, first):
        for i in range(mi):
            for hh in range(2):
                rel = np.int32(min(max(first + 16 * i + 8 * hh, lo), hi))
                for j in range(ns):
                    if np.int32(8 * j) < rel:
                        s[i, j, 2 * hh] = _NEG_INF
                    if np.int32(8 * j + 1) < rel:
                        s[i, j, 2 * hh + 1] = _NEG_INF

    return mask


def mask_transposed_window(mi: int, ns: int, causal: bool = False, window=None):
    """``mask(s, diag)``: a window's mask on a transposed score block ``Sᵀ`` (rows = keys,
    columns = queries; :func:`tilepy.tile.attention.key_window`): query ``i`` sees key ``k``
    iff ``k - shift - right <= i`` (an upper bound) and ``i <= k - shift + left`` (a lower
    bound). ``diag``: for the lane's key row ``16·0 + g``, its diagonal query relative to the
    lane's column 0 (``key - shift - query0``, ``query0`` the query of column ``2t``); rows
    ``16 i + 8 h`` further down have it ``16 i + 8 h`` later. Entries outside become -inf
    (``P = 0``). Every block is masked (no block test); 32-bit compares, clamped."""
    left, right = key_window(causal, window)
    return _mask_transposed_window(mi, ns, left, right)


@functools.cache
def _mask_transposed_window(mi: int, ns: int, left: int, right: int):
    lo, hi = np.int64(-1), np.int64(8 * ns)
    UPPER, LOWER = right >= 0, left >= 0
    R, L = right, left

    @inline_device
    def mask(s, diag):
        for i in range(mi):
            for hh in range(2):
                d = diag + 16 * i + 8 * hh
                first = np.int32(min(max(d - R, lo), hi))   # the first visible column
                last = np.int32(min(max(d + L, lo), hi))    # the last
                for j in range(ns):
                    for e in range(2):
                        c = np.int32(8 * j + e)
                        if (UPPER and c < first) or (LOWER and c > last):
                            s[i, j, 2 * hh + e] = _NEG_INF

    return mask


def score_functions(mi: int, ns: int, cap: float = 0.0, score_mod=None, score_mod_grad=None,
                    mask_mod=None, transposed: bool = False, n_args: int = 0,
                    alibi: bool = False, packed: bool = False, mask_bits: bool = False):
    """The forward's score modifications (:func:`tilepy.tile.attention.score_hook`: a soft
    cap, ALiBi, a user ``score_mod``, then a ``mask_mod``) on one lane's (mi, ns, 4) raw score
    fragment, with their derivative, for the backward: a namespace of

    * ``apply(s, dfac, scale, row0, col0, b, h, args)``: ``x = scale · s`` becomes ``y =
      mask(score_mod(alibi(cap(x))))``, ``s ← y / scale`` (so the kernels' ``exp2(scale_log2 ·
      s - lse2)`` is the modified scores' probability, as in the forward) and ``dfac ←
      dy/dx`` (a float32 fragment of ``s``'s shape): ``1 - tanh²`` of the cap times
      ``score_mod_grad(alibi(cap(x)), b, h, q_idx, kv_idx, *mod_args)`` (ALiBi's bias has
      derivative 1), 0 where ``mask_mod`` hides the key. ``row0`` / ``col0``: the index of
      the lane's first row / column in the fragment layout (``s[i, j, 2 hh + e]`` is row
      ``row0 + 16 i + 8 hh``, column ``col0 + 8 j + e``) — query rows and key columns, or with
      ``transposed`` (Sᵀ) key rows and query columns. ``args``: the kernel's hook arguments,
      the forward's (``mod_args`` first, then ALiBi's slopes and ``sk - sq``);
    * ``chain(ds, dfac)``: ``ds ← ds · dfac`` — the gradient in the scaled raw score from the
      one in the modified score (``dS = P ∘ (dP - D)``), before the ``dQ`` / ``dK`` products.

    ``packed``: ``dfac`` holds each lane's pairs of derivatives as float16 pairs (an (mi, ns,
    2) uint32 array, half the registers) — for derivatives in [0, 1] (the cap's and a mask's,
    not a ``score_mod``'s: ``ValueError``), whose float16 rounding (2⁻¹¹ relative; about
    3·10⁻⁸ absolute for the subnormal ones) is no larger than the 16-bit rounding ``dS``
    takes before its products.

    ``score_mod_grad(score, b, h, q_idx, kv_idx, *mod_args) -> float``: the derivative of
    ``score_mod`` in its first argument, required with a ``score_mod`` (``TypeError``
    otherwise). With the cap alone the code is the cap's and the indices are not read. ``cap``
    a finite float > 0 or 0; ``n_args`` the number of ``mod_args``.

    ``mask_bits`` (``mask_mod`` None, else ``ValueError``): the mask read from a block mask's
    bitmaps (:class:`tilepy.BlockMask`'s ``partial_bits`` / ``partial_bits_t``), the hook's
    arguments ``args[nb]`` / ``args[nb + 1]`` after the others (``nb = n_args``, + 2 with
    ALiBi): the key is hidden where bit ``kv_idx % 32`` of ``args[nb][b, h, q_idx, kv_idx //
    32]`` is 0 — transposed, bit ``q_idx % 32`` of ``args[nb + 1][b, h, kv_idx, q_idx //
    32]``, the same bits by key — one word loaded per 32 columns of a fragment row where
    ``ns`` is a multiple of 4 (the columns' block then starts at a multiple of 32)."""
    from .attention import _keep_score, _see_all, _user_function, check_n_args, softcap_score

    if cap:
        softcap_score(cap)   # the same validation
    n_args = check_n_args(n_args)
    check_functions(score_mod, score_mod_grad, mask_mod, n_args=n_args)
    if packed and score_mod is not None:
        raise ValueError("score_functions: packed derivatives take no score_mod (its "
                         "derivative may leave [0, 1])")
    if mask_bits and mask_mod is not None:
        raise ValueError("score_functions: mask_bits replaces mask_mod; pass one of them")
    return _score_functions(mi, ns, float(cap or 0.0),
                            _user_function(score_mod, "score_mod", 5, _keep_score, n_args),
                            _user_function(score_mod_grad, "score_mod_grad", 5, _one_grad,
                                           n_args),
                            _user_function(mask_mod, "mask_mod", 4, _see_all, n_args),
                            bool(transposed), bool(alibi), n_args, bool(packed),
                            bool(mask_bits))


def check_functions(score_mod, score_mod_grad, mask_mod, op: str = "the backward",
                    n_args: int = 0) -> bool:
    """Whether any user function is given; ``TypeError`` (naming ``op``) for one of the wrong
    arity (:func:`tilepy.tile.attention.check_user_function`, ``n_args`` ``mod_args`` after the
    fixed parameters), or a ``score_mod`` without its ``score_mod_grad`` (or the other way
    round)."""
    from .attention import check_user_function

    check_user_function(score_mod, "score_mod", 5, n_args)
    check_user_function(score_mod_grad, "score_mod_grad", 5, n_args)
    check_user_function(mask_mod, "mask_mod", 4, n_args)
    if (score_mod is None) != (score_mod_grad is None):
        raise TypeError(f"{op}: a score_mod needs its derivative, score_mod_grad(score, b, h, "
                        "q_idx, kv_idx) -> d score_mod / d score" if score_mod is not None
                        else f"{op}: score_mod_grad was given without score_mod")
    return any(f is not None for f in (score_mod, score_mod_grad, mask_mod))


def softcap_scores(mi: int, ns: int, cap: float):
    """:func:`score_functions` of a soft cap alone (normal layout): ``apply(s, dfac, scale,
    row0, col0, b, h, args)`` (indices and args unread) and ``chain(ds, dfac)``."""
    return score_functions(mi, ns, cap)


@inline_device
def _one_grad(score, b, h, q_idx, kv_idx):
    return np.float32(1.0)


def _defaults():
    from .attention import _keep_score, _see_all, _with_args

    return (_with_args(_keep_score, 5, 0), _with_args(_one_grad, 5, 0),
            _with_args(_see_all, 4, 0))


@functools.cache
def _score_functions(mi: int, ns: int, cap: float, score_mod, score_mod_grad, mask_mod,
                     transposed: bool, alibi: bool = False, n_args: int = 0,
                     packed: bool = False, bits: bool = False):
    from .attention import _alibi_slope

    CAPPED = cap > 0
    C = np.float32(cap if CAPPED else 1.0)
    INV = np.float32(1.0 / cap if CAPPED else 1.0)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    T = transposed
    sm, smg, mm = score_mod, score_mod_grad, mask_mod
    ALIBI = alibi
    slopes_at = _alibi_slope(n_args) if alibi else None

    PACKED = packed

    @inline_device
    def one_score(s, i, j, e, c, inv_scale, row0, col0, b, h, args):
        """s[i, j, e] modified in place; its derivative returned."""
        r = row0 + 16 * i + 8 * (e // 2)
        col = col0 + 8 * j + (e % 2)
        qi = col if T else r
        kj = r if T else col
        x = s[i, j, e] * c
        d = one
        if CAPPED:
            th = tanh_approx(x * INV)
            x = C * th
            d = one - th * th
        if ALIBI:
            slope, shift = slopes_at(args, b, h)
            x = x - slope * np.float32(abs(qi + shift - kj))
        d = d * np.float32(smg(x, b, h, qi, kj, args))
        x = np.float32(sm(x, b, h, qi, kj, args))
        if not mm(x, b, h, qi, kj, args):
            x = _NEG_INF
            d = zero
        s[i, j, e] = x * inv_scale
        return d

    BITS = bits
    NB = n_args + (2 if alibi else 0) + (1 if transposed else 0)   # the bitmap this layout reads
    WORDS = bits and ns % 4 == 0
    u1, u0 = np.uint32(1), np.uint32(0)

    @inline_device
    def one_bit(s, i, j, e, c, inv_scale, row0, col0, b, h, args, word, bit):
        """:func:`one_score` with the mask's bit in place of mask_mod: bit ``bit`` of
        ``word``."""
        d = one_score(s, i, j, e, c, inv_scale, row0, col0, b, h, args)
        if (word >> np.uint32(bit)) & u1 == u0:
            s[i, j, e] = _NEG_INF
            d = zero
        return d

    @inline_device
    def store(dfac, i, j, hh, d0, d1):
        if PACKED:
            dfac[i, j, hh] = cvt_f16x2_f32(d0, d1)
        else:
            dfac[i, j, 2 * hh] = d0
            dfac[i, j, 2 * hh + 1] = d1

    @inline_device
    def apply_words(s, dfac, scale, row0, col0, b, h, args):
        # (the fragment's 8·ns columns start at a multiple of 32: col0 - 2t)
        c = np.float32(scale)
        inv_scale = one / c
        words = args[NB]
        for i in range(mi):
            for hh in range(2):
                r = row0 + 16 * i + 8 * hh
                for w in range(ns // 4):
                    word = bitmap_word(words, b, h, r, col0, w)
                    for jj in range(4):
                        j = 4 * w + jj
                        d0 = one_bit(s, i, j, 2 * hh, c, inv_scale, row0, col0, b, h, args,
                                     word, 8 * jj)
                        d1 = one_bit(s, i, j, 2 * hh + 1, c, inv_scale, row0, col0, b, h, args,
                                     word, 8 * jj + 1)
                        store(dfac, i, j, hh, d0, d1)

    @inline_device
    def apply(s, dfac, scale, row0, col0, b, h, args):
        if WORDS:
            apply_words(s, dfac, scale, row0, col0, b, h, args)
            return
        c = np.float32(scale)
        inv_scale = one / c
        for i in range(mi):
            for j in range(ns):
                for hh in range(2):
                    if BITS:   # a word a score
                        r = row0 + 16 * i + 8 * hh
                        col = col0 + 8 * j
                        word = np.uint32(args[NB][b, h, r, col >> 5])
                        d0 = one_bit(s, i, j, 2 * hh, c, inv_scale, row0, col0, b, h, args,
                                     word, col & 31)
                        d1 = one_bit(s, i, j, 2 * hh + 1, c, inv_scale, row0, col0, b, h, args,
                                     word, (col & 31) + 1)
                    else:
                        d0 = one_score(s, i, j, 2 * hh, c, inv_scale, row0, col0, b, h, args)
                        d1 = one_score(s, i, j, 2 * hh + 1, c, inv_scale, row0, col0, b, h,
                                       args)
                    store(dfac, i, j, hh, d0, d1)

    @inline_device
    def chain_packed(ds, dfac):
        for i in range(mi):
            for j in range(ns):
                for hh in range(2):
                    d0, d1 = unpack_f16x2_f32(dfac[i, j, hh])
                    ds[i, j, 2 * hh] = ds[i, j, 2 * hh] * d0
                    ds[i, j, 2 * hh + 1] = ds[i, j, 2 * hh + 1] * d1

    @inline_device
    def chain_plain(ds, dfac):
        for i in range(mi):
            for j in range(ns):
                for e in range(4):
                    ds[i, j, e] = ds[i, j, e] * dfac[i, j, e]

    @inline_device
    def chain(ds, dfac):
        if PACKED:
            chain_packed(ds, dfac)
        else:
            chain_plain(ds, dfac)

    # a name of its own per configuration: the kernel disk cache keys a closure's modules by
    # name (kernels with user functions are not disk-cached; their ids keep names apart here)
    user = "" if (sm, smg, mm) == _defaults() else f"_user{id(sm)}_{id(smg)}_{id(mm)}"
    user += f"_alibi{n_args}" if alibi else ""
    user += "_bits" if bits else ""
    name = f"score_functions_{mi}x{ns}_{cap!r}{'_t' if T else ''}{'_p' if packed else ''}" \
        f"{user}".replace(".", "_")
    return device_namespace(name, apply=apply, chain=chain, CAP=cap)


@functools.cache
def mask_keys_past(mi: int, ns: int):
    """``mask(s, key, sk)``: of a transposed score fragment ``Sᵀ`` (rows = keys), the lane's
    key rows ``key + 16 i + 8 h`` at or past ``sk`` become -inf (``P = 0``). Those rows hold
    the zero-filled keys past the sequence's end: unmasked, their ``P = exp2(-lse2)``
    overflows 16 bits when the LSE is below about -11, and ``dS · K`` (a zero row times
    infinity) would put NaN into dQ. Call it in key blocks that pass ``sk``."""

    @inline_device
    def mask(s, key, sk):
        for i in range(mi):
            for hh in range(2):
                if key + 16 * i + 8 * hh >= sk:
                    for j in range(ns):
                        s[i, j, 2 * hh] = _NEG_INF
                        s[i, j, 2 * hh + 1] = _NEG_INF

    return mask


@functools.cache
def a_fragment(dtype: str):
    """``pack(acc, i, kk) -> (a0, a1, a2, a3)``: m16 tile ``i`` of a float32 accumulator
    fragment, columns ``16 kk … 16 kk + 15`` (its n8 tiles ``2 kk`` and ``2 kk + 1``), rounded
    to ``dtype`` as the A operand of an m16n8k16 product: the accumulator and A layouts agree,
    so no exchange between lanes is needed."""
    pack = _pack(dtype)

    @inline_device
    def a(acc, i, kk):
        return (pack(acc[i, 2 * kk, 0], acc[i, 2 * kk, 1]),
                pack(acc[i, 2 * kk, 2], acc[i, 2 * kk, 3]),
                pack(acc[i, 2 * kk + 1, 0], acc[i, 2 * kk + 1, 1]),
                pack(acc[i, 2 * kk + 1, 2], acc[i, 2 * kk + 1, 3]))

    return a


@functools.cache
def store_accumulators(mi: int, no: int, dtype: str):
    """``store(acc, out2, rows0, nrows, scale, g, t)``: ``scale · acc`` ((mi, no, 4) float32)
    rounded to ``dtype`` into the 2-D uint16 view ``out2`` (rows ``rows0 + 16 i + g + 8 h``,
    columns ``8 j + 2 t`` and ``+1``); rows at or past ``nrows`` are skipped."""
    pack = _pack(dtype)

    @inline_device
    def store(acc, out2, rows0, nrows, scale, g, t):
        for i in range(mi):
            for hh in range(2):
                r = rows0 + 16 * i + g + 8 * hh
                if r < nrows:
                    for j in range(no):
                        c = 8 * j + 2 * t
                        word = pack(acc[i, j, 2 * hh] * scale, acc[i, j, 2 * hh + 1] * scale)
                        out2[r, c] = word & 0xFFFF
                        out2[r, c + 1] = word >> 16

    return store


@functools.cache
def atomic_add_accumulators(mi: int, no: int):
    """``add(acc, dst2, rows0, col0, nrows, g, t)``: ``dst2[r, c] += acc`` for the lane's
    entries (rows ``rows0 + 16 i + g + 8 h`` below ``nrows``, columns ``col0 + 8 j + 2 t`` and
    ``+1``) with float32 atomic adds (their order, so the last bits of the sums, varies
    between runs). ``dst2`` a 2-D float32 view; ``g``, ``t`` the lane's quad coordinates."""

    @inline_device
    def add(acc, dst2, rows0, col0, nrows, g, t):
        for i in range(mi):
            for hh in range(2):
                r = rows0 + 16 * i + g + 8 * hh
                if r < nrows:
                    for j in range(no):
                        c = col0 + 8 * j + 2 * t
                        cuda.atomic.add(dst2, (r, c), acc[i, j, 2 * hh])
                        cuda.atomic.add(dst2, (r, c + 1), acc[i, j, 2 * hh + 1])

    return add



@inline_device
def key_block_coords(q, k, block_n):
    """``(sq, sk, b, hk, group, key0)`` of a dK / dV kernel's block over 4-D (batch, heads,
    seq, head_dim) views ``q`` and ``k``: the sequence lengths, its batch and K/V head (grid z
    and y), the query heads per K/V head, and its first key (grid x · ``block_n``). Any
    thread."""
    return (q.shape[2], k.shape[2], cuda.blockIdx.z, cuda.blockIdx.y,
            q.shape[1] // k.shape[1], cuda.blockIdx.x * block_n)


@inline_device
def blocked_row(v, slices, sl):
    """The row of a blocked float32 dQ accumulator (64-row blocks of ``slices`` 64-column
    slices, each slice's 64 rows contiguous) that holds (virtual) row ``v``'s slice ``sl``:
    ``((v // 64) · slices + sl) · 64 + v % 64``."""
    return ((v // 64) * slices + sl) * 64 + v % 64


def heavy_keys(left: int, right: int, sparse: bool, varlen: bool) -> bool:
    """Whether a dK / dV kernel's key blocks do less work the later they start (a window
    unbounded on the left and bounded on the right — causal — over one length for every
    batch, no block mask): :func:`key_block_order`'s ``heavy``."""
    return left == -1 and right >= 0 and not sparse and not varlen


@functools.cache
def key_block_order(block_n: int, head_dim: int, heavy: bool):
    """``coords(q, k) -> (sq, sk, b, hk, group, key0, kb)``: :func:`key_block_coords` plus the
    key block's index ``kb`` (``key0 = kb · block_n``). ``heavy`` (causal, one length for
    every batch: a key block's work falls with its index): the blocks taken heaviest first,
    as :func:`tilepy.tile.schedule.heavy_first` orders a causal forward's query blocks — the
    grid's linear block index walks groups of (batch, K/V head) whose Q and dO rows
    (``head_dim`` 16-bit elements each, every query head of the group) fit the L2 budget, in
    each the key blocks from the first (which sees every query) up, so that the last blocks
    the hardware starts are the shortest. Else the grid's plain order (x the key block)."""
    at = heavy_first(head_dim, True).at
    HEAVY = bool(heavy)

    @inline_device
    def coords(q, k):
        if HEAVY:
            group = q.shape[1] // k.shape[1]
            n_kb = cuda.gridDim.x
            tile = cuda.blockIdx.x + n_kb * (cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z)
            b, hk, r = at(tile, n_kb, cuda.gridDim.y, cuda.gridDim.z, q.shape[2] * group)
            kb = n_kb - 1 - r
            return q.shape[2], k.shape[2], b, hk, group, kb * block_n, kb
        return key_block_coords(q, k, block_n) + (cuda.blockIdx.x,)

    return coords


@functools.cache
def transpose_to_shared(nq: int):
    """``store(box, a, lane, warp4)``: a warpgroup's (64 × 8·nq) tile, held as the 16-bit
    pairs of :func:`a_fragment` (``a``: nq / 2 · 4 uint32, the packed wgmma accumulator
    fragment: warp ``warp4`` of the warpgroup holds rows ``16 · warp4 …``), written
    transposed — row ``r``, column ``c`` to row ``c``, column ``r`` — into the 1024-byte-
    aligned shared box ``box`` of ``8·nq`` rows × 64 columns (128-byte rows, 128-byte
    swizzle): the K-major operand layout of wgmma with the tile's rows along K. One
    stmatrix.x4.trans per 16 columns; the caller fences (``fence_proxy_async_shared``) and
    synchronises before a wgmma reads the box. ``nq`` even."""
    if nq % 2:
        raise ValueError(f"transpose_to_shared: nq must be even, got {nq}")

    @inline_device
    def store(box, a, lane, warp4):
        chunk = 2 * warp4 + (lane // 8) % 2
        for jj in range(nq // 2):
            row = 8 * (2 * jj + (lane // 8) // 2) + lane % 8
            stmatrix_x4_trans(box + row * 128 + ((chunk ^ (lane % 8)) << 4),
                              a[4 * jj], a[4 * jj + 1], a[4 * jj + 2], a[4 * jj + 3])

    return store


@functools.cache
def stage_float32(n: int, row_floats: int, swizzled: bool = False):
    """``store(stage, acc, reg0, warp4, g, t)``: a warpgroup's (64 × n) float32 wgmma
    accumulator — ``acc[reg0 …]``, ``n / 2`` registers per thread (``reg0 = 32 j``: columns
    ``64 j …`` of a wider accumulator) — into the shared tile at ``stage`` of 64 rows of
    ``row_floats`` floats each (``row_floats ≥ n``; padding rows by 4 floats puts a warp's
    8-row stores in distinct banks). ``swizzled`` (``row_floats == n == 64``, no padding):
    16-byte chunk ``k`` of row ``r`` at chunk :func:`swizzled_chunk` ``(r, k) = k ^ (r % 8)``
    instead — the same banks spread in 64 floats a row; whoever reads the tile (or the global
    memory it is reduced into) undoes it. 8-byte stores; the caller fences and synchronises
    before the tile is read (by a bulk copy: ``fence_proxy_async_shared``)."""
    if n % 8 or row_floats < n or row_floats % 2 or swizzled and (row_floats, n) != (64, 64):
        raise ValueError(f"stage_float32: n={n} (a multiple of 8) and row_floats={row_floats} "
                         f"(even, >= n; 64 and 64 swizzled)")
    RB = row_floats * 4
    SWZ = bool(swizzled)

    @inline_device
    def store(stage, acc, reg0, warp4, g, t):
        for j in range(n // 8):
            for hh in range(2):
                r = warp4 * 16 + g + 8 * hh
                if SWZ:   # chunk 2j + t // 2 of row r (r % 8 = g), 8 bytes into it for odd t
                    col = swizzled_chunk(g, 2 * j + t // 2) * 4 + (t % 2) * 2
                else:
                    col = 8 * j + 2 * t
                st_shared_v2_f32(stage + r * RB + col * 4, acc[reg0 + 4 * j + 2 * hh],
                                 acc[reg0 + 4 * j + 2 * hh + 1])

    return store


@inline_device
def swizzled_chunk(row, chunk):
    """Where :func:`stage_float32`'s swizzled tiles keep 16-byte chunk ``chunk`` (0 … 15) of
    row ``row``: chunk ``chunk ^ (row % 8)`` of the row."""
    return chunk ^ (row % 8)


def variant_mods(mods) -> tuple:
    """``(score_mod, score_mod_grad, mask_mod, n_args, alibi, bits)`` from 3, 5 or 6 entries
    (``bits``: a block mask's partial blocks read its bitmaps in place of ``mask_mod``, the
    hook's arguments after the others — :func:`score_functions`)."""
    mods = tuple(mods)
    if len(mods) == 3:
        mods += (0, False)
    if len(mods) == 5:
        mods += (False,)
    sm, smg, mm, n_args, alibi, bits = mods
    return sm, smg, mm, int(n_args), bool(alibi), bool(bits)



def kernel_variant(causal: bool, window, softcap, mods, mask_block=None, block_m: int = 0,
                   block_n: int = 0, varlen: bool = False) -> tuple:
    """A backward kernel generator's variant arguments, normalised and checked: ``(left,
    right, cap, mods, mask_block)`` — the window's bounds
    (:func:`tilepy.tile.attention.key_window`), the soft cap as a float (0: none; checked as
    the forward checks it), :func:`variant_mods`, and the block mask's ``(block_q, block_k)``
    as ints (multiples of the kernel's ``block_m`` / ``block_n``) or None.
    ``NotImplementedError`` for a block mask with packed sequences (``varlen``) or a window."""
    from .attention import check_mask_block, softcap_score

    left, right = key_window(causal, window)
    if softcap:
        softcap_score(softcap)
    if mask_block is not None:
        if varlen or (left, right) != (-1, -1):
            raise NotImplementedError("the block-sparse backward kernels take neither packed "
                                      "sequences nor a window / causal (write them in "
                                      "mask_mod)")
        mask_block = check_mask_block(mask_block, block_m, block_n)
    return left, right, float(softcap or 0.0), variant_mods(mods), mask_block


def reads_hook(mods) -> bool:
    """Whether a variant's ``mods`` (:func:`key_block_scores`) make a score hook — user
    functions or ALiBi, which read the batch and head indices and the hook's arguments."""
    mods = variant_mods(mods)
    return any(f is not None for f in mods[:3]) or mods[4]


def key_block_scores(nq: int, block_n: int, causal: bool = False, window=None,
                     softcap: float = 0.0, mods=(None, None, None), sparse: bool = False):
    """``(scores, chain, (shape, dtype))``: a variant's treatment of a dK / dV kernel's
    transposed score fragment ``Sᵀ`` (1, nq, 4) — a warp's 16 key rows against ``8 nq`` query
    columns — before :func:`softmax_gradient`'s ``probabilities``, and of ``dSᵀ`` after its
    ``gradients``.

    * ``scores(st, dfac, scale, my_key, col0, b, h, hook, part, block_diag, diag, edge,
      sk)``: the score modifications of :func:`score_functions` (soft cap, ALiBi, ``score_mod``,
      ``mask_mod``; ``dfac`` their derivative, a local array of the returned layout;
      ``my_key`` the lane's first key row, ``col0`` its first query column ``query0 +
      2t``; ``hook`` the kernel's hook arguments; ``part`` False for a block a block mask
      lists as full, whose scores skip ``mask_mod``), then the causal or window mask
      (``diag``: ``my_key - (sk - sq) - col0``, :func:`mask_transposed` /
      :func:`mask_transposed_window`) on the blocks a bound crosses — ``block_diag = row0 +
      (sk - sq) - key0`` (block-uniform: the query block's first row ``row0``, the key
      block's first key ``key0``, ``block_n`` keys, ``8 nq`` rows) tells which — then,
      where ``edge`` (the key block passes ``sk``), the zero-filled keys past the end
      (:func:`mask_keys_past`).
    * ``chain(ds, dfac)``: ``dS ← dS · dfac`` where the variant's derivative is not 1 — a
      soft cap or a ``score_mod`` (ALiBi's bias has derivative 1, and the scores a mask hides
      have ``P = 0``, so ``dS = P ∘ (dP - D)`` is 0 there already); nothing otherwise, and
      ``dfac`` is then left unread.
    * ``(shape, dtype)``: the local array ``dfac`` the caller allocates — float16 pairs
      ((1, nq, 2) uint32) for the soft cap's derivative (:func:`score_functions`'
      ``packed``), else (1, nq, 4) float32.

    ``causal`` / ``window`` as :func:`tilepy.tile.attention.key_window`; ``softcap`` a float >= 0;
    ``mods`` ``(score_mod, score_mod_grad, mask_mod[, n_args, alibi[, bits]])``
    (:func:`variant_mods`); ``sparse``: under a block mask (``part`` read). With none of them
    the code is plain causal's or full attention's. Arguments a variant does not need are not
    read."""
    left, right, cap, mods, _ = kernel_variant(causal, window, softcap, mods)
    return _key_block_scores(int(nq), int(block_n), left, right, cap, mods, bool(sparse))


@functools.cache
def _key_block_scores(nq: int, block_n: int, left: int, right: int, cap: float, mods: tuple,
                      sparse: bool):
    # a bound crosses the block when a pair of it lies past it: the upper (right) bound when
    # key0 + block_n - 1 > row0 + shift + right, the lower (left) one when key0 < row0 +
    # 8 nq - 1 + shift - left; with block_diag = row0 + shift - key0:
    UPPER = block_n - 1 - max(right, 0)     # upper crossed when block_diag < UPPER
    LOWER = left + 1 - 8 * nq               # lower crossed when block_diag > LOWER
    HAS_UPPER, HAS_LOWER = right >= 0, left >= 0
    CAPPED, CHAIN, PACKED, FULL_HOOK, capped, capped_full = _hooks(nq, cap, mods, sparse,
                                                                    True)
    VARIANT = (left, right) not in ((-1, -1), (-1, 0)) or CAPPED
    CAUSAL = right == 0 and not VARIANT
    WINDOWED = VARIANT and max(left, right) >= 0
    mask = mask_transposed(1, nq)
    mask_window = _mask_transposed_window(1, nq, left, right)
    mask_past = mask_keys_past(1, nq)

    @inline_device
    def scores(st, dfac, scale, my_key, col0, b, h, hook, part, block_diag, diag, edge, sk):
        if VARIANT:
            if FULL_HOOK and not part:
                capped_full.apply(st, dfac, scale, my_key, col0, b, h, hook)
            elif CAPPED:
                capped.apply(st, dfac, scale, my_key, col0, b, h, hook)
            if WINDOWED:
                if (HAS_UPPER and block_diag < UPPER) or (HAS_LOWER and block_diag > LOWER):
                    mask_window(st, diag)
        elif CAUSAL:
            if block_diag < UPPER:
                mask(st, diag)
        if edge:
            mask_past(st, my_key, sk)

    @inline_device
    def chain(ds, dfac):
        if CHAIN:
            capped.chain(ds, dfac)

    return scores, chain, _dfac_layout(nq, PACKED)


def _hooks(n8: int, cap: float, mods: tuple, sparse: bool, transposed: bool) -> tuple:
    """``(capped, chain, packed, full_hook, hook, full)`` of a (1, n8, 4) score fragment:
    whether the variant modifies scores (a cap or a score hook), whether its derivative
    multiplies dS (a soft cap or a ``score_mod``) and fits float16 pairs (the cap's, in
    [0, 1]), whether a block mask's full blocks take the hook without ``mask_mod`` (as the
    forward), and those :func:`score_functions` (None where not needed)."""
    capped = cap > 0 or reads_hook(mods)
    chain = cap > 0 or mods[0] is not None
    packed = chain and mods[0] is None
    full_hook = sparse and capped and mods[2] is not None
    hook = score_functions(1, n8, cap, mods[0], mods[1], None if mods[5] else mods[2],
                           transposed=transposed, n_args=mods[3], alibi=mods[4],
                           packed=packed, mask_bits=mods[5]) if capped else None
    full = score_functions(1, n8, cap, mods[0], mods[1], None, transposed=transposed,
                           n_args=mods[3], alibi=mods[4], packed=packed) if full_hook else None
    return capped, chain, packed, full_hook, hook, full


def _dfac_layout(n8: int, packed: bool) -> tuple:
    """(shape, dtype) of the derivative fragment ``dfac`` beside a (1, n8, 4) score one."""
    return ((1, n8, 2), np.uint32) if packed else ((1, n8, 4), np.float32)


def query_block_scores(ns: int, block_n: int, causal: bool = False, window=None,
                       softcap: float = 0.0, mods=(None, None, None), sparse: bool = False):
    """``(scores, chain, (shape, dtype))``: :func:`key_block_scores` for a dQ kernel's
    score fragment ``S``
    (1, ns, 4) — a warp's 16 query rows against key block ``kb`` of ``block_n`` keys.

    * ``scores(s, dfac, scale, row, kb, t, b, h, hook, part, limit, all_first, all_see)``: the
      score modifications (``row`` the lane's first query row; keys from ``kb · block_n +
      2t``), then the keys outside each row's range (``limit`` of :func:`row_state`) where the
      block needs it (:func:`tilepy.tile.attention.mask_key_block`: ``all_first`` /
      ``all_see`` of :func:`tilepy.tile.attention.key_blocks`) — causal, a window, and the
      keys past ``sk``.
    * ``chain(ds, dfac)`` as :func:`key_block_scores`'."""
    left, right, cap, mods, _ = kernel_variant(causal, window, softcap, mods)
    return _query_block_scores(int(ns), int(block_n), left, right, cap, mods, bool(sparse))


@functools.cache
def _query_block_scores(ns: int, block_n: int, left: int, right: int, cap: float, mods: tuple,
                        sparse: bool):
    BN = block_n
    CAPPED, CHAIN, PACKED, FULL_HOOK, capped, capped_full = _hooks(ns, cap, mods, sparse,
                                                                    False)
    mask = mask_key_block(1, ns, block_n, (left, right))

    @inline_device
    def scores(s, dfac, scale, row, kb, t, b, h, hook, part, limit, all_first, all_see):
        if FULL_HOOK and not part:
            capped_full.apply(s, dfac, scale, row, kb * BN + 2 * t, b, h, hook)
        elif CAPPED:
            capped.apply(s, dfac, scale, row, kb * BN + 2 * t, b, h, hook)
        mask(s, limit, kb, t, all_first, all_see)

    @inline_device
    def chain(ds, dfac):
        if CHAIN:
            capped.chain(ds, dfac)

    return scores, chain, _dfac_layout(ns, PACKED)


def query_steps(block_m: int, block_n: int, mask_block=None):
    """``(count, step, first, advance)``: a dK / dV kernel's loop over the (query head of
    the K/V head's group, query block of ``block_m`` rows) pairs that see its key block (of
    ``block_n`` keys).

    * ``count(qmask, kb, b, hq0, group, per_head) -> steps``;
    * ``step(n, qb0, per_head, qmask, kb, b, hq0, group) -> (head, qb, part)``: step ``n``'s
      query head offset within the group, query block, and whether its scores need the mask
      function (always True when dense) — random access (block-sparse: a walk over the
      group's lists);
    * ``first(qb0, per_head, qmask, kb, b, hq0, group) -> state`` and ``advance(state, qb0,
      per_head, qmask, kb, b, hq0, group) -> state``: the same steps one after the other,
      ``state = (head, qb, part, rem, cnt)`` (the first three as ``step``'s; ``rem`` / ``cnt``
      the walk's place in the head's list) — a few integers and scalar loads a step, for
      kernels whose registers are few (a producer warpgroup). Advancing past the last step
      reads nothing out of bounds (its state is not a step).

    Dense (``mask_block`` None): ``group · per_head`` steps, head by head, each over the
    query blocks ``qb0 …`` (:func:`query_blocks`); ``qmask`` and ``kb`` are not read. Under a
    block mask of ``mask_block = (block_q, block_k)`` (multiples of ``block_m`` / ``block_n``):
    ``qmask`` is its transposed lists (:func:`tilepy.tile.attention.block_mask_row`'s
    ``mask`` over key blocks), ``kb`` the kernel's key block, and each head visits the query
    blocks its lists name, partial ones first. Any thread; block-uniform."""
    if mask_block is None:
        return _dense_steps()
    return _sparse_steps(int(block_n), int(mask_block[1]), int(mask_block[0]) // int(block_m))


def counted_steps(block_m: int, block_n: int, mask_block=None):
    """``steps(addr, tid, qmask, kb, b, hq0, group, per_head) -> int64``: :func:`query_steps`'
    count, the same in every thread of the block. Under a block mask thread ``tid == 0``
    counts over the lists and leaves the count at shared address ``addr`` (4 bytes), and the
    block synchronises before every thread reads it — so every thread of the block must call
    it: a count made by each thread kept the lists' pointers and strides allocated through
    the kernels' loops (spills). Dense: the count itself (``addr`` unread, no barrier)."""
    return _counted_steps(query_steps(block_m, block_n, mask_block)[0], mask_block is not None)


@functools.cache
def _counted_steps(count, sparse: bool):
    SPARSE = sparse

    @inline_device
    def steps(addr, tid, qmask, kb, b, hq0, group, per_head):
        if SPARSE:
            if tid == 0:
                st_shared_b32(addr, np.uint32(count(qmask, kb, b, hq0, group, per_head)))
            cuda.syncthreads()
            return np.int64(ld_shared_b32(addr))
        return np.int64(count(qmask, kb, b, hq0, group, per_head))

    return steps


@functools.cache
def _dense_steps():
    @inline_device
    def count(qmask, kb, b, hq0, group, per_head):
        return group * per_head

    @inline_device
    def step(n, qb0, per_head, qmask, kb, b, hq0, group):
        h = udiv(n, per_head)      # (32-bit: no division routine in the machine code)
        return h, qb0 + n - h * per_head, True

    @inline_device
    def first(qb0, per_head, qmask, kb, b, hq0, group):
        return 0, qb0, True, 0, per_head

    @inline_device
    def advance(state, qb0, per_head, qmask, kb, b, hq0, group):
        head, qb, part, rem, cnt = state
        if qb + 1 == qb0 + per_head:
            return head + 1, qb0, True, 0, cnt
        return head, qb + 1, True, rem + 1, cnt

    return count, step, first, advance


@functools.cache
def _sparse_steps(block_n: int, mask_block_k: int, q_ratio: int):
    q_list = block_mask_row(block_n, mask_block_k, q_ratio)
    q_at = key_block_at(True, q_ratio)
    KR = mask_block_k // block_n         # kernel key blocks a mask key block
    R = np.int64(q_ratio)                # kernel query blocks a mask query block
    zero = np.int64(0)

    @inline_device
    def count(qmask, kb, b, hq0, group, per_head):
        total = np.int64(0)
        for i in range(group):
            total += q_list(qmask, kb, b, hq0 + i)[0]
        return total

    @inline_device
    def step(n, qb0, per_head, qmask, kb, b, hq0, group):
        rem = np.int64(n)
        head = 0
        qb = np.int64(0)
        part = True
        for i in range(group):
            cnt, blocks = q_list(qmask, kb, b, hq0 + i)
            if 0 <= rem < cnt:
                head = i
                qb = q_at(blocks, rem)
                part = rem < blocks[0]
            rem -= cnt
        return head, qb, part

    @inline_device
    def head_count(qmask, kb, b, h):
        """(steps, partial steps) of head h's list: block_mask_row's counts, scalar loads."""
        num, idx, full_num, _ = qmask
        qm = kb // KR
        top = np.int64(idx.shape[3])
        n_partial = min(max(np.int64(num[b, h, qm]), zero), top) * R
        n_full = min(max(np.int64(full_num[b, h, qm]), zero), top) * R
        return n_partial + n_full, n_partial

    @inline_device
    def entry(qmask, kb, b, h, rem, n_partial):
        """(query block, partial) of step rem of head h's list (key_block_at's clamping);
        positions past the list read its last entry."""
        _, idx, _, full_idx = qmask
        qm = kb // KR
        last = np.int64(idx.shape[3] - 1)
        if rem < n_partial:
            m = np.int64(idx[b, h, qm, min(rem // R, last)])
            r = rem % R
        else:
            f = rem - n_partial
            m = np.int64(full_idx[b, h, qm, min(f // R, last)])
            r = f % R
        return min(max(m, zero), last) * R + r, rem < n_partial

    @inline_device
    def settle(head, rem, cnt, n_partial, qmask, kb, b, hq0, group):
        """The walk moved on to the next head while the current one's list is done."""
        while rem >= cnt and head + 1 < group:
            head += 1
            rem = zero
            cnt, n_partial = head_count(qmask, kb, b, hq0 + head)
        qb, part = entry(qmask, kb, b, hq0 + head, rem, n_partial)
        return head, qb, part, rem, cnt

    @inline_device
    def first(qb0, per_head, qmask, kb, b, hq0, group):
        cnt, n_partial = head_count(qmask, kb, b, hq0)
        return settle(0, zero, cnt, n_partial, qmask, kb, b, hq0, group)

    @inline_device
    def advance(state, qb0, per_head, qmask, kb, b, hq0, group):
        head, qb, part, rem, cnt = state
        _, n_partial = head_count(qmask, kb, b, hq0 + head)
        return settle(head, rem + 1, cnt, n_partial, qmask, kb, b, hq0, group)

    return count, step, first, advance


def key_steps(block_m: int, block_n: int, causal: bool = False, window=None,
              mask_block=None):
    """``(bounds, at, partial)``: a dQ kernel's loop over the key blocks (of ``block_n`` keys)
    its block of ``block_m`` query rows sees (grid x the query blocks).

    * ``bounds(sq, sk, kvmask, b, h) -> (row0, kb_first, kb_end, all_first, all_see,
      blocks)``: :func:`tilepy.tile.attention.key_blocks`' bounds (causal or a window), the
      loop's steps ``kb_first … kb_end - 1``; under a block mask of ``mask_block = (block_q,
      block_k)`` (multiples of ``block_m`` / ``block_n``) the steps ``0 …`` of the lists
      ``kvmask`` names for the query block (:func:`tilepy.tile.attention.block_mask_row`;
      not read when dense), ``blocks`` what ``at`` / ``partial`` read (dense: 0, step ``j``
      visiting key block ``j``);
    * ``at(blocks, j) -> kb`` and ``partial(blocks, j) -> bool``: step ``j``'s key block and
      whether its scores take the mask function (:func:`tilepy.tile.attention.key_block_at`,
      :func:`tilepy.tile.attention.key_block_partial`).

    Any thread; block-uniform."""
    left, right = key_window(causal, window)
    mb = None if mask_block is None else (int(mask_block[0]), int(mask_block[1]))
    return _key_steps(int(block_m), int(block_n), left, right, mb)


@functools.cache
def _key_steps(block_m: int, block_n: int, left: int, right: int, mask_block):
    SPARSE = mask_block is not None
    kblocks = key_blocks(block_m, block_n, False, (left, right))
    at = key_block_at(SPARSE, mask_block[1] // block_n if SPARSE else 1)
    partial = key_block_partial(SPARSE)
    kv_list = block_mask_row(block_m, mask_block[0], mask_block[1] // block_n) \
        if SPARSE else None

    @inline_device
    def bounds(sq, sk, kvmask, b, h):
        row0, kb_first, n_kb, all_first, all_see = kblocks(sq, sk)
        if SPARSE:   # step j visits the key block at(blocks, j) of the mask's lists
            n_kb, blocks = kv_list(kvmask, cuda.blockIdx.x, b, h)
            return row0, 0, n_kb, all_first, all_see, blocks
        return row0, kb_first, n_kb, all_first, all_see, 0

    return bounds, at, partial

__all__ = ["LOG2E", "a_fragment", "atomic_add_accumulators", "blocked_row", "check_functions",
           "counted_steps", "heavy_keys", "kernel_variant", "key_block_coords", "key_block_order",
           "key_block_scores", "key_steps", "mask_keys_past", "mask_transposed",
           "mask_transposed_window", "query_block_scores", "query_blocks", "query_steps",
           "reads_hook", "row_state", "score_functions", "softcap_scores", "softmax_gradient",
           "stage_float32", "store_accumulators", "swizzled_chunk", "transpose_to_shared",
           "variant_mods"]
