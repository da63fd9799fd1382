"""FlashAttention backward: ``tilepy.flash_attention_backward`` against the backward of
PyTorch's ``scaled_dot_product_attention`` with the cuDNN backend and with the
FlashAttention-2 backend, same run; and the attention of a training step (forward + backward).

Throughput is ``2.5 · 4·B·H·Sq·Sk·D`` FLOP for the backward (five matmuls — S = Q·Kᵀ again,
dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀ·Q — against the forward's two) and
``3.5 · 4·B·H·Sq·Sk·D`` for forward + backward, halved for causal attention, per second
(``bench/measure.py``): of GPU time (CUDA events, the CPU cost of each call kept out of the
events and recorded as ``host_us``) and of the time as called (back-to-back calls, host cost
included); ratios use each implementation's slower one.

Backward (``test_flash_attention_backward``): tilepy runs
``tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=..., dq=dq, dk=dk, dv=dv)``
into preallocated gradients, from the ``out`` and ``lse`` of one ``tilepy.flash_attention(...,
return_lse=True)``; ``deterministic=True`` is timed beside it as ``tilepy deterministic``
(its ``ratios`` entry is its time over the default's: above 1, the default is faster). SDPA
runs its forward once on leaves that require grad with the backend pinned by
``torch.nn.attention.sdpa_kernel``, then ``torch.autograd.grad(out, (q, k, v), dout,
retain_graph=True)`` is timed (the backward only; the gradients are allocated from PyTorch's
cache, the autograd engine's host cost is in the as-called time). The main peer is SDPA's cuDNN
backend (``ratio``); its FlashAttention-2 backend is in ``ratios``.

Training step (``test_attention_training_step``): tilepy's forward (``return_lse=True``,
``out=`` preallocated) then its backward, against SDPA forward + ``torch.autograd.grad`` with
the cuDNN backend (``ratio``) and the FlashAttention-2 one (``ratios``); ``tilepy autograd``
(``tilepy.flash_attention`` on leaves that require grad, then ``torch.autograd.grad``) is in
``ratios`` too, its time over the direct calls'.

Every implementation's ``dq``, ``dk``, ``dv`` are checked once before it is timed, against
SDPA's gradients in float32 of the same inputs (efficient-attention or math backend, one batch
element at a time): max |error| relative to max |gradient|, each below 2e-2 (float16) or 5e-2
(bfloat16); a NaN fails (tilepy's outputs are NaN-filled before its checks, so an element it
does not write fails too). tilepy failing fails the test; a peer that refuses a case or gets it
wrong is left out and says why in ``peer_errors``.

Shapes: B=4, H=32, S=4096, D=128 and B=8, H=16, S=2048, D=64 in float16 and bfloat16; B=4,
H=32, D=128, S ∈ {1024, 8192} in float16; causal and not; Sq = Sk, no GQA. Select parts with
``-k``: ``-k backward``, ``-k training_step``, ``-k "not bfloat16"``, ``-k causal``, ``-k S8192``…
"""

import dataclasses

import numpy as np
import pytest
from measure import gpu_time, max_rel_err, record_throughput, try_peer
from tilepy.ptx.math import tanh_approx

# (batch, heads, seq, head_dim)
MAIN = [(4, 32, 4096, 128), (8, 16, 2048, 64)]
SEQ = [(4, 32, 1024, 128), (4, 32, 8192, 128)]
CASES = ([(s, dt) for s in MAIN for dt in ("float16", "bfloat16")]
         + [(s, "float16") for s in SEQ])
# past head_dim 128 (Gemma's 256; 192 runs the 256-column tiles zero-filled): the backward
# alone (no training-step case; the deterministic timing is the mma.sync kernels there)
WIDE = [((4, 16, 4096, 256), "bfloat16"), ((4, 16, 4096, 192), "bfloat16")]
CUDNN = "SDPA cuDNN"
FA2 = "SDPA FA2"
PEERS = ((CUDNN, "CUDNN_ATTENTION"), (FA2, "FLASH_ATTENTION"))
DETERMINISTIC = "tilepy deterministic"
AUTOGRAD = "tilepy autograd"


def tolerance(dtype):
    """Max |error| of each gradient relative to its max |value|: P and dS are rounded to the
    input dtype before their matmuls, the gradients to it at the end."""
    return 2e-2 if dtype == "float16" else 5e-2


def case_id(c):
    return "B{}_H{}_S{}_D{}".format(*c[0]) + f"-{c[1]}"


def inputs(torch, b, h, s, d, dtype):
    tdt = getattr(torch, dtype)
    return tuple(torch.randn(b, h, s, d, device="cuda", dtype=tdt) for _ in range(4))


def poisoned(torch, *tensors):
    """NaN-filled tensors like ``tensors``: an element the op does not write fails the check."""
    return tuple(torch.full_like(t, float("nan")) for t in tensors)


def reference_grads(torch, q, k, v, dout, causal):
    """SDPA's (dq, dk, dv) in float32 of the same inputs, one batch element at a time
    (efficient-attention backend, else math: its float32 score matrix of one element fits)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    grads = tuple(torch.empty(t.shape, device="cuda", dtype=torch.float32) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        for i in range(q.shape[0]):
            leaves = tuple(t[i:i + 1].float().requires_grad_() for t in (q, k, v))
            o = sdpa(*leaves, is_causal=causal)
            for dst, g in zip(grads, torch.autograd.grad(o, leaves, dout[i:i + 1].float())):
                dst[i:i + 1] = g
            del o
    return grads


def grad_error(torch, got, want, limit, who):
    """The largest of the three relative errors; AssertionError when one is NaN or not below
    ``limit``."""
    errs = {}
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        errs[name] = float("nan") if torch.isnan(g).any().item() else max_rel_err(g, w)
    bad = {n: e for n, e in errs.items() if not e < limit}
    if bad:
        text = ", ".join(f"{n} {e:.3g}" for n, e in bad.items())
        raise AssertionError(f"{who}: wrong gradients: {text} (tolerance {limit:.3g})")
    return max(errs.values())


def checked_pair(torch, grads, reference, run, who):
    """``reference()`` then ``run()``, both writing ``grads``: the larger relative error of
    ``run``'s gradients against ``reference``'s (``grads`` NaN-filled between the two, so an
    element ``run`` does not write fails; :func:`grad_error` at the bfloat16 tolerance)."""
    reference()
    torch.cuda.synchronize()
    want = [g.clone() for g in grads]
    for g in grads:
        g.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    return grad_error(torch, grads, want, tolerance("bfloat16"), who)


def flex_backward_timing(torch, q, k, v, dout, score_mod=None, mask_mod=None, b=None,
                         h=None):
    """Compiled FlexAttention's backward of the same problem: its forward once (a block mask
    from ``mask_mod`` over ``b`` / ``h``, None: every batch / head alike), then
    ``torch.autograd.grad`` timed. Buffer donation is off while compiling: a compiled backward
    that donates buffers refuses ``retain_graph``, which the timed backward on one forward's
    graph needs."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s, sk = q.shape[2], k.shape[2]
    fbm = (create_block_mask(mask_mod, b, h, s, sk, device="cuda", _compile=True)
           if mask_mod is not None else None)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    with torch._functorch.config.patch(donated_buffer=False):
        fo = torch.compile(flex_attention)(qg, kg, vg, score_mod=score_mod, block_mask=fbm)

        def step():
            return torch.autograd.grad(fo, (qg, kg, vg), dout, retain_graph=True)

        step()
    return gpu_time(torch, step)


def checked_grad_timing(torch, run, want, limit, who):
    """``run()`` (returns dq, dk, dv) checked once against ``want``, then timed."""
    got = run()
    torch.cuda.synchronize()
    grad_error(torch, got, want, limit, who)
    del got
    return gpu_time(torch, run)


def sdpa_backward_timing(torch, backend, q, k, v, dout, causal, want, limit, label):
    """SDPA's backward pinned to ``backend``: the forward once, ``torch.autograd.grad`` timed;
    raises when the backend refuses the case or gets it wrong."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(getattr(SDPBackend, backend)):
        out = sdpa(*leaves, is_causal=causal)
        return checked_grad_timing(
            torch, lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
            want, limit, label)


def sdpa_step_timing(torch, backend, q, k, v, dout, causal, want, limit, label):
    """SDPA forward + backward pinned to ``backend``; raises when it refuses or is wrong."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))

    def step():
        return torch.autograd.grad(sdpa(*leaves, is_causal=causal), leaves, dout)

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return checked_grad_timing(torch, step, want, limit, label)


def config_of(d, dtype, causal):
    """The forward's and (where the op says) the backward's kernel config, described."""
    parts = []
    try:
        from tilepy.ops.attention import choose_config

        parts.append("forward " + choose_config(d, dtype, causal).describe())
    except Exception:  # noqa: BLE001 — a description, never a reason to fail
        parts.append("forward ?")
    try:
        from tilepy.ops import attention_backward

        parts.append("backward " + attention_backward.choose_config(d, dtype).describe())
    except Exception:  # noqa: BLE001 — module or chooser not there (yet): no description
        parts.append("backward ?")
    return "; ".join(parts)


def work_of(b, h, s, d, causal, matmuls):
    """FLOP of ``matmuls`` Sq×Sk×D matmuls (2·Sq·Sk·D each) per (batch, head), halved for
    causal attention."""
    return matmuls * 2 * b * h * s * s * d / (2 if causal else 1)


def labels(b, h, s, d, dtype, causal):
    mask = "causal" if causal else "full"
    """(table row, shape, figure suffix) of a case."""
    return (f"B{b} H{h} S{s} D{d} {mask} {dtype}", f"B={b} H={h} S={s} D={d}",
            f"{dtype}_B{b}_H{h}_D{d}_{mask}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES + WIDE, ids=case_id)
def test_flash_attention_backward(benchmark, record, torch, gpu_name, case, causal):
    import tilepy

    (b, h, s, d), dtype = case
    q, k, v, dout = inputs(torch, b, h, s, d, dtype)
    out, lse = tilepy.flash_attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = poisoned(torch, q, k, v)

    def ours(deterministic=False):
        return tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                               deterministic=deterministic,
                                               dq=dq, dk=dk, dv=dv)

    ours()  # compile
    torch.cuda.synchronize()
    want = reference_grads(torch, q, k, v, dout, causal)
    limit = tolerance(dtype)
    err = grad_error(torch, (dq, dk, dv), want, limit, "tilepy")

    notes = {}
    timings = {"tilepy": gpu_time(torch, ours)}
    for label, backend in PEERS:
        timings[label] = try_peer(notes, label, lambda lb=label, be=backend: sdpa_backward_timing(
            torch, be, q, k, v, dout, causal, want, limit, lb))
    for t in (dq, dk, dv):
        t.fill_(float("nan"))  # the deterministic check must see its own writes
    timings[DETERMINISTIC] = try_peer(notes, DETERMINISTIC, lambda: checked_grad_timing(
        torch, lambda: ours(deterministic=True), want, limit, DETERMINISTIC))
    row, shape, tag = labels(b, h, s, d, dtype, causal)
    record_throughput(record, work=work_of(b, h, s, d, causal, 5), unit="TFLOPS",
                      timings=timings, main=CUDNN, notes=notes, gpu=gpu_name, shape=shape,
                      dtype=dtype, causal=causal, config=config_of(d, dtype, causal),
                      max_rel_err=err, table="Attention backward", case=row,
                      figure=f"attention_backward_{tag}", x=s, xlabel="sequence length")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention_backward_head_dim_v(benchmark, record, torch, gpu_name, causal):
    """v's head dim other than q's and k's — DeepSeek's 192 / 128, B4 H16 S4096 bf16: the
    built-in choice (on sm_90 the 256-column wgmma kernel, each operand zero-filled past its
    own head dim) against the mma.sync kernels (``config=``, as the built-in choice ran
    before) and SDPA's cuDNN backend where it takes the case. TFLOPS count the backward's
    five products, ``2·Sq·Sk·(3·D + 2·Dv)`` per (batch, head), halved when causal."""
    import tilepy
    from tilepy.ops.attention_backward import choose_config

    b, h, s, d, dv, dtype = 4, 16, 4096, 192, 128, "bfloat16"
    tdt = getattr(torch, dtype)
    q, k = (torch.randn(b, h, s, d, device="cuda", dtype=tdt) for _ in range(2))
    v, dout = (torch.randn(b, h, s, dv, device="cuda", dtype=tdt) for _ in range(2))
    out, lse = tilepy.flash_attention(q, k, v, causal=causal, return_lse=True)
    grads = poisoned(torch, q, k, v)
    portable = choose_config(d, dtype, variant=False, wgmma=False, head_dim_v=dv)

    def ours(config=None):
        return tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                               dq=grads[0], dk=grads[1], dv=grads[2],
                                               config=config)

    ours()  # compile
    torch.cuda.synchronize()
    want = reference_grads(torch, q, k, v, dout, causal)
    limit = tolerance(dtype)
    err = grad_error(torch, grads, want, limit, "tilepy")
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours)}
    timings["tilepy mma.sync"] = try_peer(notes, "tilepy mma.sync", lambda: checked_grad_timing(
        torch, lambda: ours(portable), want, limit, "tilepy mma.sync"))
    timings[CUDNN] = try_peer(notes, CUDNN, lambda: sdpa_backward_timing(
        torch, "CUDNN_ATTENTION", q, k, v, dout, causal, want, limit, CUDNN))
    mask = "causal" if causal else "full"
    work = 2 * b * h * s * s * (3 * d + 2 * dv) / (2 if causal else 1)
    record_throughput(record, work=work, unit="TFLOPS", timings=timings, main="tilepy mma.sync",
                      notes=notes, gpu=gpu_name, shape=f"B={b} H={h} S={s} D={d} Dv={dv}",
                      dtype=dtype, causal=causal, max_rel_err=err,
                      table="Attention backward, v's head dim",
                      case=f"B{b} H{h} S{s} D{d} Dv{dv} {mask} {dtype}",
                      figure=f"attention_backward_head_dim_v_{mask}", x=s,
                      xlabel="sequence length")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_attention_training_step(benchmark, record, torch, gpu_name, case, causal):
    import tilepy

    (b, h, s, d), dtype = case
    q, k, v, dout = inputs(torch, b, h, s, d, dtype)
    out = torch.full_like(q, float("nan"))
    dq, dk, dv = poisoned(torch, q, k, v)

    def ours():
        _, lse = tilepy.flash_attention(q, k, v, causal=causal, return_lse=True, out=out)
        return tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                               dq=dq, dk=dk, dv=dv)

    ours()  # compile
    torch.cuda.synchronize()
    want = reference_grads(torch, q, k, v, dout, causal)
    limit = tolerance(dtype)
    err = grad_error(torch, (dq, dk, dv), want, limit, "tilepy")

    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))

    def autograd_step():
        return torch.autograd.grad(tilepy.flash_attention(*leaves, causal=causal), leaves, dout)

    notes = {}
    timings = {"tilepy": gpu_time(torch, ours)}
    for label, backend in PEERS:
        timings[label] = try_peer(notes, label, lambda lb=label, be=backend: sdpa_step_timing(
            torch, be, q, k, v, dout, causal, want, limit, lb))
    timings[AUTOGRAD] = try_peer(notes, AUTOGRAD, lambda: checked_grad_timing(
        torch, autograd_step, want, limit, AUTOGRAD))
    row, shape, tag = labels(b, h, s, d, dtype, causal)
    record_throughput(record, work=work_of(b, h, s, d, causal, 7), unit="TFLOPS",
                      timings=timings, main=CUDNN, notes=notes, gpu=gpu_name, shape=shape,
                      dtype=dtype, causal=causal, config=config_of(d, dtype, causal),
                      max_rel_err=err, table="Attention forward + backward (training step)",
                      case=row, figure=f"attention_training_step_{tag}", x=s,
                      xlabel="sequence length")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


# ---- block masks (issue 25): the block-sparse backward ---------------------------------------

def _documents(torch, b, s):
    """(b, s) int32 ids of 8 documents of random lengths per row (fixed seed; the forward
    benchmark's)."""
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randint(1, s, (b, 7), generator=g), dim=1).values
    ids = torch.searchsorted(cuts, torch.arange(s).expand(b, s).contiguous(), right=True)
    return ids.to(torch.int32).cuda()


def _document_causal(b, h, q_idx, kv_idx, doc):
    # (& and clamped indices, as docs/attention.md advises)
    return (kv_idx <= q_idx) & (doc[b, min(q_idx, doc.shape[1] - 1)] ==
                                doc[b, min(kv_idx, doc.shape[1] - 1)])


def test_flash_attention_backward_block_mask(benchmark, record, torch, gpu_name):
    """Causal document masking (8 documents a row) at B4 H16 S8192 D128 bf16 with a block
    mask made once by ``tilepy.create_block_mask``: tilepy's block-sparse backward against
    the same backward walking every block (the mask without its transposed lists) and
    compiled FlexAttention's backward (its own block mask; autograd of a compiled forward).
    TFLOPS count 2.5× the forward's work over the causal pairs for every implementation."""
    import dataclasses

    import tilepy

    b, h, s, d = 4, 16, 8192, 128
    q, k, v, dout = inputs(torch, b, h, s, d, "bfloat16")
    doc = _documents(torch, b, s)
    bm = tilepy.create_block_mask(_document_causal, b, None, s, s, mod_args=(doc,))
    dense = dataclasses.replace(bm, q_num_blocks=None, q_indices=None, full_q_num_blocks=None,
                                full_q_indices=None)
    out, lse = tilepy.flash_attention(q, k, v, block_mask=bm, return_lse=True)
    grads = poisoned(torch, q, k, v)

    def ours(mask=bm):
        return tilepy.flash_attention_backward(dout, q, k, v, out, lse, block_mask=mask,
                                               dq=grads[0], dk=grads[1], dv=grads[2])

    err = checked_pair(torch, grads, ours, lambda: ours(dense), "tilepy dense walk")
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours),
               "tilepy dense walk": gpu_time(torch, lambda: ours(dense))}

    def flex():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        fbm = create_block_mask(lambda bb, hh, qi, kj: (doc[bb, qi] == doc[bb, kj]) & (kj <= qi),
                                b, h, s, s, device="cuda", _compile=True)
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        fo = torch.compile(flex_attention)(qg, kg, vg, block_mask=fbm)

        def step():
            return torch.autograd.grad(fo, (qg, kg, vg), dout, retain_graph=True)

        step()
        return gpu_time(torch, step)

    timings["FlexAttention"] = try_peer(notes, "FlexAttention", flex)
    record_throughput(record, work=work_of(b, h, s, d, True, 5), unit="TFLOPS",
                      timings=timings, main="FlexAttention", notes=notes, gpu=gpu_name,
                      shape=f"B={b} H={h} S={s} D={d}", dtype="bfloat16", causal=True,
                      max_rel_err=err, table="Attention backward, block masks",
                      case=f"B{b} H{h} S{s} D{d} document block mask bfloat16",
                      figure="attention_backward_document_block_mask", x=s,
                      xlabel="sequence length")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


# ---- variants (issue 25): window, soft cap, ALiBi on the wgmma kernels ----------------------

#: (name, window, softcap, alibi, seq): B4 H32 D128 bfloat16, causal.
VARIANTS = [("window", (1023, 0), 0.0, False, 8192), ("softcap", None, 50.0, False, 4096),
            ("alibi", None, 0.0, True, 4096)]


def _visible_pairs(s, window):
    """Causal (query, key) pairs of one head, within ``window`` (left, 0) when given."""
    left = window[0] if window is not None else s
    return sum(min(i + 1, left + 1) for i in range(s))


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_flash_attention_backward_variants(benchmark, record, torch, gpu_name, variant):
    """The forward's built-in variants through the backward at B4 H32 D128 bf16, causal — a
    sliding window of 1024 keys (S 8192), Gemma 2's soft cap 50 (S 4096), ALiBi (S 4096):
    tilepy's built-in choice (on sm_90 the wgmma kernels) against the mma.sync kernels of the
    same op (``config=`` the portable choice; the gradients compared, bf16 tolerance) and
    compiled FlexAttention's backward with the same score / mask functions. TFLOPS count
    2.5× the forward's work over the visible pairs for every implementation."""
    import tilepy
    from tilepy.ops import attention_backward as ab

    name, window, cap, alibi, s = variant
    b, h, d = 4, 32, 128
    q, k, v, dout = inputs(torch, b, h, s, d, "bfloat16")
    slopes = (torch.exp2(-8 * torch.arange(1, h + 1, device="cuda", dtype=torch.float32) / h)
              if alibi else None)
    kw = dict(causal=True, window=window, softcap=cap, alibi_slopes=slopes)
    out, lse = tilepy.flash_attention(q, k, v, return_lse=True, **kw)
    grads = poisoned(torch, q, k, v)
    portable = ab.BackwardConfig(d, dtype="bfloat16", **ab.GPU_BLOCKS[d])

    def ours(config=None):
        return tilepy.flash_attention_backward(dout, q, k, v, out, lse, config=config,
                                               dq=grads[0], dk=grads[1], dv=grads[2], **kw)

    err = checked_pair(torch, grads, lambda: ours(portable), ours, "tilepy")
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours),
               "tilepy mma.sync": gpu_time(torch, lambda: ours(portable))}

    left = window[0] if window is not None else s

    def mask(bb, hh, qi, kj):
        return (kj <= qi) & (qi - kj <= left)

    # no captured tensor (compiled FlexAttention's backward refuses one): ALiBi's slope from
    # the head index, as `slopes` above
    score = (lambda x, bb, hh, qi, kj: cap * torch.tanh(x / cap)) if cap else \
        (lambda x, bb, hh, qi, kj: x - torch.exp2(-8.0 * (hh + 1) / h) * (qi - kj).abs()) \
        if alibi else None
    timings["FlexAttention"] = try_peer(notes, "FlexAttention", lambda: flex_backward_timing(
        torch, q, k, v, dout, score, mask))
    pairs = _visible_pairs(s, window)
    record_throughput(record, work=2.5 * 4 * b * h * d * pairs, unit="TFLOPS",
                      timings=timings, main="FlexAttention", notes=notes, gpu=gpu_name,
                      shape=f"B={b} H={h} S={s} D={d}", dtype="bfloat16", causal=True,
                      max_rel_err=err, table="Attention backward, variants",
                      case=f"B{b} H{h} S{s} D{d} causal {name} bfloat16",
                      figure=f"attention_backward_variant_{name}", x=s,
                      xlabel="sequence length")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


#: (batch, heads, seq, head_dim) of head dims between the wgmma tile widths (issue 25)
PADDED = [(4, 32, 4096, 96), (4, 32, 4096, 80)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", PADDED, ids=lambda c: f"B{c[0]}_H{c[1]}_S{c[2]}_D{c[3]}")
def test_flash_attention_backward_padded_head_dims(benchmark, record, torch, gpu_name, shape,
                                                   causal):
    """Head dims between the wgmma tile widths (96, 80: the 128-column tiles, zero-filled)
    through the backward, bf16: tilepy's built-in choice (on sm_90 the wgmma kernels) against
    the mma.sync kernels of the same op (``config=`` the portable choice; the gradients
    compared, bf16 tolerance) and SDPA's cuDNN backend."""
    import tilepy
    from tilepy.ops import attention_backward as ab

    b, h, s, d = shape
    q, k, v, dout = inputs(torch, b, h, s, d, "bfloat16")
    out, lse = tilepy.flash_attention(q, k, v, causal=causal, return_lse=True)
    grads = poisoned(torch, q, k, v)
    portable = ab.choose_config(d, "bfloat16", wgmma=False)

    def ours(config=None):
        return tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                               config=config, dq=grads[0], dk=grads[1],
                                               dv=grads[2])

    err = checked_pair(torch, grads, lambda: ours(portable), ours, "tilepy")
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours),
               "tilepy mma.sync": gpu_time(torch, lambda: ours(portable))}
    want = reference_grads(torch, q, k, v, dout, causal)
    timings[CUDNN] = try_peer(notes, CUDNN, lambda: sdpa_backward_timing(
        torch, "CUDNN_ATTENTION", q, k, v, dout, causal, want, tolerance("bfloat16"), CUDNN))
    row, shp, tag = labels(b, h, s, d, "bfloat16", causal)
    record_throughput(record, work=work_of(b, h, s, d, causal, 5), unit="TFLOPS",
                      timings=timings, main=CUDNN, notes=notes, gpu=gpu_name, shape=shp,
                      dtype="bfloat16", causal=causal, config=config_of(d, "bfloat16", causal),
                      max_rel_err=err, table="Attention backward, head dims between widths",
                      case=row, figure=f"attention_backward_padded_{tag}", x=d,
                      xlabel="head dim")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


def deterministic_varlen(torch, grads, reference, run):
    """``run`` (the deterministic call into ``grads``) checked against ``reference`` and
    twice against itself (the same bits), then timed."""
    checked_pair(torch, grads, reference, run, DETERMINISTIC)
    first = [g.clone() for g in grads]
    run()
    torch.cuda.synchronize()
    if not all(torch.equal(a, b) for a, b in zip(first, grads)):
        raise AssertionError(f"{DETERMINISTIC}: two runs differ")
    return gpu_time(torch, run)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention_varlen_backward(benchmark, record, torch, gpu_name, causal):
    """The backward of packed sequences (``flash_attention_varlen_backward``) over the varlen
    forward benchmark's batch — 32 sequences of random lengths 128…4096 (seed 0), H16 D128
    bf16: the built-in choice (on sm_90 at head_dim 128 the wgmma pair whose dQ has its own
    kernel: ``attention_varlen.BACKWARD_FUSED_MIN_HEAD_DIM``) against the mma.sync kernels
    (``config=``; the gradients compared, bf16 tolerance), the warp-specialised wgmma kernel
    with dQ by bulk reductions (the fixed-length backward's choice at 128; ``config=``, its
    gradients checked the same way) and tilepy's fixed-length backward at the same tokens
    (its time scaled to the same pairs); ``deterministic=True`` timed beside (checked for the
    same bits twice). TFLOPS count 2.5× the forward's work over the visible pairs."""
    import tilepy
    from tilepy.ops import attention_varlen as av
    from tilepy.ops.attention_backward import choose_config

    h, d, dt = 16, 128, torch.bfloat16
    lens = np.random.default_rng(0).integers(128, 4097, 32)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    total, longest = int(lens.sum()), int(lens.max())
    q, k, v, dout = (torch.randn(total, h, d, device="cuda", dtype=dt) for _ in range(4))
    out, lse = tilepy.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                             return_lse=True)
    grads = poisoned(torch, q, k, v)
    portable = choose_config(d, "bfloat16", True, variant=True, wgmma=False)

    def ours(config=None):
        return av.flash_attention_varlen_backward(
            dout, q, k, v, out, lse, cu, cu, longest, longest, causal=causal, dq=grads[0],
            dk=grads[1], dv=grads[2], check_seqlens=False, config=config)

    err = checked_pair(torch, grads, lambda: ours(portable), ours, "tilepy")
    pairs = int(sum(n * (n + 1) // 2 if causal else n * n for n in lens)) * h
    timings = {"tilepy": gpu_time(torch, ours),
               "tilepy mma.sync": gpu_time(torch, lambda: ours(portable))}
    fused = choose_config(d, "bfloat16", False)     # the fixed-length backward's choice
    notes = {}
    timings["tilepy warp-specialised"] = try_peer(notes, "tilepy warp-specialised", lambda: (
        checked_pair(torch, grads, lambda: ours(portable), lambda: ours(fused),
                     "tilepy warp-specialised"),
        gpu_time(torch, lambda: ours(fused)))[1])
    for t in grads:
        t.fill_(float("nan"))  # the deterministic check must see its own writes
    timings[DETERMINISTIC] = try_peer(notes, DETERMINISTIC, lambda: deterministic_varlen(
        torch, grads, lambda: ours(portable), lambda: av.flash_attention_varlen_backward(
            dout, q, k, v, out, lse, cu, cu, longest, longest, causal=causal, dq=grads[0],
            dk=grads[1], dv=grads[2], check_seqlens=False, deterministic=True)))
    sm = total // 32
    qf, kf, vf, df = (torch.randn(32, h, sm, d, device="cuda", dtype=dt) for _ in range(4))
    of, lf = tilepy.flash_attention(qf, kf, vf, causal=causal, return_lse=True)
    fixed = gpu_time(torch, lambda: tilepy.flash_attention_backward(df, qf, kf, vf, of, lf,
                                                                    causal=causal))
    fixed_pairs = 32 * h * (sm * (sm + 1) // 2 if causal else sm * sm)
    timings["tilepy fixed-length (TFLOPS)"] = dataclasses.replace(
        fixed, ms=fixed.ms * pairs / fixed_pairs,
        ms_as_called=fixed.ms_as_called and fixed.ms_as_called * pairs / fixed_pairs)
    mask = "causal" if causal else "full"
    record_throughput(record, work=2.5 * 4 * pairs * d, unit="TFLOPS", timings=timings,
                      main="tilepy fixed-length (TFLOPS)", gpu=gpu_name, notes=notes,
                      shape=f"32 seqs 128-4096 (total {total}) H={h} D={d}", dtype="bfloat16",
                      causal=causal, max_rel_err=err, table="Attention varlen backward",
                      case=f"varlen backward 32x(128-4096) H{h} D{d} {mask} bfloat16",
                      figure=f"attention_varlen_backward_{mask}", x=total, xlabel="tokens")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


# ---- user functions (issue 25): score_mod / mask_mod through the backward --------------------

def _softcap50_grad(score, b, h, q_idx, kv_idx):
    # d/dx 50 tanh(x / 50), float32 on tanh.approx as the forward's _softcap50_f32
    t = tanh_approx(score * np.float32(0.02))
    return np.float32(1.0) - t * t


def _one(score, b, h, q_idx, kv_idx):
    return np.float32(1.0)


#: (name of the forward benchmark's USER_FUNCTIONS case, score_mod_grad or None)
USER_BACKWARD = [("softcap50_f32", _softcap50_grad), ("alibi32", _one),
                 ("causal_mask_mod", None), ("window1024_mask_mod", None),
                 ("document_block_mask", None)]


@pytest.mark.parametrize("case", USER_BACKWARD, ids=lambda c: c[0])
def test_flash_attention_backward_user_functions(benchmark, record, torch, gpu_name, case):
    """The forward benchmark's user functions (``test_bench_attention.USER_FUNCTIONS``, B4
    H16 S8192 D128 bf16) through the backward: ``tilepy.flash_attention_backward`` with the
    same ``score_mod`` (and its ``score_mod_grad``) / ``mask_mod`` / block mask, against the
    built-in argument's backward where there is one (the gradients compared, bf16 tolerance)
    and compiled FlexAttention's backward with the same functions (its own block mask). TFLOPS
    count 2.5× the forward's work over the causal (or all) pairs for every implementation."""
    import tilepy
    from test_bench_attention import USER_FUNCTIONS

    name, grad = case
    _, causal, mods, builtin, flex_mods = next(c for c in USER_FUNCTIONS if c[0] == name)
    b, h, s, d = 4, 16, 8192, 128
    q, k, v, dout = inputs(torch, b, h, s, d, "bfloat16")
    kw = dict(dict(causal=causal), **mods(torch, b, h, s))
    if grad is not None:
        kw["score_mod_grad"] = grad
    out, lse = tilepy.flash_attention(q, k, v, return_lse=True, **kw)
    grads = poisoned(torch, q, k, v)

    def ours(args=kw, o=out, l2=lse):
        return tilepy.flash_attention_backward(dout, q, k, v, o, l2, dq=grads[0], dk=grads[1],
                                               dv=grads[2], **args)

    notes, err = {}, None
    if builtin is not None:
        bkw = dict(dict(causal=causal), **builtin(torch, b, h, s))
        bout, blse = tilepy.flash_attention(q, k, v, return_lse=True, **bkw)
        err = checked_pair(torch, grads, ours, lambda: ours(bkw, bout, blse),
                           "tilepy built-in against the user functions")
    else:
        ours()
        torch.cuda.synchronize()
        if any(torch.isnan(g).any().item() for g in grads):
            raise AssertionError("tilepy: NaN in the gradients")
    timings = {"tilepy": gpu_time(torch, ours)}
    if builtin is not None:
        timings["tilepy built-in"] = gpu_time(torch, lambda: ours(bkw, bout, blse))
    if "block_mask" in kw and kw["block_mask"].mod_args:
        # a diagnostic, not an answer: the same block mask with a function that reads its
        # array and hides nothing — what the partial blocks' mask costs the backward
        import dataclasses

        from test_bench_attention import _see_all_doc

        cheap = dict(kw, block_mask=dataclasses.replace(kw["block_mask"], mask_mod=_see_all_doc,
                                                        partial_bits=None))
        timings["tilepy mask reads nothing (wrong answer)"] = gpu_time(
            torch, lambda: ours(cheap))
        # the mask's function in place of its bitmaps; the deterministic pair of kernels; the
        # warp-specialised kernel with the dense split of registers (producer 24)
        fn = dict(kw, block_mask=dataclasses.replace(kw["block_mask"], partial_bits=None,
                                                     partial_bits_t=None))
        timings["tilepy mask function"] = gpu_time(torch, lambda: ours(fn))
        timings["tilepy deterministic"] = gpu_time(torch, lambda: ours(dict(
            kw, deterministic=True)))
        from tilepy.ops import attention_backward as ab
        from tilepy.ops import attention_backward_wgmma as bw

        split = bw.WS_REGISTERS_SPARSE
        try:
            bw.WS_REGISTERS_SPARSE = bw.WS_REGISTERS
            ab._PLANS.clear()
            timings["tilepy producer 24 registers"] = gpu_time(torch, ours)
        finally:
            bw.WS_REGISTERS_SPARSE = split
            ab._PLANS.clear()
    flex = flex_mods(torch, b, h, s)
    if "mask_mod" not in flex:
        flex = dict(flex, mask_mod=(lambda bb, hh, qi, kj: kj <= qi) if causal else None)

    timings["FlexAttention"] = try_peer(notes, "FlexAttention", lambda: flex_backward_timing(
        torch, q, k, v, dout, flex.get("score_mod"), flex["mask_mod"], b, h))
    pairs = h * b * (s * (s + 1) // 2 if causal else s * s)
    kind = "mask_mod" if "mask_mod" in kw or "block_mask" in kw else "score_mod"
    record_throughput(record, work=2.5 * 4 * pairs * d, unit="TFLOPS", timings=timings,
                      main="FlexAttention", notes=notes, gpu=gpu_name,
                      shape=f"B={b} H={h} S={s} D={d}", dtype="bfloat16", causal=causal,
                      max_rel_err=err, table="Attention backward, user functions",
                      case=f"B{b} H{h} S{s} D{d} {name} {kind} bfloat16",
                      figure=f"attention_backward_user_{name}", x=s,
                      xlabel="sequence length")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)
