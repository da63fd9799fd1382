"""FlashAttention forward: ``tilepy.flash_attention`` against PyTorch's
``scaled_dot_product_attention`` with the FlashAttention-2 backend and with the cuDNN backend,
and a Triton fused attention forward, same run.

Throughput is ``4·B·H·Sq·Sk·D`` FLOP (two matmuls), halved for causal attention, per second
(``bench/measure.py``): of GPU time (CUDA events, the CPU cost of each call kept out of the
events and recorded as ``host_us``) and of the time as called (back-to-back calls, host cost
included); ratios use each implementation's slower one. tilepy and Triton write into a
preallocated ``out``; SDPA allocates its result (from PyTorch's cache). The SDPA backend is
pinned with ``torch.nn.attention.sdpa_kernel`` around the whole timing. The main peer is SDPA's
FlashAttention-2 backend (``ratio``); cuDNN and Triton are in ``ratios``. A peer that refuses
a case is left out and says why in ``peer_errors``.

Shapes of issue 7: B=4, H=32, S ∈ {1024, 2048, 4096, 8192}, D=128; B=8, H=16, S=2048, D=64;
GQA with 8 KV heads (B=4, Hq=32, S=4096, D=128); issue 25's shortest, B=16, H=16, S=512,
D=64; causal and not; float16, and bfloat16 at
two shapes. Select parts with ``-k``: ``-k "not bfloat16"``, ``-k causal``, ``-k S8192``, …
"""

import dataclasses

import numpy as np
import pytest
from tilepy.ptx.math import ex2_approx, tanh_approx
from measure import (
    checked_timing,
    gpu_time,
    max_abs_err,
    record_throughput,
    triton_peers,
    try_peer,
)

# (batch, heads_q, heads_kv, seq, head_dim)
SEQ_SWEEP = [(4, 32, 32, s, 128) for s in (1024, 2048, 4096, 8192)]
D64 = (8, 16, 16, 2048, 64)
GQA = (4, 32, 8, 4096, 128)
# the shortest sequences issue 25 lists against cuDNN (few blocks a head)
SHORT = (16, 16, 16, 512, 64)
# head dims past the two classic ones (issue 25: 96, 192, 256 at S4096, fp16 and bf16)
HEAD_DIMS = [(4, 16, 16, 4096, d) for d in (96, 192, 256)]
CASES = ([(s, "float16") for s in SEQ_SWEEP + [D64, GQA, SHORT] + HEAD_DIMS]
         + [(s, "bfloat16") for s in [SEQ_SWEEP[2], D64] + HEAD_DIMS])
FA2 = "SDPA FA2"


def tolerance(dtype):
    """Max abs error relative to max |v|: p is rounded to the input dtype before p·v."""
    return 4e-3 if dtype == "float16" else 3e-2


def sdpa_timing(torch, backend, q, k, v, causal):
    """SDPA pinned to ``backend``; raises when the backend refuses the case."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    kw = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    with sdpa_kernel(getattr(SDPBackend, backend)):
        return gpu_time(torch, lambda: sdpa(q, k, v, is_causal=causal, **kw))


def config_of(d, dtype, causal=False):
    try:
        from tilepy.ops.attention import choose_config

        return choose_config(d, dtype, causal).describe()
    except Exception:  # noqa: BLE001 — a description, never a reason to fail
        return "?"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: "B{}_Hq{}_Hkv{}_S{}_D{}".format(*c[0]) + f"-{c[1]}")
def test_flash_attention(benchmark, record, torch, gpu_name, case, causal):
    import tilepy

    (b, hq, hkv, s, d), dtype = case
    tdt = getattr(torch, dtype)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=tdt)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=tdt)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=tdt)
    out = torch.empty_like(q)

    def ours():
        return tilepy.flash_attention(q, k, v, causal=causal, out=out)

    ours()  # compile
    kr = k.repeat_interleave(hq // hkv, dim=1)
    vr = v.repeat_interleave(hq // hkv, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
    del kr, vr
    limit = tolerance(dtype) * v.abs().max().item()
    err = max_abs_err(out, want)
    assert err < limit, err

    notes = {}
    timings = {"tilepy": gpu_time(torch, ours)}
    for label, backend in ((FA2, "FLASH_ATTENTION"), ("SDPA cuDNN", "CUDNN_ATTENTION")):
        timings[label] = try_peer(notes, label,
                                  lambda b=backend: sdpa_timing(torch, b, q, k, v, causal))
    timings["Triton"] = try_peer(notes, "Triton", lambda: checked_timing(
        torch, lambda o: triton_peers().attention(q, k, v, causal=causal, out=o), want, limit,
        err=max_abs_err))
    mask = "causal" if causal else "full"
    gqa = f" Hkv={hkv}" if hkv != hq else ""
    figure = f"attention_{dtype}_B{b}_H{hq}{'_gqa' if gqa else ''}_D{d}_{mask}"
    record_throughput(record, work=4 * b * hq * s * s * d / (2 if causal else 1),
                      unit="TFLOPS", timings=timings, main=FA2, notes=notes, gpu=gpu_name,
                      shape=f"B={b} Hq={hq} Hkv={hkv} S={s} D={d}", dtype=dtype,
                      causal=causal, config=config_of(d, dtype, causal), max_abs_err=err,
                      table="Attention forward",
                      case=f"B{b} H{hq}{gqa} S{s} D{d} {mask} {dtype}",
                      figure=figure, x=s, xlabel="sequence length")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


# ---- V's head dim other than Q's (issue 25: DeepSeek's 192 / 128) ------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", [(192, 128)], ids=lambda d: f"D{d[0]}_V{d[1]}")
def test_flash_attention_head_dim_v(benchmark, record, torch, gpu_name, dims, causal):
    import tilepy
    from tilepy.ops.attention import choose_config

    (d, dv), (b, h, s) = dims, (4, 16, 4096)
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, h, s, dv, device="cuda", dtype=torch.bfloat16)
    out = q.new_empty(b, h, s, dv)

    def ours():
        return tilepy.flash_attention(q, k, v, causal=causal, out=out)

    ours()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    limit = tolerance("bfloat16") * v.abs().max().item()
    err = max_abs_err(out, want)
    assert err < limit, err
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours)}
    for label, backend in (("SDPA cuDNN", "CUDNN_ATTENTION"), (FA2, "FLASH_ATTENTION"),
                           ("SDPA efficient", "EFFICIENT_ATTENTION")):
        timings[label] = try_peer(notes, label,
                                  lambda b=backend: sdpa_timing(torch, b, q, k, v, causal))
    mask = "causal" if causal else "full"
    # Q·Kᵀ over d, P·V over dv: 2·B·H·S²·(d + dv), halved when causal
    record_throughput(record, work=2 * b * h * s * s * (d + dv) / (2 if causal else 1),
                      unit="TFLOPS", timings=timings, main="SDPA cuDNN", notes=notes,
                      gpu=gpu_name, shape=f"B={b} H={h} S={s} D={d} Dv={dv}",
                      dtype="bfloat16", causal=causal, max_abs_err=err,
                      config=choose_config(d, "bfloat16", causal, head_dim_v=dv).describe(),
                      table="Attention forward, V's head dim other than Q's",
                      case=f"B{b} H{h} S{s} D{d} Dv{dv} {mask} bfloat16",
                      figure=f"attention_head_dim_v_D{d}_V{dv}_{mask}", x=s,
                      xlabel="sequence length")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


# ---- FP8 (issue 28): e4m3 q, k, v against tilepy's own bfloat16 attention -------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [128, 256], ids=lambda d: f"D{d}")
def test_flash_attention_fp8(benchmark, record, torch, gpu_name, d, causal):
    """The issue's shapes (B4 H32 S8192, D128 and D256): tilepy on e4m3 inputs with per-tensor
    descales (V's transpose included in its time) against tilepy's bfloat16 attention and
    SDPA's cuDNN backend on the same dequantised values, same run; error against the bfloat16
    result (e4m3's P rounding). Also timed: the FP8 kernel with every other (and every third)
    8-key tile's exponentials on the FMA pipe (``fma_exp_every`` 2 and 3)."""
    import tilepy
    from tilepy.ops.attention_fp8 import default_config

    b, h, s = 4, 32, 8192
    f8 = torch.float8_e4m3fn
    q, k, v = ((torch.randn(b, h, s, d, device="cuda") * 2).to(f8) for _ in range(3))
    dq, dk, dv = (torch.tensor(x, device="cuda") for x in (0.3, 0.5, 1.5))
    out = torch.empty(b, h, s, d, device="cuda", dtype=torch.bfloat16)

    def ours():
        return tilepy.flash_attention(q, k, v, causal=causal, descale_q=dq, descale_k=dk,
                                      descale_v=dv, out=out)

    ours()
    qb, kb, vb = (x.to(torch.bfloat16) * f for x, f in ((q, dq), (k, dk), (v, dv)))
    out_bf = torch.empty_like(qb)

    def bf16():
        return tilepy.flash_attention(qb, kb, vb, causal=causal, out=out_bf)

    bf16()
    limit = 0.015 * vb.abs().max().item()
    err = max_abs_err(out, out_bf)
    assert err < limit, err
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours), "tilepy bf16": gpu_time(torch, bf16)}
    timings["SDPA cuDNN"] = try_peer(notes, "SDPA cuDNN", lambda: sdpa_timing(
        torch, "CUDNN_ATTENTION", qb, kb, vb, causal))
    # every other (every third) 8-key tile's exponentials on the FMA pipe
    # (WgmmaAttentionConfig's fma_exp_every): the candidate remedy for the MUFU-bound
    # softmax, timed beside (a half may overload the FMA pipe instead: a third too)
    out_f = torch.empty_like(out)
    for every, name in ((2, "tilepy, FMA exponentials"), (3, "tilepy, FMA exponentials 1/3")):
        fma_cfg = dataclasses.replace(default_config(d, d), fma_exp_every=every)

        def fma_exp(cfg=fma_cfg):
            return tilepy.flash_attention(q, k, v, causal=causal, descale_q=dq, descale_k=dk,
                                          descale_v=dv, out=out_f, config=cfg)

        fma_exp()
        assert max_abs_err(out_f, out_bf) < limit
        timings[name] = gpu_time(torch, fma_exp)
    mask = "causal" if causal else "full"
    record_throughput(record, work=4 * b * h * s * s * d / (2 if causal else 1),
                      unit="TFLOPS", timings=timings, main="tilepy bf16", notes=notes,
                      gpu=gpu_name, shape=f"B={b} H={h} S={s} D={d}", dtype="float8_e4m3fn",
                      causal=causal, max_abs_err=err, config=default_config(d, d).describe(),
                      table="Attention forward, FP8",
                      case=f"B{b} H{h} S{s} D{d} {mask} e4m3",
                      figure=f"attention_fp8_D{d}_{mask}", x=s, xlabel="sequence length")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


# ---- the variants (issue 25): a sliding window and a soft cap -------------------------------

def flex_timing(torch, q, k, v, score_mod=None, mask_mod=None):
    """Compiled FlexAttention (PyTorch's) of the same problem; a block mask from ``mask_mod``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, h, s, _ = q.shape
    # _compile: the mask_mod traced, not evaluated over the whole (S, S) grid (128 GiB at S32768)
    block_mask = (create_block_mask(mask_mod, b, h, s, k.shape[2], device="cuda",
                                    _compile=True) if mask_mod is not None else None)
    flex = torch.compile(flex_attention)
    run = lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)  # noqa: E731
    run()
    return gpu_time(torch, run)


# (name, (batch, heads, seq, head_dim), causal, window, softcap)
VARIANTS = [
    ("window4096", (1, 16, 32768, 128), True, (4095, 0), 0.0),
    ("softcap50", (4, 16, 8192, 128), False, None, 50.0),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda c: c[0])
def test_flash_attention_variants(benchmark, record, torch, gpu_name, variant):
    """``window=`` / ``softcap=`` (on sm_90 the TMA wgmma kernels' variants) against
    compiled FlexAttention, and tilepy's plain kernel of the same shape (causal for the window:
    its TFLOPS over its own visible pairs are in the same record's ``impls``). Throughput
    counts only the visible (query, key) pairs: ``4·B·H·pairs·D``."""
    import tilepy

    name, (b, h, s, d), causal, window, cap = variant
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)

    def ours():
        return tilepy.flash_attention(q, k, v, causal=causal, window=window, softcap=cap,
                                      out=out)

    ours()
    if window is not None:
        w = window[0] + 1
        pairs = h * b * (s * w - w * (w - 1) // 2)   # row i sees min(i + 1, w) keys

        def mask_mod(bb, hh, qi, kj):
            return (kj <= qi) & (qi - kj < w)

        score_mod = None
    else:
        pairs = h * b * s * s
        mask_mod = None

        def score_mod(score, bb, hh, qi, kj):
            return cap * torch.tanh(score / cap)

    notes = {}
    timings = {"tilepy": gpu_time(torch, ours)}
    timings["FlexAttention"] = try_peer(notes, "FlexAttention", lambda: flex_timing(
        torch, q, k, v, score_mod, mask_mod))
    plain_pairs = h * b * (s * (s + 1) // 2 if causal else s * s)
    plain = gpu_time(torch, lambda: tilepy.flash_attention(q, k, v, causal=causal, out=out))
    # the plain kernel's time scaled to this case's pairs: the ratio is of TFLOPS
    timings["tilepy plain (TFLOPS)"] = dataclasses.replace(
        plain, ms=plain.ms * pairs / plain_pairs,
        ms_as_called=plain.ms_as_called and plain.ms_as_called * pairs / plain_pairs)
    record_throughput(record, work=4 * pairs * d, unit="TFLOPS", timings=timings,
                      main="FlexAttention", notes=notes, gpu=gpu_name,
                      shape=f"B={b} H={h} S={s} D={d}", dtype="bfloat16", causal=causal,
                      window=window, softcap=cap, table="Attention variants",
                      case=f"B{b} H{h} S{s} D{d} {name} bfloat16",
                      figure=f"attention_variant_{name}", x=s, xlabel="sequence length")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


# ---- user functions (score_mod= / mask_mod=) against the built-in arguments -----------------

def _softcap50(score, b, h, q_idx, kv_idx):
    # a global, not an import inside the function: Numba does not compile import statements;
    # Python float constants make the arithmetic float64 (score is float32)
    return 50.0 * tanh_approx(score * 0.02)


def _softcap50_f32(score, b, h, q_idx, kv_idx):
    # the same with float32 constants: the built-in softcap=50's instructions
    return np.float32(50.0) * tanh_approx(score * np.float32(0.02))


def _alibi(score, b, h, q_idx, kv_idx):
    # ALiBi's slopes for 16 heads, 2**(-(h + 1) / 2), on the distance behind the diagonal
    return score - 2.0 ** (-(h + 1) * 0.5) * (q_idx - kv_idx)


def _alibi32(score, b, h, q_idx, kv_idx):
    # the same in float32 on ex2.approx: what _alibi costs beyond the bias itself is its
    # float64 power
    return score - ex2_approx(np.float32(-0.5 * (h + 1))) * np.float32(q_idx - kv_idx)


def _same_document(b, h, q_idx, kv_idx, doc):
    return doc[b, min(q_idx, 8191)] == doc[b, min(kv_idx, 8191)]


def _documents(torch, b, s):
    """(b, s) int32 ids of 8 documents of random lengths per row (fixed seed)."""
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randint(1, s, (b, 7), generator=g), dim=1).values
    ids = torch.searchsorted(cuts, torch.arange(s).expand(b, s).contiguous(), right=True)
    return ids.to(torch.int32).cuda()


def _causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _window1024(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx and q_idx - kv_idx < 1024


def _document_causal(b, h, q_idx, kv_idx, doc):
    # (& and clamped indices, as docs/attention.md advises: unconditional reads the kernel
    # can share between a row's columns)
    return (kv_idx <= q_idx) & (doc[b, min(q_idx, 8191)] == doc[b, min(kv_idx, 8191)])


def _document_causal_and(b, h, q_idx, kv_idx, doc):
    # (the same with a short-circuit `and`: every read behind a branch)
    return kv_idx <= q_idx and doc[b, min(q_idx, 8191)] == doc[b, min(kv_idx, 8191)]


def _see_all_doc(b, h, q_idx, kv_idx, doc):
    return True


def _document_block_mask(torch, b, h, s, fn=_document_causal):
    """tilepy's keywords for causal document masking with a block mask made once (outside
    the timing), as a FlexAttention user makes one with create_block_mask."""
    import tilepy

    doc = _documents(torch, b, s)
    return dict(causal=False, block_mask=tilepy.create_block_mask(
        fn, b, None, s, s, mod_args=(doc,)))


def _alibi_slopes(torch, h):
    return torch.tensor([2.0 ** (-(i + 1) * 0.5) for i in range(h)], device="cuda")


# (name, causal, tilepy's keywords, the same as built-in arguments or None, Flex's keywords),
# each a function of (torch, batch, heads, seq)
USER_FUNCTIONS = [
    ("softcap50", False, lambda torch, b, h, s: dict(score_mod=_softcap50),
     lambda torch, b, h, s: dict(softcap=50.0),
     lambda torch, b, h, s: dict(score_mod=lambda x, bb, hh, qi, kj: 50.0 * torch.tanh(
         x / 50.0))),
    ("softcap50_f32", False, lambda torch, b, h, s: dict(score_mod=_softcap50_f32),
     lambda torch, b, h, s: dict(softcap=50.0),
     lambda torch, b, h, s: dict(score_mod=lambda x, bb, hh, qi, kj: 50.0 * torch.tanh(
         x / 50.0))),
    ("alibi", True, lambda torch, b, h, s: dict(score_mod=_alibi),
     lambda torch, b, h, s: dict(alibi_slopes=_alibi_slopes(torch, h)),
     lambda torch, b, h, s: dict(score_mod=lambda x, bb, hh, qi, kj: x - torch.exp2(
         -(hh + 1) * 0.5) * (qi - kj))),
    ("alibi32", True, lambda torch, b, h, s: dict(score_mod=_alibi32),
     lambda torch, b, h, s: dict(alibi_slopes=_alibi_slopes(torch, h)),
     lambda torch, b, h, s: dict(score_mod=lambda x, bb, hh, qi, kj: x - torch.exp2(
         -(hh + 1) * 0.5) * (qi - kj))),
    # packed documents under causal: the ids read by mask_mod through mod_args (tilepy has no
    # block mask yet: it visits every causal key block; Flex skips the other documents')
    ("document", True, lambda torch, b, h, s: dict(mask_mod=_same_document,
                                                   mod_args=(_documents(torch, b, s),)),
     None,
     lambda torch, b, h, s: (lambda doc: dict(mask_mod=lambda bb, hh, qi, kj: (
         doc[bb, qi] == doc[bb, kj]) & (kj <= qi)))(_documents(torch, b, s))),
    # block masks (made by tilepy for a mask_mod of no array, kept per shape; or by the user
    # with tilepy.create_block_mask): causal and a causal 1024-key window written as mask_mod
    # against the built-in arguments, and the document mask above with its block mask
    ("causal_mask_mod", True, lambda torch, b, h, s: dict(causal=False, mask_mod=_causal_mask),
     lambda torch, b, h, s: dict(causal=True),
     lambda torch, b, h, s: dict(mask_mod=lambda bb, hh, qi, kj: kj <= qi)),
    ("window1024_mask_mod", True,
     lambda torch, b, h, s: dict(causal=False, mask_mod=_window1024),
     lambda torch, b, h, s: dict(causal=True, window=(1023, 0)),
     lambda torch, b, h, s: dict(mask_mod=lambda bb, hh, qi, kj: (kj <= qi) & (qi - kj < 1024))),
    ("document_block_mask", True, _document_block_mask, None,
     lambda torch, b, h, s: (lambda doc: dict(mask_mod=lambda bb, hh, qi, kj: (
         doc[bb, qi] == doc[bb, kj]) & (kj <= qi)))(_documents(torch, b, s))),
    ("document_block_mask_and", True,
     lambda torch, b, h, s: _document_block_mask(torch, b, h, s, _document_causal_and), None,
     lambda torch, b, h, s: (lambda doc: dict(mask_mod=lambda bb, hh, qi, kj: (
         doc[bb, qi] == doc[bb, kj]) & (kj <= qi)))(_documents(torch, b, s))),
]


@pytest.mark.parametrize("case", USER_FUNCTIONS, ids=lambda c: c[0])
def test_flash_attention_user_functions(benchmark, record, torch, gpu_name, case):
    """``score_mod=`` / ``mask_mod=`` written by a user (plain Python functions inlined into
    the kernel, a document mask reading its ids through ``mod_args=``) at B4 H16 S8192 D128
    bf16, against compiled FlexAttention with the same functions, and the built-in argument
    that computes the same where there is one (``softcap=``, ``alibi_slopes=``): the issue's
    "within 10 %". TFLOPS count the causal (or all) pairs for every implementation, also for
    the document mask, whose visible pairs are fewer."""
    import tilepy

    name, causal, mods, builtin, flex_mods = case
    b, h, s, d = 4, 16, 8192, 128
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    mods = mods(torch, b, h, s)
    builtin = builtin(torch, b, h, s) if builtin is not None else None
    flex = flex_mods(torch, b, h, s)
    if "mask_mod" in flex:   # it says the causal part itself
        flex_causal = flex
    else:
        flex_causal = dict(flex, mask_mod=(lambda bb, hh, qi, kj: kj <= qi) if causal else None)

    def ours():   # (a case's keywords may say causal themselves: its mask_mod is causal)
        return tilepy.flash_attention(q, k, v, out=out, **dict(dict(causal=causal), **mods))

    ours()
    kind = "mask_mod" if "mask_mod" in mods or "block_mask" in mods else "score_mod"
    pairs = h * b * (s * (s + 1) // 2 if causal else s * s)
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours)}
    timings["FlexAttention"] = try_peer(notes, "FlexAttention", lambda: flex_timing(
        torch, q, k, v, **flex_causal))
    if builtin is not None:
        timings["tilepy built-in"] = gpu_time(torch, lambda: tilepy.flash_attention(
            q, k, v, out=out, **dict(dict(causal=causal), **builtin)))
    if kind == "mask_mod" and name != "document":   # block-sparse: the other TMA kernel
        import dataclasses

        from tilepy.ops import attention as at

        other = dataclasses.replace(at.hopper_config(d, "bfloat16", False),   # (d128: grid)
                                    persistent=not at.SPARSE_PERSISTENT)
        label = "tilepy persistent kernel" if other.persistent else "tilepy grid kernel"
        timings[label] = gpu_time(torch, lambda: tilepy.flash_attention(
            q, k, v, out=out, config=other, **dict(dict(causal=causal), **mods)))
    if "block_mask" in mods and mods["block_mask"].mod_args:
        import dataclasses

        # the mask's function on the partial blocks in place of its bitmap (partial_bits)
        mask = mods["block_mask"]
        fn = dataclasses.replace(mask, partial_bits=None)
        timings["tilepy mask function"] = gpu_time(
            torch, lambda: tilepy.flash_attention(q, k, v, out=out, block_mask=fn))
        # a diagnostic, not an answer: the same block mask with a mask function that reads
        # its array but hides nothing, so the partial blocks cost no mask at all. What it
        # saves is the most any cheaper mask evaluation could
        cheap = dataclasses.replace(mask, mask_mod=_see_all_doc, partial_bits=None)
        timings["tilepy mask reads nothing (wrong answer)"] = gpu_time(
            torch, lambda: tilepy.flash_attention(q, k, v, out=out, block_mask=cheap))
    record_throughput(record, work=4 * pairs * d, unit="TFLOPS", timings=timings,
                      main="FlexAttention", notes=notes, gpu=gpu_name,
                      shape=f"B={b} H={h} S={s} D={d}", dtype="bfloat16", causal=causal,
                      table="Attention user functions",
                      case=f"B{b} H{h} S{s} D{d} {name} {kind} bfloat16",
                      figure=f"attention_user_{name}", x=s, xlabel="sequence length")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


# ---- packed variable-length batches (issue 25) -----------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention_varlen(benchmark, record, torch, gpu_name, causal):
    """``tilepy.flash_attention_varlen`` over 32 sequences of random lengths 128…4096 (seed
    0), H16 D128 bf16, against SDPA's cuDNN backend on the same batch padded to the longest
    (its wasted work included: what a user without varlen runs) and tilepy's fixed-length
    kernel at the same number of tokens (its ratio in TFLOPS): 32 sequences of the mean length. Throughput counts the visible pairs of the packed sequences. Lengths checked on
    the host once, outside the timing (``check_seqlens=False`` inside it)."""
    import tilepy

    h, d, dt = 16, 128, torch.bfloat16
    lens = np.random.default_rng(0).integers(128, 4097, 32)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    total, longest = int(lens.sum()), int(lens.max())
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=dt) for _ in range(3))
    out = torch.empty_like(q)

    def ours(check=False):
        return tilepy.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                             out=out, check_seqlens=check)

    ours(True)
    # correctness: two sequences against SDPA (math) in float32
    for z in (0, 17):
        a, e = int(cu[z]), int(cu[z + 1])
        want = torch.nn.functional.scaled_dot_product_attention(
            *(x[a:e].transpose(0, 1).float() for x in (q, k, v)), is_causal=causal)
        err = max_abs_err(out[a:e].transpose(0, 1), want)
        assert err < tolerance("bfloat16") * v.abs().max().item(), (z, err)
    pairs = int(sum(n * (n + 1) // 2 if causal else n * n for n in lens)) * h
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours)}
    padded = torch.zeros(32, h, longest, d, device="cuda", dtype=dt)
    timings["SDPA cuDNN padded"] = try_peer(notes, "SDPA cuDNN padded", lambda: sdpa_timing(
        torch, "CUDNN_ATTENTION", padded, padded, padded, causal))
    del padded
    # 32 sequences of the mean length: the same tokens, about the same pairs
    sm = total // 32
    qf, kf, vf = (torch.randn(32, h, sm, d, device="cuda", dtype=dt) for _ in range(3))
    fixed = gpu_time(torch, lambda: tilepy.flash_attention(qf, kf, vf, causal=causal))
    fixed_pairs = 32 * h * (sm * (sm + 1) // 2 if causal else sm * sm)
    timings["tilepy fixed-length (TFLOPS)"] = dataclasses.replace(
        fixed, ms=fixed.ms * pairs / fixed_pairs,
        ms_as_called=fixed.ms_as_called and fixed.ms_as_called * pairs / fixed_pairs)
    mask = "causal" if causal else "full"
    record_throughput(record, work=4 * pairs * d, unit="TFLOPS", timings=timings,
                      main="SDPA cuDNN padded", notes=notes, gpu=gpu_name,
                      shape=f"32 seqs 128-4096 (total {total}) H={h} D={d}", dtype="bfloat16",
                      causal=causal, table="Attention varlen",
                      case=f"varlen 32x(128-4096) H{h} D{d} {mask} bfloat16",
                      figure=f"attention_varlen_{mask}", x=total, xlabel="tokens")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)


# ---- decoding over a KV cache (issue 26) -----------------------------------------------------

#: (batch, capacity) of the decoding cases; heads 32 / 8, head_dim 128, bf16.
KV_SHAPES = [(b, s) for b in (1, 8, 64) for s in (4096, 32768, 131072)]
_COPY = {}


def copy_timing(torch, nbytes: int):
    """A device-to-device copy that moves ``nbytes`` (reads half, writes half) as a Timing:
    measured at that size up to 2 GiB moved, above it scaled from the 2 GiB copy (bandwidth
    flat by then); once per size and process."""
    from measure import Timing

    moved = min(nbytes, 2 << 30)
    if moved not in _COPY:
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        _COPY[moved] = gpu_time(torch, lambda: dst.copy_(src))
        del src, dst
    t = _COPY[moved]
    f = nbytes / moved
    return Timing(t.ms * f, t.host_us, t.flushed, t.hidden,
                  t.ms_as_called and t.ms_as_called * f, t.calls_as_called)


@pytest.mark.parametrize("sq", [1, 4], ids=["q1", "q4"])
@pytest.mark.parametrize("page", [None, 16, 256], ids=["contiguous", "page16", "page256"])
@pytest.mark.parametrize("shape", KV_SHAPES, ids=lambda s: f"B{s[0]}_S{s[1]}")
def test_flash_attention_with_kvcache(benchmark, record, torch, gpu_name, shape, page, sq):
    """``tilepy.flash_attention_with_kvcache`` (one decoding step: ``sq`` query rows per
    sequence, 32 query heads over 8 KV heads, head_dim 128, bf16, every sequence at the
    cache's capacity, ``num_splits`` chosen) as bandwidth: the bytes of K and V the visible
    keys occupy over the time. Peers in the same run: a device-to-device copy moving as many
    bytes (the main ratio: the fraction of copy bandwidth reached) and, on the contiguous
    cache, ``F.scaled_dot_product_attention(..., enable_gqa=True)`` over the whole cache (its
    default backend; not causal for ``sq`` 4: four rows' mask is no work at these lengths;
    left out above 8 GB of K and V). Correctness first: two sequences against SDPA in
    float32 (the bottom-right causal mask). Also timed where the keys are split: the combine
    kernel in blocks of four warps (``attention_kvcache.COMBINE_WARPS``; the default eight),
    and the opt-in merge by each row tile's last split inside the decoding kernel
    (``FUSED_MERGE``)."""
    import tilepy
    import torch.nn.functional as F

    b, cap = shape
    hq, hk, d, dt = 32, 8, 128, torch.bfloat16
    nbytes = 2 * b * cap * hk * d * 2
    if page is None:
        kc = torch.randn(b, cap, hk, d, device="cuda", dtype=dt)
        table = None
    else:
        kc = torch.randn(b * cap // page, page, hk, d, device="cuda", dtype=dt)
        table = torch.randperm(kc.shape[0], device="cuda").view(b, -1).int()
    vc = torch.randn_like(kc)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt)
    lens = torch.full((b,), cap, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)

    def ours(check=False):
        return tilepy.flash_attention_with_kvcache(q, kc, vc, lens, block_table=table, out=out,
                                                   check_seqlens=check)

    ours(True)
    for z in sorted({0, b - 1}):
        j = torch.arange(cap, device="cuda")
        k = kc[table[z, j // page], j % page] if page else kc[z]
        v = vc[table[z, j // page], j % page] if page else vc[z]
        mask = j[None] <= torch.arange(sq, device="cuda")[:, None] + cap - sq
        want = F.scaled_dot_product_attention(
            q[z:z + 1].transpose(1, 2).float(), k[None].transpose(1, 2).float(),
            v[None].transpose(1, 2).float(), attn_mask=mask, enable_gqa=True).transpose(1, 2)
        err = max_abs_err(out[z:z + 1], want)
        assert err < tolerance("bfloat16") * v.abs().max().item(), (z, err)
        del k, v
    notes = {}
    timings = {"tilepy": gpu_time(torch, ours), "device copy": copy_timing(torch, nbytes)}
    # the same with the combine kernel in blocks of four warps, and with the splits merged in
    # the decoding kernel (COMBINE_WARPS, FUSED_MERGE; the plan cache keys on both). (PDL
    # against plain stream order: sessions 33-34's runs.)
    from tilepy.ops import attention_kvcache as akv

    cfg = akv.choose_config(d, "bfloat16", sq, page or 0, hq // hk)
    splits = akv.decode_launches(q, kc, vc, lens, block_table=table)[3]
    first = out.clone()
    fused, warps = akv.FUSED_MERGE, akv.COMBINE_WARPS
    try:
        for name, merge, n in (("tilepy, 4-warp combine", False, 4),
                               ("tilepy, fused merge", True, warps)) if splits > 1 else ():
            akv.FUSED_MERGE, akv.COMBINE_WARPS = merge, n
            out.fill_(float("nan"))
            ours(True)
            err = max_abs_err(out, first)       # (the splits' sums in another grouping)
            assert err < tolerance("bfloat16") * vc.abs().max().item(), err
            timings[name] = gpu_time(torch, ours)
    finally:
        akv.FUSED_MERGE, akv.COMBINE_WARPS = fused, warps
    if page is None:
        if nbytes <= 8 << 30:
            qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
            timings["SDPA"] = try_peer(notes, "SDPA", lambda: gpu_time(
                torch, lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)))
        else:
            notes["SDPA"] = "left out above 8 GB of K and V"
    layout = "contiguous" if page is None else f"page {page}"
    record_throughput(record, work=nbytes, unit="GB/s", timings=timings, main="device copy",
                      notes=notes, gpu=gpu_name, dtype="bfloat16",
                      shape=f"B{b} S{cap} Hq{hq}/Hkv{hk} D{d} q{sq}",
                      config=cfg.describe(),
                      table="Decoding over a KV cache",
                      case=f"B{b} cache {cap} {layout} q{sq} bfloat16",
                      figure=f"kvcache_{layout.replace(' ', '')}_q{sq}", x=nbytes,
                      xlabel="bytes of K and V")
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=3, iterations=1)
    del kc, vc
    torch.cuda.empty_cache()


@pytest.mark.parametrize("context", [4096, 16384])
def test_llama_decoding_step(benchmark, record, torch, gpu_name, context):
    """One decoding step of a small random-weight Llama (transformers; 8 layers, hidden 2048,
    16 query heads over 4 KV heads of 128, bf16) at batch 8 with ``context`` tokens in a
    StaticCache, captured in a CUDA graph and replayed, with tilepy's attention
    (``attn_implementation="tilepy"``: ``flash_attention_with_kvcache`` over the cache) and
    with transformers' SDPA path (main peer). Throughput: the K and V bytes the step's
    attention reads (all layers) per second; tokens per second (batch / step time) in
    ``tokens_per_s``. The logits of one step agree between the two."""
    import tilepy.integrations.transformers as tt
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    name = tt.register()
    b, layers, hk, d = 8, 8, 4, 128
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=hk, max_position_embeddings=context + 64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, cfg.vocab_size, (b, context), device="cuda")
    graphs, logits, timings = {}, {}, {}
    for impl in ("sdpa", name):
        model.set_attn_implementation(impl)
        cache = StaticCache(config=cfg, max_cache_len=context + 64)
        tok = torch.zeros(b, 1, dtype=torch.long, device="cuda")
        pos = torch.full((1, 1), context, dtype=torch.long, device="cuda")
        with torch.no_grad():
            for i in range(0, context, 2048):   # prefill in chunks
                model(prompt[:, i:i + 2048], past_key_values=cache, use_cache=True,
                      position_ids=torch.arange(i, i + 2048, device="cuda")[None])
            def step():
                # the cache's write position back to the context's end, so that every replay
                # writes the new token at the same slot (the cache advances it on the device)
                for layer in cache.layers:
                    layer.cumulative_length.fill_(context)
                return model(tok, past_key_values=cache, use_cache=True, position_ids=pos)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
        tok.copy_(prompt[:, -1:])
        graph.replay()
        torch.cuda.synchronize()
        logits[impl] = out.logits.float().clone()
        timings[impl] = gpu_time(torch, graph.replay)
        graphs[impl] = (graph, cache, out)
    ref = logits["sdpa"]
    err = (logits[name] - ref).abs().max().item() / ref.abs().max().item()
    assert err < 5e-2, err
    nbytes = 2 * layers * b * (context + 1) * hk * d * 2
    tokens = {("tilepy" if k == name else "SDPA"): b / t.effective_ms * 1e3
              for k, t in timings.items()}
    record_throughput(record, work=nbytes, unit="GB/s",
                      timings={"tilepy": timings[name], "SDPA": timings["sdpa"]}, main="SDPA",
                      gpu=gpu_name, dtype="bfloat16", tokens_per_s=tokens,
                      shape=f"B{b} context {context} 8 layers Hq16/Hkv4 D128",
                      table="Llama decoding step (CUDA graph)",
                      case=f"Llama 8x2048 B{b} context {context} bfloat16")
    benchmark.pedantic(lambda: (graphs[name][0].replay(), torch.cuda.synchronize()), rounds=3,
                       iterations=1)
