"""Attention's per-row key ranges, masking and score modification, as device-function generators.

The FlashAttention forward kernels (:mod:`tilepy.ops.attention_mma_sync` on mma.sync,
:mod:`tilepy.ops.attention_wgmma` on wgmma) are compositions of these pieces; a backward
kernel, a sliding-window or soft-capped variant, or a user's own kernel compose the same ones.
Each generator is cached on its arguments and returns a device function inlined into its
callers (:func:`tilepy.inline.inline_device`); every size is a closure constant.

Which keys a query row sees
---------------------------

Query rows ``i`` in ``0 … sq-1``, keys ``j`` in ``0 … sk-1``, ``shift = sk - sq`` (the
diagonal aligned to the bottom-right corner: FlashAttention-2's convention). Row ``i`` sees the
keys ``first(i) <= j <= last(i)`` with

* ``last(i) = min(sk - 1, i + shift + right)``, or ``sk - 1`` when ``right`` is unbounded;
* ``first(i) = max(0, i + shift - left)``, or ``0`` when ``left`` is unbounded;

``(left, right)`` from the generators' ``causal`` and ``window`` arguments
(:func:`key_window`): ``window=(left, right)`` is FlashAttention's ``window_size``, relative
to the diagonal, ``-1`` meaning unbounded on that side; ``causal=True`` is ``right = 0``.
``window=None`` with ``causal=False`` sees every key; with ``causal=True`` it is today's causal
mask, ``j <= i + shift``. A row with ``last(i) < first(i)`` (e.g. ``i < -shift`` when
``right = 0``) sees no key: all its scores are -inf, which the online softmax keeps clean
(:mod:`tilepy.tile.online_softmax`: output row 0, LSE -inf).

The pieces, in the order a kernel uses them
-------------------------------------------

* :func:`key_blocks` / :func:`block_bounds` — a block of ``block_m`` query rows: its first row,
  the key blocks (of ``block_n`` keys) any of its rows sees, and the keys every one of its rows
  sees (the key blocks wholly inside those need no mask).
* :func:`key_block_at` / :func:`key_block_partial` / :func:`block_mask_row` — the key block
  a key loop visits at each step: the range above, or a block mask's lists (block-sparse
  kernels; :func:`mask_visible` is the mask function a block mask is made from).
* :func:`row_limits` — per lane: the first / last key of each of its rows (a local array of
  :func:`limits_shape`), and the online softmax's start (row max -inf, row sum 0).
* :func:`modify_scores` — an optional score function on the scores of one key block, before
  the mask; :func:`softcap_score` makes Gemma 2's, :func:`score_hook` one from a cap and a
  user's FlexAttention-style ``score_mod`` / ``mask_mod`` or a block mask's bitmap
  (:func:`bitmap_word`).
* :func:`mask_scores` — the scores of keys a row does not see set to -inf;
  :func:`mask_key_block` the same in the key blocks that need it (a block-uniform test).
* :func:`store_rows` — the finalised O rows rounded to 16 bits, and the LSE.

Scores are accumulator fragments in the m16n8 layout (:mod:`tilepy.ptx.fragments`): a float32
local array ``s`` of shape (mi, ns, 4) holding one warp's ``16·mi`` rows × ``8·ns`` keys of one
key block; lane ``4g + t`` holds row ``16 i + g`` in ``s[i, j, 0:2]`` and row ``16 i + g + 8``
in ``s[i, j, 2:4]``, keys ``8 j + 2 t`` and ``8 j + 2 t + 1``. A wgmma accumulator has this
layout per warp once viewed as (1, ns, 4) (:func:`tilepy.tile.online_softmax.
accumulator_fragment`). Who calls: each lane of one warp for itself (no exchange between
lanes); :func:`key_blocks` / :func:`block_bounds` any thread (the values are block-uniform).

With ``window=None`` the generated code is what the kernels had before windows existed: no
lower bound, no extra registers. Both forward kernel families take ``window`` and
``score_mod`` as generator parameters (:func:`tilepy.ops.attention_mma_sync.attention_kernel`,
and :func:`tilepy.ops.attention_wgmma.wgmma_attention_kernel` on its TMA configs), and
``tilepy.flash_attention(..., window=, softcap=)`` passes them (the backward's counterparts are
in :mod:`tilepy.tile.attention_backward`, on the mma.sync backward kernels).
"""

from __future__ import annotations

import functools
import inspect
import math

import numpy as np
from numba import cuda

from ..inline import inline_device
from ..ptx.math import cvt_bf16x2_f32, cvt_f16x2_f32, tanh_approx
from .config import DTYPES
from .schedule import udiv

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


#: The largest window side taken as given: a longer one sees every key a sequence has (no
#: sequence is this long) and reads as unbounded, so the kernels' constants stay in 32 bits.
WINDOW_UNBOUNDED = 2 ** 31 - 1


def key_window(causal: bool = False, window=None) -> tuple[int, int]:
    """``(left, right)``: the visible keys of row ``i`` relative to its diagonal key
    ``i + sk - sq`` (see the module docstring), ``-1`` for unbounded.

    ``window``: None or FlashAttention's ``window_size`` ``(left, right)``, each side an int
    >= 0, or ``-1`` / None for unbounded (other negative values are an error); a side past
    :data:`WINDOW_UNBOUNDED` (longer than any sequence) is unbounded too, the same keys.
    ``causal=True`` sets ``right = 0``; a window given with it must have ``right`` 0, -1 or
    None.
    """
    if window is None:
        left, right = -1, -1
    else:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(f"window must be None or (left, right), got {window!r}") from None
        sides = []
        for side, v in (("left", left), ("right", right)):
            if v is None:
                v = -1
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) \
                    or v < -1:
                raise ValueError(f"window {side} must be an int >= 0, or -1 / None for "
                                 f"unbounded, got {v!r} in {window!r}")
            sides.append(-1 if v > WINDOW_UNBOUNDED else int(v))
        left, right = sides
    if causal:
        if right not in (-1, 0):
            raise ValueError(f"causal=True means window right = 0; got window={window!r}")
        right = 0
    return left, right


def limits_shape(mi: int, causal: bool = False, window=None) -> tuple:
    """Shape of the int64 local array of per-row key limits that :func:`row_limits` fills and
    :func:`mask_scores` reads, for ``mi`` m16 tiles of rows per warp: ``(mi, 2)`` (the last
    visible key of row ``16 i + g + 8 h`` at ``[i, h]``) without a lower bound, ``(mi, 2, 2)``
    (``[i, h, 0]`` the first visible key, ``[i, h, 1]`` the last) with one."""
    left, _ = key_window(causal, window)
    return (mi, 2, 2) if left >= 0 else (mi, 2)


# ---- key blocks of a block of query rows ----------------------------------------------------

def block_bounds(block_m: int, block_n: int, causal: bool = False, window=None):
    """``bounds(qb, sq, sk) -> (row0, kb_first, kb_end, all_first, all_see)`` for query block
    ``qb`` (rows ``qb·block_m …``, the rows past ``sq`` not counted):

    * ``row0 = qb · block_m``, its first query row;
    * key blocks (of ``block_n`` keys) ``kb_first … kb_end - 1``: the first and one past the
      last that any of its rows sees (none when ``kb_end <= kb_first``; a block that sees no
      key has ``kb_end`` 0);
    * ``all_first`` … ``all_see``: the keys every one of its rows sees (none when
      ``all_see < all_first``, e.g. when a row sees no key). A key block that starts before
      ``all_first`` or ends after ``all_see`` needs the mask (:func:`mask_key_block`), the
      others do not.

    Without a lower bound (``window`` None or ``left = -1``) ``kb_first`` and ``all_first``
    are the constant 0. int64 values, block-uniform; any thread computes them."""
    left, right = key_window(causal, window)
    return _block_bounds(block_m, block_n, left, right)


@functools.cache
def _block_bounds(block_m: int, block_n: int, left: int, right: int):
    BM, BN = block_m, block_n
    UPPER, LOWER = right >= 0, left >= 0
    R, L = right, left

    @inline_device
    def bounds(qb, sq, sk):
        row0 = qb * BM
        if UPPER:
            shift = sk - sq  # bottom-right alignment: row i sees keys j <= i + shift + R
            last = min(sk, min(row0 + BM, sq) + shift + R) - 1
            kb_end = last // BN + 1 if last >= 0 else 0
            all_see = min(sk, row0 + shift + R + 1) - 1
        else:
            kb_end = (sk + BN - 1) // BN
            all_see = sk - 1
        if LOWER:
            # row i sees keys j >= i + shift - L: the block's first row sees the earliest,
            # its last row (before sq) the latest first key
            lead = sk - sq - L
            kb_first = max(0, row0 + lead) // BN
            all_first = max(0, min(row0 + BM, sq) - 1 + lead)
            return row0, kb_first, kb_end, all_first, all_see
        return row0, 0, kb_end, 0, all_see

    return bounds


def key_blocks(block_m: int, block_n: int, causal: bool = False, window=None):
    """``bounds(sq, sk) -> (row0, kb_first, kb_end, all_first, all_see)``: :func:`block_bounds`
    of this block's query block, for a grid of ``ceil(sq / block_m)`` blocks along x. With an
    upper bound (causal) the blocks that see the most keys run first (query block
    ``gridDim.x - 1 - blockIdx.x``), else query block ``blockIdx.x``."""
    left, right = key_window(causal, window)
    return _key_blocks(block_m, block_n, left, right)


@functools.cache
def _key_blocks(block_m: int, block_n: int, left: int, right: int):
    at = _block_bounds(block_m, block_n, left, right)
    HEAVY_FIRST = right >= 0

    @inline_device
    def bounds(sq, sk):
        if HEAVY_FIRST:
            return at(cuda.gridDim.x - 1 - cuda.blockIdx.x, sq, sk)
        return at(cuda.blockIdx.x, sq, sk)

    return bounds


@inline_device
def block_coords(q, k):
    """``(sq, sk, b, h, hk)`` of a grid kernel's block over 4-D (batch, heads, seq, head_dim)
    views ``q`` and ``k``: the sequence lengths, its batch and query head (grid z and y), and
    the K/V head that query head reads (GQA: ``h // (Hq // Hkv)``). Any thread."""
    sq = q.shape[2]
    sk = k.shape[2]
    b = cuda.blockIdx.z
    h = cuda.blockIdx.y
    return sq, sk, b, h, udiv(h, udiv(q.shape[1], k.shape[1]))   # (32-bit: schedule.udiv)


@inline_device
def packed_sequence(seqs, b):
    """``(q_start, k_start, sq, sk)`` (int64) of packed sequence ``b``: its first query row and
    key in the packed views and its lengths, from ``seqs = (cu_seqlens_q, cu_seqlens_k)``
    (int32 cumulative lengths). Any thread."""
    cu_q, cu_k = seqs
    q_start = np.int64(cu_q[b])
    k_start = np.int64(cu_k[b])
    return q_start, k_start, np.int64(cu_q[b + 1]) - q_start, np.int64(cu_k[b + 1]) - k_start


# ---- per-row limits, score modification, masking -------------------------------------------

def row_limits(mi: int, causal: bool = False, window=None):
    """``init(limit, row_max, row_sum, rows0, g, sq, sk)``, each lane of a warp for its own
    ``mi × 2`` rows ``rows0 + 16 i + g + 8 h`` (``rows0`` the warp's first row, ``g = lane //
    4``): ``limit`` (int64, :func:`limits_shape`) gets each row's first and last visible key
    (the last alone without a lower bound; rows past ``sq`` get limits too, which nobody
    stores), ``row_max`` / ``row_sum`` ((mi, 2) float32) the online softmax's start, -inf and
    0."""
    left, right = key_window(causal, window)
    return _row_limits(mi, left, right)


@functools.cache
def _row_limits(mi: int, left: int, right: int):
    UPPER, LOWER = right >= 0, left >= 0
    R1, L = right + 1, left

    @inline_device
    def init(limit, row_max, row_sum, rows0, g, sq, sk):
        for i in range(mi):
            for hh in range(2):
                row_max[i, hh] = _NEG_INF
                row_sum[i, hh] = _ZERO
                if UPPER:
                    last = min(sk, rows0 + 16 * i + g + 8 * hh + sk - sq + R1) - 1
                else:
                    last = sk - 1
                if LOWER:
                    limit[i, hh, 0] = max(0, rows0 + 16 * i + g + 8 * hh + sk - sq - L)
                    limit[i, hh, 1] = last
                else:
                    limit[i, hh] = last

    return init


def modify_scores(mi: int, ns: int, score_mod=None):
    """``modify(s, row0, key0, b, h, scale, args)``: ``s[...] = score_mod(s·scale, q_row,
    k_col, b, h, args) / scale`` on every entry of one lane's (mi, ns, 4) score fragment of one
    key block.

    * ``score_mod(score, q_row, k_col, batch, head, args) -> float32``: a device function
      (:func:`tilepy.inline.inline_device`; a plain Python function is wrapped so), inlined.
      ``score`` is the *scaled* score ``scale · q_i · k_j`` (FlexAttention's contract), the
      indices are int64 positions in the sequences (``q_row`` may be past ``sq`` and ``k_col``
      past ``sk`` in edge tiles: the mask removes those keys afterwards). It may return -inf
      (the key is then masked for that row); not +inf or NaN. ``args``: the kernel's tuple of
      run-time arguments for the hook (device arrays and scalars, ``()`` when it has none:
      :func:`score_hook`'s ``mod_args`` and ALiBi slopes), passed through unread.
    * ``row0``: the lane's first row (``rows0 + g``; ``s[i, :, 2h:2h+2]`` is row ``row0 + 16 i +
      8 h``), ``key0`` the key of its column 0 in the block (``kb·block_n + 2t``, as for
      :func:`mask_scores`), ``b`` / ``h`` the batch and query head, ``scale`` the float32
      softmax scale (> 0).

    The kernels keep raw scores and fold the scale into the exponent (``p = exp2(s·c - m·c)``,
    ``c = scale · log2(e)``, :func:`tilepy.tile.online_softmax.online_softmax_update`); dividing
    the modified score by ``scale`` keeps that: ``p = exp(score_mod(scale · s) - …)``, and the
    LSE (``row_max · scale + log(row_sum)``, :func:`store_rows`) is that of the modified
    scores. Call it right before :func:`mask_scores` / :func:`mask_key_block`, on every key
    block (not only those that need the mask). ``score_mod=None``: a function that does
    nothing (no code)."""
    if score_mod is not None and inspect.isfunction(score_mod):
        score_mod = _as_device(score_mod)
    return _modify_scores(mi, ns, score_mod)


@functools.cache
def _as_device(fn):
    return inline_device(fn)


@functools.cache
def _modify_scores(mi: int, ns: int, score_mod):
    if score_mod is None:
        @inline_device
        def nothing(s, row0, key0, b, h, scale, args):
            return None

        return nothing
    if score_mod in _BITS_HOOKS and ns % 4 == 0:
        return _modify_scores_bits(mi, ns, *_BITS_HOOKS[score_mod])
    fn = score_mod

    @inline_device
    def modify(s, row0, key0, b, h, scale, args):
        c = np.float32(scale)
        inv = _ONE / c
        for i in range(mi):
            for hh in range(2):
                r = row0 + 16 * i + 8 * hh
                for j in range(ns):
                    for e in range(2):
                        x = s[i, j, 2 * hh + e] * c
                        s[i, j, 2 * hh + e] = np.float32(
                            fn(x, r, key0 + 8 * j + e, b, h, args)) * inv

    return modify


@inline_device
def bitmap_word(words, b, h, r, col0, w):
    """Word ``w`` of a fragment row's bitmap: ``words[b, h, r, col0 // 32 + w]`` (uint32) shifted
    right by ``col0 % 32``, so that bit ``8·jj + e`` is the lane's column ``col0 + 8·(4w + jj)
    + e`` — for a fragment whose 8·ns columns start at a multiple of 32 (``col0`` = that start
    + 2t): :func:`score_hook`'s ``mask_bits``."""
    return np.uint32(words[b, h, r, (col0 >> 5) + w]) >> np.uint32(col0 & 31)


@functools.cache
def _modify_scores_bits(mi: int, ns: int, base, nb: int):
    # the fragment's 8·ns keys start at a multiple of 32 (key0 - 2t = kb · 8·ns)
    NW, NB, PLAIN = ns // 4, nb, base is None
    fn = _keep6 if base is None else base
    one, zero = np.uint32(1), np.uint32(0)

    @inline_device
    def modify(s, row0, key0, b, h, scale, args):
        c = np.float32(scale)
        inv = _ONE / c
        bits = args[NB]
        for i in range(mi):
            for hh in range(2):
                r = row0 + 16 * i + 8 * hh
                for w in range(NW):
                    word = bitmap_word(bits, b, h, r, key0, w)
                    for jj in range(4):
                        j = 4 * w + jj
                        for e in range(2):
                            if PLAIN:
                                x = s[i, j, 2 * hh + e]
                            else:
                                x = np.float32(fn(s[i, j, 2 * hh + e] * c, r, key0 + 8 * j + e,
                                                  b, h, args)) * inv
                            if (word >> np.uint32(8 * jj + e)) & one == zero:
                                x = _NEG_INF
                            s[i, j, 2 * hh + e] = x

    return modify


def softcap_score(cap: float):
    """Gemma 2's soft cap as a ``score_mod`` (:func:`modify_scores`): ``cap · tanh(score /
    cap)`` of the scaled score, ``cap > 0`` a closure constant (one device function per
    value: ``2`` and ``2.0`` give the same one). tanh is the hardware's
    (:func:`tilepy.ptx.math.tanh_approx`, relative error about 1e-5), as the backward's cap
    derivative (:mod:`tilepy.tile.attention_backward`) also uses."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.integer, np.floating)) \
            or not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap must be a finite float > 0, got {cap!r}")
    return _softcap_score(float(cap))


@functools.cache
def _softcap_score(cap: float):
    C = np.float32(cap)
    INV = np.float32(1.0 / float(cap))

    @inline_device
    def softcap(score, q_row, k_col, batch, head, args):
        return C * tanh_approx(score * INV)

    return softcap


def score_hook(cap: float = 0.0, score_mod=None, mask_mod=None, *, n_args: int = 0,
               alibi: bool = False, mask_bits: bool = False):
    """The kernels' ``score_mod`` (:func:`modify_scores`'s contract) for a soft cap, ALiBi and
    a user's FlexAttention-style functions, applied in this order to each scaled score:

    1. ``cap > 0``: ``cap · tanh(score / cap)`` (:func:`softcap_score`);
    2. ``alibi``: ``- slope · |q_idx + sk - sq - kv_idx|`` added, ``slope = args[n_args][b,
       h]`` (a float32 (batch, heads_q) array, a zero batch stride for per-head slopes) and
       ``sk - sq = args[n_args + 1]`` (an int64): FlashAttention's ``alibi_slopes``;
    3. ``score_mod(score, b, h, q_idx, kv_idx, *mod_args) -> float32``: any modification (a
       bias table, a cap of the user's own, ...);
    4. ``mask_mod(b, h, q_idx, kv_idx, *mod_args) -> bool``: False hides the key from that
       query row (its score becomes -inf; a row that sees no key gives zeros and LSE -inf).

    ``mod_args`` are the kernel's hook arguments ``args[:n_args]`` (device arrays or scalars
    the op passes at run time — a per-token document id, a bias table), given to both user
    functions after the four (five) fixed ones. ``b`` / ``h`` are the batch and query head,
    ``q_idx`` / ``kv_idx`` int64 positions in the sequences — in edge tiles past ``seq_q`` /
    ``seq_k`` too, whose results are never used (a function that reads memory at these
    indices must bound them itself). The functions run after the window's and the causal
    mask's key ranges are chosen and before they are applied: key blocks outside those ranges
    are skipped, the rest see every score — or, in a block-sparse kernel, the key blocks a
    block mask lists, the full ones with the hook made without ``mask_mod``. Each is a Numba CUDA device function or a plain
    Python function (compiled as one, inlined); they must not have side effects. None with
    nothing to do. ``TypeError`` for a non-callable or a function whose positional parameters
    do not number ``5 + n_args`` (score_mod) / ``4 + n_args`` (mask_mod); ``ValueError`` for
    ``n_args`` outside 0 … :data:`MAX_MOD_ARGS`. One device function per (cap, score_mod,
    mask_mod, n_args, alibi, mask_bits).

    ``mask_bits=True`` takes the mask from a bitmap in place of ``mask_mod`` (then None, else
    ``ValueError``): key ``kv_idx`` is hidden from row ``q_idx`` where bit ``kv_idx % 32`` of
    the uint32 word ``args[nb][b, h, q_idx, kv_idx // 32]`` is 0, ``nb = n_args`` (+ 2 with
    ``alibi``): the argument after the others — a block mask's ``partial_bits``
    (:func:`tilepy.create_block_mask`). :func:`modify_scores` then loads each word once for
    the 32 keys it covers (the function, called per score, would load it per score)."""
    n_args = check_n_args(n_args)
    if mask_bits:
        if mask_mod is not None:
            raise ValueError("score_hook: mask_bits replaces mask_mod; pass one of them")
        base = score_hook(cap, score_mod, None, n_args=n_args, alibi=alibi)
        return _bits_hook(base, n_args + (2 if alibi else 0))
    if score_mod is None and mask_mod is None and not alibi:
        return softcap_score(cap) if cap else None
    if cap:
        softcap_score(cap)   # the same validation
    sm = _user_function(score_mod, "score_mod", 5, _keep_score, n_args)
    mm = _user_function(mask_mod, "mask_mod", 4, _see_all, n_args)
    return _score_hook(float(cap or 0.0), sm, mm, n_args, bool(alibi))


#: The most ``mod_args`` a user function takes after its fixed parameters.
MAX_MOD_ARGS = 6


def check_n_args(n_args) -> int:
    """``n_args`` as an int; ``ValueError`` outside 0 … :data:`MAX_MOD_ARGS`."""
    if isinstance(n_args, bool) or not isinstance(n_args, (int, np.integer)) \
            or not 0 <= n_args <= MAX_MOD_ARGS:
        raise ValueError(f"mod_args: at most {MAX_MOD_ARGS} arguments, got {n_args!r}")
    return int(n_args)


@inline_device
def _keep_score(score, b, h, q_idx, kv_idx):
    return score


@inline_device
def _see_all(b, h, q_idx, kv_idx):
    return True


def check_user_function(fn, name: str, arity: int, n_args: int = 0) -> None:
    """``TypeError`` unless ``fn`` is None or a callable (a Python function, or a Numba
    dispatcher of one) taking ``arity + n_args`` positional parameters (the fixed ones, then
    one per ``mod_args`` entry)."""
    if fn is None:
        return
    if not callable(fn):
        raise TypeError(f"{name} must be a function (a Numba CUDA device function or a plain "
                        f"Python function), got {type(fn).__name__} {fn!r}")
    py = getattr(fn, "py_func", fn)
    try:
        params = inspect.signature(py).parameters.values()
    except (TypeError, ValueError):
        return   # no signature to read (a builtin): Numba will say when it compiles
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != arity + n_args or any(p.kind == p.VAR_POSITIONAL for p in params):
        want = ("(score, b, h, q_idx, kv_idx" if arity == 5 else "(b, h, q_idx, kv_idx") + (
            f", *mod_args: {n_args} more)" if n_args else ")")
        raise TypeError(f"{name} {getattr(py, '__qualname__', py)!r} must take {arity + n_args} "
                        f"positional parameters {want}, got {inspect.signature(py)}")


def _user_function(fn, name, arity, default, n_args=0):
    """``fn`` (or ``default``) as an inlined device function of the fixed parameters and the
    hook's ``args`` tuple: ``call(*fixed, args) = fn(*fixed, *args[:n_args])``."""
    check_user_function(fn, name, arity, n_args)
    if fn is None:
        return _with_args(default, arity, 0)
    return _with_args(_as_device(fn) if inspect.isfunction(fn) else fn, arity, n_args)


@functools.cache
def _with_args(fn, arity: int, n: int):
    # Numba inlines a closure only at its exact arity (no *args call): one adapter per count
    if inspect.isfunction(fn):
        fn = _as_device(fn)
    f = fn
    if arity == 4:   # mask_mod: the score is not passed
        adapters = (
            lambda x, b, h, q, k, a: f(b, h, q, k),
            lambda x, b, h, q, k, a: f(b, h, q, k, a[0]),
            lambda x, b, h, q, k, a: f(b, h, q, k, a[0], a[1]),
            lambda x, b, h, q, k, a: f(b, h, q, k, a[0], a[1], a[2]),
            lambda x, b, h, q, k, a: f(b, h, q, k, a[0], a[1], a[2], a[3]),
            lambda x, b, h, q, k, a: f(b, h, q, k, a[0], a[1], a[2], a[3], a[4]),
            lambda x, b, h, q, k, a: f(b, h, q, k, a[0], a[1], a[2], a[3], a[4], a[5]))
    else:
        adapters = (
            lambda x, b, h, q, k, a: f(x, b, h, q, k),
            lambda x, b, h, q, k, a: f(x, b, h, q, k, a[0]),
            lambda x, b, h, q, k, a: f(x, b, h, q, k, a[0], a[1]),
            lambda x, b, h, q, k, a: f(x, b, h, q, k, a[0], a[1], a[2]),
            lambda x, b, h, q, k, a: f(x, b, h, q, k, a[0], a[1], a[2], a[3]),
            lambda x, b, h, q, k, a: f(x, b, h, q, k, a[0], a[1], a[2], a[3], a[4]),
            lambda x, b, h, q, k, a: f(x, b, h, q, k, a[0], a[1], a[2], a[3], a[4], a[5]))
    return inline_device(adapters[n])


@functools.cache
def _bits_hook(base, nb: int):
    """The hook of :func:`score_hook` with ``mask_bits``: ``base`` (the hook without a mask,
    or None), then the bitmap ``args[nb]``'s test. Kept in :data:`_BITS_HOOKS` for
    :func:`modify_scores`' word-at-a-time form."""
    NB = nb
    keep = _keep6 if base is None else base

    @inline_device
    def hook(score, q_row, k_col, batch, head, args):
        x = keep(score, q_row, k_col, batch, head, args)
        w = np.uint32(args[NB][batch, head, q_row, k_col >> 5])
        if (w >> np.uint32(k_col & 31)) & np.uint32(1) == np.uint32(0):
            x = _NEG_INF
        return x

    _BITS_HOOKS[hook] = (base, NB)
    return hook


#: Hooks made by :func:`score_hook` with ``mask_bits``: hook → (the hook without the mask or
#: None, the bitmap's index in the hook's arguments).
_BITS_HOOKS = {}


@inline_device
def _keep6(score, q_row, k_col, batch, head, args):
    return score


@functools.cache
def _score_hook(cap: float, score_mod, mask_mod, n_args: int, alibi: bool):
    CAPPED = cap > 0
    C = np.float32(cap if CAPPED else 1.0)
    INV = np.float32(1.0 / cap if CAPPED else 1.0)
    sm, mm = score_mod, mask_mod
    ALIBI = alibi
    slopes_at = _alibi_slope(n_args) if alibi else None

    @inline_device
    def hook(score, q_row, k_col, batch, head, args):
        x = score
        if CAPPED:
            x = C * tanh_approx(x * INV)
        if ALIBI:
            slope, shift = slopes_at(args, batch, head)
            x = x - slope * np.float32(abs(q_row + shift - k_col))
        x = np.float32(sm(x, batch, head, q_row, k_col, args))
        if not mm(x, batch, head, q_row, k_col, args):
            x = _NEG_INF
        return x

    return hook


@functools.cache
def _alibi_slope(n: int):
    """``(slope, shift)`` of (batch, head) from the hook's ``args[n]`` (the slopes) and
    ``args[n + 1]`` (``sk - sq``)."""
    N, N1 = n, n + 1

    @inline_device
    def at(args, batch, head):
        return np.float32(args[N][batch, head]), args[N1]

    return at


def mask_scores(mi: int, ns: int, window=None):
    """``mask(s, limit, key0)``: set the entries of one lane's (mi, ns, 4) score fragment whose
    key its row does not see to -inf. ``limit``: the lane's row limits from :func:`row_limits`
    (of a window with the same ``left``: only the lower bound changes what ``limit`` holds);
    ``key0``: the key of the lane's column 0 in the block, ``kb·BN + 2t``.

    The per-entry compares are 32-bit (the relative column, clamped to the block, fits): one
    ISETP each where 64-bit ones took two."""
    left, _ = key_window(False, window)
    return _mask_scores(mi, ns, left >= 0)


@functools.cache
def _mask_scores(mi: int, ns: int, lower: bool):
    lo, hi = np.int64(-1), np.int64(8 * ns)
    zero = np.int64(0)
    LOWER = lower

    @inline_device
    def mask(s, limit, key0):
        for i in range(mi):
            for hh in range(2):
                if LOWER:
                    # first and last visible column, relative: first 8·ns or last -1 masks all
                    first = np.int32(min(max(limit[i, hh, 0] - key0, zero), hi))
                    rel = np.int32(min(max(limit[i, hh, 1] - key0, lo), hi))
                    for j in range(ns):
                        if np.int32(8 * j) > rel or np.int32(8 * j) < first:
                            s[i, j, 2 * hh] = _NEG_INF
                        if np.int32(8 * j + 1) > rel or np.int32(8 * j + 1) < first:
                            s[i, j, 2 * hh + 1] = _NEG_INF
                else:
                    # last visible column, relative; -1 masks all, 8·ns none
                    rel = np.int32(min(max(limit[i, hh] - key0, lo), hi))
                    for j in range(ns):
                        if np.int32(8 * j) > rel:
                            s[i, j, 2 * hh] = _NEG_INF
                        if np.int32(8 * j + 1) > rel:
                            s[i, j, 2 * hh + 1] = _NEG_INF

    return mask


def mask_key_block(mi: int, ns: int, block_n: int, window=None):
    """``mask(s, limit, kb, t, all_first, all_see)``: :func:`mask_scores` of key block ``kb``
    (keys ``kb·block_n …``; ``key0 = kb·block_n + 2t``) where the block needs it — it starts
    before ``all_first`` or ends after ``all_see`` (:func:`block_bounds`; a partial last key
    block always does, ``all_see < sk``) — and nothing in the blocks every row of the query
    block sees whole. The test is block-uniform (the same branch in every lane). Without a
    lower bound ``all_first`` is not read. ``ns = block_n / 8`` for a whole block."""
    left, _ = key_window(False, window)
    return _mask_key_block(mi, ns, block_n, left >= 0)


@functools.cache
def _mask_key_block(mi: int, ns: int, block_n: int, lower: bool):
    BN, LOWER = block_n, lower
    mask = _mask_scores(mi, ns, lower)

    # the test written out, not a call of a bool-returning device function: such a call
    # leaves the window-less kernels' PTX with other register numbers
    @inline_device
    def mask_block(s, limit, kb, t, all_first, all_see):
        if LOWER:
            if (kb + 1) * BN - 1 > all_see or kb * BN < all_first:
                mask(s, limit, kb * BN + 2 * t)
        elif (kb + 1) * BN - 1 > all_see:
            mask(s, limit, kb * BN + 2 * t)

    return mask_block


# ---- block-sparse key loops (a block mask) -------------------------------------------------

def key_block_at(sparse: bool = False, ratio: int = 1):
    """``at(blocks, j) -> kb``: the key block (of the kernel's ``block_n`` keys) a key loop
    visits at its step ``j``.

    * ``sparse=False``: ``blocks`` is the first key block (an int, :func:`block_bounds`'
      ``kb_first``) and step ``j`` visits ``blocks + j`` — the dense loops' code.
    * ``sparse=True``: ``blocks`` is :func:`block_mask_row`'s ``(n_partial, partial, full)``:
      the first ``n_partial`` steps visit the key blocks of the row ``partial`` of a block
      mask's ``kv_indices``, the rest those of ``full`` (``full_kv_indices``). A mask block of
      ``ratio`` kernel key blocks (its key block size over the kernel's ``block_n``) is visited
      as ``ratio`` consecutive steps: step ``j`` of a list is kernel key block
      ``list[j // ratio] · ratio + j % ratio``; a list entry outside ``0 … len(list) - 1`` is
      clamped into that range (a hand-made mask never makes a kernel read out of bounds).

    Any thread; the value is block-uniform."""
    return _key_block_at(bool(sparse), int(ratio))


@functools.cache
def _key_block_at(sparse: bool, ratio: int):
    R = np.int64(ratio)
    if not sparse:
        @inline_device
        def dense(blocks, j):
            return blocks + j

        return dense

    @inline_device
    def at(blocks, j):
        n_partial, partial, full = blocks
        last = np.int64(partial.shape[0] - 1)
        if j < n_partial:
            m = np.int64(partial[j // R])
            r = j % R
        else:
            f = j - n_partial
            m = np.int64(full[f // R])
            r = f % R
        return min(max(m, np.int64(0)), last) * R + r

    return at


def key_block_partial(sparse: bool = False):
    """``partial(blocks, j) -> bool``: whether step ``j`` of a key loop (:func:`key_block_at`'s
    ``blocks``) visits a partial block, whose scores the mask function must see — always
    (True) when not ``sparse``; under a block mask the steps before ``n_partial``. A full
    block's scores take the score hook without the mask function."""
    return _key_block_partial(bool(sparse))


@functools.cache
def _key_block_partial(sparse: bool):
    if not sparse:
        @inline_device
        def always(blocks, j):
            return True

        return always

    @inline_device
    def partial(blocks, j):
        return j < blocks[0]

    return partial


def block_mask_row(block_m: int, mask_block_q: int, ratio: int = 1):
    """``row(mask, qb, b, h) -> (n_kb, blocks)``: the key blocks a block of ``block_m`` query
    rows (query block ``qb``, batch ``b``, query head ``h``) visits under a block mask, for
    :func:`key_block_at` ``(sparse=True, ratio)``.

    ``mask`` is ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)``
    (FlexAttention's ``BlockMask`` arrays, int32, (batch, heads, mask query blocks[, mask key
    blocks]); a mask made for one batch or head is passed with a zero stride there): the
    kernel's query block lies in mask query block ``qb // (mask_block_q // block_m)``
    (``mask_block_q`` a multiple of ``block_m``). ``n_kb`` is the number of key loop steps —
    the partial and full mask blocks, ``ratio`` steps each — and ``blocks`` is
    ``(n_partial, partial, full)``: the steps before ``n_partial`` are the partial blocks
    (the mask function is evaluated on their scores), the others full (every pair visible).
    Counts are clamped to ``0 … mask key blocks``. Any thread; block-uniform values."""
    if block_m <= 0 or mask_block_q % block_m:
        raise ValueError(f"block_mask_row: the mask's query block {mask_block_q} must be a "
                         f"multiple of the kernel's block_m {block_m}")
    return _block_mask_row(mask_block_q // block_m, int(ratio))


@functools.cache
def _block_mask_row(q_ratio: int, ratio: int):
    QR, R = q_ratio, np.int64(ratio)

    @inline_device
    def row(mask, qb, b, h):
        num, idx, full_num, full_idx = mask
        qm = qb // QR
        top = np.int64(idx.shape[3])
        n_partial = min(max(np.int64(num[b, h, qm]), np.int64(0)), top) * R
        n_full = min(max(np.int64(full_num[b, h, qm]), np.int64(0)), top) * R
        return n_partial + n_full, (n_partial, idx[b, h, qm], full_idx[b, h, qm])

    return row


def check_mask_block(mask_block, block_m: int, block_n: int) -> tuple:
    """``(block_q, block_k)`` of a block mask as ints (a kernel generator's ``mask_block``);
    ``ValueError`` unless multiples of the kernel's ``block_m`` and ``block_n``."""
    bq, bk = (int(x) for x in mask_block)
    if bq <= 0 or bk <= 0 or bq % block_m or bk % block_n:
        raise ValueError(f"a block mask of block size ({bq}, {bk}) needs kernel tiles that "
                         f"divide it; this kernel's are block_m {block_m}, block_n {block_n}")
    return bq, bk


def mask_visible(mask_mod, n_args: int = 0):
    """``visible(b, h, q_idx, kv_idx, args) -> bool``: a user's ``mask_mod(b, h, q_idx, kv_idx,
    *mod_args)`` (:func:`score_hook`'s contract; ``args[:n_args]`` are the ``mod_args``) as an
    inlined device function — what a block mask is computed from. ``TypeError`` as
    :func:`check_user_function`."""
    n_args = check_n_args(n_args)
    if mask_mod is None:
        raise TypeError("mask_visible: mask_mod is None")
    return _mask_visible(_user_function(mask_mod, "mask_mod", 4, _see_all, n_args))


@functools.cache
def _mask_visible(mm):
    @inline_device
    def visible(b, h, q_idx, kv_idx, args):
        return mm(_ZERO, b, h, q_idx, kv_idx, args)

    return visible


# ---- the output rows -----------------------------------------------------------------------

@functools.cache
def store_rows(mi: int, no: int, dtype: str, has_lse: bool):
    """``store(acc, row_max, row_sum, o2, lse, b, h, rows0, sq, scale, g, t)``, each lane of a
    warp: its finalised O fragment ``acc`` ((mi, no, 4) float32, m16n8 layout: ``8·no``
    columns of head_dim) rounded to ``dtype`` (float16 / bfloat16) into ``o2`` (the (Sq, D)
    uint16 view of this (batch, head); rows ``rows0 + 16 i + g + 8 h`` past ``sq`` skipped),
    and, with ``has_lse``, lane ``t = 0`` of each quad writes the row's natural-log LSE
    ``row_max · scale + log(row_sum)`` to ``lse[b, h, row]`` (-inf for a row that saw no key:
    ``row_sum`` 0; NaN where a score was). ``row_sum``: the quad-reduced totals (after
    :func:`~tilepy.tile.online_softmax.online_softmax_finalize`). ``no = 0`` writes the LSE
    alone."""
    if dtype not in DTYPES:
        raise ValueError(f"store_rows: dtype must be one of {DTYPES}, got {dtype!r}")
    pack = cvt_f16x2_f32 if dtype == "float16" else cvt_bf16x2_f32
    HAS_LSE = bool(has_lse)

    @inline_device
    def store(acc, row_max, row_sum, o2, lse, b, h, rows0, sq, scale, g, t):
        for i in range(mi):
            for hh in range(2):
                r = rows0 + 16 * i + g + 8 * hh
                if r < sq:
                    for j in range(no):
                        c = 8 * j + 2 * t
                        word = pack(acc[i, j, 2 * hh], acc[i, j, 2 * hh + 1])
                        o2[r, c] = word & 0xFFFF
                        o2[r, c + 1] = word >> 16
                    if HAS_LSE and t == 0:
                        total = row_sum[i, hh]
                        # no key: -inf; a NaN score's row: NaN (never "no key")
                        if total == _ZERO:
                            lse[b, h, r] = _NEG_INF
                        else:
                            lse[b, h, r] = row_max[i, hh] * scale + math.log(total)

    return store


__all__ = ["bitmap_word", "block_bounds", "block_coords", "block_mask_row", "check_mask_block",
           "check_user_function",
           "key_block_at", "key_block_partial", "key_blocks", "key_window", "limits_shape",
           "mask_visible",
           "mask_key_block", "mask_scores", "modify_scores", "row_limits", "score_hook",
           "MAX_MOD_ARGS", "check_n_args",
           "softcap_score", "store_rows"]
