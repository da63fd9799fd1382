"""``tilepy.flash_attention_backward`` and the autograd of ``tilepy.flash_attention`` on a GPU:
the gradients at full size (head_dim 64 and 128, GQA, seq_q ≠ seq_k both ways, causal and not,
both layouts, float16 and bfloat16) against SDPA's in float32, written over NaN-filled
outputs; ``deterministic=True`` repeatable to the bit; ``loss.backward()`` through
``tilepy.flash_attention``, eager and under ``torch.compile(fullgraph=True)``; and a small
random-weight Llama trained for 50 steps with tilepy's attention and with SDPA from the same
weights, whose loss curves agree. Skipped without a GPU (the ``gpu`` marker,
tests/conftest.py)."""

from __future__ import annotations

import copy
import itertools
import math

import pytest

torch = pytest.importorskip("torch")

import tilepy  # noqa: E402
import tilepy.integrations.pytorch  # noqa: E402,F401

pytestmark = pytest.mark.gpu

# Max |error| of each gradient relative to its max |value| (P and dS are rounded to the input
# dtype before their matmuls, the gradients to it at the end).
TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2}
F16, BF16 = torch.float16, torch.bfloat16

# (batch, heads_q, heads_kv, seq_q, seq_k, head_dim, causal, layout, dtype, scale)
CASES = [
    (2, 8, 8, 1024, 1024, 64, False, "bhsd", F16, None),
    (2, 8, 8, 1024, 1024, 128, True, "bhsd", BF16, None),
    (2, 8, 2, 1024, 1024, 128, False, "bshd", F16, None),
    (2, 8, 2, 1024, 1024, 64, True, "bshd", BF16, None),
    (2, 8, 8, 1000, 1536, 128, True, "bhsd", F16, None),     # every row sees keys
    (2, 8, 8, 1536, 1000, 64, True, "bhsd", BF16, None),     # 536 rows see no key
    (2, 8, 2, 1536, 1000, 128, True, "bshd", F16, None),
    (2, 8, 2, 1000, 1536, 64, False, "bshd", BF16, None),
    (2, 8, 8, 1536, 1000, 128, False, "bshd", BF16, 0.05),
    (2, 8, 2, 1000, 1536, 64, True, "bhsd", F16, None),
    (2, 8, 8, 1024, 1024, 128, True, "bshd", F16, 0.2),
    (2, 8, 2, 1024, 1024, 64, False, "bhsd", BF16, None),
    (1, 4, 2, 1000, 1100, 256, True, "bshd", BF16, None),     # past 128: mma.sync kernels
    (1, 4, 4, 700, 900, 200, False, "bhsd", F16, None),
]


def case_id(c):
    b, hq, hkv, sq, sk, d, causal, layout, dtype, scale = c
    return (f"B{b}_Hq{hq}_Hkv{hkv}_Sq{sq}_Sk{sk}_D{d}-{'causal' if causal else 'full'}-{layout}"
            f"-{str(dtype).split('.')[-1]}" + (f"-scale{scale}" if scale else ""))


def make_inputs(b, hq, hkv, sq, sk, d, layout, dtype, grad=False):
    """q, k, v, dout in ``layout``, standard normal."""
    def shape(h, s):
        return (b, s, h, d) if layout == "bshd" else (b, h, s, d)

    q = torch.randn(shape(hq, sq), device="cuda", dtype=dtype)
    k = torch.randn(shape(hkv, sk), device="cuda", dtype=dtype)
    v = torch.randn(shape(hkv, sk), device="cuda", dtype=dtype)
    dout = torch.randn(shape(hq, sq), device="cuda", dtype=dtype)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, dout


def bhsd(t, layout):
    """``t`` as (batch, heads, seq, head_dim) (a view)."""
    return t.transpose(1, 2) if layout == "bshd" else t


def dead_rows(sq, sk, causal):
    """How many leading query rows see no key (bottom-right causal mask, seq_q > seq_k)."""
    return max(sq - sk, 0) if causal else 0


def reference(q, k, v, dout, causal, layout="bhsd", scale=None):
    """SDPA (math backend) in float32 of the same inputs: ``(out, (dq, dk, dv))`` in
    ``layout``. Bottom-right causal mask: ``is_causal`` when seq_q == seq_k, else an explicit
    boolean mask ``j <= i + sk - sq`` over the rows that see a key; the others (i < sq - sk)
    get out = 0 and dq = 0, and add nothing to dk, dv. GQA through ``enable_gqa``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q, k, v, dout = (bhsd(t, layout).detach().float() for t in (q, k, v, dout))
    sq, sk = q.shape[2], k.shape[2]
    dead = dead_rows(sq, sk, causal)
    ql = q[:, :, dead:].clone().requires_grad_()
    kl, vl = k.clone().requires_grad_(), v.clone().requires_grad_()
    kw = {"scale": scale}
    if q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True
    if causal and sq == sk:
        kw["is_causal"] = True
    elif causal:
        i = torch.arange(dead, sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        kw["attn_mask"] = j <= i + sk - sq
    with sdpa_kernel(SDPBackend.MATH):
        o = sdpa(ql, kl, vl, **kw)
    dql, dk, dv = torch.autograd.grad(o, (ql, kl, vl), dout[:, :, dead:])
    out, dq = q.new_zeros(*q.shape[:3], v.shape[3]), torch.zeros_like(q)
    out[:, :, dead:] = o.detach()
    dq[:, :, dead:] = dql
    if layout == "bshd":
        out, dq, dk, dv = (t.transpose(1, 2) for t in (out, dq, dk, dv))
    return out, (dq, dk, dv)


def rel(got, want):
    """max |got - want| / max |want| in float64; NaN anywhere fails."""
    assert not torch.isnan(got).any(), "NaN (or an unwritten element)"
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def check_grads(got, want, dtype, what=""):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == dtype, (name, g.shape, g.dtype)
        err = rel(g, w)
        assert err < TOL[dtype], (what, name, err)


def bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpu_backward_against_sdpa_float32(case):
    b, hq, hkv, sq, sk, d, causal, layout, dtype, scale = case
    q, k, v, dout = make_inputs(b, hq, hkv, sq, sk, d, layout, dtype)
    out, lse = tilepy.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                      layout=layout)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    got = tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                          layout=layout, dq=dq, dk=dk, dv=dv)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    want_out, want = reference(q, k, v, dout, causal, layout, scale)
    assert rel(out, want_out) < TOL[dtype]
    check_grads((dq, dk, dv), want, dtype, case_id(case))
    dead = dead_rows(sq, sk, causal)
    if dead:
        assert torch.isneginf(lse[:, :, :dead]).all()
        assert (bhsd(out, layout)[:, :, :dead] == 0).all(), "rows without keys: out 0"
        assert (bhsd(dq, layout)[:, :, :dead] == 0).all(), "rows without keys: dq 0"


# (192: the second consumer's products and dQ slices over its one valid 64-column sub-tile)
WIDE_CASES = [CASES[12], CASES[13], (1, 4, 2, 1300, 900, 256, True, "bhsd", F16, None),
              (2, 4, 2, 1000, 700, 192, True, "bhsd", BF16, None)]


@pytest.mark.parametrize("halves", [False, True], ids=["whole-scores", "query-halves"])
@pytest.mark.parametrize("case", WIDE_CASES, ids=case_id)
def test_gpu_wide_head_dims_on_wgmma(case, halves):
    """Past head_dim 128, the warp-specialised wgmma kernel with its columns split between
    the consumers (``split_columns``, dQ staged in the ring slot; 200 and 192 zero-filled to
    256) —
    each consumer computing the whole Sᵀ / dPᵀ, or its query half (``query_halves``) — into
    NaN-filled outputs, against SDPA's math backend in float32 — GQA, seq_q above and below
    seq_k."""
    from tilepy.ops.attention_backward_wgmma import WgmmaBackwardConfig

    b, hq, hkv, sq, sk, d, causal, layout, dtype, scale = case
    q, k, v, dout = make_inputs(b, hq, hkv, sq, sk, d, layout, dtype)
    out, lse = tilepy.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                      layout=layout)
    cfg = WgmmaBackwardConfig(d, dtype=str(dtype).split(".")[-1], key_groups=1,
                              dq_atomic=True, producer=True, split_columns=True,
                              query_halves=halves)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                    layout=layout, dq=dq, dk=dk, dv=dv, config=cfg)
    _, want = reference(q, k, v, dout, causal, layout, scale)
    check_grads((dq, dk, dv), want, dtype, case_id(case))


@pytest.mark.parametrize("d,fused", [(256, False), (128, True)],
                         ids=["d256-built-in", "d128-fused-config"])
def test_gpu_packed_sequences_on_the_fused_kernel(d, fused):
    """Packed sequences' backward with dQ by bulk reductions into each sequence's 64-row
    blocks of the accumulator — past 128 the built-in choice (query halves), at 128 a fused
    config — into NaN-filled outputs, each sequence against SDPA's math backend in float32;
    zero-length query and key sequences (their rows: zero gradients), GQA 4/2, causal, rows
    outside every sequence left as they were."""
    from tilepy.ops.attention_backward_wgmma import WgmmaBackwardConfig
    from tilepy.ops.attention_varlen import flash_attention_varlen_backward

    lq, lk, hq, hk, dtype = [300, 0, 1000, 65, 700], [300, 20, 1000, 0, 900], 4, 2, BF16
    cu = [torch.tensor([0] + list(itertools.accumulate(x)), dtype=torch.int32, device="cuda")
          for x in (lq, lk)]
    q, dout = (torch.randn(sum(lq) + 3, hq, d, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(sum(lk) + 3, hk, d, device="cuda", dtype=dtype) for _ in range(2))
    args = (*cu, max(lq), max(lk))
    out, lse = tilepy.flash_attention_varlen(q, k, v, *args, causal=True, return_lse=True)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    cfg = WgmmaBackwardConfig(d, dtype="bfloat16", dq_atomic=True, producer=True) \
        if fused else None
    flash_attention_varlen_backward(dout, q, k, v, out, lse, *args, causal=True,
                                    dq=grads[0], dk=grads[1], dv=grads[2], config=cfg)
    cq, ck = (c.tolist() for c in cu)
    for z in range(len(lq)):
        rq, rk = slice(cq[z], cq[z + 1]), slice(ck[z], ck[z + 1])
        if not lq[z] or not lk[z]:      # no queries or no keys: zero gradients
            assert all((g[r] == 0).all() for g, r in zip(grads, (rq, rk, rk))), z
            continue
        _, want = reference(q[rq][None], k[rk][None], v[rk][None], dout[rq][None], True,
                            "bshd")
        check_grads(tuple(g[r][None] for g, r in zip(grads, (rq, rk, rk))), want, dtype,
                    f"sequence {z}")
    for g, total in zip(grads, (sum(lq), sum(lk), sum(lk))):
        assert torch.isnan(g[total:]).all(), "rows outside every sequence written"


@pytest.mark.parametrize("dtype,causal,layout", [(BF16, True, "bshd"), (F16, False, "bhsd")])
def test_gpu_head_dim_v_gradients_through_autograd(dtype, causal, layout):
    """DeepSeek's 192 / 128 (v's head dim other than q's and k's), GQA 8/2, seq_q ≠ seq_k:
    ``loss.backward()`` through ``tilepy.flash_attention`` (the TMA forward, the built-in
    backward: on sm_90 the 256-column wgmma kernel, each operand zero-filled past its own
    head dim) against SDPA's math backend in float32."""
    b, hq, hkv, sq, sk, d, dv = 1, 8, 2, 700, 900, 192, 128

    def shape(h, s, w):
        return (b, s, h, w) if layout == "bshd" else (b, h, s, w)

    q = torch.randn(shape(hq, sq, d), device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(shape(hkv, sk, d), device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(shape(hkv, sk, dv), device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(shape(hq, sq, dv), device="cuda", dtype=dtype)
    out = tilepy.flash_attention(q, k, v, causal=causal, layout=layout)
    out.backward(dout)
    want_out, want = reference(q, k, v, dout, causal, layout)
    assert rel(out.detach(), want_out) < TOL[dtype]
    check_grads((q.grad, k.grad, v.grad), want, dtype, "head_dim_v")


@pytest.mark.parametrize("case", [CASES[9], CASES[6]], ids=case_id)
def test_gpu_deterministic_backward_repeats_to_the_bit(case):
    """Two ``deterministic=True`` runs — into NaN-filled outputs, then into ones it allocates
    — give the same bits, and the right gradients."""
    b, hq, hkv, sq, sk, d, causal, layout, dtype, scale = case
    q, k, v, dout = make_inputs(b, hq, hkv, sq, sk, d, layout, dtype)
    out, lse = tilepy.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                      layout=layout)
    poisoned = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    first = tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                            scale=scale, layout=layout, deterministic=True,
                                            dq=poisoned[0], dk=poisoned[1], dv=poisoned[2])
    second = tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                             scale=scale, layout=layout, deterministic=True)
    for name, x, y in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(bits(x), bits(y)), f"{name} differs between two deterministic runs"
    _, want = reference(q, k, v, dout, causal, layout, scale)
    check_grads(first, want, dtype, "deterministic")


# (layout, seq_q, seq_k, dout): ``sum`` backpropagates out.float().sum(), ``random`` a random
# dout; causal, GQA 8 / 2, head_dim 128, float16
AUTOGRAD_CASES = [("bhsd", 1024, 1024, "sum"), ("bshd", 1536, 1000, "random")]


@pytest.mark.parametrize("layout,sq,sk,kind", AUTOGRAD_CASES,
                         ids=[f"{c[0]}-Sq{c[1]}_Sk{c[2]}-{c[3]}" for c in AUTOGRAD_CASES])
def test_gpu_autograd_eager_matches_sdpa(layout, sq, sk, kind):
    q, k, v, dout = make_inputs(2, 8, 2, sq, sk, 128, layout, F16, grad=True)
    o = tilepy.flash_attention(q, k, v, causal=True, layout=layout)
    if kind == "sum":
        dout = torch.ones_like(dout)
        o.float().sum().backward()
    else:
        o.backward(dout)
    want_out, want = reference(q, k, v, dout, True, layout)
    assert rel(o.detach(), want_out) < TOL[F16]
    check_grads((q.grad, k.grad, v.grad), want, F16, kind)


@pytest.mark.parametrize("how", ["loss_backward", "autograd_grad"])
def test_gpu_autograd_under_torch_compile_fullgraph(how):
    """``loss_backward``: a compiled loss (forward graph, AOTAutograd's backward graph), then
    ``.backward()``; ``autograd_grad``: forward and ``torch.autograd.grad`` in one compiled
    function (Dynamo traces the autograd call with ``trace_autograd_ops``)."""
    q, k, v, dout = make_inputs(2, 8, 2, 1024, 1024, 128, "bhsd", F16, grad=True)
    _, want = reference(q, k, v, dout, True)
    torch._dynamo.reset()
    if how == "loss_backward":
        def loss(q, k, v, dout):
            return (tilepy.flash_attention(q, k, v, causal=True).float() * dout.float()).sum()

        torch.compile(loss, fullgraph=True)(q, k, v, dout).backward()
        got = (q.grad, k.grad, v.grad)
    else:
        if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
            pytest.skip("this PyTorch's Dynamo cannot trace torch.autograd.grad")

        def step(q, k, v, dout):
            o = tilepy.flash_attention(q, k, v, causal=True)
            return torch.autograd.grad(o, (q, k, v), dout)

        with torch._dynamo.config.patch(trace_autograd_ops=True):
            got = torch.compile(step, fullgraph=True)(q, k, v, dout)
    check_grads(got, want, F16, how)


STEPS = 50
LOSS_SCALE = 2.0 ** 12


def _train(model, ids, steps):
    """``steps`` of AdamW (lr 1e-3) on one fixed batch: float16 model, float32 master weights
    (the optimizer's), a static loss scale; the loss of each step."""
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(master, lr=1e-3)
    losses = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        (loss * LOSS_SCALE).backward()
        for m, p in zip(master, params):
            m.grad = p.grad.float() / LOSS_SCALE
        finite = torch.stack([torch.isfinite(m.grad).all() for m in master]).all().item()
        assert finite, f"step {step}: a gradient overflowed float16 (loss scale {LOSS_SCALE})"
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)
        losses.append(loss.item())
    return losses


def test_gpu_llama_training_loss_curve_matches_sdpa(monkeypatch):
    """A random-weight Llama (hidden 256, 4 layers, 8 heads, 2 KV heads, vocab 1000) trained
    50 steps on one fixed random batch from the same weights with attention "tilepy" and
    "sdpa": the losses agree within 1% at every step, and tilepy's attention ran in every
    layer of every step.

    Precision: float16 compute with float32 master weights. tilepy's attention takes float16 /
    bfloat16 only, and under float32 weights with autocast, RoPE hands it float32 q / k (the
    rotary cos / sin take the float32 residual stream's dtype), so every call would run SDPA.
    bfloat16 weights work, but two attention implementations' rounding alone then moves the
    loss curve by about 1% where it falls fastest (measured on CPU, eager against SDPA
    attention, same model and batch: up to 1.8% with bfloat16 weights, 0.9-1.0% with float32
    master weights; 3e-5 in float32), too close to the bound; float16 rounds 8x finer."""
    transformers = pytest.importorskip("transformers")
    import tilepy.integrations.transformers as tt

    name = tt.register()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688,
                                   num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=512)
    base = transformers.LlamaForCausalLM(cfg).to("cuda", torch.float16).train()
    batch, seq = 8, 256
    ids = torch.randint(0, 1000, (batch, seq), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    calls = []
    real = tilepy.flash_attention
    monkeypatch.setattr(tilepy, "flash_attention",
                        lambda *a, **kw: calls.append(tuple(a[0].shape)) or real(*a, **kw))

    curves = {}
    for impl in ("sdpa", name):
        model = copy.deepcopy(base)
        model.set_attn_implementation(impl)
        curves[impl] = _train(model, ids, STEPS)
        del model
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert calls == [(batch, cfg.num_attention_heads, seq, head_dim)] * (
        cfg.num_hidden_layers * STEPS), (len(calls), calls[:1])
    ref, got = curves["sdpa"], curves[name]
    assert all(math.isfinite(x) for x in ref + got), (ref, got)
    assert ref[-1] < 0.9 * ref[0], ("the model did not train", ref)
    worst = max(abs(g - r) / abs(r) for g, r in zip(got, ref))
    assert worst < 1e-2, (worst, list(zip(ref, got)))


@pytest.mark.parametrize("layout, hq, hk, batch", [
    ("bhsd", 70000, 70000, 1),      # query and K/V heads past the grid's y limit (65535)
    ("bshd", 70002, 2, 1),          # GQA: 35001 query heads per K/V head
    ("bhsd", 2, 1, 70000),          # batch past the z limit
])
def test_gpu_heads_and_batches_past_the_grid_limit(layout, hq, hk, batch):
    """The backward's launches (pre-pass, dK / dV, dQ) at 70000 along a batch axis run in
    chunks: the gradients match, to the bit, the same kernels run on two halves of the axis
    (each within the limit)."""
    torch.manual_seed(0)
    d, sq, sk = 64, 24, 40
    q, k, v, dout = make_inputs(batch, hq, hk, sq, sk, d, layout, torch.float16)
    out, lse = tilepy.flash_attention(q, k, v, causal=True, return_lse=True, layout=layout)
    full = tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=True, layout=layout)
    if batch > 1:
        halves = [slice(0, batch // 2), slice(batch // 2, batch)]
        pieces = [tilepy.flash_attention_backward(dout[i], q[i], k[i], v[i], out[i], lse[i],
                                                  causal=True, layout=layout) for i in halves]
        want = [torch.cat([p[j] for p in pieces], 0) for j in range(3)]
    else:
        axis = 1 if layout == "bhsd" else 2
        half_kv = hk // 2                 # every case here has at least two K/V heads
        hq_half = half_kv * (hq // hk)
        pieces = []
        for qs, ks in ((slice(0, hq_half), slice(0, half_kv)),
                       (slice(hq_half, hq), slice(half_kv, hk))):
            def cut(t, sl):
                return t[:, sl] if axis == 1 else t[:, :, sl]
            pieces.append(tilepy.flash_attention_backward(
                cut(dout, qs), cut(q, qs), cut(k, ks), cut(v, ks), cut(out, qs),
                lse[:, qs], causal=True, layout=layout))
        want = [torch.cat([p[j] for p in pieces], axis) for j in range(3)]
    for name, g, w in zip(("dq", "dk", "dv"), full, want):
        assert torch.equal(bits(g), bits(w)), name


def variant_reference(q, k, v, causal, window, cap):
    """float32 attention by explicit PyTorch ops on (B, H, S, D) tensors that require grad:
    the bottom-right diagonal, ``window`` (left, right) relative to it (-1 unbounded),
    ``cap`` the soft cap of the scaled scores (SDPA has none); GQA by repeating k, v. Every
    row must see a key (no NaN rows)."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q.shape[-1] ** -0.5 * q @ kk.mT
    if cap:
        s = cap * torch.tanh(s / cap)
    left, right = window
    right = 0 if causal else right
    sq, sk = s.shape[-2:]
    diag = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        keep &= j <= diag + right
    if left >= 0:
        keep &= j >= diag - left
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ vv


@pytest.mark.parametrize("b, hq, hkv, sq, sk, d, causal, window, cap, layout, dtype", [
    (1, 4, 4, 1024, 1024, 128, True, (255, 0), 0.0, "bhsd", BF16),   # Mistral-style window
    (1, 4, 2, 1024, 1024, 64, False, (128, 64), 30.0, "bshd", F16),  # both sides, a cap, GQA
    (1, 4, 4, 900, 1100, 128, False, (-1, -1), 20.0, "bhsd", F16),   # Gemma 2's cap alone
])
def test_gpu_window_and_softcap_autograd(b, hq, hkv, sq, sk, d, causal, window, cap, layout,
                                         dtype):
    """The forward's variants and their gradients through autograd at full size, against
    float32 autograd of explicit attention."""
    q, k, v, dout = make_inputs(b, hq, hkv, sq, sk, d, layout, dtype, grad=True)
    if cap:
        with torch.no_grad():
            q *= 4    # scores of a few units: the cap bites
    out = tilepy.flash_attention(q, k, v, causal=causal, window=window, softcap=cap,
                                 layout=layout)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [bhsd(t, layout).detach().float().requires_grad_() for t in (q, k, v)]
    want_out = variant_reference(*ref_in, causal, window, cap)
    want = torch.autograd.grad(want_out, ref_in, bhsd(dout, layout).float())
    assert rel(bhsd(out, layout), want_out) < TOL[dtype]
    check_grads(tuple(bhsd(g, layout) for g in got), want, dtype, (window, cap))


@pytest.mark.parametrize("b, hq, hkv, sq, sk, d, causal, layout, dtype", [
    (2, 4, 4, 1000, 1000, 40, True, "bhsd", F16),     # 48-column tiles
    (1, 8, 2, 700, 1100, 72, False, "bshd", BF16),    # 80-column tiles, GQA
    (1, 4, 4, 1100, 700, 24, True, "bhsd", BF16),     # 32-column tiles, 400 rows see no key
    (1, 4, 4, 513, 513, 120, True, "bshd", F16),      # 128-column tiles, the widest
    (1, 8, 2, 900, 1000, 96, True, "bshd", BF16),     # 96: Phi's; GQA
])
def test_gpu_head_dims_not_a_multiple_of_16(b, hq, hkv, sq, sk, d, causal, layout, dtype):
    """head_dim a multiple of 8 only: the forward and the gradients through the explicit
    backward at full size against SDPA's float32 gradients, written over NaN-filled outputs
    — on sm_90 from 40 up the wgmma kernels (the 64- or 128-column tile zero-filled past the
    head dim, the stores its columns only), else the mma.sync ones (tiles zero-padded to the
    next 16); both ways, the fused kernel and the deterministic pair."""
    q, k, v, dout = make_inputs(b, hq, hkv, sq, sk, d, layout, dtype)
    out, lse = tilepy.flash_attention(q, k, v, causal=causal, return_lse=True, layout=layout)
    want_out, want = reference(q, k, v, dout, causal, layout)
    assert rel(out, want_out) < TOL[dtype]
    for deterministic in (False, True):
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, layout=layout,
                                        dq=dq, dk=dk, dv=dv, deterministic=deterministic)
        check_grads((dq, dk, dv), want, dtype, (d, deterministic))
