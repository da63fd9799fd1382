"""``tilepy.flash_attention_backward``: FlashAttention-2's backward pass on tensor cores.

Validation on the host, then three launches on the inputs' device and the caller's current
stream (:mod:`tilepy.ops.attention_backward_wgmma` on sm_90, else
:mod:`tilepy.ops.attention_backward_mma_sync`): the rows pre-pass, the dK / dV kernel, and the
dQ kernel (or, with a ``dq_atomic`` config and ``deterministic=False``, the conversion of dQ's
float32 accumulator, which the dK / dV kernel filled).
"""

from __future__ import annotations

import math

import numpy as np

from .. import arrays, launch
from ..arrays import describe
from ..launch import PlanCache, arg_at
from ..tile import device_write
from . import attention_backward_mma_sync as bk
from . import attention_backward_wgmma as bw
from ..tile.attention_backward import check_functions
from . import attention_block_mask as abm
from .attention_block_mask import block_sizes, cached_block_mask, check_block_mask
from .attention import (bhsd_dims, bhsd_view, check_alibi, check_arguments, check_variant,
                        hook_args, hook_fingerprints, is_variant, mask_fingerprints,
                        n_mod_args, readable)
from .attention_backward_mma_sync import BackwardConfig
from .attention_backward_wgmma import WgmmaBackwardConfig

# GPU: 4 warps of 16 keys (64 keys per block) over query blocks of 64 rows up to head_dim 64,
# of 32 above; dQ's own kernel 4 warps of 16 rows over 64-key blocks. The fastest of
# bench/probe_attention_backward.py's grid on the H200 (bench/NOTES.md: attention backward);
# at head_dim 128 it spills 24 B (dK and dV hold D/2 registers each per thread), and 16-row
# steps that do not spill were slower. Simulator: 2 warps, 32 × 32 tiles (several query and
# key blocks per problem, masked edges).
# Past 128 (the portable fallback): 32-row, 32-key tiles, whose dK / dV and dQ kernels take at
# most 97 KB of shared memory at head_dim 256 (within sm_86's and sm_89's 99 KB).
GPU_BLOCKS = {64: dict(block_m=64, block_n=64, dq_block_m=64, dq_block_n=64),
              128: dict(block_m=32, block_n=64, dq_block_m=64, dq_block_n=64),
              256: dict(block_m=32, block_n=32, dq_block_m=32, dq_block_n=32)}
SIM_BLOCKS = dict(block_m=32, block_n=32, dq_block_m=32, dq_block_n=32)


#: Hopper (sm_90), by tile width (64, 128; a head dim between takes its width's): the wgmma
#: kernels' config fields — the
#: fastest of bench/probe_attention_backward_kernels.py's grid per kernel on the H200
#: (bench/NOTES.md: attention backward): one 64-key warpgroup per dK / dV block, dQ by its own
#: kernel of one warpgroup. The deterministic choice, and at head_dim 64 the default.
HOPPER_CHOICE = {64: dict(block_m=128, key_groups=1, dq_groups=1, dq_block_n=64),
                 128: dict(block_m=64, key_groups=1, dq_groups=1, dq_block_n=64)}
#: Hopper, head_dim 128, ``deterministic=False``: the warp-specialised kernel (a producer and
#: two 64-key consumer warpgroups, dQ by bulk reductions) — 10 % faster than HOPPER_CHOICE's
#: two kernels at B4 H32 S4096 on the H200, causal or not (bench/probe_attention_backward.py);
#: at head_dim 64 it was slower.
HOPPER_FUSED = {128: dict(block_m=64, key_groups=2, dq_atomic=True, producer=True),
                256: dict(block_m=64, key_groups=1, dq_atomic=True, producer=True,
                          split_columns=True, query_halves=True)}
#: Whether the built-in choice on sm_90 runs head dims past 128 (``deterministic=False``) on
#: the warp-specialised wgmma kernel with its columns split between the consumers
#: (``HOPPER_FUSED[256]``: 3.5-3.8x the mma.sync kernels at S4096 on an H100,
#: bench/NOTES.md; the deterministic path stays on the mma.sync kernels there). False: the
#: mma.sync kernels for every head dim past 128.
WGMMA_WIDE = True


#: The smallest head dim the built-in choice on sm_90 runs on the wgmma kernels (each head
#: dim up to 128 in the tile of its 64-column class, :func:`~tilepy.ops.
#: attention_backward_wgmma.tile_width`: 40 fills 5/8 of a 64-column tile, 72 9/16 of a
#: 128-column one); below, the mma.sync kernels.
WGMMA_MIN_HEAD_DIM = 40
#: Whether a head dim between the tile widths (not 64 or 128) takes the wgmma kernels at all
#: (False: only 64 and 128 do, the others the mma.sync kernels).
WGMMA_PADDED = True
#: Whether a v head dim differing from q's (``head_dim_v``, e.g. 192 / 128) takes the wgmma
#: kernels on sm_90 as :data:`WGMMA_PADDED` head dims do — the tiles of the wider one's class,
#: each operand zero-filled past its own head dim (False: the mma.sync kernels, on every
#: device).
WGMMA_HEAD_DIM_V = True

#: Whether the built-in choice on sm_90 runs a variant (window, soft cap, ALiBi, user
#: functions, block masks) on the wgmma kernels (True) or the mma.sync ones.
WGMMA_VARIANTS = True


def choose_config(head_dim: int, dtype: str, deterministic: bool = False,
                  variant: bool = False, wgmma: bool = True, head_dim_v=None):
    """The built-in backward config for a head dimension and dtype on the current device: on a
    compute capability 9.0 GPU for head dims from :data:`WGMMA_MIN_HEAD_DIM` to 128 the
    wgmma kernels' — those of the head dim's tile width (64 or 128), :data:`HOPPER_FUSED`
    where it applies and atomics are allowed, else :data:`HOPPER_CHOICE` — and past 128 with
    :data:`WGMMA_WIDE` and atomics allowed ``HOPPER_FUSED[256]``; otherwise the mma.sync
    kernels' (simulator: small tiles).
    ``variant`` (a window other than causal / full, a soft cap, ALiBi, user functions): on
    sm_90 the wgmma kernels as well while :data:`WGMMA_VARIANTS` holds, else the mma.sync
    kernels'. Both kernel families take every variant and block mask; ``wgmma=False``: the
    mma.sync kernels' choice whatever the device.
    ``head_dim_v`` (v's head dim, where it differs): on sm_90 with :data:`WGMMA_HEAD_DIM_V`
    the wgmma kernels' config of the wider one's tile class (both at least
    :data:`WGMMA_MIN_HEAD_DIM`), otherwise the mma.sync kernels' of the wider of the two."""
    dv = head_dim if head_dim_v is None else head_dim_v
    extra = {} if dv == head_dim else {"head_dim_v": dv}
    if arrays.SIMULATOR:
        return BackwardConfig(head_dim, dtype=dtype, **SIM_BLOCKS, **extra)
    if extra and not WGMMA_HEAD_DIM_V:
        wgmma = False
    # a head dim between: the wider tile, zero-filled
    w = bw.tile_width(max(head_dim, dv))
    exact = head_dim == dv and head_dim in (64, 128)
    if wgmma and min(head_dim, dv) >= WGMMA_MIN_HEAD_DIM and dv in bw.HEAD_DIMS and \
            head_dim in bw.HEAD_DIMS and (WGMMA_PADDED or exact) and launch.is_hopper() and \
            (WGMMA_VARIANTS or not variant) and (w <= 128 or WGMMA_WIDE and not deterministic):
        if not deterministic and w in HOPPER_FUSED:
            return WgmmaBackwardConfig(head_dim, dtype=dtype, **HOPPER_FUSED[w], **extra)
        return WgmmaBackwardConfig(head_dim, dtype=dtype, **HOPPER_CHOICE[w], **extra)
    width = max(head_dim, dv)
    blocks = GPU_BLOCKS[min(d for d in GPU_BLOCKS if d >= width)]
    if 64 < width <= 128 and (-(-width // 16) * 2) % 4:
        # 80- and 112-column tiles (head_dim 72, 80, 104, 112): their 10 / 14 n8 tiles do not
        # split over GPU_BLOCKS[128]'s two column groups of warps; 32 keys a block (two warps,
        # each its own 16 rows of dQ and every column) — offline sm_90: 234 registers at 72,
        # 255 and 24 B of spill stores at 112 (64 query rows a step instead: 124 B)
        blocks = dict(blocks, block_n=32)
    return BackwardConfig(head_dim, dtype=dtype, **blocks, **extra)


def flash_attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None,
                             window=None, softcap=0.0, alibi_slopes=None, score_mod=None,
                             score_mod_grad=None, mask_mod=None, mod_args=(), block_mask=None,
                             layout="bhsd", deterministic=False, dq=None, dk=None, dv=None,
                             config=None, dlse=None):
    """Gradients ``(dq, dk, dv)`` of ``out = flash_attention(q, k, v, causal=causal,
    scale=scale, window=window, softcap=softcap, layout=layout)`` for the output gradient
    ``dout``.

    * ``q``, ``k``, ``v``, ``causal``, ``scale``, ``window``, ``softcap``, ``layout``: as given
      to :func:`tilepy.flash_attention` (the same checks: float16 / bfloat16, GQA / MQA,
      bottom-right causal alignment, any ``seq_q`` / ``seq_k``); ``out`` and ``lse`` what it
      returned with ``return_lse=True`` — ``lse`` float32 (batch, heads_q, seq_q), natural
      log, ``-inf`` for a row that sees no key (its gradients are 0). ``dout`` has ``out``'s
      shape and dtype.
    * ``v``'s head dim may differ from q's and k's (``out`` and ``dout`` end in v's, as the
      forward's): on sm_90 the wgmma kernels of the wider head dim's tile class (e.g. 192 /
      128: the 256-column kernel), elsewhere the mma.sync kernels (their tiles as wide as the
      wider head dim), each operand zero-filled past its own; a ``config`` then has
      ``head_dim_v`` (``BackwardConfig`` or ``WgmmaBackwardConfig``).
    * Results in ``q``'s, ``k``'s and ``v``'s shapes, layout and dtype, written into
      ``dq``, ``dk``, ``dv`` when given (any strides). With grouped-query attention ``dk`` and
      ``dv`` are summed over each key/value head's query heads.
    * The FlashAttention-2 algorithm: ``D = rowsum(dout ∘ out)`` first, then one block per key
      block computing ``dK``, ``dV`` (summed over query blocks and the group's heads in
      registers) and either ``dQ``'s partial sums, added in float32 into an accumulator
      (atomically: their order varies, so the last bits of ``dq`` can differ between runs)
      and converted after, or nothing more, ``dQ`` then coming from a kernel of its own (one
      block per query block, recomputing ``S`` and ``dP``; the same bits on every run).
      ``deterministic=False`` (the default) takes the faster way for the device: on sm_90 at
      head_dim 128 the warp-specialised kernel with dQ by bulk reductions (FlashAttention-3's
      design), elsewhere dQ's own kernel. ``deterministic=True`` always takes dQ's own kernel
      (on the H200 at head_dim 128 about 10 % slower: ``bench/NOTES.md``). A config with
      ``dq_atomic=True`` asks for the atomic way (unless ``deterministic=True``).
    * ``window`` / ``softcap`` (the forward's variants): the same kernels with the window's
      query and key ranges and the cap's derivative (``dS`` times ``1 - tanh²``) — on sm_90
      at head dims 40 … 128 the wgmma kernels, elsewhere the mma.sync ones (both take every
      variant: :func:`tilepy.tile.attention_backward.key_block_scores`).
    * ``score_mod`` / ``mask_mod``: the forward's user functions, inlined into the same
      kernels (:func:`tilepy.tile.attention_backward.score_functions`); a ``score_mod`` needs
      ``score_mod_grad(score, b, h, q_idx, kv_idx) -> float``, its derivative in ``score``
      (``TypeError`` without it). The indices and the order are the forward's.
    * ``alibi_slopes`` and ``mod_args``: the forward's (ALiBi's bias has derivative 1; the
      user functions, ``score_mod_grad`` included, take the ``mod_args`` after their fixed
      parameters). No gradient flows into them.
    * ``block_mask``: the forward's :class:`tilepy.BlockMask`, checked as there; its
      ``mask_mod`` and ``mod_args`` are used as the forward used them. Block-sparse: the dQ
      kernel visits the key blocks the mask lists for each query block and the dK / dV kernel
      the query blocks its transposed lists (:attr:`tilepy.BlockMask.q_arrays`, made by
      :func:`tilepy.create_block_mask`) list for each key block, ``mask_mod`` applied on every
      visited score of the partial blocks — or, where the mask has its bitmaps
      (``partial_bits`` / ``partial_bits_t``) and the call no ``mod_args`` but the mask's own,
      their bits; a ``mask_mod`` of no array argument gets the op's own mask at the
      kernels' tiles (:func:`tilepy.ops.attention_block_mask.cached_block_mask`). A mask
      without transposed lists, or whose blocks the kernels' tiles do not divide, has every
      block visited, ``mask_mod`` on every score. Either way the gradients are the forward's
      for a mask that agrees with its function (one made by ``create_block_mask`` from it); a
      hand-made mask that calls full a block the function partly hides gives a forward the
      backward does not match.
    * float32 accumulation; ``P`` and ``dS`` rounded to the input dtype for their products (as
      FlashAttention does).
    * ``config``: a :class:`~tilepy.ops.attention_backward_mma_sync.BackwardConfig` (mma.sync)
      or :class:`~tilepy.ops.attention_backward_wgmma.WgmmaBackwardConfig` (Hopper; its
      ``head_dim``, ``dtype`` and v's head dim — ``head_dim_v``, a BackwardConfig's only —
      must match) instead of the built-in choice.
    * ``dlse``: the loss's gradient in ``lse`` (float32, ``lse``'s shape) when the forward's
      LSE is used downstream as well as ``out`` (autograd passes it); None: zero.
    * Array kinds, devices and streams as :func:`tilepy.flash_attention`; errors are raised
      before anything is launched. A call with the same signature as an earlier one reuses its
      launch plans.
    """
    # (the mask's bitmaps in place of mask_mod: the call's own function and arguments)
    bits = abm.reads_bits(block_mask, mask_mod, mod_args, by_key=True)
    if block_mask is not None:
        Q = describe(q, "q")
        b, hq, sq, _ = bhsd_dims(Q.shape, layout) if layout in ("bhsd", "bshd") else (0,) * 4
        sk = bhsd_dims(describe(k, "k").shape, layout)[2] if layout in ("bhsd", "bshd") else 0
        mask_mod, mod_args, _ = check_block_mask(block_mask, mask_mod, mod_args, b, hq, sq, sk,
                                                 causal, window, q, "flash_attention_backward")
    fps = [arrays.fingerprint(x) for x in (dout, q, k, v, out, lse, dq, dk, dv, dlse)]
    fh, ph = hook_fingerprints(alibi_slopes, mod_args)
    # (the arrays the plans bind: the lists and transposed lists, none without the latter)
    fm, pm = mask_fingerprints(block_mask, _mask_arrays(block_mask, bits)) \
        if block_mask is not None else (None, ())
    mods = (score_mod, score_mod_grad, mask_mod)
    key = (tuple(f for f, _ in fps), causal, scale, window, softcap, mods, fh, fm, layout,
           deterministic, config, bits)
    cached, key = _PLANS.lookup(key)
    if cached is not None:
        bound, stream, makers, _ = cached
        ptrs = [p for _, p in fps]
        results, scratch = [dq, dk, dv], []
        for slot, make in makers:   # new outputs the caller did not give, then the scratch
            arr, p = make()
            if slot < _SCRATCH0:
                results[slot - _DQ] = arr
                ptrs[slot] = p
            else:
                scratch.append(arr)   # alive until the launches are queued (stream-ordered
                ptrs.append(p)        # allocators may reuse it after that, not before)
        # the hook's arrays, then the block mask's
        ptrs += [0] * (len(_OPERANDS) - len(ptrs)) + list(ph) + list(pm)
        s = stream()
        for plan in bound:
            plan(s, ptrs)
        device_write.keep_during_capture(s, *scratch)
        del scratch
        return tuple(results)
    return _backward(dout, q, k, v, out, lse, causal, scale, window, softcap,
                     mods + (alibi_slopes, mod_args), layout, deterministic, dq, dk, dv,
                     config, dlse, key, block_mask, bits)


_PLANS = PlanCache()


def _mask_arrays(block_mask, bits: bool = False) -> tuple:
    """The arrays of a block mask the backward reads: the lists and, where it has them, the
    transposed lists (without them it is not block-sparse: none), then with ``bits`` its
    bitmaps (``partial_bits``, ``partial_bits_t``)."""
    qa = block_mask.q_arrays
    if qa is None:
        return ()
    extra = (block_mask.partial_bits, block_mask.partial_bits_t) if bits else ()
    return tuple(block_mask.arrays) + tuple(qa) + extra


def _sparse_mask(block_mask, cfg, mods, win, bq, hq, sq, sk, like, deterministic=False):
    """``(mask, caller's, recordable)``: the block mask the backward's kernels walk — the
    caller's, or for a ``mask_mod`` of no array argument (and no window) the op's own, made
    once per shape at both kernels' tiles
    (:func:`tilepy.ops.attention_block_mask.cached_block_mask`) — or
    ``(None, False, …)``: every block visited (a mask without transposed lists, tiles of the
    kernels that run that do not divide its blocks — the dK / dV kernel's alone when dQ comes
    by atomics — or a capture with no mask kept yet — then not ``recordable``: the plans are
    not kept, so a later call gets the op's mask)."""
    _, _, mask_mod, _, mod_args = mods
    if not (bq and hq and sq and sk):
        return None, False, True
    # the mask's blocks must be multiples of the tiles of the kernels that run
    tiles = (math.lcm(cfg.block_m, cfg.dq_block_m), math.lcm(cfg.block_n, cfg.dq_block_n))
    runs = (cfg.block_m, cfg.block_n) if bk.uses_atomics(cfg, deterministic) else tiles
    if block_mask is None:
        if not abm.makes_own_mask(mask_mod, mod_args, win):
            return None, False, True
        block_mask = cached_block_mask(mask_mod, mod_args, bq, hq, sq, sk, tiles, like)
        if block_mask is None:
            return None, False, False
        caller = False
    else:
        caller = True
    bm, bn = block_sizes(block_mask.block_size)
    if block_mask.q_arrays is None or bm % runs[0] or bn % runs[1]:
        return None, False, True
    return block_mask, caller, True
#: The operands of one call in the order bound plans take their pointers: the arguments as
#: passed, then the float32 scratch (``dq_acc`` only on the atomic path; its slot is 0
#: without), then the score hook's arrays (``mod_args``' and the ALiBi slopes).
_OPERANDS = ("do", "q", "k", "v", "o", "lse", "dq", "dk", "dv", "dlse", "delta", "lse2",
             "dq_acc")
_DQ, _SCRATCH0 = 6, 10


def output_spec(dout, q, k, v, out, lse, *, causal=False, scale=None, window=None,
                softcap=0.0, alibi_slopes=None, layout="bhsd", deterministic=False,
                config=None):
    """``(dq shape, dk shape, dv shape, dtype name)`` after every check the op makes before
    launching; reads only metadata (the registered operator's fake implementation)."""
    (Q, K, V, _), dtype, *_ = _validate(dout, q, k, v, out, lse, causal, scale, window,
                                        softcap, (None, None, None, alibi_slopes, ()),
                                        layout, deterministic,
                                        None, None, None, config, None)
    return Q.shape, K.shape, V.shape, dtype


def describe_grads(dq, dk, dv, Q, K, V, dtype: str) -> list:
    """The caller's gradient outputs ``dq``, ``dk``, ``dv`` (each None or an array of q's,
    k's, v's shape and ``dtype``) as Operands, None where not given; ``ValueError`` for a
    shape or dtype other than that."""
    grads = []
    for name, arr, like in (("dq", dq, Q), ("dk", dk, K), ("dv", dv, V)):
        G = describe(arr, name, allow_float32=False) if arr is not None else None
        if G is not None and (G.shape != like.shape or G.dtype != dtype):
            raise ValueError(f"{name} must have {like.name}'s shape {like.shape} and dtype "
                             f"{dtype}, got {G.shape} {G.dtype}")
        arrays.check_distinct(G)
        grads.append(G)
    return grads


def _validate(dout, q, k, v, out, lse, causal, scale, window, softcap, mods, layout,
              deterministic, dq, dk, dv, config, dlse):
    if out is None:
        raise TypeError("flash_attention_backward needs the forward's out (flash_attention's "
                        "result), got None")
    Q, dtype, (bq, hq, sq, sk, d), (K, V, Out), scale, device = check_arguments(
        q, k, v, causal, scale, out, layout, None, any_device=True)
    win, cap = check_variant(causal, window, softcap)
    score_mod, score_mod_grad, mask_mod, alibi_slopes, mod_args = mods
    n_args = n_mod_args(mod_args)
    user = check_functions(score_mod, score_mod_grad, mask_mod, op="flash_attention_backward",
                           n_args=n_args)
    if n_args and not user:
        raise TypeError("flash_attention_backward: mod_args are passed to score_mod / "
                        "mask_mod; neither was given")
    user = user or alibi_slopes is not None
    dO = describe(dout, "dout", allow_float32=False)
    if dO.shape != Out.shape or dO.dtype != dtype:
        raise ValueError(f"dout must have out's shape {Out.shape} and dtype {dtype}, got "
                         f"{dO.shape} {dO.dtype}")
    if lse is None:
        raise TypeError("flash_attention_backward needs the forward's lse "
                        "(flash_attention(..., return_lse=True)), got None")
    Lse = describe(lse, "lse")
    if Lse.dtype != "float32" or Lse.shape != (bq, hq, sq):
        raise ValueError(f"lse must be float32 of shape {(bq, hq, sq)} (batch, heads_q, "
                         f"seq_q), got {Lse.dtype} {Lse.shape}")
    dLse = describe(dlse, "dlse") if dlse is not None else None
    if dLse is not None and (dLse.dtype != "float32" or dLse.shape != Lse.shape):
        raise ValueError(f"dlse must be float32 of lse's shape {Lse.shape}, got {dLse.dtype} "
                         f"{dLse.shape}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} "
                        f"{deterministic!r}")
    grads = describe_grads(dq, dk, dv, Q, K, V, dtype)
    device = arrays.same_device(Q, K, V, Out, dO, Lse, dLse, *grads)
    if config is not None:
        if not isinstance(config, (BackwardConfig, WgmmaBackwardConfig)):
            raise TypeError(f"config must be a tilepy.ops.attention_backward_mma_sync."
                            f"BackwardConfig (mma.sync) or a tilepy.ops.attention_backward_"
                            f"wgmma.WgmmaBackwardConfig (Hopper), got {type(config).__name__}")
        if (config.head_dim, config.dtype) != (d, dtype):
            raise ValueError(f"config is for head_dim {config.head_dim} {config.dtype}; the "
                             f"inputs are head_dim {d} {dtype}")
        dv = bhsd_dims(V.shape, layout)[3]
        if getattr(config, "dv", config.head_dim) != dv:
            raise ValueError(f"config is for v's head_dim {getattr(config, 'dv', d)}; v's is "
                             f"{dv} (a config with head_dim_v={dv} takes it)")
    if user and max(bq, hq) > launch.MAX_GRID_YZ:
        raise NotImplementedError(
            f"flash_attention_backward: score_mod / mask_mod / alibi_slopes with more than "
            f"{launch.MAX_GRID_YZ} batches or query heads (got batch {bq}, heads {hq}); split "
            f"the batch")
    if alibi_slopes is not None:
        arrays.same_device(Q, check_alibi(alibi_slopes, bq, hq))
    return ((Q, K, V, Out), dtype, (bq, hq, sq, sk, d), (dO, Lse, dLse, grads), scale, device,
            (win, cap, user, (score_mod, score_mod_grad, mask_mod, n_args,
                              alibi_slopes is not None)))


def _backward(dout, q, k, v, out, lse, causal, scale, window, softcap, mods, layout,
              deterministic, dq, dk, dv, config, dlse, key, block_mask=None, bits=False):
    (Q, K, V, Out), dtype, (bq, hq, sq, sk, d), (dO, Lse, dLse, grads), scale, device, \
        (win, cap, user, kmods) = _validate(
            dout, q, k, v, out, lse, causal, scale, window, softcap, mods, layout,
            deterministic, dq, dk, dv, config, dlse)
    with arrays.on_device(device):
        hargs, hops = hook_args(mods[3], mods[4], bq, hq, sq, sk)   # views of the hook's arrays
        arrays.same_device(Q, *hops)
        results, makers = [], []
        for slot, (arr, like, G) in enumerate(zip((dq, dk, dv), (Q, K, V), grads)):
            if arr is None:
                make = arrays.allocator(Q, like.shape, dtype)
                makers.append((_DQ + slot, make))
                arr, _ = make()
                G = describe(arr, _OPERANDS[_DQ + slot])
            results.append((arr, G))
        cfg = config or choose_config(d, dtype, bool(deterministic), is_variant(win, cap) or user,
                                      head_dim_v=bhsd_dims(V.shape, layout)[3])
        hk = bhsd_dims(K.shape, layout)[1]
        if not (bq and hq and hk and (sq or sk)):
            return tuple(a for a, _ in results)
        gen = bw if isinstance(cfg, WgmmaBackwardConfig) else bk
        mask, caller_mask, recordable = _sparse_mask(block_mask, cfg, mods, win, bq, hq, sq, sk,
                                                     Q.raw, bool(deterministic))
        sqp = bk.row_pad(cfg, sq)
        if mask is not None:
            # a mask's last query block may reach past seq_q: the rows' scratch covers it whole
            mask_block = block_sizes(mask.block_size)
            sqp = bk.row_pad(cfg, -(-sq // mask_block[0]) * mask_block[0])
        scratch = [("delta", (bq, hq, sqp)), ("lse2", (bq, hq, sqp))]
        if bk.uses_atomics(cfg, deterministic):
            scratch.append(("dq_acc", gen.dq_acc_shape(cfg, bq, hq, sqp)))
        ops = {"do": dO, "q": Q, "k": K, "v": V, "o": Out, "lse": Lse, "dq": results[0][1],
               "dk": results[1][1], "dv": results[2][1]}
        views, reusable = {}, True
        for name in ("q", "k", "v", "o", "do"):
            op = ops[name]
            if not readable(op):
                op = ops[name] = describe(arrays.copy_aligned(op), op.name)
                reusable = False
            views[name] = bhsd_view(op, layout)
        for name in ("dq", "dk", "dv"):
            views[name] = bhsd_view(ops[name], layout)
        views["lse"] = bhsd_view(Lse, "bhsd")
        if dLse is not None:
            views["dlse"] = bhsd_view(dLse, "bhsd")
            ops["dlse"] = dLse
        for i, (name, shape) in enumerate(scratch):
            make = arrays.allocator(Q, shape, "float32")
            makers.append((_SCRATCH0 + i, make))
            arr, _ = make()
            ops[name] = describe(arr, name)
            views[name] = bhsd_view(ops[name], "bhsd")
        arrays_of_hook = [x for x in hargs if not isinstance(x, np.generic)]
        for i, (view, op) in enumerate(zip(arrays_of_hook, hops)):   # bound after _OPERANDS
            views[f"hook{i}"], ops[f"hook{i}"] = view, op
        sparse = None
        bits = bool(bits and caller_mask and mask is not None)
        if mask is not None:
            mops = [describe(x, "block_mask", dtypes=("int32",)) for x in _mask_arrays(mask)]
            if bits:   # the bitmaps: the hook's last two arguments, bound after the lists
                mops += [abm.check_partial_bits(mask, bq, hq, by_key) for by_key in (0, 1)]
            mviews = abm.mask_views(mops, bq, hq)
            if caller_mask:      # bound after the hook's arrays (the caller's pointers)
                for i, (view, op) in enumerate(zip(mviews, mops)):
                    views[f"mask{i}"], ops[f"mask{i}"] = view, op
            if bits:
                hargs = tuple(hargs) + tuple(mviews[8:])
                kmods = tuple(kmods) + (True,)
            sparse = (mask_block, mviews[:4], mviews[4:8])
        views["placeholder3"] = arrays.placeholder(3)
        views["placeholder4"] = arrays.placeholder(4)
        stream = arrays.stream_handle(Q)
        plans = gen.plans(cfg, False, bool(deterministic), views, scale, win, cap, kmods,
                          hargs, sparse=sparse)
        for plan, args in plans:
            plan.launch(stream, args)
        # the scratch and any copies, when a CUDA graph captured the launches
        device_write.keep_during_capture(stream, *(ops[n] for n, _ in scratch),
                                         *(ops[n] for n in ("q", "k", "v", "o", "do")
                                           if not reusable))
        if reusable and recordable:
            # (the op's own mask kept with the plans that read it)
            _PLANS.put(key, (_bind(plans, views, ops), arrays.stream_getter(Q), makers,
                             None if caller_mask else mask))
        return tuple(a for a, _ in results)


def _bind(plans, views, ops):
    """The plans bound to the operands of :data:`_OPERANDS` (a later call passes their
    pointers): each array argument found by identity among the views; anything else (the
    placeholder) stays constant."""
    names = _OPERANDS + tuple(n for n in views if n.startswith("hook")) + \
        tuple(n for n in views if n.startswith("mask"))
    index = {name: i for i, name in enumerate(names)}
    by_view = {id(views[name]): name for name in names if name in views}
    bound = []
    for plan, args in plans:
        sources = []
        for pos in plan.array_positions():
            name = by_view.get(id(arg_at(args, pos)))
            sources.append(None if name is None else (index[name], ops[name].byte_pointer()))
        bound.append(plan.bind(sources))
    return bound
