"""``tilepy.flash_attention``: the FlashAttention-2 forward pass on tensor cores.

Validation and layout handling on the host, then one launch of the mma.sync kernel of
:mod:`tilepy.ops.attention_mma_sync` on the inputs' device and the caller's current stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import warnings

import numpy as np

from .. import arrays, launch
from ..arrays import device_view, describe
from ..launch import PlanCache
from ..tile import device_write
from ..tile.attention import check_n_args, check_user_function, key_window, score_hook
from . import attention_block_mask as abm
from .attention_tuned import tuned_attention_config
from . import attention_mma_sync as fa
from . import attention_wgmma as aw
from .attention_mma_sync import HEAD_DIMS, AttentionConfig

LAYOUTS = ("bhsd", "bshd")

# GPU: 8 warps of 16 query rows (BM = 128) share each K/V tile of 64 keys; Q (BM × D), and two
# stages of K and V: 48 KB at D = 64, 96 KB at D = 128. 128 / 210 registers per thread
# (offline report, sm_90), no spills.
# (block_m, block_n, warp_rows) by head_dim: the fastest of bench/sweep_attention.py's grid on
# the H200 (bench/NOTES.md: attention configs, non-causal fp16). Head dims without a
# measurement take the nearest measured one's shape (<= 64 -> the first, else the second);
# warp_rows 32 spills at head_dim 128 (offline compile), so it is not used above 64.
# Past 128 (the portable fallback; on Hopper the TMA kernels run): 64 × 32 tiles, 96 KB of
# shared memory at head_dim 256, within sm_80's and sm_86's limits.
GPU_CONFIGS = {64: (128, 64, 32), 128: (64, 64, 16), 256: (64, 32, 16)}
# Simulator: every thread is a Python thread: 2 warps, 16-key blocks, still a real pipeline
# (several key blocks per query block) with masked edges.
SIM_BLOCK_M, SIM_BLOCK_N, SIM_WARP_ROWS = 32, 16, 16


# Hopper (sm_90): the wgmma kernel (attention_wgmma) for the head dims it has; per (head_dim,
# causal): the config's fields (query rows: 128 = two consumer warpgroups at head_dim 128, 192
# = three at 64), each the fastest in absolute TFLOPS over the attention benchmark shapes, fp16
# (bench/NOTES.md: the attention schedule sweeps — TMA feeding, the producer warpgroup with
# ping-pong at d128, three consumer warpgroups at d64, the persistent ticket-scheduled kernel
# where it won: d64 and causal d128). TILEPY_HOPPER=0 keeps mma.sync. Values:
# WgmmaAttentionConfig's keyword arguments.
# Keys: (tile_dim, causal), tile_dim the head dim rounded up to 64 columns (every head dim
# runs the TMA kernel of its tile_dim, TMA filling the columns past it with zeros). Past 128,
# FlashAttention-3's tiles: 128 query rows over 112 (96 causal) keys at 192 and 80 keys at 256
# (two K/V stages beside Q fill the shared memory; no room for the persistent kernel's second
# Q buffer).
_D128 = dict(block_m=128, block_n=128, overlap=True, tma=True, pingpong=True, producer=True)
_D64 = dict(block_m=192, block_n=128, overlap=True, tma=True, producer=True, persistent=True)
_WIDE = dict(block_m=128, overlap=True, tma=True, pingpong=True, producer=True)
HOPPER_CHOICE = {(128, False): _D128, (128, True): dict(_D128, persistent=True),
                 (64, False): _D64, (64, True): _D64,
                 (192, False): dict(_WIDE, block_n=112), (192, True): dict(_WIDE, block_n=96),
                 (256, False): dict(_WIDE, block_n=80), (256, True): dict(_WIDE, block_n=80)}
# Short causal sequences at the 64-column class (seq_q <= SHORT_CAUSAL_SEQ, plain causal: no
# window, cap or user function): 64 x 64 tiles of one consumer warpgroup that issues its own
# TMA loads (no producer warpgroup), several blocks an SM, so that one tile's prologue and
# epilogue overlap another's main loop. Causal S512 has ~2.5 key blocks per 192-row tile on
# average: there the fixed cost per tile decides (bench/NOTES.md: short sequences with 64-row
# tiles — the fastest causal config at B16 H16 S512 D64 in two runs, +14 % and +30 % over the
# 192-row one; not faster without the mask, nor at S1024 D128).
SHORT_CAUSAL_SEQ = 512
_SHORT_CAUSAL_D64 = dict(block_m=64, block_n=64, overlap=True, tma=True)


def hopper_config(head_dim: int, dtype: str, causal: bool = False, head_dim_v=None,
                  seq_q=None, variant: bool = False):
    """The wgmma kernel's built-in config (:data:`HOPPER_CHOICE`) for a head dim (a multiple
    of 8 up to 256: the config of its 64-column tile width; with a different ``head_dim_v``,
    of the wider of the two). ``seq_q`` (the query length, when known) and ``variant`` (a
    window, soft cap or user function): a plain causal call at the 64-column class with
    ``seq_q <= SHORT_CAUSAL_SEQ`` takes the short-sequence tiles."""
    dv = head_dim if head_dim_v is None else head_dim_v
    tile_dim = aw.tile_width(max(head_dim, dv))
    fields = HOPPER_CHOICE[(tile_dim, bool(causal))]
    if (tile_dim == 64 and causal and not variant and seq_q is not None
            and seq_q <= SHORT_CAUSAL_SEQ):
        fields = _SHORT_CAUSAL_D64
    return aw.WgmmaAttentionConfig(head_dim, dtype=dtype,
                                   head_dim_v=None if dv == head_dim else dv, **fields)


def choose_config(head_dim: int, dtype: str, causal: bool = False, variant: bool = False,
                  head_dim_v=None, seq_q=None):
    """The built-in config for a head dimension, dtype and masking on the current device: the
    TMA wgmma kernel's on a compute capability 9.0 GPU for every head dim (that of its
    64-column class, :data:`HOPPER_CHOICE`), else the mma.sync kernel's (simulator: a small
    one).
    ``variant`` (a window other than causal / full, a soft cap, ALiBi or a user function):
    the same kernel family — the Hopper configs are TMA ones, whose kernels take variants —
    but never the short-sequence tiles, which ``seq_q`` (the query length) selects for a plain
    causal call (:func:`hopper_config`). ``head_dim_v`` (v's head dim, when it differs): the
    TMA kernels only — in the simulator a small TMA config, on a GPU other than sm_90 a
    ``NotImplementedError``."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if arrays.SIMULATOR:
        if dv != head_dim:
            return aw.WgmmaAttentionConfig(head_dim, 64, 64, dtype, overlap=True, tma=True,
                                           head_dim_v=dv)
        return AttentionConfig(head_dim, SIM_BLOCK_M, SIM_BLOCK_N, SIM_WARP_ROWS, dtype)
    if head_dim in aw.TMA_HEAD_DIMS and launch.is_hopper():
        return hopper_config(head_dim, dtype, causal, dv, seq_q=seq_q, variant=variant)
    if dv != head_dim:
        raise NotImplementedError(hopper_only(head_dim, dv))
    return mma_sync_config(head_dim, dtype)


def hopper_only(d: int, dv: int, device=None) -> str:
    """Why v's head dim ``dv`` other than ``d`` cannot run on ``device`` (default: the one an
    op works on)."""
    cc = launch.compute_capability(device)
    return (f"flash_attention: v's head_dim {dv} differing from q's and k's {d} runs on the "
            f"Hopper TMA kernels only (compute capability 9.0, TILEPY_HOPPER not 0); this "
            f"GPU is compute capability {cc}" + (" with TILEPY_HOPPER=0" if cc[0] == 9 else ""))


def flash_attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0,
                    alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None,
                    mod_args=(), block_mask=None, return_lse=False, out=None, layout="bhsd",
                    config=None):
    """``softmax(scale · q kᵀ + mask) · v`` per (batch, head), FlashAttention-2 style.

    * ``layout="bhsd"``: ``q`` (batch, heads_q, seq_q, head_dim), ``k`` and ``v`` (batch,
      heads_kv, seq_k, head_dim; v's may differ, below). ``layout="bshd"``: (batch, seq,
      heads, head_dim) instead, read and written in place (no transposing copy). ``out`` and
      the result have ``q``'s shape (with v's head dim) and layout.
    * float16 or bfloat16, the same for all three; float32 accumulation and softmax inside,
      ``p`` rounded to the input dtype for the ``p · v`` product (as FlashAttention does).
      Or float8_e4m3fn (``tilepy.flash_attention`` only): FlashAttention-3's FP8 forward with
      ``descale_q``, ``descale_k``, ``descale_v`` (float32, one value or one per (batch,
      heads_kv)), bfloat16 out, on sm_90 — :func:`tilepy.ops.attention_fp8.flash_attention_fp8`
      (no ALiBi, user functions or backward yet).
    * ``head_dim``: a multiple of 8 from 8 to 256, the same for q and k. On sm_90 every one
      runs the TMA wgmma kernel of its 64-column class (64, 128, 192, 256), TMA filling the
      columns past it with zeros in shared memory (no padded copy); elsewhere the mma.sync
      kernel, its tiles zero-padded to the next multiple of 16 (past 128 it spills: a
      portable fallback). ``v`` may have another head dim (``head_dim_v``, e.g. 192 / 128),
      a multiple of 8 up to 256: ``out`` then ends in v's; the TMA kernels only (sm_90 and
      the simulator). Its backward runs the mma.sync backward kernels (any GPU), tiles as
      wide as the wider head dim.
    * Any ``seq_q`` and ``seq_k`` (not multiples of a block; ``seq_q != seq_k`` allowed).
    * Grouped-query / multi-query attention: ``heads_q`` a multiple of ``heads_kv``; query
      head ``h`` uses key/value head ``h // (heads_q // heads_kv)``.
    * ``causal=True``: query ``i`` sees keys ``j <= i + seq_k - seq_q`` — the causal mask
      aligned to the bottom-right corner when ``seq_q != seq_k`` (FlashAttention-2's
      convention; PyTorch's ``is_causal`` aligns to the top-left instead). A query row that
      sees no key at all (``i < seq_q - seq_k``) comes out as zeros.
    * ``scale``: a positive float; default ``1 / sqrt(head_dim)``.
    * ``window=(left, right)``: a sliding window (FlashAttention's ``window_size``): query
      ``i`` sees keys ``i + sk - sq - left <= j <= i + sk - sq + right`` (relative to the same
      bottom-right diagonal); a side of ``-1`` or None is unbounded, other negative values are
      an error. With ``causal=True``, ``right`` must be 0, -1 or None (``causal`` is
      ``right = 0``); Mistral's window of ``w`` keys is ``causal=True, window=(w - 1, 0)``.
      Key blocks that no row of a query block sees are never loaded.
    * ``softcap``: ``0.0`` (none), or a float > 0: the scaled scores become
      ``softcap · tanh(score / softcap)`` before the softmax (Gemma 2's soft cap); the LSE is
      that of the capped scores.
    * ``alibi_slopes``: ALiBi (FlashAttention's argument): float32 ``(heads_q,)`` or
      ``(batch, heads_q)``; ``-slope · |i + seq_k - seq_q - j|`` is added to the scaled score
      of query ``i`` and key ``j`` (after the soft cap). The slopes are read on the GPU at run
      time (no host synchronisation; a CUDA graph replays new values).
    * A window other than causal / full, or a soft cap, runs in the same kernels as the
      plain forms: on sm_90 the TMA wgmma kernels (a ``WgmmaAttentionConfig`` without
      ``tma=True`` given with one is a ``NotImplementedError``), elsewhere the mma.sync one.
    * ``score_mod(score, b, h, q_idx, kv_idx) -> float`` and ``mask_mod(b, h, q_idx, kv_idx)
      -> bool``: user functions in FlexAttention's convention — each a Numba CUDA device
      function or a plain Python function, inlined into the kernel — applied to every scaled
      score after the soft cap; ``mask_mod`` False hides the key (a row that sees no key gives
      zeros, LSE -inf). ``b`` / ``h`` are the batch and query head, ``q_idx`` / ``kv_idx``
      positions in the sequences (in edge tiles also past ``seq_q`` / ``seq_k``: those results
      are discarded). Key blocks outside ``causal`` / ``window`` are skipped first. Contract,
      order and examples: :func:`tilepy.tile.attention.score_hook` and ``docs/attention.md``.
      ``score_mod_grad(score, b, h, q_idx, kv_idx) -> float``, the derivative of
      ``score_mod`` in ``score``, is what the backward needs (not read here):
      :func:`tilepy.flash_attention_backward` takes the same three, and on PyTorch tensors
      autograd differentiates through them (a ``score_mod`` without ``score_mod_grad`` that
      needs a gradient raises ``NotImplementedError``). On PyTorch tensors they run outside
      ``torch.compile`` graphs (a graph break). A function of the wrong arity is a
      ``TypeError`` before launch, one that does not compile a ``TypeError`` naming it.
    * ``mod_args``: a tuple of arrays (any integer, bool, float16 / float32 / float64 dtype,
      on the inputs' device) and numbers (int or bool → int64, float → float32) passed to the
      user functions after their fixed parameters — ``score_mod(score, b, h, q_idx, kv_idx,
      *mod_args)``, ``mask_mod(b, h, q_idx, kv_idx, *mod_args)`` (and ``score_mod_grad``) —
      so that a document id per token or a bias table is read inside the kernel; at most
      :data:`tilepy.tile.attention.MAX_MOD_ARGS`. A new array of the same signature reuses the
      compiled kernel and launch plan; a number is part of the plan's key.
    * ``block_mask``: a :class:`tilepy.BlockMask` (:func:`tilepy.create_block_mask`, FlexAttention's
      ``BlockMask``): each query block visits only the key blocks the mask lists, and
      evaluates ``mask_mod`` only on its partial ones (not on the full ones) — or, where the
      mask keeps its bitmap (``partial_bits``) and this call gives no ``mod_args`` but the
      mask's own objects, reads the function's bits there instead. Its ``mask_mod``
      is used (a different ``mask_mod`` given here is a ``ValueError``), and its ``mod_args``
      unless this call gives some; with ``causal`` or ``window`` a ``ValueError`` (write them
      in ``mask_mod``). Without one, a ``mask_mod`` whose ``mod_args`` hold no array gets a
      block mask made on the GPU the first time a shape is seen and kept
      (:func:`tilepy.ops.attention_block_mask.cached_block_mask`; not while a CUDA graph is
      being captured, which then visits every block); with arrays among the ``mod_args``
      (whose contents may change from call to call) every key block is visited — pass a
      ``block_mask`` made for their contents to skip. The kernel's tiles are chosen to divide
      the mask's block size (``ValueError`` when no config of this GPU does).
    * ``return_lse=True``: return ``(out, lse)`` with ``lse`` float32 (batch, heads_q, seq_q)
      (always in this order, whatever the layout): the natural-log
      ``log Σ_j exp(scale · q_i · k_j)`` over the keys row ``i`` sees; ``-inf`` for a row
      that sees none.
    * ``config``: an :class:`tilepy.ops.attention_mma_sync.AttentionConfig` to override the
      built-in choice (its ``head_dim`` and ``dtype`` must match the inputs).
    * CuPy arrays, PyTorch tensors, Numba device arrays (NumPy arrays in the simulator); the
      result is of the same kind, on the inputs' device, computed on the caller's current
      stream. Inputs whose head_dim axis is not contiguous, or whose other strides or base are
      not 16-byte aligned, are first copied. Errors are raised before anything is launched.
    * A call with the same array kinds, dtypes, shapes, strides, device, alignment and
      arguments as an earlier one reuses its launch plan (:mod:`tilepy.launch`).
    """
    fq, pq = arrays.fingerprint(q)
    fk, pk = arrays.fingerprint(k)
    fv, pv = arrays.fingerprint(v)
    fo, po = arrays.fingerprint(out)
    bits = abm.reads_bits(block_mask, mask_mod, mod_args)
    if isinstance(block_mask, abm.BlockMask):     # its function and arguments, unless given
        mask_mod, mod_args = block_mask.function(mask_mod, mod_args)
    fh, ph = hook_fingerprints(alibi_slopes, mod_args)
    fb, pb = mask_fingerprints(block_mask, bits=bits)
    cached, key = _PLANS.lookup((fq, fk, fv, fo, causal, scale, window, softcap, score_mod,
                                 mask_mod, fh, fb, return_lse, layout, config,
                                 SPARSE_PERSISTENT))
    if cached is not None:
        bound, stream, alloc_out, alloc_lse, scalars, own_mask = cached
        if out is None:
            out, po = alloc_out()
        lse, pl = alloc_lse() if alloc_lse is not None else (None, 0)
        bound(stream(), (pq, pk, pv, po, pl, *ph, *pb, *own_mask[1]), scalars)
        return (out, lse) if return_lse else out
    if score_mod_grad is not None:
        check_user_function(score_mod_grad, "score_mod_grad", 5, n_mod_args(mod_args))
        if score_mod is None:
            raise TypeError("flash_attention: score_mod_grad was given without score_mod")
    return _flash_attention(q, k, v, causal, scale, window, softcap,
                            (score_mod, mask_mod, alibi_slopes, mod_args, block_mask),
                            return_lse, out, layout, config, key, bits)


_PLANS = PlanCache()


def output_spec(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0,
                alibi_slopes=None, out=None, layout="bhsd", config=None):
    """``(out shape, lse shape, dtype name)`` of ``flash_attention``'s results (the LSE is
    float32), after every check it makes before launching (the same errors); reads only
    metadata, so it also takes PyTorch fake tensors (the registered operator's meta
    function)."""
    Q, dtype, (bq, hq, sq, _, _), (_, V, _), *_ = check_arguments(
        q, k, v, causal, scale, out, layout, config)
    check_config_variant(config, *check_variant(causal, window, softcap),
                         alibi_slopes is not None)
    if alibi_slopes is not None:
        arrays.same_device(Q, check_alibi(alibi_slopes, bq, hq))
    return out_shape(Q, V), (bq, hq, sq), dtype


def n_mod_args(mod_args) -> int:
    """How many ``mod_args`` there are; ``TypeError`` unless a tuple or list (None: none),
    ``ValueError`` past :data:`tilepy.tile.attention.MAX_MOD_ARGS`."""
    if mod_args is None:
        return 0
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays and numbers, got "
                        f"{type(mod_args).__name__}")
    return check_n_args(len(mod_args))


def hook_fingerprints(alibi_slopes, mod_args):
    """``(signature, pointers)`` of the score hook's run-time arguments (:func:`hook_args`'
    order: ``mod_args``, then the slopes) for the plan cache: arrays by
    :func:`tilepy.arrays.fingerprint`, numbers by type and value; ``((), ())`` with none."""
    if alibi_slopes is None and (mod_args is None or (type(mod_args) in (tuple, list)
                                                      and not mod_args)):
        return (), ()
    sigs, ptrs = [], []
    for x in (*(mod_args if isinstance(mod_args, (tuple, list)) else (mod_args,)),
              alibi_slopes):
        if x is None:
            sigs.append(None)
        elif isinstance(x, (bool, int, float, np.generic)):
            sigs.append((type(x), x))
        else:
            f, p = arrays.fingerprint(x)
            sigs.append(f)
            ptrs.append(p)
    return tuple(sigs), tuple(ptrs)


def mask_fingerprints(block_mask, mask_arrays=None, bits: bool = False):
    """``(signature, pointers)`` of a caller's block mask for the plan cache: its block size,
    lengths, function and arguments' signature, and its arrays
    (:func:`tilepy.arrays.fingerprint`) — ``mask_arrays``, by default its four lists, in the
    order the plans bind them, after its ``partial_bits`` where the call reads them
    (``bits``: the last of the hook's arguments); ``(None, ())`` for none (or not a
    BlockMask: the op's checks refuse it)."""
    if not isinstance(block_mask, abm.BlockMask):
        return (None if block_mask is None else id(block_mask)), ()
    sigs, ptrs = [], []
    mask_arrays = block_mask.arrays if mask_arrays is None else mask_arrays
    for x in ((block_mask.partial_bits,) if bits else ()) + tuple(mask_arrays):
        f, p = arrays.fingerprint(x)
        sigs.append(f)
        ptrs.append(p)
    fm, _ = hook_fingerprints(None, block_mask.mod_args)
    return (tuple(sigs), tuple(block_mask.block_size), tuple(block_mask.seq_lengths),
            block_mask.mask_mod, fm), tuple(ptrs)


def check_alibi(alibi_slopes, batch: int, heads: int):
    """The slopes' Operand; ``TypeError`` / ``ValueError`` unless a float32 array of shape
    ``(heads,)`` or ``(batch, heads)``."""
    A = describe(alibi_slopes, "alibi_slopes", dtypes=("float32",))
    if A.shape not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape (heads_q,) = ({heads},) or (batch, "
                         f"heads_q) = ({batch}, {heads}), got {A.shape}")
    return A


def hook_args(alibi_slopes, mod_args, batch: int, heads: int, sq: int, sk: int):
    """``(hargs, operands)``: the score hook's run-time arguments as kernel arguments —
    ``mod_args`` (arrays as device views of their own dtype, ints and bools as int64, floats
    as float32), then with ALiBi the slopes as a (batch, heads) float32 view (a zero batch stride
    for per-head slopes) and ``sk - sq`` as int64 (:func:`tilepy.tile.attention.score_hook`'s
    order) — and the Operands of the arrays among them, in order. Errors name the argument."""
    n_mod_args(mod_args)
    hargs, ops = [], []
    for i, x in enumerate(mod_args or ()):
        name = f"mod_args[{i}]"
        if isinstance(x, (bool, np.bool_, int, np.integer)):
            hargs.append(np.int64(x))       # a bool as 0 / 1 (launch plans pass no bool)
        elif isinstance(x, (float, np.floating)):
            hargs.append(np.float32(x))
        else:
            op = describe(x, name, dtypes=arrays.HOOK_DTYPES)
            if op.ndim == 0:
                raise ValueError(f"{name}: a 0-d array; pass a number or a 1-element array")
            ops.append(op)
            hargs.append(device_view(arrays.raw_view(op, hook=True)))
    if alibi_slopes is not None:
        A = check_alibi(alibi_slopes, batch, heads)
        view = arrays.raw_view(A)
        if A.ndim == 1:
            item = view.dtype.itemsize
            view = arrays.restride(view, (batch, heads), (0, A.strides[0] * item))
        ops.append(A)
        hargs += [device_view(view), np.int64(sk - sq)]
    return tuple(hargs), ops


def check_variant(causal, window, softcap):
    """``((left, right), cap)``: ``window`` and ``causal`` as the key window of
    :func:`tilepy.tile.attention.key_window` (-1 unbounded), ``softcap`` as a float (0.0:
    none). ``ValueError`` / ``TypeError`` for a bad window or cap."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    win = key_window(bool(causal), window)
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(
            softcap, (int, float, np.integer, np.floating)):
        raise TypeError(f"softcap must be a float (0.0: none), got {type(softcap).__name__} "
                        f"{softcap!r}")
    cap = float(softcap)
    if not (cap == 0 or FLOAT32_RANGE[0] <= cap <= FLOAT32_RANGE[1]):
        raise ValueError(f"softcap must be 0.0 (none) or a float in {FLOAT32_RANGE[0]:g} … "
                         f"{FLOAT32_RANGE[1]:g} (the kernels compute in float32), got "
                         f"{softcap!r}")
    return win, cap


#: The range of ``scale`` and ``softcap``: the kernels take them (and ``scale · log2(e)``,
#: ``1 / softcap``) in float32, where values outside would round to 0 or overflow.
FLOAT32_RANGE = (1e-30, 1e30)


def is_variant(win, cap) -> bool:
    """A key window other than full / causal, or a soft cap (:func:`check_variant`'s)."""
    return tuple(win) not in ((-1, -1), (-1, 0)) or cap > 0


def check_user_functions(score_mod, mask_mod, n_args: int = 0) -> bool:
    """Whether a user ``score_mod`` or ``mask_mod`` is given; ``TypeError`` for one that is not
    a function of the right arity (:func:`tilepy.tile.attention.check_user_function`; ``n_args``
    ``mod_args`` after the fixed parameters)."""
    check_user_function(score_mod, "score_mod", 5, n_args)
    check_user_function(mask_mod, "mask_mod", 4, n_args)
    return score_mod is not None or mask_mod is not None


def check_config_variant(config, win, cap, user=False) -> None:
    """``NotImplementedError`` for a variant (``user``: a score_mod, mask_mod or ALiBi) with a
    wgmma config other than a TMA one (only the TMA wgmma kernels take a window or a score
    modification)."""
    if (is_variant(win, cap) or user) and isinstance(config, aw.WgmmaAttentionConfig) \
            and not config.tma:
        raise NotImplementedError("flash_attention: of the wgmma kernels only the TMA ones "
                                  "take a window or a soft cap; leave config unset, pass a "
                                  "WgmmaAttentionConfig with tma=True, or an AttentionConfig "
                                  "(mma.sync)")


def check_arguments(q, k, v, causal, scale, out, layout, config, any_device=False):
    """Validate flash_attention's arguments (the backward's too,
    :mod:`tilepy.ops.attention_backward`): ``(Q, dtype, (batch, heads_q, seq_q, seq_k,
    head_dim), (K, V, Out), scale as a float, device)``. v's head dim may differ from q's and
    k's (``out`` then ends in v's, :func:`out_shape`) — on sm_90 only (elsewhere a
    ``NotImplementedError``) unless ``any_device`` (the backward's mma.sync kernels)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    Q = describe(q, "q", allow_float32=False)
    K = describe(k, "k", allow_float32=False)
    V = describe(v, "v", allow_float32=False)
    if not (Q.dtype == K.dtype == V.dtype):
        raise TypeError(f"q, k and v must have the same dtype; got q {Q.dtype}, k {K.dtype}, "
                        f"v {V.dtype}")
    dtype = Q.dtype
    bq, hq, sq, sk, d, dv = check_shapes(Q, K, V, layout)
    for name, x in (("head_dim", d), ("v's head_dim", dv)):
        if x not in HEAD_DIMS:
            raise ValueError(f"{name} {x} is not supported; supported: the multiples of 8 "
                             f"from {HEAD_DIMS[0]} to {HEAD_DIMS[-1]}")
    if dv != d and not arrays.SIMULATOR and not any_device:
        qkv_device = arrays.same_device(Q, K, V)
        if not launch.is_hopper(qkv_device):
            raise NotImplementedError(hopper_only(d, dv, qkv_device))
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    scale = check_scale(scale, d)
    Out = describe(out, "out", allow_float32=False) if out is not None else None
    arrays.check_distinct(Out)
    if Out is not None:
        want = out_shape(Q, V)
        if Out.shape != want:
            raise ValueError(f"out must have shape {want} (that of q"
                             + (f" with v's head_dim {dv}" if dv != d else "")
                             + f"), got {Out.shape}")
        if Out.dtype != dtype:
            raise ValueError(f"out must have dtype {dtype} (that of q), got {Out.dtype}")
    device = arrays.same_device(Q, K, V, Out)
    if config is not None:
        if not isinstance(config, (AttentionConfig, aw.WgmmaAttentionConfig)):
            raise TypeError(f"config must be a tilepy.ops.attention_mma_sync.AttentionConfig "
                            f"(mma.sync) or a tilepy.ops.attention_wgmma.WgmmaAttentionConfig "
                            f"(Hopper), got {type(config).__name__}")
        if (config.head_dim, config.dtype) != (d, dtype):
            raise ValueError(f"config is for head_dim {config.head_dim} {config.dtype}; the "
                             f"inputs are head_dim {d} {dtype}")
        if getattr(config, "dv", d) != dv:
            raise ValueError(f"config is for v's head_dim {getattr(config, 'dv', d)}; v's is "
                             f"{dv} (a WgmmaAttentionConfig with tma=True and head_dim_v="
                             f"{dv} takes it)")
    return Q, dtype, (bq, hq, sq, sk, d), (K, V, Out), scale, device


def check_shapes(Q, K, V, layout: str):
    """``(batch, heads_q, seq_q, seq_k, head_dim, v's head_dim)`` of ``Q``, ``K``, ``V`` in
    ``layout`` after the shape checks every attention forward makes (4-D; batches, k's and v's
    heads and lengths agree; q's and k's head dims agree; heads_q a multiple of heads_kv);
    v's head dim may differ."""
    for op in (Q, K, V):
        if op.ndim != 4:
            raise ValueError(f"{op.name} must be 4-D ({axes(layout)}), got shape {op.shape}")
    bq, hq, sq, d = bhsd_dims(Q.shape, layout)
    bk, hk, sk, dk = bhsd_dims(K.shape, layout)
    bv, hv, sv, dv = bhsd_dims(V.shape, layout)
    if not (bq == bk == bv):
        raise ValueError(f"batch sizes differ: q {Q.shape}, k {K.shape}, v {V.shape} "
                         f"(layout {layout!r}: {axes(layout)})")
    if d != dk:
        raise ValueError(f"head_dim differs: q {d}, k {dk}, v {dv} (shapes q {Q.shape}, "
                         f"k {K.shape}, v {V.shape}, layout {layout!r})")
    if (hk, sk) != (hv, sv):
        raise ValueError(f"k and v must have the same shape, got k {K.shape} and v {V.shape}")
    if hk < 1 or hq % hk:
        raise ValueError(f"heads_q ({hq}) must be a multiple of heads_kv ({hk}) (shapes q "
                         f"{Q.shape}, k {K.shape}, layout {layout!r})")
    return bq, hq, sq, sk, d, dv


def out_shape(Q, V) -> tuple:
    """The forward's output shape: q's, ending in v's head dim (both layouts end in it)."""
    return tuple(Q.shape[:-1]) + (V.shape[-1],)


def check_scale(scale, head_dim: int) -> float:
    """``scale`` as a float (None: ``1 / sqrt(head_dim)``); ``TypeError`` / ``ValueError``
    unless a positive number in :data:`FLOAT32_RANGE`."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer,
                                                                   np.floating)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__} {scale!r}")
    value = float(scale)
    if not FLOAT32_RANGE[0] <= value <= FLOAT32_RANGE[1]:
        raise ValueError(f"scale must be a positive number in {FLOAT32_RANGE[0]:g} … "
                         f"{FLOAT32_RANGE[1]:g} (the kernels compute in float32), got "
                         f"{scale!r}")
    return value


def _flash_attention(q, k, v, causal, scale, window, softcap, mods, return_lse, out, layout,
                     config, key, reads_bits=False):
    Q, dtype, (bq, hq, sq, sk, d), (K, V, Out), scale, device = check_arguments(
        q, k, v, causal, scale, out, layout, config)
    with arrays.on_device(device):
        dv = V.shape[-1]
        win, cap = check_variant(causal, window, softcap)
        score_mod, mask_mod, alibi_slopes, mod_args, block_mask = mods
        mask_ops, bits = None, None
        if block_mask is not None:
            mask_mod, mod_args, mask_ops = abm.check_block_mask(
                block_mask, mask_mod, mod_args, bq, hq, sq, sk, causal, window, Q.raw)
            mask_block = abm.block_sizes(block_mask.block_size)
            # (reads_bits: abm.reads_bits of the call's own mask_mod and mod_args)
            bits = abm.check_partial_bits(block_mask, bq, hq) if reads_bits else None
        n_args = n_mod_args(mod_args)
        user = check_user_functions(score_mod, mask_mod, n_args)
        if n_args and not user:
            raise TypeError("flash_attention: mod_args are passed to score_mod / mask_mod; "
                            "neither was given")
        alibi = alibi_slopes is not None
        check_config_variant(config, win, cap, user or alibi)
        hargs, hops = hook_args(alibi_slopes, mod_args, bq, hq, sq, sk)
        if bits is not None:   # the bitmap: the hook's last argument
            hargs += (abm.mask_views([bits], bq, hq)[0],)
            hops = list(hops) + [bits]
        arrays.same_device(Q, *hops)
        variant = is_variant(win, cap) or user or alibi
        caller_out = out is not None
        # a block mask: the caller's, else one made here for a mask_mod of no array argument
        own_mask, recordable = (None, ()), True
        # (ALiBi's slopes may come with it: they do not change which keys are seen)
        auto = block_mask is None and abm.makes_own_mask(mask_mod, mod_args, win)
        if auto and bq and hq and sq and sk:
            mask_block = sparse_block(config or choose_config(d, dtype, False, True, dv))
            made = abm.cached_block_mask(mask_mod, mod_args, bq, hq, sq, sk, mask_block, Q.raw)
            if made is None:
                recordable = False      # (being captured: every block visited, no plan kept)
            else:
                mask_ops = [describe(x, "block_mask", dtypes=("int32",)) for x in made.arrays]
                own_mask = (made, tuple(op.byte_pointer() for op in mask_ops))
        sparse = None if mask_ops is None else (mask_block, abm.mask_views(mask_ops, bq, hq),
                                                mask_ops)
        if out is None:
            out = arrays.empty(Q, out_shape(Q, V), dtype)
            Out = describe(out, "out")
        lse = arrays.empty(Q, (bq, hq, sq), "float32") if return_lse else None
        if bq and hq and sq:
            # the caller's config, else a choice persisted by `python -m tilepy tune attention`,
            # else the built-in one
            # (a tuned choice is for the plain kernels: a variant takes the built-in one)
            cfg = config or (None if variant or dv != d else tuned_attention_config(
                bq, hq, sq, sk, d, dtype, causal, device)) or choose_config(d, dtype, causal,
                                                                             variant, dv, sq)
            if sparse is not None:
                cfg = sparse_config(cfg, sparse[0], given=config is not None)
            bound = _run(Q, K, V, Out, lse, cfg, bool(causal), scale, layout, device,
                         fallback=config is None,
                         variant=((win, cap, score_mod, mask_mod, n_args, alibi,
                                   bits is not None) if variant else None),
                         hargs=hargs, hops=hops, sparse=sparse)
            if bound is not None and recordable:
                _PLANS.put(key, (bound, arrays.stream_getter(Q),
                               None if caller_out else arrays.allocator(Q, out_shape(Q, V),
                                                                        dtype),
                               arrays.allocator(Q, (bq, hq, sq), "float32") if return_lse else None,
                               (scale, scale * fa.LOG2E,
                                *(x for x in hargs if isinstance(x, np.generic))), own_mask))
        return (out, lse) if return_lse else out


def axes(layout: str) -> str:
    """The axes of ``layout``, for messages."""
    return ("batch, heads, seq, head_dim" if layout == "bhsd"
            else "batch, seq, heads, head_dim")


def bhsd_dims(shape, layout: str):
    """(batch, heads, seq, head_dim) of a 4-D shape in ``layout``."""
    if layout == "bhsd":
        return tuple(shape)
    b, s, h, d = shape
    return b, h, s, d


def readable(op) -> bool:
    """The kernels' cp.async / TMA read ``op`` in place: unit stride along head_dim, every
    other stride (of an axis longer than 1, in bytes: 2-byte elements, 1-byte float8) and the
    base 16-byte aligned."""
    if op.shape[-1] > 1 and op.strides[-1] != 1:
        return False
    item = 1 if op.dtype.startswith("float8") else 2
    if any(s * item % 16 for n, s in zip(op.shape[:-1], op.strides[:-1]) if n > 1):
        return False
    return op.byte_pointer() % 16 == 0


def bhsd_view(op, layout: str):
    """``op`` as a 4-D (B, H, S, D) kernel argument, no copy (bshd: a strided view)."""
    view = arrays.raw_view(op)
    if layout == "bshd":
        shape, strides = list(view.shape), list(view.strides)
        shape[1], shape[2] = shape[2], shape[1]
        strides[1], strides[2] = strides[2], strides[1]
        view = arrays.restride(view, tuple(shape), tuple(strides))
    return device_view(view)


def _run(Q, K, V, Out, lse, cfg, causal, scale, layout, device, fallback=False, variant=None,
         hargs=(), hops=(), sparse=None):
    """Launch; return the plan bound to (q, k, v, out, lse) when no input needed a copy (a
    later call with the same signature can reuse it), else None. ``fallback`` (a config the
    caller did not give): a TMA config whose tensor maps cannot be encoded for these views
    runs as the same config without TMA (cp.async loads) instead of failing — or, for a
    variant or a head dim without a cp.async wgmma kernel (not 64 or 128), as the mma.sync
    kernel; with v's head dim other than q's (TMA kernels only) the error is raised.
    ``variant``: ``((left, right), cap, score_mod, mask_mod, n_args, alibi, bits)``, the
    kernels' window, soft cap, user functions, their number of ``mod_args``, ALiBi and
    whether the partial blocks read the block mask's bitmap (the hook's last argument) in
    place of ``mask_mod`` (:func:`tilepy.tile.attention.score_hook`), else None; ``hargs``
    the hook's run-time arguments (:func:`hook_args`) and ``hops`` the Operands of the arrays
    among them, whose pointers a bound plan takes after out's and lse's. ``sparse``:
    ``(mask_block, views, Operands)`` of a block mask (the block-sparse kernel; its arrays'
    pointers after the hook's), or None."""
    with arrays.on_device(device):
        views, reusable, copies = [], True, []
        for op in (Q, K, V):
            if not readable(op):
                op = describe(arrays.copy_aligned(op), op.name)
                reusable = False
                copies.append(op)
            views.append(bhsd_view(op, layout))
        o_v = bhsd_view(Out, layout)
        if lse is not None:
            Lse = describe(lse, "lse")
            lse_v, lse_src = bhsd_view(Lse, "bhsd"), (4, Lse.byte_pointer())
        else:
            lse_v, lse_src = arrays.placeholder(3), None
        # a TMA grid kernel cannot launch more heads or batches than the grid's y / z limit
        # in chunks: its persistent variant, else the cp.async grid kernel (see _grid_safe)
        batch, heads = bhsd_dims(Q.shape, layout)[:2]
        cfg = _grid_safe(cfg, batch, heads)
        if variant is not None and isinstance(cfg, aw.WgmmaAttentionConfig) and not cfg.tma:
            cfg = mma_sync_config(cfg.head_dim, cfg.dtype)   # past the grid limit
            if sparse is not None:
                cfg = sparse_config(cfg, sparse[0])
        stream = arrays.stream_handle(Q)
        run = (variant, lse is not None, views, o_v, lse_v, scale, stream, Q, tuple(hargs),
               sparse)
        with user_errors(variant):
            try:
                plan, args = _plan(cfg, causal, *run)
            except (ValueError, RuntimeError):
                if not (fallback and getattr(cfg, "tma", False)):
                    raise
                if cfg.dv != cfg.head_dim:     # (a TMA config: no other kernel takes it)
                    raise
                if variant is not None or cfg.head_dim not in aw.HEAD_DIMS:
                    cfg = mma_sync_config(cfg.head_dim, cfg.dtype)
                    if sparse is not None:
                        cfg = sparse_config(cfg, sparse[0])
                else:
                    # the cp.async kernel: no producer warpgroup, so at most two consumer
                    # warpgroups
                    cfg = dataclasses.replace(cfg, block_m=min(cfg.block_m, 128), tma=False,
                                              pingpong=False, producer=False,
                                              persistent=False)
                plan, args = _plan(cfg, causal, *run)
            plan.launch(stream, args)
        device_write.keep_during_capture(stream, *copies)   # when a CUDA graph captured it
    if not reusable:
        return None
    # the plan's arrays: the five operands, any the plan supplies (TMA maps, tile counter),
    # then the hook's
    hook_src = [(5 + i, op.byte_pointer())
                for i, op in enumerate(list(hops) + list(sparse[2] if sparse else ()))]
    n_plan = len(plan.array_positions()) - 5 - len(hook_src)
    return plan.bind([(0, Q.byte_pointer()), (1, K.byte_pointer()), (2, V.byte_pointer()),
                      (3, Out.byte_pointer()), lse_src] + [None] * n_plan + hook_src)


@contextlib.contextmanager
def user_errors(variant):
    """Numba's errors from compiling a kernel with a user's score_mod / mask_mod, as a
    ``TypeError`` that names them (the kernels themselves compile)."""
    if variant is None or (variant[2] is None and variant[3] is None):
        yield
        return
    try:
        yield
    except Exception as e:   # Numba's errors (numba.core.errors, numba.cuda.errors) only
        if not type(e).__module__.startswith("numba"):
            raise
        names = " / ".join(f"{n} {getattr(getattr(f, 'py_func', f), '__qualname__', f)!r}"
                           for n, f in (("score_mod", variant[2]), ("mask_mod", variant[3]))
                           if f is not None)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TypeError(f"flash_attention: {names} did not compile inside the kernel (a "
                        f"score_mod returns a float, a mask_mod a bool, from (b, h, q_idx, "
                        f"kv_idx) integers, a float32 score and the mod_args): {first}") from e


def sparse_block(cfg) -> tuple:
    """The block size of the mask the op makes for ``cfg``'s kernel: its (sparse) tiles."""
    cfg = sparse_config(cfg, None)
    return cfg.block_m, cfg.block_n


#: Whether block-sparse attention on sm_90 runs the persistent TMA kernel (the next tile's Q and
#: first key blocks load while the current one computes) where its config allows — a producer
#: warpgroup (128 query rows or more) and a (tile width, block_n) the persistent overlap kernel
#: compiles without spills — instead of the grid TMA kernel. On: with the partial blocks' mask
#: read from a bitmap, measured against the grid kernel at B4 H16 S8192 D128 bf16 it was 2–5 %
#: faster on a causal document block mask and 3 % on a 1024-key window, 3 % slower on causal
#: as mask_mod (bench/NOTES.md: block-sparse on the persistent kernel, the bitmap).
SPARSE_PERSISTENT = True


def sparse_config(cfg, mask_block, given: bool = False):
    """``cfg`` as a block-sparse kernel takes it: a TMA config — persistent per
    :data:`SPARSE_PERSISTENT` where it can be (a caller's config as given) — and, for a mask
    of block size ``mask_block`` (None: any), tiles that divide it — ``block_m`` the
    config's, else 128 or 64 rows (TMA) / 16 (mma.sync), ``block_n`` the config's or the
    largest multiple of 16 below it that divides the mask's. ``ValueError`` when ``given``
    (the caller's config) does not divide it, or no tile does."""
    bq, bk = (None, None) if mask_block is None else mask_block
    if isinstance(cfg, aw.WgmmaAttentionConfig):
        if not cfg.tma:
            raise NotImplementedError(f"flash_attention: a block mask runs on the TMA kernels "
                                      f"(tma=True) on sm_90; got {cfg.describe()}")
        rows = [cfg.block_m, 128, 64]
        keys = [cfg.block_n] + [n for n in aw.TMA_BLOCK_NS[::-1] if n < cfg.block_n]
        fields = dict(persistent=cfg.persistent if given else SPARSE_PERSISTENT)
    else:
        rows = [cfg.block_m, 16]
        keys = list(range(cfg.block_n, 15, -16))
        fields = {}
    bm = next((r for r in rows if bq is None or bq % r == 0), None)
    bn = next((n for n in keys if bk is None or bk % n == 0), None)
    if given and (bm, bn) != (cfg.block_m, cfg.block_n):
        raise ValueError(f"flash_attention: config {cfg.describe()} has tiles "
                         f"{cfg.block_m} x {cfg.block_n}, which do not divide the block mask's "
                         f"{mask_block}")
    if bm is None or bn is None:
        raise ValueError(f"flash_attention: a block mask's block size {mask_block} must be "
                         f"multiples of {rows[-1]} rows and {keys[-1]} keys here")
    if isinstance(cfg, aw.WgmmaAttentionConfig):
        if given:
            return cfg
        if bm != cfg.block_m:   # (a producer warpgroup and ping-pong need 128 rows or more)
            fields.update(block_m=bm, pingpong=cfg.pingpong and bm >= 128,
                          producer=cfg.producer and bm >= 128)
        try:
            return dataclasses.replace(cfg, block_n=bn, **fields)
        except ValueError:      # no persistent kernel of these tiles: the grid one
            if not fields["persistent"]:
                raise
            return dataclasses.replace(cfg, block_n=bn, **dict(fields, persistent=False))
    if bm != cfg.block_m:
        return dataclasses.replace(cfg, block_m=bm, block_n=bn, warp_rows=16)
    return dataclasses.replace(cfg, block_n=bn)


def mma_sync_config(head_dim: int, dtype: str) -> AttentionConfig:
    """The built-in mma.sync config of a head_dim and dtype (:data:`GPU_CONFIGS`)."""
    return AttentionConfig(head_dim, *GPU_CONFIGS[min(d for d in GPU_CONFIGS if d >= head_dim)],
                           dtype)


def _plan(cfg, causal, variant, has_lse, views, o_v, lse_v, scale, stream, Q, hargs,
          sparse=None):
    """``(plan, args)`` of ``cfg``'s kernel (the variant's when ``variant`` is not None; the
    block-sparse one over ``sparse``'s mask) for the views (see :func:`_run`)."""
    gen = aw if isinstance(cfg, aw.WgmmaAttentionConfig) else fa
    kernel = aw.wgmma_attention_kernel if gen is aw else fa.attention_kernel
    reads_bh = False
    if variant is not None:
        win, cap, score_mod, mask_mod, n_args, alibi, bits = variant
        kern = kernel(cfg, False, has_lse, win,
                      score_hook(cap, score_mod, None if bits else mask_mod, n_args=n_args,
                                 alibi=alibi, mask_bits=bits),
                      mask_block=sparse[0] if sparse else None,
                      full_score_mod=score_hook(cap, score_mod, None, n_args=n_args,
                                                alibi=alibi) if sparse else None)
        if sparse:
            hargs = (tuple(hargs), sparse[1])
        reads_bh = score_mod is not None or mask_mod is not None or alibi
    else:
        kern = kernel(cfg, causal, has_lse)
    if gen is aw:
        extra = {"alloc": arrays.byte_allocator(Q)}   # TMA maps, counters
    else:
        # a hook that reads the batch or head cannot run in grid chunks (they would shift
        # both): past the grid's limit, refused here
        extra = {"chunks": not reads_bh}
        b, h = views[0].shape[0], views[0].shape[1]
        if reads_bh and max(b, h) > launch.MAX_GRID_YZ:
            raise NotImplementedError(
                f"flash_attention: score_mod / mask_mod / alibi_slopes with more than "
                f"{launch.MAX_GRID_YZ} batches or query heads (got batch {b}, heads {h}) on "
                f"the mma.sync kernel; split the batch")
    plan, args = gen.plan(kern, cfg, *views, o_v, lse_v, scale, stream=stream, hargs=hargs,
                          **extra)
    if variant is not None and (variant[2] is not None or variant[3] is not None) \
            and kern not in _FLOAT64_CHECKED:
        _FLOAT64_CHECKED.add(kern)
        warn_float64(plan.ptx(), variant[2], variant[3], "flash_attention")
    return plan, args


def _outside_tilepy() -> int:
    """``warnings.warn``'s stacklevel of the first frame outside the tilepy package, seen
    from the function that calls ``warnings.warn``."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return level


#: Kernels with user functions whose PTX :func:`warn_float64` has read (one warning each).
_FLOAT64_CHECKED = set()

_F64_OP = re.compile(r"^\s*\w+(\.\w+)*\.f64\b", re.MULTILINE)


def warn_float64(ptx, score_mod, mask_mod, op: str) -> int:
    """Warn (``RuntimeWarning``) when the PTX of a kernel that inlines a user's
    ``score_mod`` / ``mask_mod`` holds float64 arithmetic: the built-in kernels have none, so
    it is the functions' (a Python float constant is a float64 in Numba, and it makes a
    float32 score's arithmetic float64, at a fraction of float32's speed on every score).
    The warning points at the first caller outside tilepy. Returns the count of float64
    instructions (0 without PTX: the simulator)."""
    n = len(_F64_OP.findall(ptx)) if ptx else 0
    if n:
        names = " / ".join(f"{k} {getattr(getattr(f, 'py_func', f), '__qualname__', f)!r}"
                           for k, f in (("score_mod", score_mod), ("mask_mod", mask_mod))
                           if f is not None)
        warnings.warn(f"{op}: {names} computes in float64 ({n} float64 instructions in the "
                      f"kernel), which slows every score; write its constants as np.float32 "
                      f"(a Python float such as 2.0 is a float64 in Numba) and keep its "
                      f"arithmetic in float32", RuntimeWarning, stacklevel=_outside_tilepy())
    return n


def _grid_safe(cfg, batch: int, heads: int):
    """``cfg``, unless it is a non-persistent TMA :class:`~tilepy.ops.attention_wgmma.
    WgmmaAttentionConfig` and ``heads`` (grid y) or ``batch`` (grid z) exceeds the grid's
    limit (:data:`tilepy.launch.MAX_GRID_YZ`).

    The rule (the caller's config included): the TMA kernel's tensor maps describe the whole
    (batch, head, seq, head_dim) tensors and its blocks take their batch and head from
    ``blockIdx``, so its grid cannot be launched in chunks of pointer-shifted views as the
    cp.async kernels' grids are; past the limit it runs as its persistent variant (a
    one-dimensional grid, the same results), or where that config is invalid (no producer
    warpgroup, a (head_dim, block_n) the persistent overlap kernel does not fit) as the same
    tile without TMA (cp.async loads, at most two consumer warpgroups), whose grid launches
    in chunks — for a head dim without a cp.async wgmma kernel (not 64 or 128), the mma.sync
    kernel's built-in config."""
    limit = launch.MAX_GRID_YZ
    if not (isinstance(cfg, aw.WgmmaAttentionConfig) and cfg.tma and not cfg.persistent
            and max(batch, heads) > limit):
        return cfg
    try:
        return dataclasses.replace(cfg, persistent=True)
    except ValueError:
        pass
    if cfg.dv != cfg.head_dim:
        raise NotImplementedError(
            f"flash_attention: v's head_dim {cfg.dv} differing from q's and k's "
            f"{cfg.head_dim} with more than {limit} batches or heads (batch {batch}, heads "
            f"{heads}): its TMA kernel cannot run persistent ({cfg.describe()}); split the "
            f"batch")
    if cfg.head_dim not in aw.HEAD_DIMS:      # no cp.async wgmma kernel of this head dim
        return mma_sync_config(cfg.head_dim, cfg.dtype)
    return dataclasses.replace(cfg, block_m=min(cfg.block_m, 128), tma=False,
                               pingpong=False, producer=False)


__all__ = ["choose_config", "flash_attention"]
