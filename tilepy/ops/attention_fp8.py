"""``tilepy.flash_attention`` on float8 (e4m3) inputs: FlashAttention-3's FP8 forward.

``softmax(scale · (q · dq) (k · dk)ᵀ) · (v · dv)`` with the descales ``dq``, ``dk``, ``dv``
float32 per tensor or per (batch, K/V head), out in bfloat16. Two launches:

1. V's transpose (:mod:`tilepy.tile.transpose`, by 4-byte words where V's data allows):
   Vᵀ (batch, heads_kv, head_dim_v, keys rounded up to 16) uint8, each 16 keys in the order of
   :data:`tilepy.ops.attention_wgmma.FP8_KEY_ORDER`, keys past seq_k zero. The 8-bit P·V
   wgmma takes its B operand K-major only; with the keys in that order the S accumulators,
   rounded to e4m3, are P's A registers as they stand (no shuffle in the kernel). It reads and
   writes V once: at B4 H32 S8192 D128 about 1.5 % of the attention's time at 1000 TFLOPS.
2. The Hopper TMA attention kernel with its 8-bit generator parameter
   (:class:`~tilepy.ops.attention_wgmma.WgmmaAttentionConfig` ``dtype="float8_e4m3fn"``):
   k32 wgmmas on e4m3 Q, K and Vᵀ, the descales folded into the softmax's scale and O's
   final factor, P scaled by 256 before its e4m3 rounding (e4m3's normal range covers the
   small probabilities; the factor cancels in O's normalisation).

Needs a compute capability 9.0 GPU (the simulator runs it too). Errors are raised before
anything is launched.
"""

from __future__ import annotations

import numpy as np

from .. import arrays, launch
from ..arrays import describe, device_view
from ..tile import device_write
from ..tile import transpose as TR
from ..tile.attention import score_hook
from . import attention_wgmma as aw
from .attention import (
    LAYOUTS,
    bhsd_dims,
    bhsd_view,
    check_scale,
    check_shapes,
    check_variant,
    readable,
)

DTYPES = aw.FP8_DTYPES
#: Head dims the FP8 kernel takes: multiples of 16 (TMA's 16-byte rows) up to 256.
HEAD_DIMS = tuple(range(16, 257, 16))


def flash_attention_fp8(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0,
                        descale_q=None, descale_k=None, descale_v=None, return_lse=False,
                        out=None, layout="bhsd", config=None):
    """FlashAttention on float8_e4m3fn ``q``, ``k``, ``v`` (FlashAttention-3's FP8 forward).

    * Shapes, layouts, GQA, ``causal`` (bottom-right aligned), ``scale``, ``window`` and
      ``softcap`` as :func:`tilepy.flash_attention`; head dims multiples of 16 up to 256
      (``v``'s may differ).
    * ``descale_q``, ``descale_k``, ``descale_v``: float32, one value (0-d or (1,)) or one per
      (batch, K/V head) ((batch, heads_kv)); None is 1.0. The scores are ``scale · dq · dk ·
      q kᵀ`` and O is ``dv · softmax(...) · v`` (FlashAttention-3's ``descale_*``). Read on
      the GPU at run time, so not checked on the host: ``dq · dk`` must be positive and
      finite (quantiser scales are); a (batch, head) where it is not gives NaN there.
    * ``out``: bfloat16 of q's shape (ending in v's head dim), or None; ``return_lse``: also
      the float32 (batch, heads_q, seq_q) natural-log LSE of the descaled scores.
    * ``config``: a :class:`~tilepy.ops.attention_wgmma.WgmmaAttentionConfig` of dtype
      ``"float8_e4m3fn"`` (``tma=True``, ``producer=True``, ``block_n`` 64 or 128) to
      override the built-in one (:func:`default_config`).

    P is rounded to e4m3 for the P·V product (as FlashAttention-3 does): expect errors of a
    few per cent of O's scale against a float64 reference on the dequantised inputs. No
    ``alibi_slopes``, user functions or backward (``NotImplementedError``).

    The first call of a signature (array kinds, dtypes, shapes, strides, device, alignment,
    arguments) records its launches; later ones replay them from their pointers (no checks,
    views or plans built; V's transpose buffer, ``out`` and the LSE made anew per call)."""
    fps = [arrays.fingerprint(x) for x in (q, k, v, out, None, descale_q, descale_k,
                                            descale_v)]
    cached, key = _PLANS.lookup((tuple(f for f, _ in fps), causal, scale, window, softcap,
                                 return_lse, layout, config))
    if cached is not None:
        call, stream, keep = cached
        s = stream()
        made = call(s, [p for _, p in fps] + [0])
        if device_write.stream_capturing(s):
            device_write.keep_during_capture(s, keep, *made.values())
        res = made.get(OUT, out)
        return (res, made[LSE]) if return_lse else res
    Q, K, V, Out, descales, (bq, hq, sq), want, scale, win, cap, cfg, device = \
        check_arguments(q, k, v, causal, scale, window, softcap, descale_q, descale_k,
                        descale_v, out, layout, config)
    with arrays.on_device(device):
        if not arrays.SIMULATOR and launch.compute_capability(device) != (9, 0):
            raise NotImplementedError("flash_attention on float8 inputs needs a compute "
                                      "capability 9.0 GPU (wgmma); other GPUs are not supported")
        if max(bq, hq) > launch.MAX_GRID_YZ:
            raise NotImplementedError(f"flash_attention on float8 inputs: more than "
                                      f"{launch.MAX_GRID_YZ} batches or query heads (the grid "
                                      f"kernel's limit; got {bq}, {hq}); split the batch")
        allocs = {}
        if out is None:
            allocs[OUT] = arrays.allocator(Q, want, "bfloat16")
        if return_lse:
            allocs[LSE] = arrays.allocator(Q, (bq, hq, sq), "float32")
        made = {k_: alloc() for k_, alloc in allocs.items()}
        out = made[OUT][0] if out is None else out
        lse = made[LSE][0] if return_lse else None
        if bq and hq and sq and not K.shape[-2 if layout == "bhsd" else 1]:
            # no key: zeros and LSE -inf (the 16-bit kernels' answer), without a launch
            arrays.fill(describe(out, "out"), 0.0)
            if lse is not None:
                arrays.fill(describe(lse, "lse"), -np.inf)
            return (out, lse) if return_lse else out
        if bq and hq and sq:
            ptrs = [Q.byte_pointer(), K.byte_pointer(), V.byte_pointer(),
                    describe(out, "out").byte_pointer(),
                    made[LSE][1] if return_lse else 0] + \
                [S.byte_pointer() if S is not None else 0 for S in descales]
            recorded = _run(Q, K, V, describe(out, "out"), lse, descales, cfg, win, cap, scale,
                            layout, device, ptrs)
            # (ones made during a capture are written only when the graph runs: not kept for
            # eager calls)
            if recorded is not None and (recorded[2] is None or not device_write.stream_capturing(
                    arrays.stream_handle(Q))):
                steps, vt_alloc, keep = recorded
                _PLANS.put(key, (launch.CallPlan(steps, {**allocs, VT: vt_alloc}),
                                 arrays.stream_getter(Q), keep))
        return (out, lse) if return_lse else out


#: The operand slots of a recorded call (:class:`tilepy.launch.CallPlan`): the caller's
#: arrays in the order of the signature, then V's transpose (made per call).
SLOTS = ("q", "k", "v", "out", "lse", "descale_q", "descale_k", "descale_v", "vt")
OUT, LSE, VT = 3, 4, 8
_PLANS = launch.PlanCache()


def check_arguments(q, k, v, causal, scale, window, softcap, descale_q, descale_k, descale_v,
                    out, layout, config):
    """Every check :func:`flash_attention_fp8` makes before launching, on metadata only (fake
    tensors too): ``(Q, K, V, Out, descales, (batch, heads_q, seq_q), out shape, scale,
    window, softcap, config, device)``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    Q, K, V = (describe(x, n, dtypes=DTYPES) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    bq, hq, sq, _, d, dv = check_shapes(Q, K, V, layout)
    hk = bhsd_dims(K.shape, layout)[1]
    for name, x in (("head_dim", d), ("v's head_dim", dv)):
        if x not in HEAD_DIMS:
            raise ValueError(f"{name} {x} is not supported on float8 inputs: the multiples of "
                             f"16 from 16 to 256")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    scale = check_scale(scale, d)
    win, cap = check_variant(causal, window, softcap)
    want = tuple(Q.shape[:-1]) + (dv,)
    Out = describe(out, "out") if out is not None else None
    arrays.check_distinct(Out)
    if Out is not None and (Out.shape != want or Out.dtype != "bfloat16"):
        raise ValueError(f"out must be bfloat16 of shape {want}, got {Out.dtype} {Out.shape}")
    descales = [_descale(x, n, bq, hk, Q) for x, n in ((descale_q, "descale_q"),
                                                       (descale_k, "descale_k"),
                                                       (descale_v, "descale_v"))]
    device = arrays.same_device(Q, K, V, Out, *(s for s in descales if s is not None))
    cfg = config if config is not None else default_config(d, dv)
    if not isinstance(cfg, aw.WgmmaAttentionConfig) or not cfg.fp8 or \
            (cfg.head_dim, cfg.dv) != (d, dv):
        raise ValueError(f"config must be a WgmmaAttentionConfig of dtype float8_e4m3fn for "
                         f"head_dim {d} / {dv}, got {config!r}")
    return Q, K, V, Out, descales, (bq, hq, sq), want, scale, win, cap, cfg, device


def output_spec(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0,
                descale_q=None, descale_k=None, descale_v=None, out=None, layout="bhsd"):
    """``(out shape, lse shape)`` after every check :func:`flash_attention_fp8` makes (O
    bfloat16, the LSE float32): the registered operator's fake implementation."""
    _, _, _, _, _, (bq, hq, sq), want, *_ = check_arguments(
        q, k, v, causal, scale, window, softcap, descale_q, descale_k, descale_v, out, layout,
        None)
    return want, (bq, hq, sq)


def default_config(d: int, dv: int) -> aw.WgmmaAttentionConfig:
    """The built-in FP8 config: 128 query rows × 128 keys (64 past head_dim 128: the
    registers), two consumer warpgroups in ping-pong and a producer warpgroup (the 16-bit
    kernels' schedule at head_dim 128)."""
    return aw.WgmmaAttentionConfig(d, 128, 128 if max(d, dv) <= 128 else 64, "float8_e4m3fn",
                                   overlap=True, tma=True, pingpong=True, producer=True,
                                   head_dim_v=None if dv == d else dv)


def _descale(x, name: str, batch: int, heads_kv: int, Q):
    """A descale's Operand (None stays): float32, one value or (batch, heads_kv)."""
    if x is None:
        return None
    S = describe(x, name)
    if S.dtype != "float32":
        raise TypeError(f"{name} must be float32, got {S.dtype}")
    if int(np.prod(S.shape)) != 1 and tuple(S.shape) != (batch, heads_kv):
        raise ValueError(f"{name} must hold one value (0-d or (1,)) or one per (batch, "
                         f"heads_kv) = ({batch}, {heads_kv}), got shape {S.shape}")
    return S


def _descale_view(S, ones, batch: int, heads_kv: int):
    """A descale as the kernel's (batch, heads_kv) float32 view (zero strides for one value;
    ``ones`` for None)."""
    if S is None:
        view = arrays.raw_view(describe(ones, "ones"))
        return device_view(arrays.restride(view, (batch, heads_kv), (0, 0)))
    view = arrays.raw_view(S)
    if int(np.prod(S.shape)) == 1:
        return device_view(arrays.restride(view, (batch, heads_kv), (0, 0)))
    item = view.dtype.itemsize
    return device_view(arrays.restride(view, (batch, heads_kv),
                                       tuple(st * item for st in S.strides)))


def _run(Q, K, V, Out, lse, descales, cfg, win, cap, scale, layout, device, ptrs):
    """Launch V's transpose and the attention kernel; return ``(steps, V's transpose
    allocator, kept array)`` for a :class:`tilepy.launch.CallPlan` over :data:`SLOTS` (``ptrs``
    their pointers in this call, V's transpose's added here), or None when an input needed
    an aligned copy (such a call is not recorded)."""
    with arrays.on_device(device):
        stream = arrays.stream_handle(Q)
        copies = []
        views = []
        for op in (Q, K):
            if not readable(op):
                op = describe(arrays.copy_aligned(op), op.name, dtypes=DTYPES)
                copies.append(op.raw)
            views.append(bhsd_view(op, layout))
        v_v = bhsd_view(V, layout)
        b, hk, sk, dv = v_v.shape
        vt_alloc = arrays.allocator(Q, (b, hk, dv, -(-sk // 16) * 16), "uint8")
        vt, vt_ptr = vt_alloc()
        ptrs = list(ptrs) + [vt_ptr]
        vt_v = device_view(arrays.raw_view(describe(vt, "vt", dtypes=("uint8",))))
        t_plan, t_args = transpose_plan(v_v, vt_v)
        if t_plan is not None:
            t_plan.launch(stream, t_args)
        ones = arrays.ones(Q, (1,)) if any(s is None for s in descales) else None
        dsc = tuple(_descale_view(s, ones, b, hk) for s in descales)
        o_v = bhsd_view(Out, layout)
        lse_v = bhsd_view(describe(lse, "lse"), "bhsd") if lse is not None else \
            arrays.placeholder(3)
        # (the window includes causal's upper bound: check_variant's)
        kern = aw.wgmma_attention_kernel(cfg, False, lse is not None, win,
                                         score_hook(cap) if cap else None)
        plan, args = aw.plan(kern, cfg, *views, vt_v, o_v, lse_v, scale, stream=stream,
                             alloc=arrays.byte_allocator(Q), hargs=(dsc, ()))
        plan.launch(stream, args)
        device_write.keep_during_capture(stream, ones, vt, *copies)
    if copies:
        return None
    # the attention's arrays: q, k, Vᵀ, out, lse, what the plan supplies (tensor maps), then
    # the three descales (a None one reads the kept ones: constant)
    src = [(0, ptrs[0]), (1, ptrs[1]), (VT, vt_ptr), (OUT, ptrs[OUT]),
           (LSE, ptrs[LSE]) if lse is not None else None]
    hook = [(5 + i, ptrs[5 + i]) if S is not None else None for i, S in enumerate(descales)]
    n_plan = len(plan.array_positions()) - len(src) - len(hook)
    steps = [(plan.bind(src + [None] * n_plan + hook), ())]
    if t_plan is not None:
        steps.insert(0, (t_plan.bind([(2, ptrs[2]), (VT, vt_ptr)]), ()))
    return steps, vt_alloc, ones


# ---- V's transpose -----------------------------------------------------------------------------

def transpose_plan(v, vt):
    """``(plan, args)`` of V's transpose (:func:`tilepy.tile.transpose.launch_plan` with the
    FP8 key order) from view ``v`` (B, H, S, D) into ``vt`` (B, H, D, S16); ``(None, None)``
    when there is nothing to do."""
    return TR.launch_plan(v, vt, key_order=True)


def transpose_v(v, vt, stream):
    """Launch V's transpose (:func:`transpose_plan`) on ``stream``."""
    plan, args = transpose_plan(v, vt)
    if plan is not None:
        plan.launch(stream, args)


def compile_reports():
    """Offline sm_90a reports of the byte and word transposes (V's, with the key order; and
    the plain ones the FP8 GEMM uses for a b that is not K-major)."""
    from numba import types

    from ..offline import report_entry

    reps = []
    for unit, dtype, make, block in (("bytes", types.uint8, TR.transpose_bytes_kernel,
                                      TR.BLOCK),
                                     ("words", types.uint32, TR.transpose_words_kernel,
                                      TR.WBLOCK)):
        ty = types.Array(dtype, 4, "A")
        reps += [report_entry(f"transpose_{unit}{'_key_order' if order else ''}",
                              lambda order=order, make=make: make(order), (ty, ty), (9, 0),
                              threads=block[0] * block[1])
                 for order in (True, False)]
    return reps
