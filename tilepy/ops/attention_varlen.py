"""``tilepy.flash_attention_varlen``: attention over packed sequences of different lengths.

FlashAttention-2's varlen API: the sequences of a batch lie one after another in ``q``
(total_q, heads_q, head_dim) and ``k`` / ``v`` (total_k, heads_kv, head_dim), delimited by
int32 cumulative lengths. One launch of a forward kernel with its ``varlen`` generator
parameter — on sm_90 the grid TMA wgmma kernel
(:func:`tilepy.ops.attention_wgmma.wgmma_attention_kernel`), elsewhere the mma.sync one
(:func:`tilepy.ops.attention_mma_sync.attention_kernel`): grid z runs over
the sequences, each block reads its sequence's bounds on the device (no host round trip per
call; :func:`flash_attention_varlen`'s ``check_seqlens`` reads them once on the host to
validate).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import arrays, launch
from ..arrays import describe
from ..tile import device_write
from ..tile.attention import score_hook
from ..tile.attention_backward import check_functions
from . import attention as at
from . import attention_backward_mma_sync as bk
from .attention_backward import describe_grads
from . import attention_mma_sync as fa
from . import attention_wgmma as aw
from .attention_backward_mma_sync import BackwardConfig
from . import attention_backward_wgmma as bw
from .attention_backward_wgmma import WgmmaBackwardConfig
from .attention_mma_sync import HEAD_DIMS, AttentionConfig


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           causal=False, scale=None, window=None, softcap=0.0,
                           alibi_slopes=None, score_mod=None, mask_mod=None, mod_args=(),
                           return_lse=False, out=None, check_seqlens=True, config=None):
    """:func:`tilepy.flash_attention` over a packed batch of ``n`` sequences of different
    lengths (FlashAttention-2's ``flash_attn_varlen_func``).

    * ``q`` (total_q, heads_q, head_dim), ``k`` (total_k, heads_kv, head_dim) and ``v``
      (total_k, heads_kv, head_dim_v): sequence ``z`` is rows ``cu_seqlens_q[z] …
      cu_seqlens_q[z + 1] - 1`` of ``q`` and keys ``cu_seqlens_k[z] … cu_seqlens_k[z + 1] - 1``
      of ``k`` / ``v``. ``out`` and the result are (total_q, heads_q, head_dim_v); rows of
      ``q`` outside every sequence are not written. v's head dim may differ from q's and k's
      (e.g. 192 / 128) on sm_90 (the grid TMA kernel; elsewhere ``NotImplementedError``, as
      :func:`tilepy.flash_attention`).
    * ``cu_seqlens_q`` / ``cu_seqlens_k``: int32 arrays of ``n + 1`` cumulative lengths on the
      inputs' device, starting at 0, non-decreasing (zero-length sequences allowed), ending at
      most at ``total_q`` / ``total_k``. ``max_seqlen_q``: at least the longest query
      sequence (the grid is sized by it; rows past it would not be computed);
      ``max_seqlen_k``: at least the longest key sequence (checked; the kernel reads each
      sequence's length itself).
    * ``check_seqlens=True`` copies the cumulative lengths to the host once per call and
      raises ``ValueError`` for any of the above that does not hold — a synchronisation with
      the stream; ``False`` skips it (the caller vouches for them), as does a call while the
      stream is being captured into a CUDA graph (the copy cannot be captured). Unchecked bad
      lengths read and write out of bounds.
    * ``causal``, ``window``, ``softcap``: per sequence, relative to its own bottom-right
      diagonal (``i + seq_k - seq_q``); a query row that sees no key gives zeros (LSE -inf).
    * ``alibi_slopes``: float32 ``(heads_q,)`` or ``(n, heads_q)``; the bias is
      ``-slope · |i + seq_k - seq_q - j|`` with the sequence's own lengths.
    * ``score_mod`` / ``mask_mod`` / ``mod_args``: as :func:`tilepy.flash_attention`'s, with
      ``b`` the sequence index and ``q_idx`` / ``kv_idx`` positions within the sequence.
    * ``return_lse=True``: ``(out, lse)`` with ``lse`` float32 (heads_q, total_q)
      (FlashAttention-2's varlen LSE layout); rows outside every sequence are not written.
    * ``config``: an :class:`~tilepy.ops.attention_mma_sync.AttentionConfig` (the mma.sync
      kernel) or a :class:`~tilepy.ops.attention_wgmma.WgmmaAttentionConfig` with ``tma=True``
      and not persistent (the grid TMA kernel; another is a ``NotImplementedError``). Unset:
      on sm_90 the built-in Hopper config's grid TMA kernel for every head dim (the mma.sync
      kernel where TMA cannot describe the views), elsewhere the mma.sync kernel.
    * head_dim, dtypes, GQA, ``scale`` and the accepted array kinds: as
      :func:`tilepy.flash_attention`'s. Errors are raised before anything is launched.
    * A call with the same array kinds, dtypes, shapes, strides, device, alignment and
      arguments (``max_seqlen_q`` / ``max_seqlen_k`` included; the cumulative lengths'
      values may differ) as an earlier one reuses its launch plan (:mod:`tilepy.launch`);
      ``check_seqlens`` still reads and checks the lengths of every call.
    """
    fps = [arrays.fingerprint(x) for x in (q, k, v, out, cu_seqlens_q, cu_seqlens_k)]
    fh, ph = at.hook_fingerprints(alibi_slopes, mod_args)
    cached, key = _PLANS.lookup((tuple(f for f, _ in fps), max_seqlen_q, max_seqlen_k, causal,
                                 scale, window, softcap, score_mod, mask_mod, fh, return_lse,
                                 config))
    if cached is not None:
        bound, stream, alloc_out, alloc_lse, sizes = cached
        pq, pk, pv, po, pcq, pck = (p for _, p in fps)
        if check_seqlens and not device_write.stream_capturing(stream()):
            cq, ck = (describe(x, name, dtypes=("int32",)) for x, name in (
                (cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")))
            check_seqlen_values(arrays.to_host(cq), arrays.to_host(ck), *sizes)
        if out is None:
            out, po = alloc_out()
        lse, pl = alloc_lse() if alloc_lse is not None else (None, 0)
        bound(stream(), (pq, pk, pv, po, pl, pcq, pck, *ph))
        return (out, lse) if return_lse else out
    Q, dtype, (hq, hk, d, dv), (K, V, Out), scale, device = check_arguments(q, k, v, scale,
                                                                             out, config)
    with arrays.on_device(device):
        CuQ, CuK, n = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, Q, K, device)
        mq, mk = check_max_seqlens(max_seqlen_q, max_seqlen_k)
        win, cap = at.check_variant(causal, window, softcap)
        n_args = at.n_mod_args(mod_args)
        user = at.check_user_functions(score_mod, mask_mod, n_args)
        if n_args and not user:
            raise TypeError("flash_attention_varlen: mod_args are passed to score_mod / mask_mod; "
                            "neither was given")
        alibi = alibi_slopes is not None
        hargs, hops = _packed_hook_args("flash_attention_varlen", alibi_slopes, mod_args, n, hq,
                                        Q)
        if check_seqlens and not device_write.stream_capturing(arrays.stream_handle(Q)):
            check_seqlen_values(arrays.to_host(CuQ), arrays.to_host(CuK), Q.shape[0], K.shape[0],
                                mq, mk)
        caller_out = out is not None
        o_shape = out_shape(Q, V)
        if out is None:
            out = arrays.empty(Q, o_shape, dtype)
            Out = describe(out, "out")
        lse = arrays.empty(Q, (hq, Q.shape[0]), "float32") if return_lse else None
        if n and hq and mq:
            cfg = config or choose_config(d, dtype, causal, dv)
            variant = at.is_variant(win, cap) or user or alibi
            hook = score_hook(cap, score_mod, mask_mod, n_args=n_args, alibi=alibi) \
                if variant else None
            with at.user_errors((win, cap, score_mod, mask_mod) if variant else None):
                views, copies = [], []
                for op in (Q, K, V):
                    if not at.readable(op):
                        op = describe(arrays.copy_aligned(op), op.name)
                        copies.append(op)
                    views.append(packed_view(op))
                lse_v = packed_lse_view(describe(lse, "lse")) if lse is not None \
                    else arrays.placeholder(3)
                seqs = (at.device_view(arrays.raw_view(CuQ, hook=True)),
                        at.device_view(arrays.raw_view(CuK, hook=True)))
                stream = arrays.stream_handle(Q)
                run = (views, packed_view(Out), lse_v, scale, (seqs, tuple(hargs)), (n, mq),
                       causal, (win, hook) if variant else None, lse is not None, Q)
                try:
                    plan, args = _plan(cfg, *run)
                except (ValueError, RuntimeError):
                    # TMA cannot describe these views (tensor-map limits): the mma.sync kernel
                    # (of one head dim only)
                    if config is not None or not isinstance(cfg, aw.WgmmaAttentionConfig) \
                            or dv != d:
                        raise
                    plan, args = _plan(at.mma_sync_config(d, dtype), *run)
                plan.launch(stream, args)
                device_write.keep_during_capture(stream, *copies)
                if not copies and not device_write.stream_capturing(stream):
                    # the plan's arrays: the five operands, any the plan supplies (TMA maps),
                    # then the lengths and the hook's, as operands 5, 6, ...
                    lse_src = (4, describe(lse, "lse").byte_pointer()) if lse is not None \
                        else None
                    hook_src = [(5 + i, op.byte_pointer())
                                for i, op in enumerate([CuQ, CuK, *hops])]
                    n_plan = len(plan.array_positions()) - 5 - len(hook_src)
                    bound = plan.bind([(0, Q.byte_pointer()), (1, K.byte_pointer()),
                                       (2, V.byte_pointer()), (3, Out.byte_pointer()), lse_src]
                                      + [None] * n_plan + hook_src)
                    _PLANS.put(key, (bound, arrays.stream_getter(Q),
                                     None if caller_out else arrays.allocator(Q, o_shape, dtype),
                                     arrays.allocator(Q, (hq, Q.shape[0]), "float32")
                                     if return_lse else None,
                                     (Q.shape[0], K.shape[0], mq, mk)))
        return (out, lse) if return_lse else out


_PLANS = launch.PlanCache()


def output_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None,
                any_device=False):
    """``(out shape, lse shape)`` of :func:`flash_attention_varlen` after every check it
    makes before launching that reads only metadata (the cumulative lengths' values are not
    read): the registered operator's fake implementation (``any_device``: the backward's,
    whose kernels run v's own head dim on every GPU)."""
    Q, _, (hq, _, _, _), (K, V, _), _, device = check_arguments(q, k, v, scale, None, None,
                                                                any_device)
    _, _, n = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, Q, K, device)
    check_max_seqlens(max_seqlen_q, max_seqlen_k)
    at.check_variant(causal, window, softcap)
    if alibi_slopes is not None:
        arrays.same_device(Q, at.check_alibi(alibi_slopes, n, hq))
    return out_shape(Q, V), (hq, Q.shape[0])


def _plan(cfg, views, o_v, lse_v, scale, hargs, varlen, causal, variant, has_lse, Q):
    """``(plan, args)`` of ``cfg``'s varlen kernel over the packed views: the variant's when
    ``variant`` is ``(win, hook)`` — the window (which holds the causal bound) and the score
    hook, None where only the window varies — else the plain or causal one."""
    kernel = aw.wgmma_attention_kernel if isinstance(cfg, aw.WgmmaAttentionConfig) \
        else fa.attention_kernel
    if variant is not None:
        kern = kernel(cfg, False, has_lse, *variant, varlen=True)
    else:
        kern = kernel(cfg, bool(causal), has_lse, varlen=True)
    if kernel is aw.wgmma_attention_kernel:
        return aw.plan(kern, cfg, *views, o_v, lse_v, scale, hargs=hargs, varlen=varlen,
                       alloc=arrays.byte_allocator(Q))
    return fa.plan(kern, cfg, *views, o_v, lse_v, scale, hargs=hargs, varlen=varlen)


def choose_config(head_dim: int, dtype: str, causal: bool = False, head_dim_v=None):
    """The config packed sequences run with: on sm_90 (head dims of the TMA kernels) the
    built-in Hopper config's grid TMA kernel (:func:`tilepy.ops.attention.hopper_config`, not
    persistent: a block per (query block, head, sequence)); elsewhere the built-in mma.sync
    config of the head_dim (:data:`tilepy.ops.attention.GPU_CONFIGS`); in the simulator the
    small mma.sync one. ``head_dim_v`` (v's head dim, where it differs): the TMA kernel's
    config (in the simulator a small one; elsewhere :func:`check_arguments` refuses it)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if arrays.SIMULATOR:
        if dv != head_dim:
            return at.choose_config(head_dim, dtype, causal, head_dim_v=dv)
        return AttentionConfig(head_dim, at.SIM_BLOCK_M, at.SIM_BLOCK_N, at.SIM_WARP_ROWS,
                               dtype)
    if (head_dim in aw.TMA_HEAD_DIMS and launch.is_hopper()) or dv != head_dim:
        return dataclasses.replace(at.hopper_config(head_dim, dtype, causal, dv),
                                   persistent=False)
    return at.mma_sync_config(head_dim, dtype)


def _packed_hook_args(op: str, alibi_slopes, mod_args, n: int, hq: int, Q):
    """``(hook arguments, their array operands)`` of a packed batch of ``n`` sequences and
    ``hq`` query heads (:func:`tilepy.ops.attention.hook_args`, without ALiBi's key offset: the
    kernels append each sequence's seq_k - seq_q), the arrays on ``Q``'s device;
    ``NotImplementedError`` (naming ``op``) past the grid's y / z limit."""
    hargs, hops = at.hook_args(alibi_slopes, mod_args, n, hq, 0, 0)
    if alibi_slopes is not None:
        hargs = hargs[:-1]
    arrays.same_device(Q, *hops)
    if max(n, hq) > launch.MAX_GRID_YZ:
        raise NotImplementedError(f"{op}: at most {launch.MAX_GRID_YZ} sequences and query "
                                  f"heads (got {n} and {hq})")
    return hargs, hops


def check_arguments(q, k, v, scale, out, config, any_device=False):
    """``(Q, dtype, (heads_q, heads_kv, head_dim, v's head_dim), (K, V, Out), scale, device)``
    of packed (total, heads, head_dim) inputs; errors name the argument. v's head dim may
    differ from q's and k's: the forward's TMA kernels take it on sm_90 only (elsewhere a
    ``NotImplementedError``, unless ``any_device``: the backward, whose mma.sync kernels take
    it on every GPU)."""
    Q = describe(q, "q", allow_float32=False)
    K = describe(k, "k", allow_float32=False)
    V = describe(v, "v", allow_float32=False)
    if not (Q.dtype == K.dtype == V.dtype):
        raise TypeError(f"q, k and v must have the same dtype; got q {Q.dtype}, k {K.dtype}, "
                        f"v {V.dtype}")
    for op in (Q, K, V):
        if op.ndim != 3:
            raise ValueError(f"{op.name} must be 3-D (total, heads, head_dim) for packed "
                             f"sequences, got shape {op.shape}")
    (_, hq, d), (tk, hk, dk), (tv, hv, dv) = Q.shape, K.shape, V.shape
    if d != dk:
        raise ValueError(f"head_dim differs: q {d}, k {dk}, v {dv}")
    if (tk, hk) != (tv, hv):
        raise ValueError(f"k and v must have the same total and heads, got k {K.shape} and v "
                         f"{V.shape}")
    if hk < 1 or hq % hk:
        raise ValueError(f"heads_q ({hq}) must be a multiple of heads_kv ({hk})")
    for name, x in (("head_dim", d), ("v's head_dim", dv)):
        if x not in HEAD_DIMS:
            raise ValueError(f"{name} {x} is not supported; supported: the multiples of 8 "
                             f"from {HEAD_DIMS[0]} to {HEAD_DIMS[-1]}")
    scale = at.check_scale(scale, d)
    Out = describe(out, "out", allow_float32=False) if out is not None else None
    arrays.check_distinct(Out)
    want = out_shape(Q, V)
    if Out is not None and (Out.shape != want or Out.dtype != Q.dtype):
        raise ValueError(f"out must have shape {want} (q's" + (f" with v's head_dim {dv}"
                         if dv != d else "") + f") and dtype {Q.dtype}, got {Out.shape} "
                         f"{Out.dtype}")
    device = arrays.same_device(Q, K, V, Out)
    if dv != d and not arrays.SIMULATOR and not any_device and not launch.is_hopper(device):
        raise NotImplementedError(at.hopper_only(d, dv, device).replace(
            "flash_attention:", "flash_attention_varlen:"))
    if config is not None:
        if isinstance(config, aw.WgmmaAttentionConfig):
            if not config.tma or config.persistent or config.fp8:
                raise NotImplementedError(
                    f"flash_attention_varlen runs the grid TMA wgmma kernel (tma=True, not "
                    f"persistent) or the mma.sync kernel; got {config.describe()}")
        elif not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be an AttentionConfig or a WgmmaAttentionConfig, "
                            f"got {type(config).__name__}")
        if (config.head_dim, config.dtype) != (d, Q.dtype):
            raise ValueError(f"config is for head_dim {config.head_dim} {config.dtype}; the "
                             f"inputs are head_dim {d} {Q.dtype}")
        if getattr(config, "dv", d) != dv:
            raise ValueError(f"config is for v's head_dim {getattr(config, 'dv', d)}; v's is "
                             f"{dv} (a WgmmaAttentionConfig with tma=True and head_dim_v="
                             f"{dv} takes it)")
    return Q, Q.dtype, (hq, hk, d, dv), (K, V, Out), scale, device


def out_shape(Q, V):
    """The packed output's shape: q's (total_q, heads_q) with v's head dim."""
    return (*Q.shape[:2], V.shape[2])


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, Q, K, device):
    """``(CuQ, CuK, sequences)``: both int32, 1-D, of the same length ``n + 1 >= 1``, on the
    inputs' device."""
    ops = []
    for x, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        op = describe(x, name, dtypes=arrays.HOOK_DTYPES)
        if op.dtype != "int32":
            raise TypeError(f"{name} must be int32 (FlashAttention's convention), got "
                            f"{op.dtype}")
        if op.ndim != 1 or op.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D with n + 1 >= 1 entries (n sequences), got "
                             f"shape {op.shape}")
        ops.append(op)
    if ops[0].shape != ops[1].shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (one entry "
                         f"per sequence, plus one), got {ops[0].shape[0]} and "
                         f"{ops[1].shape[0]}")
    arrays.same_device(Q, K, *ops)
    return ops[0], ops[1], ops[0].shape[0] - 1


def check_max_seqlens(max_seqlen_q, max_seqlen_k):
    """The two as ints: ``TypeError`` for another type, ``ValueError`` for a negative one."""
    out = []
    for x, name in ((max_seqlen_q, "max_seqlen_q"), (max_seqlen_k, "max_seqlen_k")):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{name} must be an int >= 0, got {type(x).__name__} {x!r}")
        if x < 0:
            raise ValueError(f"{name} must be an int >= 0, got {x!r}")
        out.append(int(x))
    return out


def check_seqlen_values(cu_q, cu_k, total_q: int, total_k: int, max_q: int, max_k: int):
    """``ValueError`` unless each of the host copies starts at 0, never decreases, ends within
    its total, and no sequence is longer than its maximum."""
    for cu, total, longest, name in ((cu_q, total_q, max_q, "q"), (cu_k, total_k, max_k, "k")):
        lens = np.diff(cu.astype(np.int64))
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens_{name} must start at 0, got {int(cu[0])}")
        if (lens < 0).any():
            z = int(np.argmax(lens < 0))
            raise ValueError(f"cu_seqlens_{name} must not decrease: entry {z + 1} "
                             f"({int(cu[z + 1])}) < entry {z} ({int(cu[z])})")
        if cu[-1] > total:
            raise ValueError(f"cu_seqlens_{name} ends at {int(cu[-1])}, past total_{name} = "
                             f"{total} (the rows of {name})")
        if lens.size and lens.max() > longest:
            raise ValueError(f"max_seqlen_{name} = {longest} but sequence "
                             f"{int(np.argmax(lens))} has {int(lens.max())} "
                             f"{'rows' if name == 'q' else 'keys'}")


def packed_view(op):
    """A packed (total, heads, head_dim) operand as the kernel's 4-D (1, heads, total,
    head_dim) view, no copy."""
    view = arrays.raw_view(op)
    (t, h, d), (st, sh, sd) = op.shape, op.strides
    item = view.dtype.itemsize
    view = arrays.restride(view, (1, h, t, d), (t * st * item, sh * item, st * item, sd * item))
    return at.device_view(view)


def packed_lse_view(op):
    """The (heads, total) float32 LSE as the kernel's (1, heads, total) view."""
    view = arrays.raw_view(op)
    (h, t), (sh, st) = op.shape, op.strides
    item = view.dtype.itemsize
    view = arrays.restride(view, (1, h, t), (h * sh * item, sh * item, st * item))
    return at.device_view(view)




def flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                                    window=None, softcap=0.0, alibi_slopes=None,
                                    score_mod=None, score_mod_grad=None, mask_mod=None,
                                    mod_args=(), deterministic=False, dq=None, dk=None,
                                    dv=None, check_seqlens=True, config=None, dlse=None):
    """Gradients ``(dq, dk, dv)`` of ``out = flash_attention_varlen(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`` for the output gradient ``dout``.

    * The forward's arguments as given to it; ``out`` and ``lse`` (float32 (heads_q,
      total_q)) what it returned with ``return_lse=True``; ``dout`` has ``out``'s shape and
      dtype (v's head dim may differ from q's: as :func:`tilepy.flash_attention_backward`
      takes it, the wgmma kernels on sm_90, the mma.sync ones elsewhere).
      A ``score_mod`` needs its derivative ``score_mod_grad`` (as for
      :func:`tilepy.flash_attention_backward`).
    * ``dq`` / ``dk`` / ``dv``: optional outputs of ``q``'s / ``k``'s / ``v``'s shape and
      dtype; their rows outside every sequence are left as they are (allocated here: zeros).
    * ``dlse``: the loss's gradient in ``lse`` (float32, ``lse``'s shape) when the forward's
      LSE is used downstream (as :func:`tilepy.flash_attention_backward`'s).
    * ``deterministic``: as :func:`tilepy.flash_attention_backward`'s. Without it, on sm_90,
      the warp-specialised wgmma kernel (a config with ``producer``) reduces dQ into a float32
      accumulator as it computes dK / dV (the order of the additions varies from run to
      run); with it, and with every other config, dQ comes from its own kernel (the same
      bits every run). ``check_seqlens`` as the forward's. ``config``: a
      :class:`~tilepy.ops.attention_backward_mma_sync.BackwardConfig` (the mma.sync
      kernels) or, on sm_90, a :class:`~tilepy.ops.attention_backward_wgmma.
      WgmmaBackwardConfig`; unset, on sm_90 the wgmma kernels where the head dim takes
      them (:func:`choose_backward_config`), else the mma.sync ones.
    """
    if out is None or lse is None:
        raise TypeError("flash_attention_varlen_backward needs the forward's out and lse "
                        "(flash_attention_varlen(..., return_lse=True)), got None")
    Q, dtype, (hq, hk, d, dv_dim), (K, V, Out), scale, device = check_arguments(
        q, k, v, scale, out, None, any_device=True)
    with arrays.on_device(device):
        CuQ, CuK, n = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, Q, K, device)
        mq, mk = check_max_seqlens(max_seqlen_q, max_seqlen_k)
        win, cap = at.check_variant(causal, window, softcap)
        n_args = at.n_mod_args(mod_args)
        user = check_functions(score_mod, score_mod_grad, mask_mod,
                               op="flash_attention_varlen_backward", n_args=n_args)
        if n_args and not user:
            raise TypeError("flash_attention_varlen_backward: mod_args are passed to score_mod / "
                            "mask_mod; neither was given")
        dO = describe(dout, "dout", allow_float32=False)
        if dO.shape != Out.shape or dO.dtype != dtype:
            raise ValueError(f"dout must have out's shape {Out.shape} and dtype {dtype}, got "
                             f"{dO.shape} {dO.dtype}")
        Lse = describe(lse, "lse")
        if Lse.dtype != "float32" or Lse.shape != (hq, Q.shape[0]):
            raise ValueError(f"lse must be float32 of shape {(hq, Q.shape[0])} (heads_q, "
                             f"total_q), got {Lse.dtype} {Lse.shape}")
        dLse = describe(dlse, "dlse") if dlse is not None else None
        if dLse is not None and (dLse.dtype != "float32" or dLse.shape != Lse.shape):
            raise ValueError(f"dlse must be float32 of lse's shape {Lse.shape}, got "
                             f"{dLse.dtype} {dLse.shape}")
        if not isinstance(deterministic, (bool, np.bool_)):
            raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} "
                            f"{deterministic!r}")
        grads = describe_grads(dq, dk, dv, Q, K, V, dtype)
        arrays.same_device(Q, dO, Lse, dLse, *grads)
        if config is not None:
            if not isinstance(config, (BackwardConfig, WgmmaBackwardConfig)):
                raise TypeError(f"config must be a tilepy.ops.attention_backward_mma_sync."
                                f"BackwardConfig or a tilepy.ops.attention_backward_wgmma."
                                f"WgmmaBackwardConfig, got {type(config).__name__}")
            if isinstance(config, WgmmaBackwardConfig) and not launch.is_hopper(device) \
                    and not arrays.SIMULATOR:
                raise NotImplementedError("flash_attention_varlen_backward: a "
                                          "WgmmaBackwardConfig runs on sm_90 only")
            if (config.head_dim, config.dtype) != (d, dtype):
                raise ValueError(f"config is for head_dim {config.head_dim} {config.dtype}; the "
                                 f"inputs are head_dim {d} {dtype}")
            if getattr(config, "dv", config.head_dim) != dv_dim:
                raise ValueError(f"config is for v's head_dim {config.dv}; v's is {dv_dim} (a "
                                 f"config with head_dim_v={dv_dim} takes it)")
        alibi = alibi_slopes is not None
        hargs, hops = _packed_hook_args("flash_attention_varlen_backward", alibi_slopes,
                                        mod_args, n, hq, Q)
        if check_seqlens and not device_write.stream_capturing(arrays.stream_handle(Q)):
            check_seqlen_values(arrays.to_host(CuQ), arrays.to_host(CuK), Q.shape[0], K.shape[0],
                                mq, mk)
        results = []
        for arr, like, G, name in zip((dq, dk, dv), (Q, K, V), grads, ("dq", "dk", "dv")):
            if arr is None:
                arr = arrays.zeros(Q, like.shape, dtype)
                G = describe(arr, name)
            results.append((arr, G))
        if not (n and hq and (mq or mk)):
            return tuple(a for a, _ in results)
        cfg = config or choose_backward_config(d, dtype, bool(deterministic), dv_dim)
        # lse2 / delta per sequence, 16-byte aligned, padded after each (bk.varlen_row_start)
        rows = bk.varlen_rows(Q.shape[0], n, bk.varlen_pad(cfg))
        scratch = [("delta", (1, hq, rows)), ("lse2", (1, hq, rows))]
        if bw.varlen_atomic(cfg, bool(deterministic)):    # dQ by bulk reductions
            scratch.append(("dq_acc", bw.varlen_dq_acc_shape(cfg, hq, Q.shape[0], n)))
        variant = at.is_variant(win, cap) or user or alibi
        kmods = (score_mod, score_mod_grad, mask_mod, n_args, alibi)
        with at.user_errors((win, cap, score_mod, mask_mod) if user else None):
            views, copies = {}, []
            for name, op in (("q", Q), ("k", K), ("v", V), ("o", Out), ("do", dO)):
                if not at.readable(op):
                    op = describe(arrays.copy_aligned(op), op.name)
                    copies.append(op)
                views[name] = packed_view(op)
            for name, (_, G) in zip(("dq", "dk", "dv"), results):
                views[name] = packed_view(G)
            views["lse"] = packed_lse_view(Lse)
            if dLse is not None:
                views["dlse"] = packed_lse_view(dLse)
            for name, shape in scratch:
                arr = arrays.empty(Q, shape, "float32")
                copies.append(describe(arr, name))
                views[name] = at.bhsd_view(copies[-1], "bhsd")
            views["placeholder3"] = arrays.placeholder(3)
            views["placeholder4"] = arrays.placeholder(4)
            seqs = (at.device_view(arrays.raw_view(CuQ, hook=True)),
                    at.device_view(arrays.raw_view(CuK, hook=True)))
            stream = arrays.stream_handle(Q)
            gen = bw if isinstance(cfg, WgmmaBackwardConfig) else bk
            plans = gen.plans(cfg, False, bool(deterministic), views, scale, win, cap,
                              kmods if variant else (None, None, None), (seqs, tuple(hargs)),
                              varlen=(n, mq, mk))
            for plan, args in plans:
                plan.launch(stream, args)
            device_write.keep_during_capture(stream, *copies)
        return tuple(a for a, _ in results)


def choose_backward_config(head_dim: int, dtype: str, deterministic: bool,
                           head_dim_v=None):
    """The backward config packed sequences run with: the built-in one
    (:func:`tilepy.ops.attention_backward.choose_config` — on sm_90 the wgmma kernels'
    where the head dim takes them: without ``deterministic`` and from
    :data:`BACKWARD_FUSED_MIN_HEAD_DIM` up (q's or v's head dim) the warp-specialised kernel
    with dQ by bulk reductions, else the pair whose dQ has its own kernel); ``head_dim_v``:
    v's head dim where it differs."""
    from .attention_backward import choose_config as backward_choice

    wider = head_dim if head_dim_v is None else max(head_dim, head_dim_v)
    fused = not deterministic and wider >= BACKWARD_FUSED_MIN_HEAD_DIM
    return backward_choice(head_dim, dtype, not fused, variant=True, wgmma=BACKWARD_WGMMA,
                           head_dim_v=head_dim_v)


#: Whether packed sequences' backward takes sm_90's wgmma kernels by default (False: the
#: mma.sync ones everywhere).
BACKWARD_WGMMA = True
#: The smallest head dim at which packed sequences' backward without ``deterministic`` takes
#: the warp-specialised wgmma kernel where the fixed-length backward does (dQ by bulk
#: reductions into a float32 accumulator, each sequence in 64-row blocks of its own); below,
#: the pair whose dQ has its own kernel. At head_dim 128 the two ran equally fast over
#: packed sequences on an H100 (the fused kernel's loop spills there: its walk derives from
#: the loaded lengths), so the deterministic pair stays; past 128 the alternative is the
#: mma.sync kernels (4x slower).
BACKWARD_FUSED_MIN_HEAD_DIM = 136


__all__ = ["flash_attention_varlen", "flash_attention_varlen_backward"]
