"""``tilepy.flash_attention_varlen``: packed sequences of different lengths (zero-length ones
included) against float64 per sequence in the simulator, with GQA, causal (each sequence's
own bottom-right diagonal), a window, a soft cap, ALiBi per sequence and a user mask reading
``mod_args``; rows outside every sequence left untouched; the LSE in (heads, total) order;
bad input refused before launch. The kernel's offline compile: test_ops_attention.py."""

from __future__ import annotations

import numpy as np
import pytest

from tilepy import flash_attention_varlen
from tilepy.ops.attention_backward_mma_sync import BackwardConfig
from tilepy.ops.attention_backward_wgmma import WgmmaBackwardConfig
from tilepy.ops.attention_mma_sync import AttentionConfig
from tilepy.ops.attention_varlen import flash_attention_varlen_backward
from tilepy.ops.attention_wgmma import WgmmaAttentionConfig

from test_ops_attention import NP, check, check_lse, f64, rand, reference

sim = pytest.mark.sim


def cumulative(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def varlen_reference(q, k, v, cu_q, cu_k, causal, window=(-1, -1), cap=0.0, alibi=None,
                     mask_mod=None, mod_args=()):
    """float64 ``(out, lse)`` of each sequence alone (:func:`test_ops_attention.reference` on
    a batch of one, bshd), packed back: out (total_q, Hq, D) and lse (Hq, total_q); rows
    outside every sequence NaN."""
    out = np.full((*q.shape[:2], v.shape[2]), np.nan)
    lse = np.full((q.shape[1], q.shape[0]), np.nan)
    for z in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[z], cu_q[z + 1]), slice(cu_k[z], cu_k[z + 1])
        mm = None if mask_mod is None else (
            lambda b, h, i, j, *a, z=z: mask_mod(z, h, i, j, *a))
        slopes = None if alibi is None else (alibi[z] if alibi.ndim == 2 else alibi)
        o, l = reference(q[None, rq], k[None, rk], v[None, rk], causal, None, "bshd", window,
                         cap, mask_mod=mm, alibi=slopes, mod_args=mod_args)
        out[rq], lse[:, rq] = o[0], l[0]
    return out, lse


def run(lq, lk, hq, hk, d, dtype, causal, pad=3, dv=None, **kw):
    """Pack random sequences of lengths ``lq`` / ``lk`` (``pad`` rows past the last sequence
    in q and k; v of head dim ``dv``, default ``d``), run into a NaN-poisoned out, check
    against float64 and return the LSE."""
    rng = np.random.default_rng()
    cu_q, cu_k = cumulative(lq), cumulative(lk)
    q = rand(rng, (cu_q[-1] + pad, hq, d), dtype)
    k = rand(rng, (cu_k[-1] + pad, hk, d), dtype)
    v = rand(rng, (cu_k[-1] + pad, hk, dv or d), dtype)
    out = np.full((*q.shape[:2], v.shape[2]), np.nan, NP[dtype])
    res, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                      out=out, return_lse=True, **kw)
    assert res is out and lse.shape == (hq, q.shape[0])
    ro, rl = varlen_reference(q, k, v, cu_q, cu_k, causal, kw.get("window") or (-1, -1),
                              kw.get("softcap", 0.0), kw.get("alibi_slopes"),
                              kw.get("mask_mod"), kw.get("mod_args", ()))
    n = cu_q[-1]
    check(res[:n], ro[:n], v, dtype)
    check_lse(lse[:, :n], rl[:, :n])
    assert np.isnan(f64(res[n:])).all(), "rows outside every sequence were written"
    return lse


@sim
@pytest.mark.parametrize("lq,lk,causal,d,dtype,kw", [
    # zero-length queries, zero-length keys (rows of zeros, LSE -inf), seq_q > seq_k under
    # causal (rows that see no key), several query blocks in one sequence; head_dim 24
    ([5, 0, 37, 20], [9, 4, 30, 0], True, 24, "bfloat16", {}),
    ([17, 40, 1], [33, 40, 50], False, 32, "float16", {}),
    # a window alone (no soft cap, ALiBi or user function: no score hook) — it was once
    # dropped, the kernel attending to every key
    ([33, 6], [40, 6], False, 32, "float16", {"window": (9, 4)}),
], ids=["causal-d24", "full-d32", "window-alone"])
def test_against_float64(lq, lk, causal, d, dtype, kw):
    run(lq, lk, 2, 1, d, dtype, causal, **kw)


def same_segment(b, h, i, j, seg):
    """A mask through mod_args: query i and key j of sequence b in the same half of it."""
    return (i < seg[b]) == (j < seg[b])


@sim
def test_variants_per_sequence():
    """A window on both sides, a soft cap and ALiBi slopes per (sequence, head) — each
    relative to the sequence's own lengths — and a user mask reading an array through
    mod_args with the sequence index as its batch."""
    lq, lk = [23, 6, 40], [30, 6, 35]
    slopes = np.random.default_rng().uniform(0.05, 0.5, (3, 2)).astype(np.float32)
    seg = np.array([10, 3, 17], np.int64)
    run(lq, lk, 2, 2, 32, "float16", False, window=(7, 3), softcap=5.0, alibi_slopes=slopes,
        mask_mod=same_segment, mod_args=(seg,))


@sim
@pytest.mark.parametrize("dtype,causal,variant", [("bfloat16", True, False),
                                                  ("float16", False, True)])
def test_tma_kernel_against_float64(dtype, causal, variant):
    """The grid TMA wgmma kernel (sm_90's choice) on packed sequences: TMA loads each tile at
    its sequence's packed offset, so the rows and keys past a sequence's end are the next
    sequence's (or TMA's zeros past the tensor) — masked, never written; a zero-length query
    or key sequence, a sequence shorter than the grid's x (causal, heavy-first blocks past it
    return), GQA; with a window on both sides, a soft cap, ALiBi per (sequence, head) and a
    user mask reading mod_args (the hook's batch the sequence index)."""
    cfg = WgmmaAttentionConfig(64, 64, 64, dtype, overlap=True, tma=True)
    if variant:
        slopes = np.random.default_rng().uniform(0.05, 0.5, (3, 2)).astype(np.float32)
        run([70, 6, 41], [66, 6, 90], 2, 1, 64, dtype, causal, config=cfg, window=(30, 9),
            softcap=5.0, alibi_slopes=slopes, mask_mod=same_segment,
            mod_args=(np.array([30, 3, 20], np.int64),))
    else:
        run([70, 0, 130, 5], [90, 3, 120, 0], 2, 1, 64, dtype, causal, config=cfg)


@sim
def test_head_dim_v_forward():
    """v's own head dim (48 / 32 and 24 / 40) on packed sequences: the TMA kernel's config
    (the simulator's small one), a zero-length query and key sequence, GQA, causal and a
    window; out (total_q, heads_q, head_dim_v)."""
    run([5, 0, 70, 20], [9, 4, 66, 0], 2, 1, 48, "float16", True, dv=32)
    run([33, 6], [40, 6], 2, 2, 24, "bfloat16", False, dv=40, window=(9, 4))


def backward_reference(q, k, v, do, cu_q, cu_k, causal, window=None, cap=0.0, alibi=None):
    """float64 (dq, dk, dv) of each sequence alone
    (:func:`test_ops_attention_backward.reference` on a batch of one), packed; rows outside
    every sequence 0."""
    from test_ops_attention_backward import reference as grads

    out = [np.zeros(x.shape) for x in (q, k, v)]
    for z in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[z], cu_q[z + 1]), slice(cu_k[z], cu_k[z + 1])
        if cu_q[z] == cu_q[z + 1] or cu_k[z] == cu_k[z + 1]:
            continue        # no queries or no keys: zero gradients
        bhsd = [x[rows].transpose(1, 0, 2)[None] for x, rows in
                ((q, rq), (k, rk), (v, rk), (do, rq))]
        slopes = None if alibi is None else (alibi[z] if alibi.ndim == 2 else alibi)
        _, dq, dk, dv = grads(*bhsd, causal, q.shape[-1] ** -0.5, window, cap,
                              alibi_slopes=slopes)
        for acc, g, rows in zip(out, (dq, dk, dv), (rq, rk, rk)):
            acc[rows] = g[0].transpose(1, 0, 2)
    return out


@sim
@pytest.mark.parametrize("lq,lk,causal,d,dtype,kw", [
    # zero-length queries / keys, rows that see no key, head_dim 24; dQ by its own kernel
    ([5, 0, 37, 20], [9, 4, 30, 0], True, 24, "float16", {}),
    # a window, a cap, ALiBi per sequence; dQ by atomics
    ([23, 40, 6], [30, 35, 6], False, 32, "bfloat16", {
        "window": (7, 3), "softcap": 5.0,
        "config": BackwardConfig(32, dtype="bfloat16", block_m=32, block_n=32, dq_block_m=32,
                                 dq_block_n=32, dq_atomic=True)}),
    # v's own head dim, causal, a zero-length key sequence
    ([30, 7], [20, 0], True, 48, "float16", {"dv": 32}),
    # the wgmma kernels (sm_90's choice): the pair whose dQ has its own kernel, zero-length
    # sequences, causal
    ([5, 0, 37, 70], [9, 4, 30, 0], True, 64, "bfloat16", {
        "config": WgmmaBackwardConfig(64, dtype="bfloat16", block_m=32, key_groups=1,
                                      dq_groups=1, dq_block_n=32)}),
    # the warp-specialised kernel, dQ by bulk reductions into each sequence's 64-row blocks
    # of the accumulator (the default past head_dim 128): 136 by query halves (the 256-column
    # tiles, dQ staged in the ring slot), a sequence over two blocks beside zero-length ones,
    # causal; 64 (each consumer's own keys); a head dim between the tile widths (96) with a
    # window and a cap
    ([70, 0, 6], [66, 5, 0], True, 136, "float16", {
        "config": WgmmaBackwardConfig(136, key_groups=1, dq_atomic=True, producer=True,
                                      split_columns=True, query_halves=True)}),
    pytest.param([70, 0, 6, 37], [66, 5, 0, 40], True, 64, "bfloat16", {
        "config": WgmmaBackwardConfig(64, dtype="bfloat16", block_m=64, key_groups=2,
                                      dq_atomic=True, producer=True)},
                 marks=pytest.mark.extended),
    pytest.param([23, 70, 6], [30, 64, 6], False, 96, "float16", {
        "window": (20, 9), "softcap": 5.0,
        "config": WgmmaBackwardConfig(96, block_m=64, key_groups=2, dq_atomic=True,
                                      producer=True)}, marks=pytest.mark.extended),
    # v's head dim other than q's on the wide kernel (DeepSeek's 192 / 128)
    pytest.param([70, 0, 6], [66, 5, 0], True, 192, "bfloat16", {
        "dv": 128, "config": WgmmaBackwardConfig(192, dtype="bfloat16", key_groups=1,
                                                 dq_atomic=True, producer=True,
                                                 split_columns=True, query_halves=True,
                                                 head_dim_v=128)},
                 marks=pytest.mark.extended),
], ids=["causal-d24", "variants-atomic-dq", "head-dim-v-48-32", "wgmma-causal-d64",
        "wgmma-fused-halves-causal-d136", "wgmma-fused-causal-d64",
        "wgmma-fused-d96-window-softcap", "wgmma-fused-halves-d192-v128"])
def test_backward_against_float64(lq, lk, causal, d, dtype, kw):
    """The gradients of packed sequences against each sequence's float64 derivation, into
    NaN-poisoned dq / dk / dv whose rows outside every sequence stay NaN (GQA 2/1); v's own
    head dim (``dv``: the mma.sync kernels' tiles as wide as the wider one)."""
    from test_ops_attention_backward import close

    kw = dict(kw)
    dv = kw.pop("dv", d)
    rng = np.random.default_rng()
    cu_q, cu_k = cumulative(lq), cumulative(lk)
    q = rand(rng, (cu_q[-1] + 2, 2, d), dtype)
    do = rand(rng, (cu_q[-1] + 2, 2, dv), dtype)
    k = rand(rng, (cu_k[-1] + 2, 1, d), dtype)
    v = rand(rng, (cu_k[-1] + 2, 1, dv), dtype)
    fwd = {n: kw[n] for n in ("window", "softcap") if n in kw}
    slopes = rng.uniform(0.05, 0.5, (len(lq), 2)).astype(np.float32) if fwd else None
    args = (cu_q, cu_k, max(lq), max(lk))
    out, lse = flash_attention_varlen(q, k, v, *args, causal=causal, return_lse=True,
                                      alibi_slopes=slopes, **fwd)
    poisoned = [np.full_like(x, np.nan) for x in (q, k, v)]
    got = flash_attention_varlen_backward(do, q, k, v, out, lse, *args, causal=causal,
                                          alibi_slopes=slopes, dq=poisoned[0], dk=poisoned[1],
                                          dv=poisoned[2], **kw)
    assert all(g is p for g, p in zip(got, poisoned))
    want = backward_reference(q, k, v, do, cu_q, cu_k, causal, kw.get("window"),
                              kw.get("softcap", 0.0), slopes)
    for name, g, w, n in zip(("dq", "dk", "dv"), got, want, (cu_q[-1], cu_k[-1], cu_k[-1])):
        close(g[:n], w[:n], dtype, name)
        assert np.isnan(f64(g[n:])).all(), f"{name}: rows outside every sequence written"


def test_bad_input_is_refused_before_launch():
    x = np.zeros((10, 2, 32), np.float16)
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        flash_attention_varlen(x, x, x, cu.astype(np.int64), cu, 6, 6)
    with pytest.raises(ValueError, match="must be 1-D"):
        flash_attention_varlen(x, x, x, cu[None], cu, 6, 6)
    with pytest.raises(ValueError, match="the same length"):
        flash_attention_varlen(x, x, x, cu, cu[:2], 6, 6)
    with pytest.raises(ValueError, match="must not decrease"):
        flash_attention_varlen(x, x, x, np.array([0, 5, 4], np.int32), cu, 6, 6)
    with pytest.raises(ValueError, match="must start at 0"):
        flash_attention_varlen(x, x, x, cu, np.array([1, 4, 10], np.int32), 6, 6)
    with pytest.raises(ValueError, match="past total_k"):
        flash_attention_varlen(x, x[:9], x[:9], cu, cu, 6, 6)
    with pytest.raises(ValueError, match="max_seqlen_q = 5 but sequence 1 has 6 rows"):
        flash_attention_varlen(x, x, x, cu, cu, 5, 6)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        flash_attention_varlen(x, x, x, cu, cu, 6, 6.0)
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= 0, got -1"):
        flash_attention_varlen(x, x, x, cu, cu, -1, 6)
    with pytest.raises(ValueError, match="must be 3-D"):
        flash_attention_varlen(x[None], x, x, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flash_attention_varlen(x, x, x, cu, cu, 6, 6, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="window"):
        flash_attention_varlen(x, x, x, cu, cu, 6, 6, window=(-2, 0))
    with pytest.raises(NotImplementedError, match="grid TMA wgmma kernel"):
        flash_attention_varlen(x, x, x, cu, cu, 6, 6, config=WgmmaAttentionConfig(64))
    with pytest.raises(NotImplementedError, match="grid TMA wgmma kernel"):
        flash_attention_varlen(x, x, x, cu, cu, 6, 6, config=WgmmaAttentionConfig(
            64, 192, 128, overlap=True, tma=True, producer=True, persistent=True))
    with pytest.raises(ValueError, match="config is for head_dim 64"):
        flash_attention_varlen(x, x, x, cu, cu, 6, 6, config=AttentionConfig(64))
    lse = np.zeros((2, 10), np.float32)
    with pytest.raises(TypeError, match="needs the forward's out and lse"):
        flash_attention_varlen_backward(x, x, x, x, None, lse, cu, cu, 6, 6)
    with pytest.raises(ValueError, match=r"lse must be float32 of shape \(2, 10\)"):
        flash_attention_varlen_backward(x, x, x, x, x, lse.T, cu, cu, 6, 6)
    with pytest.raises(TypeError, match="a score_mod needs its derivative"):
        flash_attention_varlen_backward(x, x, x, x, x, lse, cu, cu, 6, 6,
                                        score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(ValueError, match="must not decrease"):
        flash_attention_varlen_backward(x, x, x, x, x, lse, np.array([0, 5, 4], np.int32), cu,
                                        6, 6)
    # v's own head dim: out and dout of (total_q, heads_q, head_dim_v); configs of it
    v16 = np.zeros((10, 2, 16), np.float16)
    with pytest.raises(ValueError, match=r"out must have shape \(10, 2, 16\)"):
        flash_attention_varlen(x, x, v16, cu, cu, 6, 6, out=x)
    with pytest.raises(ValueError, match="config is for v's head_dim 32"):
        flash_attention_varlen(x, x, v16, cu, cu, 6, 6, config=WgmmaAttentionConfig(
            32, 64, 64, overlap=True, tma=True))
    with pytest.raises(ValueError, match="head_dim 12 is not supported"):
        flash_attention_varlen(x, x, np.zeros((10, 2, 12), np.float16), cu, cu, 6, 6)
    with pytest.raises(ValueError, match="dout must have out's shape"):
        flash_attention_varlen_backward(x, x, x, v16, v16, lse, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="config is for v's head_dim 32"):
        flash_attention_varlen_backward(v16, x, x, v16, v16, lse, cu, cu, 6, 6,
                                        config=BackwardConfig(32, dtype="float16"))


@sim
def test_unchecked_lengths_and_an_empty_batch():
    """check_seqlens=False launches without reading the lengths (the caller vouches); no
    sequences at all gives out untouched and no launch."""
    run([8, 19], [8, 19], 1, 1, 16, "float16", True, check_seqlens=False)
    x = np.full((4, 1, 16), np.nan, np.float16)
    zero = np.zeros(1, np.int32)
    out = flash_attention_varlen(x, x, x, zero, zero, 0, 0, out=x.copy())
    assert np.isnan(f64(out)).all()


@sim
def test_a_call_of_the_same_signature_reuses_the_plan(monkeypatch):
    """A second call with new arrays of the same shapes and new lengths (the same totals and
    longest sequences), ALiBi slopes and the LSE launches the first call's plan (no plan is
    built: building one fails here) and computes the new sequences; check_seqlens still
    checks that call's lengths; a new longest sequence is a new plan."""
    from tilepy.ops import attention_varlen as av

    av._PLANS.clear()
    slopes = np.array([0.5, 0.25], np.float32)
    run([5, 20], [9, 30], 2, 1, 16, "float16", True, alibi_slopes=slopes)
    assert len(av._PLANS) == 1

    def no_new_plan(*a, **kw):
        raise AssertionError("a new plan was built")

    monkeypatch.setattr(av, "_plan", no_new_plan)
    run([20, 5], [30, 9], 2, 1, 16, "float16", True, alibi_slopes=slopes.copy())
    x = np.zeros((28, 2, 16), np.float16)
    kv = np.zeros((42, 1, 16), np.float16)
    with pytest.raises(ValueError, match="must not decrease"):
        flash_attention_varlen(x, kv, kv, np.array([0, 20, 5], np.int32),
                               np.array([0, 30, 39], np.int32), 20, 30, causal=True,
                               out=np.zeros_like(x), return_lse=True, alibi_slopes=slopes)
    with pytest.raises(AssertionError, match="new plan"):
        run([21, 4], [30, 9], 2, 1, 16, "float16", True, alibi_slopes=slopes)


@pytest.mark.gpu
def test_gpu_window_alone_and_head_dim_v():
    """On the GPU (sm_90's grid TMA kernel for the forward, the mma.sync backward): a window
    alone (no soft cap, ALiBi or user function — once dropped on this path) with q / k head
    dim 192 and v's 128, GQA 8/2, 6 sequences of 0…700, bf16 — out and the gradients against
    SDPA in float32 per sequence with the window as an explicit mask."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("v's own head dim: the forward runs on sm_90's TMA kernels")
    import torch.nn.functional as F

    from tilepy.ops.attention_varlen import flash_attention_varlen_backward

    dt, left, right = torch.bfloat16, 100, 30
    lens = np.random.default_rng().integers(0, 701, 6)
    lens[2] = 0
    cu = torch.tensor(cumulative(lens), device="cuda")
    total, longest = int(lens.sum()), int(lens.max())
    q = torch.randn(total, 8, 192, device="cuda", dtype=dt)
    k = torch.randn(total, 2, 192, device="cuda", dtype=dt)
    v = torch.randn(total, 2, 128, device="cuda", dtype=dt)
    do = torch.randn(total, 8, 128, device="cuda", dtype=dt)
    out, lse = flash_attention_varlen(q, k, v, cu, cu, longest, longest, window=(left, right),
                                      return_lse=True)
    grads = flash_attention_varlen_backward(do, q, k, v, out, lse, cu, cu, longest, longest,
                                            window=(left, right))
    for z in range(6):
        a, e = int(cu[z]), int(cu[z + 1])
        if a == e:
            continue
        i = torch.arange(e - a, device="cuda")
        keep = (i[None, :] >= i[:, None] - left) & (i[None, :] <= i[:, None] + right)
        leaves = [x[a:e].transpose(0, 1).float().requires_grad_() for x in (q, k, v)]
        want = F.scaled_dot_product_attention(*leaves, attn_mask=keep, enable_gqa=True)
        want_grads = torch.autograd.grad(want, leaves, do[a:e].transpose(0, 1).float())
        got = out[a:e].transpose(0, 1).float()
        err = ((got - want).abs().max() / v.abs().max()).item()
        assert err < 3e-2, ("out", z, err)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
            g = g[a:e].transpose(0, 1).float()
            err = ((g - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
            assert not g.isnan().any() and err < 5e-2, (name, z, err)


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,dtype", [(128, True, "bfloat16"), (64, False, "float16"),
                                            (72, True, "float16")])
def test_gpu_against_sdpa_and_a_graph_replay(d, causal, dtype):
    """PyTorch tensors on the GPU: 12 sequences of random lengths 0…900 (GQA 8/2) against
    SDPA in float32 per sequence; the same call captured in a CUDA graph (the host check of
    the lengths skipped while capturing) replays new inputs."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    lens = np.random.default_rng().integers(0, 901, 12)
    lens[3] = 0
    cu = torch.tensor(cumulative(lens), device="cuda")
    total = int(lens.sum())
    q = torch.randn(total, 8, d, device="cuda", dtype=dt)
    k, v = (torch.randn(total, 2, d, device="cuda", dtype=dt) for _ in range(2))
    out = torch.full_like(q, float("nan"))

    def call():
        return flash_attention_varlen(q, k, v, cu, cu, int(lens.max()), int(lens.max()),
                                      causal=causal, out=out)

    def check_all():
        for z in range(12):
            a, e = int(cu[z]), int(cu[z + 1])
            if a == e:
                continue
            want = F.scaled_dot_product_attention(
                *(x[a:e].transpose(0, 1).float() for x in (q, k, v)), is_causal=causal,
                enable_gqa=True).transpose(0, 1)
            got = out[a:e].float()
            assert not got.isnan().any()
            err = ((got - want).abs().max() / v.abs().max()).item()
            assert err < (4e-3 if dtype == "float16" else 3e-2), (z, err)

    call()
    check_all()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
        with torch.cuda.graph(graph, stream=s):
            call()
    torch.cuda.current_stream().wait_stream(s)
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_all()


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,dtype", [(128, True, "bfloat16"), (64, False, "float16")])
def test_gpu_backward_against_sdpa(d, causal, dtype):
    """The gradients of 10 packed sequences of random lengths 0…700 (GQA 8/2) against
    SDPA's float32 autograd per sequence, into NaN-filled dq / dk / dv whose rows outside
    every sequence stay NaN."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    lens = np.random.default_rng().integers(0, 701, 10)
    lens[2] = 0
    cu = torch.tensor(cumulative(lens), device="cuda")
    total, m = int(lens.sum()), int(lens.max())
    q, do = (torch.randn(total + 5, 8, d, device="cuda", dtype=dt) for _ in range(2))
    k, v = (torch.randn(total + 5, 2, d, device="cuda", dtype=dt) for _ in range(2))
    out, lse = flash_attention_varlen(q, k, v, cu, cu, m, m, causal=causal, return_lse=True)
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    flash_attention_varlen_backward(do, q, k, v, out, lse, cu, cu, m, m, causal=causal,
                                    dq=grads[0], dk=grads[1], dv=grads[2])
    tol = 2e-2 if dtype == "float16" else 5e-2
    for z in range(10):
        a, e = int(cu[z]), int(cu[z + 1])
        if a == e:
            continue
        ins = [x[a:e].transpose(0, 1).float().requires_grad_() for x in (q, k, v)]
        o = F.scaled_dot_product_attention(*ins, is_causal=causal, enable_gqa=True)
        want = torch.autograd.grad(o, ins, do[a:e].transpose(0, 1).float())
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            got = g[a:e].transpose(0, 1).float()
            assert not got.isnan().any(), (z, name)
            err = ((got - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
            assert err < tol, (z, name, err)
    for g in grads:
        assert g[total:].isnan().all(), "rows outside every sequence were written"


@pytest.mark.gpu
def test_gpu_autograd_eager_and_compiled():
    """loss.backward() through tilepy.flash_attention_varlen on CUDA tensors (the operator's
    autograd formula), eager and under torch.compile(fullgraph=True), against SDPA's float32
    gradients per sequence."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import tilepy

    lens = np.random.default_rng().integers(1, 500, 6)
    cu = torch.tensor(cumulative(lens), device="cuda")
    total, m = int(lens.sum()), int(lens.max())
    base = [torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    g = torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16)

    def loss(q, k, v):
        out = tilepy.flash_attention_varlen(q, k, v, cu, cu, m, m, causal=True)
        return (out.float() * g.float()).sum()

    want = [torch.zeros(total, 4, 64, device="cuda") for _ in range(3)]
    for z in range(6):
        a, e = int(cu[z]), int(cu[z + 1])
        ins = [x[a:e].transpose(0, 1).float().requires_grad_() for x in base]
        o = F.scaled_dot_product_attention(*ins, is_causal=True)
        for w, d in zip(want, torch.autograd.grad(o, ins, g[a:e].transpose(0, 1).float())):
            w[a:e] = d.transpose(0, 1)
    torch._dynamo.reset()
    for run in (loss, torch.compile(loss, fullgraph=True)):
        ins = [x.clone().requires_grad_() for x in base]
        run(*ins).backward()
        for name, x, w in zip(("dq", "dk", "dv"), ins, want):
            err = ((x.grad.float() - w).abs().max() / w.abs().max()).item()
            assert err < 5e-2, (name, err)
