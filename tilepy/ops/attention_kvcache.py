"""``tilepy.flash_attention_with_kvcache``: attention of a few new query rows per sequence
against a KV cache, contiguous or paged (FlashAttention-2's ``flash_attn_with_kvcache``).

The decoding kernel (:mod:`tilepy.ops.attention_decode_mma_sync`, mma.sync): the query
heads of one KV head packed into one 16-row tile (K and V read once for all of them), the keys
cut into ``num_splits`` runs handled by separate warps (flash-decoding), whose float32
partials a second small kernel merges by their log-sum-exps (opt-in, :data:`FUSED_MERGE`:
each row tile's last run merges them inside the decoding kernel — measured slower). Each
block reads its sequence's length (and, paged, its block table) on the device, so the same
launches — and a CUDA graph that captured them — serve every step of a generation loop. New
keys and values (``k`` / ``v``) are first written into the cache by a small copy kernel
(:func:`append_kernel`) on the same stream. An
:class:`~tilepy.ops.attention_mma_sync.AttentionConfig` as ``config`` runs the forward kernel
instead (its ``cache`` generator parameter: one block per query block and query head, no
split).

Not yet: the Hopper (TMA / wgmma) kernels.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .. import arrays, launch
from ..arrays import describe
from ..kcache import cached_jit
from ..launch import LaunchPlan
from ..tile import device_write
from ..tile.attention import score_hook
from . import attention as at
from . import attention_mma_sync as fa
from . import attention_decode_mma_sync as dec
from .attention_decode_mma_sync import DecodeConfig
from .attention_mma_sync import HEAD_DIMS, AttentionConfig


def flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None,
                                 block_table=None, causal=True, scale=None, window=None,
                                 softcap=0.0, num_splits=None, return_lse=False, out=None,
                                 check_seqlens=True, config=None):
    """Attention of ``q`` against the first ``cache_seqlens[b]`` keys of each sequence's
    cache (plus the ``k`` / ``v`` appended by this call).

    * ``q`` (batch, seq_q, heads_q, head_dim), float16 / bfloat16; ``out`` and the result
      have its shape. ``seq_q`` is typically 1 (decoding) to ~16 (speculative decoding).
    * ``k_cache`` / ``v_cache``: a contiguous cache (batch, capacity, heads_kv, head_dim), or
      with ``block_table`` a paged one (pages, page_size, heads_kv, head_dim), ``page_size`` a
      multiple of 16; ``heads_q`` a multiple of ``heads_kv`` (GQA / MQA).
    * ``cache_seqlens`` (batch,) int32 on the inputs' device: the valid keys of each
      sequence before this call (0: none; a row that sees no key gives zeros, LSE -inf).
    * ``block_table`` (batch, max_pages) int32: key ``j`` of sequence ``b`` is row ``j %
      page_size`` of page ``block_table[b, j // page_size]``; the capacity is ``max_pages ·
      page_size``.
    * ``k`` / ``v`` (batch, seq_new, heads_kv, head_dim): written into the cache at positions
      ``cache_seqlens[b] … cache_seqlens[b] + seq_new - 1`` (through the block table when
      paged) before the attention, which then sees ``cache_seqlens[b] + seq_new`` keys.
      ``cache_seqlens`` itself is not changed (the caller advances it).
    * ``causal`` (default True), ``window``, ``softcap``: as :func:`tilepy.flash_attention`'s,
      aligned to each sequence's bottom-right diagonal: query row ``i`` sits at position
      ``seqlen_b - seq_q + i`` of its sequence.
    * ``check_seqlens=True`` copies ``cache_seqlens`` (and the block table) to the host once
      per call and raises ``ValueError`` for a length past the capacity (with the appended
      tokens) or a page outside ``0 … pages - 1`` — a synchronisation with the stream;
      ``False`` skips it, as does a call being captured into a CUDA graph. Unchecked, the
      kernels never read or write out of bounds: lengths are clamped into ``0 … capacity``,
      table entries into ``0 … pages - 1``, and appended tokens past the capacity are
      dropped.
    * ``return_lse=True``: ``(out, lse)``, ``lse`` float32 (batch, heads_q, seq_q).
    * ``num_splits``: the keys of each sequence are cut into this many runs, each run by its
      own blocks, merged afterwards (flash-decoding; ``1``: one pass, no merge). ``None``
      chooses from the SM count, the batch, the KV heads and the capacity
      (:func:`tilepy.ops.attention_decode_mma_sync.choose_splits`): the fewest within 2 % of
      the least modelled time of the waves of blocks over the SMs, each as long as its
      longest run (runs differ by at most one key block), each run at least 4 key blocks
      long, a multiple of the config's ``warps``; a given count is rounded up to such a
      multiple. The results agree to
      rounding whatever the value.
    * ``config``: a :class:`~tilepy.ops.attention_decode_mma_sync.DecodeConfig` (default: 32-key
      blocks, three stages: :func:`choose_config`), or an
      :class:`~tilepy.ops.attention_mma_sync.AttentionConfig` for the forward kernel (no
      split). A paged cache's ``page_size``: the forward kernel's ``block_n`` must divide it,
      the decoding kernel's must divide it or be a multiple of it (a key block then gathers
      its pages).
    Errors are raised before anything is launched.
    """
    ops = (q, k_cache, v_cache, cache_seqlens, block_table, k, v, out)
    fps = [arrays.fingerprint(x) for x in ops]
    cached, key = _PLANS.lookup((tuple(f for f, _ in fps), causal, scale, window, softcap,
                                 num_splits, return_lse, config, PDL, COMBINE_WARPS,
                                 FUSED_MERGE))
    if cached is not None:
        call, stream, checker = cached
        if check_seqlens and checker is not None and not device_write.stream_capturing(
                stream()):
            checker(cache_seqlens, block_table)
        made = call(stream(), [p for _, p in fps] + [0] * (len(SLOTS) - len(ops)))
        out = made.get(OUT, out)
        return (out, made[LSE]) if return_lse else out
    return _run(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, scale, window,
                softcap, num_splits, return_lse, out, check_seqlens, config, key)


#: The operand slots of a recorded call (:class:`tilepy.launch.CallPlan`): the caller's
#: arrays in the order of the signature, then those each call makes.
SLOTS = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "k", "v", "out", "lse",
         "parts", "part_lse")
Q_, KC, VC, SEQ, TABLE, KN, VN, OUT, LSE, PARTS, PLSE = range(len(SLOTS))

_PLANS = launch.PlanCache()

#: Programmatic dependent launch of the split path's combine kernel (sm_90): launched with
#: programmatic stream serialisation, it may begin while the decoding kernel finishes (whose
#: warps let it, their key loops done) and waits for that kernel's results before reading
#: them — the launch gap between the two overlapped. False launches the two in plain stream
#: order (the same results, bit for bit).
PDL = True

#: Opt-in (off): the split path's merge inside the decoding kernel — the last split of each
#: row tile to finish merges the tile's partials
#: (:func:`tilepy.ops.attention_decode_mma_sync.decode_kernel` with ``fused``), so no combine
#: kernel runs, where the warps' shared memory holds the merge's weights
#: (:func:`~tilepy.ops.attention_decode_mma_sync.fused_fits`). Measured on an H100 it is
#: slower wherever the keys are split (0.34–0.92× the combine kernel's bandwidth; worst at
#: many splits and four query rows): one warp walks every split of its tile at the end of the
#: launch, a chain of dependent loads on the critical path, where the combine kernel spreads
#: the rows over many warps. The same results either way, to float32 rounding (each way the
#: same bits on every run).
FUSED_MERGE = False

#: Warps of the split path's combine kernel block (4, or 8: more warps share a row of many
#: splits, :func:`tilepy.ops.attention_decode_mma_sync.combine_ways`): 8 on a GPU (measured:
#: 1.01–1.06× four at one sequence's 32–64 splits, the same elsewhere), the simulator's 2.
COMBINE_WARPS = dec.COMBINE_WARPS


def _run(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, scale, window, softcap,
         num_splits, return_lse, out, check_seqlens, config, key):
    """The first call of a signature: every check, the launches, and the recorded call
    (:data:`_PLANS`) that later calls of the signature replay from their pointers."""
    Q, K, V, Out, dims, device = check_arguments(q, k_cache, v_cache, out, block_table)
    with arrays.on_device(device):
        b, sq, hq, hk, d, paged = dims
        scale = at.check_scale(scale, d)
        Seq = check_seqlens_array(cache_seqlens, b, Q)
        Table = describe_table(block_table, b, Q) if paged else None
        Kn, Vn, sn = check_new(k, v, b, hk, d, Q)
        win, cap = at.check_variant(causal, window, softcap)
        page = K.shape[1] if paged else 0
        capacity = Table.shape[1] * page if paged else K.shape[1]
        cfg = config if config is not None else choose_config(d, Q.dtype, sq, page, hq // hk)
        check_config(cfg, d, Q.dtype, page)
        splits = check_splits(num_splits, cfg)
        if max(b, hq, hk) > launch.MAX_GRID_YZ:
            raise NotImplementedError(f"flash_attention_with_kvcache: at most "
                                      f"{launch.MAX_GRID_YZ} sequences and heads (got {b} and "
                                      f"{hq})")
        stream = arrays.stream_handle(Q)
        checker = functools.partial(check_call_values, seq_new=sn, capacity=capacity,
                                    pages=K.shape[0] if paged else 0)
        if check_seqlens and b and not device_write.stream_capturing(stream):
            checker(cache_seqlens, block_table)
        allocs = {}
        if out is None:
            allocs[OUT] = arrays.allocator(Q, Q.shape, Q.dtype)
        if return_lse:
            allocs[LSE] = arrays.allocator(Q, (b, hq, sq), "float32")
        steps = []      # (plan, args, sources)
        made = {}
        ptrs = {Q_: Q.byte_pointer(), KC: K.byte_pointer(), VC: V.byte_pointer(),
                SEQ: Seq.byte_pointer()}
        if paged:
            ptrs[TABLE] = Table.byte_pointer()
        seq_v = at.device_view(arrays.raw_view(Seq, hook=True))
        table_v = at.device_view(arrays.raw_view(Table, hook=True)) if paged else None
        caches = (at.bhsd_view(K, "bshd"), at.bhsd_view(V, "bshd"))
        if sn and b:
            ptrs[KN], ptrs[VN] = Kn.byte_pointer(), Vn.byte_pointer()
            steps.append(append(caches, (at.bhsd_view(Kn, "bshd"), at.bhsd_view(Vn, "bshd")),
                                seq_v, table_v))
        if b and hq and sq:
            if isinstance(cfg, DecodeConfig):
                if splits is None:
                    tiles = -(-(sq * (hq // hk)) // dec.ROWS)
                    splits = dec.choose_splits(b, hk, tiles, -(-capacity // cfg.block_n),
                                               launch.sm_count(launch.SIM_SMS),
                                               dec.resident_splits(cfg), cfg.warps)
                splits = -(-splits // cfg.warps) * cfg.warps   # each warp of a block one
                if splits > 1:
                    allocs[PARTS] = arrays.allocator(Q, (splits, b, hk, sq, hq // hk, d),
                                                     "float32")
                    allocs[PLSE] = arrays.allocator(Q, (splits, b, hk, hq // hk, sq),
                                                    "float32")
        for k_, alloc in allocs.items():
            made[k_], ptrs[k_] = alloc()
        if out is not None:
            ptrs[OUT] = Out.byte_pointer()
        O = describe(made.get(OUT, out), "out")
        L = describe(made[LSE], "lse") if return_lse else None
        if b and hq and sq:
            keys = (seq_v, np.int64(sn)) + ((table_v,) if paged else ())
            if isinstance(cfg, DecodeConfig):
                steps += decode(cfg, Q, caches, O, L, keys, scale, win, cap, paged, splits,
                                made.get(PARTS), made.get(PLSE))
            else:
                steps.append(forward(cfg, Q, caches, O, L, keys, scale, causal, win, cap,
                                     paged))
        for plan, args, _ in steps:
            plan.launch(stream, args)
        bound = [(plan.bind([None if s is None else (s, ptrs[s]) for s in sources]), ())
                 for plan, _, sources in steps]
        _PLANS.put(key, (launch.CallPlan(bound, allocs), arrays.stream_getter(Q),
                         checker if b else None))
        out = made.get(OUT, out)
        return (out, made[LSE]) if return_lse else out


def forward(cfg, Q, caches, Out, lse, keys, scale, causal, win, cap, paged):
    """``(plan, args, sources)`` of the mma.sync forward kernel with its ``cache`` parameter: a
    block per (query block, query head, sequence), all of the sequence's keys (an
    :class:`AttentionConfig` given as ``config``); ``sources``: the slot (:data:`SLOTS`) of
    each array argument, None for a constant one."""
    kind = "paged" if paged else "contiguous"
    if at.is_variant(win, cap):
        kern = fa.attention_kernel(cfg, False, lse is not None, win,
                                   score_hook(cap) if cap else None, cache=kind)
    else:
        kern = fa.attention_kernel(cfg, bool(causal), lse is not None, cache=kind)
    lse_v = at.device_view(arrays.raw_view(lse)) if lse is not None else arrays.placeholder(3)
    plan, args = fa.plan(kern, cfg, at.bhsd_view(Q, "bshd"), *caches,
                         at.bhsd_view(Out, "bshd"), lse_v, scale, hargs=(keys, ()),
                         chunks=False)
    sources = [Q_, KC, VC, OUT, LSE if lse is not None else None, SEQ] + \
        ([TABLE] if paged else [])
    return plan, args, sources


def decode(cfg, Q, caches, Out, lse, keys, scale, win, cap, paged, splits, parts, part_lse,
           trace=None):
    """``(plan, args, sources)`` of each launch of the decoding kernel
    (:mod:`tilepy.ops.attention_decode_mma_sync`): the query heads of a KV head packed into one
    tile, the keys split ``splits`` ways; with more than one split, into the float32
    ``parts`` / ``part_lse``, merged by the combine kernel (a second launch) or, with
    :data:`FUSED_MERGE` where it fits, by each row tile's last split (one launch). ``trace``: the
    decoding kernel is the traced one, marking into this array (``decode_kernel(...,
    trace=True)``; a measuring tool's, not the op's)."""
    b, sq, hq, d = Q.shape
    hk = caches[0].shape[1]
    q5 = at.device_view(dec.packed_view(arrays.raw_view(Q), hk))
    o5 = at.device_view(dec.packed_view(arrays.raw_view(Out), hk))
    lse4 = at.device_view(dec.lse_view(arrays.raw_view(lse), hk)) \
        if lse is not None else arrays.placeholder(4)
    lse_src = LSE if lse is not None else None
    keys_src = [SEQ] + ([TABLE] if paged else [])
    split = splits > 1      # (several warps: at least that many splits)
    fused = split and FUSED_MERGE and dec.fused_fits(cfg, splits)
    pdl = split and not fused and PDL and (arrays.SIMULATOR or
                                           launch.compute_capability() >= (9, 0))
    page = caches[0].shape[2] if paged else 0
    kern = dec.decode_kernel(cfg, win[0], win[1], lse is not None, split, cap, paged,
                             trace=trace is not None, trigger=pdl, fused=fused,
                             page_rows=page if page < cfg.block_n else 0)
    if not split:
        plan, args = dec.plan(kern, cfg, q5, *caches, o5, lse4, scale, keys, 1, trace=trace)
        return [(plan, args, [Q_, KC, VC, OUT, lse_src] + keys_src)]
    p_raw = arrays.raw_view(describe(parts, "parts"))
    pl_raw = arrays.raw_view(describe(part_lse, "part_lse"))
    p_v, pl_v = at.device_view(p_raw), at.device_view(pl_raw)
    if fused:
        alloc = arrays.byte_allocator(Q)
        p2, l2, counters, counter = dec.fused_views(p_raw, pl_raw, alloc)
        fin = (at.device_view(p2), at.device_view(l2), o5, lse4, counters)
        plan, args = dec.plan(kern, cfg, q5, *caches, p_v, pl_v, scale, keys, splits,
                              trace=trace, fin=fin, counter=counter, alloc=alloc)
        return [(plan, args, [Q_, KC, VC, PARTS, PLSE] + keys_src +
                 [PARTS, PLSE, OUT, lse_src, None])]
    plan, args = dec.plan(kern, cfg, q5, *caches, p_v, pl_v, scale, keys, splits, trace=trace)
    warps = COMBINE_WARPS
    ways = dec.combine_ways(splits, warps)
    comb = dec.combine_kernel(d, cfg.dtype, lse is not None, wait=pdl, ways=ways, warps=warps)
    cargs = (p_v, pl_v, o5, lse4)
    cplan = LaunchPlan(comb, cargs, dec.combine_grid(sq, hq // hk, hk, b, ways, warps),
                       dec.combine_threads(warps), dependent=pdl)
    return [(plan, args, [Q_, KC, VC, PARTS, PLSE] + keys_src),
            (cplan, cargs, [PARTS, PLSE, OUT, lse_src])]


def decode_launches(q, k_cache, v_cache, cache_seqlens, *, block_table=None, causal=True,
                    num_splits=None, config=None, trace=None):
    """What :func:`flash_attention_with_kvcache` launches for these arguments (no new keys,
    no LSE), built but not launched, for a measuring tool: ``(steps, out, cfg, splits,
    keep)`` with
    ``steps`` the ``(plan, args)`` of the decoding kernel — the traced one writing into
    ``trace`` when given (a uint64 array of :mod:`tilepy.tile.trace` rows, one per warp:
    ``dec.grid(...)`` blocks times ``cfg.warps``) — and, with splits not merged in it, the
    combine kernel;
    ``out`` the new output array they write, ``keep`` the split partials' arrays they also
    write (hold them as long as the plans are used). The op's checks and choices (config,
    splits)."""
    Q, K, V, _, dims, device = check_arguments(q, k_cache, v_cache, None, block_table)
    with arrays.on_device(device):
        b, sq, hq, hk, d, paged = dims
        scale = at.check_scale(None, d)
        Seq = check_seqlens_array(cache_seqlens, b, Q)
        Table = describe_table(block_table, b, Q) if paged else None
        page = K.shape[1] if paged else 0
        capacity = Table.shape[1] * page if paged else K.shape[1]
        cfg = config if config is not None else choose_config(d, Q.dtype, sq, page, hq // hk)
        check_config(cfg, d, Q.dtype, page)
        if not isinstance(cfg, DecodeConfig):
            raise ValueError("decode_launches: the decoding kernel's config (a DecodeConfig)")
        splits = check_splits(num_splits, cfg)
        if splits is None:
            splits = dec.choose_splits(b, hk, -(-(sq * (hq // hk)) // dec.ROWS),
                                       -(-capacity // cfg.block_n), launch.sm_count(launch.SIM_SMS),
                                       dec.resident_splits(cfg), cfg.warps)
        splits = -(-splits // cfg.warps) * cfg.warps
        win, cap = at.check_variant(causal, None, 0.0)
        out = arrays.empty(Q, Q.shape, Q.dtype)
        parts = arrays.empty(Q, (splits, b, hk, sq, hq // hk, d), "float32") \
            if splits > 1 else None
        part_lse = arrays.empty(Q, (splits, b, hk, hq // hk, sq), "float32") \
            if splits > 1 else None
        keys = (at.device_view(arrays.raw_view(Seq, hook=True)), np.int64(0)) + (
            (at.device_view(arrays.raw_view(Table, hook=True)),) if paged else ())
        steps = decode(cfg, Q, (at.bhsd_view(K, "bshd"), at.bhsd_view(V, "bshd")),
                       describe(out, "out"), None, keys, scale, win, cap, paged, splits,
                       parts, part_lse, trace=trace)
        return [(plan, args) for plan, args, _ in steps], out, cfg, splits, (parts, part_lse)


def output_spec(q, k_cache, v_cache, cache_seqlens, *, block_table=None, return_lse=False):
    """``(out shape, lse shape or None)`` after the checks that read only metadata (the
    registered operator's fake implementation)."""
    Q, _, _, _, dims, _ = check_arguments(q, k_cache, v_cache, None, block_table, data=False)
    b, sq, hq = dims[:3]
    check_seqlens_array(cache_seqlens, b, Q)
    return Q.shape, ((b, hq, sq) if return_lse else None)


def choose_config(head_dim: int, dtype: str, seq_q: int, page_size: int = 0, group: int = 1):
    """The built-in config. Up to :data:`DECODE_ROWS` packed rows (``seq_q`` times the query
    heads of a KV head, ``group``): the decoding kernel, 32-key blocks (16 in the simulator),
    fewer when a page size neither divides nor is a multiple of them (48: 16-key blocks; a
    16-key page: each 32-key block gathers two pages), four stages (three
    key blocks in flight while one is computed). More (a prefill against a cache): the
    forward kernel, 64-row query blocks of four warps. Past head_dim 128 the key blocks are
    halved (16 keys, four stages; the forward's 32), so that shared memory stays within the
    99 KB of sm_86 / sm_89 (72 KB and 96 KB at head_dim 256)."""
    wide = head_dim > 128
    if seq_q * group > DECODE_ROWS:
        bm, bn = (at.SIM_BLOCK_M, at.SIM_BLOCK_N) if arrays.SIMULATOR else (64, 32 if wide
                                                                              else 64)
        while page_size and page_size % bn:
            bn //= 2
        return AttentionConfig(head_dim, bm, bn, 16, dtype)
    bn = at.SIM_BLOCK_N if arrays.SIMULATOR else 16 if wide else 32
    # a page smaller than a key block and dividing it: the block gathers its pages
    while page_size and page_size % bn and bn % page_size:
        bn //= 2
    return DecodeConfig(head_dim, bn, 3 if bn >= 32 else 4, dtype)


#: The most packed rows (seq_q · query heads per KV head) the built-in config runs on the
#: decoding kernel (four of its 16-row tiles); more run the forward kernel.
DECODE_ROWS = 64


def check_config(cfg, d: int, dtype: str, page: int) -> None:
    """``TypeError`` / ``ValueError`` unless ``cfg`` is a :class:`DecodeConfig` (the decoding
    kernel) or an :class:`AttentionConfig` (the forward kernel, one block per query head) of
    the inputs' head_dim and dtype whose ``block_n`` divides a paged cache's ``page`` (0: not
    paged) — or, the decoding kernel's, is a multiple of it (a key block then gathers several
    pages)."""
    if not isinstance(cfg, (DecodeConfig, AttentionConfig)):
        raise TypeError(f"config must be a tilepy.ops.attention_decode_mma_sync.DecodeConfig "
                        f"or a tilepy.ops.attention_mma_sync.AttentionConfig, got "
                        f"{type(cfg).__name__}")
    if (cfg.head_dim, cfg.dtype) != (d, dtype):
        raise ValueError(f"config is for head_dim {cfg.head_dim} {cfg.dtype}; the inputs are "
                         f"head_dim {d} {dtype}")
    if page and page % cfg.block_n:
        if not isinstance(cfg, DecodeConfig):
            raise ValueError(f"config.block_n = {cfg.block_n} must divide the page size {page}")
        if cfg.block_n % page:
            raise ValueError(f"config.block_n = {cfg.block_n} must divide the page size {page} "
                             f"or be a multiple of it")


#: The most splits of the keys ``num_splits`` may ask for.
MAX_SPLITS = dec.MAX_COMBINE_SPLITS


def check_num_splits(num_splits):
    """``num_splits`` as an int, or None; ``TypeError`` / ``ValueError`` for anything but
    None or an int in ``1 … MAX_SPLITS``."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be an int or None, got "
                        f"{type(num_splits).__name__} {num_splits!r}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1 … {MAX_SPLITS} (or None: chosen from the "
                         f"SM count, batch and capacity), got {num_splits}")
    return int(num_splits)


def check_splits(num_splits, cfg):
    """:func:`check_num_splits`, and ``ValueError`` above 1 with the forward kernel's config;
    None (chosen per call) becomes 1 there."""
    num_splits = check_num_splits(num_splits)
    if num_splits is None:
        return None if isinstance(cfg, DecodeConfig) else 1
    if num_splits > 1 and not isinstance(cfg, DecodeConfig):
        raise ValueError("num_splits > 1 needs the decoding kernel (a DecodeConfig); an "
                         "AttentionConfig runs the forward kernel, which does not split")
    return int(num_splits)


def check_arguments(q, k_cache, v_cache, out, block_table, data: bool = True):
    """``(Q, K, V, Out, (batch, seq_q, heads_q, heads_kv, head_dim, paged), device)``;
    errors name the argument. ``data=False``: metadata only (not the alignment of the data
    pointers: fake tensors have none)."""
    Q = describe(q, "q", allow_float32=False)
    K = describe(k_cache, "k_cache", allow_float32=False)
    V = describe(v_cache, "v_cache", allow_float32=False)
    if not (Q.dtype == K.dtype == V.dtype):
        raise TypeError(f"q, k_cache and v_cache must have the same dtype; got q {Q.dtype}, "
                        f"k_cache {K.dtype}, v_cache {V.dtype}")
    for op, what in ((Q, "(batch, seq_q, heads_q, head_dim)"),
                     (K, "(batch, capacity, heads_kv, head_dim) or paged (pages, page_size, "
                         "heads_kv, head_dim)"), (V, "like k_cache")):
        if op.ndim != 4:
            raise ValueError(f"{op.name} must be 4-D {what}, got shape {op.shape}")
    if K.shape != V.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {K.shape} and "
                         f"{V.shape}")
    (b, sq, hq, d), (nb, page, hk, dk) = Q.shape, K.shape
    paged = block_table is not None
    if d != dk:
        raise ValueError(f"head_dim differs: q {d}, k_cache {dk}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim {d} is not supported; supported: the multiples of 8 from "
                         f"{HEAD_DIMS[0]} to {HEAD_DIMS[-1]}")
    if hk < 1 or hq % hk:
        raise ValueError(f"heads_q ({hq}) must be a multiple of heads_kv ({hk})")
    if paged:
        if page % 16 or page < 16:
            raise ValueError(f"the page size (k_cache.shape[1] = {page}) must be a positive "
                             f"multiple of 16")
    elif nb != b:
        raise ValueError(f"k_cache has {nb} sequences, q {b} (a paged cache needs "
                         f"block_table)")
    Out = describe(out, "out", allow_float32=False) if out is not None else None
    arrays.check_distinct(Out)
    if Out is not None and (Out.shape != Q.shape or Out.dtype != Q.dtype):
        raise ValueError(f"out must have q's shape {Q.shape} and dtype {Q.dtype}, got "
                         f"{Out.shape} {Out.dtype}")
    for op in (Q, K, V) + ((Out,) if Out is not None else ()) if data else ():
        if not at.readable(op):
            raise ValueError(f"{op.name} must have a unit stride along head_dim and 16-byte "
                             f"aligned other strides and start (a cache is read and written "
                             f"in place), got strides {op.strides}")
    device = arrays.same_device(Q, K, V, Out)
    return Q, K, V, Out, (b, sq, hq, hk, d, paged), device


def _int32(x, name: str, ndim: int, Q):
    """``x`` as an int32 Operand of ``ndim`` dimensions on q's device; errors name it."""
    op = describe(x, name, dtypes=arrays.HOOK_DTYPES)
    if op.dtype != "int32":
        raise TypeError(f"{name} must be int32 (FlashAttention's convention), got {op.dtype}")
    if op.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {op.shape}")
    arrays.same_device(Q, op)
    return op


def check_seqlens_array(cache_seqlens, batch: int, Q):
    """``cache_seqlens`` as an Operand: int32, (batch,), on q's device."""
    op = _int32(cache_seqlens, "cache_seqlens", 1, Q)
    if op.shape[0] != batch:
        raise ValueError(f"cache_seqlens must have one entry per sequence ({batch}), got "
                         f"shape {op.shape}")
    return op


def describe_table(block_table, batch: int, Q):
    """``block_table`` as an Operand: int32, (batch, max_pages >= 1), on q's device."""
    op = _int32(block_table, "block_table", 2, Q)
    if op.shape[0] != batch or op.shape[1] < 1:
        raise ValueError(f"block_table must be ({batch}, max_pages >= 1), got shape "
                         f"{op.shape}")
    return op


def check_new(k, v, batch: int, hk: int, d: int, Q):
    """``(Kn, Vn, seq_new)`` of the appended tokens (``(None, None, 0)`` without)."""
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: pass both or neither")
    if k is None:
        return None, None, 0
    Kn = describe(k, "k", allow_float32=False)
    Vn = describe(v, "v", allow_float32=False)
    for op in (Kn, Vn):
        if op.dtype != Q.dtype:
            raise TypeError(f"{op.name} must have q's dtype {Q.dtype}, got {op.dtype}")
        if op.ndim != 4 or op.shape[0] != batch or op.shape[2:] != (hk, d):
            raise ValueError(f"{op.name} must be ({batch}, seq_new, {hk}, {d}), got shape "
                             f"{op.shape}")
    if Kn.shape != Vn.shape:
        raise ValueError(f"k and v must have the same shape, got {Kn.shape} and {Vn.shape}")
    arrays.same_device(Q, Kn, Vn)
    return Kn, Vn, Kn.shape[1]


def check_call_values(cache_seqlens, block_table, *, seq_new: int, capacity: int,
                      pages: int) -> None:
    """:func:`check_values` on the host copies of a call's lengths and block table (None: not
    paged) — a synchronisation with the caller's stream."""
    seqlens = arrays.to_host(describe(cache_seqlens, "cache_seqlens", dtypes=arrays.HOOK_DTYPES))
    table = None if block_table is None else arrays.to_host(
        describe(block_table, "block_table", dtypes=arrays.HOOK_DTYPES))
    check_values(seqlens, table, seq_new, capacity, pages)


def check_values(seqlens, table, seq_new: int, capacity: int, pages: int) -> None:
    """``ValueError`` unless every ``seqlens + seq_new`` lies in ``0 … capacity`` and every
    table entry (paged) that those lengths use lies in ``0 … pages - 1`` (the entries past
    them are never read: padding such as -1 is allowed)."""
    lens = seqlens.astype(np.int64)
    if (lens < 0).any():
        z = int(np.argmax(lens < 0))
        raise ValueError(f"cache_seqlens[{z}] = {int(lens[z])} is negative")
    if (lens + seq_new > capacity).any():
        z = int(np.argmax(lens + seq_new > capacity))
        raise ValueError(f"cache_seqlens[{z}] = {int(lens[z])}" + (
            f" plus {seq_new} appended tokens" if seq_new else "") +
            f" exceeds the cache's capacity of {capacity} keys")
    if table is not None:
        # only the pages the lengths use: entries past them (padding, -1) are never read
        page = capacity // table.shape[1]
        used = np.arange(table.shape[1])[None, :] < -(-(lens + seq_new) // page)[:, None]
        bad = used & ((table < 0) | (table >= pages))
        if bad.any():
            z, j = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"block_table[{z}, {j}] = {int(table[z, j])} is not a page "
                             f"(0 … {pages - 1})")


@functools.cache
def append_kernel(paged: bool):
    """``kernel(k_cache, v_cache, k, v, seqlens, table)`` (caches and new tokens as 4-D
    (B or pages, heads, S, D) 16-bit views, ``table`` a (B, max_pages) int32 view or, not
    paged, unused): block ``(i, h, b)`` writes new token ``i`` of head ``h`` at position
    ``seqlens[b] + i`` of sequence ``b``'s cache — through its page when ``paged``, the page
    clamped into range — and nothing past the capacity; one thread per element."""

    @cached_jit
    def kernel(kc, vc, kn, vn, seqlens, table):
        i = cuda.blockIdx.x
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        e = cuda.threadIdx.x
        pos = np.int64(seqlens[b]) + i
        if paged:
            page = kc.shape[2]
            cap = np.int64(table.shape[1]) * page
        else:
            cap = np.int64(kc.shape[2])
        if pos < 0 or pos >= cap or e >= kc.shape[3]:
            return
        if paged:
            pg = min(max(np.int64(table[b, pos // page]), np.int64(0)),
                     np.int64(kc.shape[0] - 1))
            r = pos % page
            kc[pg, h, r, e] = kn[b, h, i, e]
            vc[pg, h, r, e] = vn[b, h, i, e]
        else:
            kc[b, h, pos, e] = kn[b, h, i, e]
            vc[b, h, pos, e] = vn[b, h, i, e]

    return kernel


def append(caches, new, seq_v, table_v):
    """``(plan, args, sources)`` of :func:`append_kernel` for the new tokens ``new`` into
    ``caches`` (4-D views)."""
    kn = new[0]
    b, hk, sn, d = kn.shape
    paged = table_v is not None
    table = table_v if paged else arrays.placeholder(2)
    args = (*caches, *new, seq_v, table)
    return (LaunchPlan(append_kernel(paged), args, (sn, hk, b), d), args,
            [KC, VC, KN, VN, SEQ, TABLE if paged else None])
