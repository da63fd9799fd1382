"""tilepy's ops as PyTorch operators (``torch.ops.tilepy.*``), in the simulator on PyTorch CPU
tensors: registration, ``torch.library.opcheck`` (schema, fake tensors, autograd
registration, AOT dispatch), gradients against float64 autograd of a PyTorch reference,
``torch.compile(fullgraph=True)`` of inference and of a training step, and errors. The same
operators run CUDA tensors on a GPU (tests/test_torch_gpu.py)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tilepy
import tilepy.integrations.pytorch  # noqa: F401  (registers torch.ops.tilepy.* now)

pytestmark = pytest.mark.sim

TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 2e-5}
ACT = {None: lambda z: z, "relu": F.relu, "gelu": F.gelu,
       "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu}


def rand(*shape, dtype=torch.float16, grad=False):
    return torch.randn(*shape, dtype=torch.float64).to(dtype).requires_grad_(grad)


def close(got, ref, dtype, what=""):
    got = got.detach().double()
    assert got.shape == ref.shape, what
    assert not torch.isnan(got).any(), f"{what}: NaN"
    scale = max(ref.abs().max().item(), 1e-6)
    err = (got - ref).abs().max().item() / scale
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]}"


def check_grads(fn, ref_fn, inputs, dtype):
    """``fn``'s gradients in every input that requires grad against float64 autograd of
    ``ref_fn``, for a fresh random output gradient."""
    out = fn(*inputs)
    dy = torch.randn(out.shape, dtype=torch.float64)
    (out.float() * dy.float()).sum().backward()
    ref_in = [x.detach().double().requires_grad_(x.requires_grad) for x in inputs]
    (ref_fn(*ref_in) * dy).sum().backward()
    for i, (x, r) in enumerate(zip(inputs, ref_in)):
        if x.requires_grad:
            assert x.grad is not None and x.grad.dtype == x.dtype, f"input {i}"
            close(x.grad, r.grad, dtype, f"gradient of input {i}")


def test_every_op_is_registered_and_import_does_not_load_torch():
    for name in ("gemm", "gemm_out", "softmax", "log_softmax", "softmax_out",
                 "log_softmax_out", "softmax_backward", "log_softmax_backward",
                 "softmax_backward_out", "log_softmax_backward_out", "gemm_softmax",
                 "gemm_softmax_out", "flash_attention", "flash_attention_out",
                 "flash_attention_backward", "flash_attention_backward_out", "grouped_gemm",
                 "grouped_gemm_weight_grad", "quantize_fp8", "gemm_fp8",
                 "flash_attention_fp8"):
        assert hasattr(torch.ops.tilepy, name), name
    code = "import sys, tilepy; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- gemm -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [
    # (a shape, b shape, dtype, activation, bias, c shape, alpha, beta, out_dtype)
    ((19, 24), (24, 12), torch.float16, "gelu", True, None, 0.5, 0.0, None),
    ((3, 19, 24), (24, 12), torch.float16, "relu", False, (19, 12), 1.0, -1.5, None),
    ((19, 24), (2, 24, 12), torch.bfloat16, "silu", True, None, 1.0, 0.0, None),
    ((2, 19, 24), (1, 24, 12), torch.float16, None, False, (2, 19, 12), 2.0, 0.5,
     torch.float32),
    ((13, 20), (20, 9), torch.float32, "gelu_tanh", True, (13, 9), 1.0, 1.0, None),
])
def test_gemm_gradients_against_float64(case):
    sa, sb, dtype, act, has_bias, sc, alpha, beta, out_dtype = case
    cdt = out_dtype or dtype
    inputs = [rand(*sa, dtype=dtype, grad=True), rand(*sb, dtype=dtype, grad=True),
              rand(sb[-1], dtype=dtype, grad=True) if has_bias else None,
              rand(*sc, dtype=cdt, grad=True) if sc else None]
    present = [x for x in inputs if x is not None]

    def fn(*xs):
        it = iter(xs)
        a, b = next(it), next(it)
        bias = next(it) if has_bias else None
        c = next(it) if sc else None
        return tilepy.gemm(a, b, bias=bias, c=c, activation=act, alpha=alpha, beta=beta,
                           out_dtype=out_dtype)

    def ref(*xs):
        it = iter(xs)
        a, b = next(it), next(it)
        z = alpha * (a @ b)
        if has_bias:
            z = z + next(it)
        if sc:
            z = z + beta * next(it)
        return ACT[act](z)

    y = fn(*present)
    assert y.grad_fn is not None and "tilepy" in type(y.grad_fn).__name__
    check_grads(fn, ref, present, dtype)


def test_gemm_eager_without_grad_matches_the_operator():
    a, b = rand(17, 24), rand(24, 8)
    direct = tilepy.gemm(a, b, activation="relu")
    assert direct.grad_fn is None
    via_op = torch.ops.tilepy.gemm(a, b, None, None, "relu", 1.0, 0.0, None, False)
    assert torch.equal(direct, via_op)
    out = torch.full((17, 8), float("nan"), dtype=torch.float16)
    assert tilepy.gemm(a, b, activation="relu", out=out) is out
    assert torch.equal(out, direct)


def test_opcheck_gemm():
    a, b = rand(19, 24, grad=True), rand(24, 16, grad=True)
    bias, c = rand(16, grad=True), rand(19, 16)
    torch.library.opcheck(torch.ops.tilepy.gemm.default,
                          (a, b, bias, c, "gelu", 0.5, 1.0, None, False))
    out = torch.empty(19, 16, dtype=torch.float32)
    torch.library.opcheck(torch.ops.tilepy.gemm_out.default,
                          (a.detach(), b.detach(), None, None, None, 1.0, 0.0, False, out))


# ---- softmax and log_softmax ----------------------------------------------------------------

@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("shape,axis,dtype", [((5, 37), -1, torch.float32),
                                              ((3, 9, 4), 1, torch.float16),
                                              ((4, 70), 1, torch.bfloat16)])
def test_softmax_gradients_against_float64(log, shape, axis, dtype):
    fn = tilepy.log_softmax if log else tilepy.softmax
    ref = torch.log_softmax if log else torch.softmax
    x = rand(*shape, dtype=dtype, grad=True)
    check_grads(lambda t: fn(t, axis), lambda t: ref(t, axis), [x], dtype)


def test_softmax_backward_ops_match_float64():
    y = torch.softmax(rand(6, 33, dtype=torch.float32), -1)
    dy = rand(6, 33, dtype=torch.float32)
    ref = y.double() * (dy.double() - (dy.double() * y.double()).sum(-1, keepdim=True))
    close(tilepy.softmax_backward(dy, y, -1), ref, torch.float32)
    ly = torch.log_softmax(rand(6, 33, dtype=torch.float32), -1)
    ref = dy.double() - ly.double().exp() * dy.double().sum(-1, keepdim=True)
    close(tilepy.log_softmax_backward(dy, ly, -1), ref, torch.float32)


def test_opcheck_softmax_family():
    x = rand(4, 37, dtype=torch.float32, grad=True)
    for op in (torch.ops.tilepy.softmax, torch.ops.tilepy.log_softmax):
        torch.library.opcheck(op.default, (x, 1))
    torch.library.opcheck(torch.ops.tilepy.softmax_out.default,
                          (x.detach(), -1, torch.empty(4, 37)))
    y, dy = torch.softmax(x.detach(), -1), rand(4, 37, dtype=torch.float32)
    for op in (torch.ops.tilepy.softmax_backward, torch.ops.tilepy.log_softmax_backward):
        torch.library.opcheck(op.default, (dy, y, -1))
    torch.library.opcheck(torch.ops.tilepy.softmax_backward_out.default,
                          (dy, y, -1, torch.empty(4, 37)))


def test_out_written_directly_advances_its_version():
    """An eager out= call writes ``out`` as an in-place op would: autograd sees the write."""
    x, out = rand(4, 37, dtype=torch.float32), torch.empty(4, 37)
    v = out._version
    assert tilepy.softmax(x, -1, out=out) is out and out._version == v + 1
    w = rand(4, 37, dtype=torch.float32, grad=True)
    saved = torch.empty(4, 37)
    y = w * saved                         # autograd saves `saved` for w's gradient
    tilepy.softmax(x, -1, out=saved)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# ---- gemm_softmax -----------------------------------------------------------------------------

def test_gemm_softmax_gradients_and_opcheck():
    a, b = rand(19, 24, grad=True), rand(24, 40, grad=True)
    check_grads(lambda x, w: tilepy.gemm_softmax(x, w, scale=0.3),
                lambda x, w: torch.softmax(0.3 * (x @ w), -1), [a, b], torch.float16)
    torch.library.opcheck(torch.ops.tilepy.gemm_softmax.default,
                          (a.detach().requires_grad_(), b.detach(), 0.3))


# ---- flash_attention ------------------------------------------------------------------------

def _attention_reference(q, k, v, causal, scale, window=(-1, -1), cap=0.0):
    """float64 attention by PyTorch ops (autograd derives the gradients): bottom-right causal
    alignment, ``window`` (left, right) relative to the same diagonal (-1 unbounded), ``cap``
    the soft cap of the scaled scores."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ k.mT
    if cap:
        s = cap * torch.tanh(s / cap)
    left, right = window
    right = 0 if causal else right
    sq, sk = s.shape[-2:]
    diag = torch.arange(sq)[:, None] + (sk - sq)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep &= torch.arange(sk)[None, :] <= diag + right
    if left >= 0:
        keep &= torch.arange(sk)[None, :] >= diag - left
    s = s.masked_fill(~keep, float("-inf"))
    return torch.nan_to_num(torch.softmax(s, -1)) @ v


def test_flash_attention_operator_and_gradients_against_float64():
    q, k, v = rand(1, 4, 19, 32), rand(1, 2, 23, 32), rand(1, 2, 23, 32)
    out, lse = torch.ops.tilepy.flash_attention(q, k, v, True, None, -1, -1, 0.0, True, "bhsd")
    close(out, _attention_reference(q, k, v, True, 32 ** -0.5), torch.float16)
    assert lse.shape == (1, 4, 19) and lse.dtype == torch.float32
    torch.library.opcheck(torch.ops.tilepy.flash_attention.default,
                          (q, k, v, False, 0.2, -1, -1, 0.0, False, "bhsd"))
    # (batch, seq, heads, dim), GQA 4 / 2, causal with seq_q < seq_k
    ins = [rand(1, 19, 4, 32, grad=True), rand(1, 23, 2, 32, grad=True),
           rand(1, 23, 2, 32, grad=True)]
    check_grads(lambda q, k, v: tilepy.flash_attention(q, k, v, causal=True, layout="bshd"),
                lambda q, k, v: _attention_reference(*(x.transpose(1, 2) for x in (q, k, v)),
                                                     True, 32 ** -0.5).transpose(1, 2),
                ins, torch.float16)


def test_flash_attention_head_dim_v_gradients():
    """v's head dim other than q's and k's (48 / 32; GQA 2 / 1, causal, seq_q < seq_k) through
    autograd against float64, and the backward operator's fake shapes (opcheck)."""
    ins = [rand(1, 2, 9, 48, grad=True), rand(1, 1, 13, 48, grad=True),
           rand(1, 1, 13, 32, grad=True)]
    check_grads(lambda q, k, v: tilepy.flash_attention(q, k, v, causal=True),
                lambda q, k, v: _attention_reference(q, k, v, True, 48 ** -0.5),
                ins, torch.float16)
    q, k, v = (x.detach() for x in ins)
    o, l = tilepy.flash_attention(q, k, v, causal=True, return_lse=True)
    torch.library.opcheck(torch.ops.tilepy.flash_attention_backward.default,
                          (rand(1, 2, 9, 32), q, k, v, o, l, None, True, None, -1, -1, 0.0,
                           "bhsd", False))


def test_flash_attention_window_and_softcap_gradients_and_compile():
    """The variants through the operator: opcheck with a window and a cap, gradients against
    float64 autograd (a sliding window under causal with a cap; GQA; rows that see no key),
    and a compiled training step with them that matches eager."""
    q, k, v = rand(1, 4, 21, 32), rand(1, 2, 25, 32), rand(1, 2, 25, 32)
    torch.library.opcheck(torch.ops.tilepy.flash_attention.default,
                          (q, k, v, True, None, 6, 0, 2.5, True, "bhsd"))
    ins = [(rand(1, 4, 21, 32) * 2).requires_grad_(), rand(1, 2, 25, 32, grad=True),
           rand(1, 2, 25, 32, grad=True)]
    check_grads(lambda q, k, v: tilepy.flash_attention(q, k, v, causal=True, window=(6, None),
                                                       softcap=2.5),
                lambda q, k, v: _attention_reference(q, k, v, True, 32 ** -0.5, (6, 0), 2.5),
                ins, torch.float16)
    torch._dynamo.reset()

    def loss(q, k, v):
        return tilepy.flash_attention(q, k, v, window=(3, 5), softcap=4.0).float().square().sum()

    ins = [rand(1, 2, 17, 16, grad=True) for _ in range(3)]
    loss(*ins).backward()
    eager = [x.grad.clone() for x in ins]
    for x in ins:
        x.grad = None
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*ins).backward()
    for x, g in zip(ins, eager):
        assert torch.equal(x.grad, g)


def test_flash_attention_user_functions_on_tensors():
    """score_mod= / mask_mod= on PyTorch tensors: gradients through autograd (the user's
    derivative of score_mod) against float64 autograd of the same attention (the mask as
    mask_mod and as a block mask), torch.compile
    running the call eagerly, and a clear NotImplementedError for a score_mod without its
    derivative when a gradient is wanted."""
    def bias(score, b, h, q_idx, kv_idx):
        return score - 0.5 * (h + 1) * abs(q_idx - kv_idx)

    def bias_grad(score, b, h, q_idx, kv_idx):
        return 1.0

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx or kv_idx < 3

    def ref(q, k, v):
        s = q @ k.mT / 4.0
        i = torch.arange(19)[:, None]
        j = torch.arange(19)[None, :]
        s = s - 0.5 * torch.tensor([1.0, 2.0]).double()[:, None, None] * (i - j).abs()
        return torch.softmax(s.masked_fill(~((j <= i) | (j < 3)), float("-inf")), -1) @ v

    ins = [rand(1, 2, 19, 16, grad=True) for _ in range(3)]
    check_grads(lambda q, k, v: tilepy.flash_attention(q, k, v, score_mod=bias,
                                                       score_mod_grad=bias_grad,
                                                       mask_mod=prefix),
                ref, ins, torch.float16)
    # the same through a block mask (made from the tensors' kind: CPU tensors here), which
    # the backward takes as well
    bm = tilepy.create_block_mask(prefix, None, None, 19, 19, like=ins[0], block_size=16)
    assert isinstance(bm.kv_indices, torch.Tensor) and bm.kv_indices.dtype == torch.int32
    check_grads(lambda q, k, v: tilepy.flash_attention(q, k, v, score_mod=bias,
                                                       score_mod_grad=bias_grad, block_mask=bm),
                ref, [x.detach().clone().requires_grad_() for x in ins], torch.float16)
    q, k, v = (x.detach() for x in ins)
    compiled = torch.compile(lambda q, k, v: tilepy.flash_attention(q, k, v, mask_mod=prefix),
                             backend="eager")
    close(compiled(q, k, v), tilepy.flash_attention(q, k, v, mask_mod=prefix), torch.float16,
          "compiled")
    torch._dynamo.reset()
    with pytest.raises(NotImplementedError, match="needs its derivative"):
        tilepy.flash_attention(q.requires_grad_(), k, v, score_mod=bias)


def test_flash_attention_alibi_and_mod_args_on_tensors():
    """alibi_slopes= and mod_args= tensors (a document id per token) through autograd against
    float64 autograd of the same attention; slopes that require grad are refused (their
    gradient is not computed)."""
    def same_doc(b, h, q_idx, kv_idx, doc):
        return doc[min(q_idx, 18)] == doc[min(kv_idx, 18)]

    doc = torch.tensor([0] * 7 + [1] * 5 + [2] * 7, dtype=torch.int32)
    slopes = torch.tensor([0.25, 0.5])

    def ref(q, k, v):
        s = q @ k.mT / 4.0
        i, j = torch.arange(19)[:, None], torch.arange(19)[None, :]
        s = s - slopes.double()[:, None, None] * (i - j).abs()
        keep = (j <= i) & (doc[:, None] == doc[None, :])
        return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v

    ins = [rand(1, 2, 19, 16, grad=True) for _ in range(3)]
    check_grads(lambda q, k, v: tilepy.flash_attention(q, k, v, causal=True,
                                                       alibi_slopes=slopes, mask_mod=same_doc,
                                                       mod_args=(doc,)),
                ref, ins, torch.float16)
    with pytest.raises(NotImplementedError, match="alibi_slopes requires grad"):
        tilepy.flash_attention(*ins, alibi_slopes=slopes.clone().requires_grad_())


def test_flash_attention_padded_head_dim_gradients():
    """head_dim 24 (zero-padded to 32 in the kernels' shared tiles) through autograd against
    float64 autograd."""
    ins = [rand(1, 2, 9, 24, grad=True) for _ in range(3)]
    check_grads(lambda q, k, v: tilepy.flash_attention(q, k, v, causal=True),
                lambda q, k, v: _attention_reference(q, k, v, True, 24 ** -0.5),
                ins, torch.float16)


def test_flash_attention_alibi_through_the_operator():
    """alibi_slopes= alone is an operator argument (``Tensor? alibi_slopes``): opcheck, and a
    compiled training step (fullgraph: no graph break) whose gradients equal eager's."""
    q, k, v = rand(1, 2, 13, 16), rand(1, 1, 15, 16), rand(1, 1, 15, 16)
    slopes = torch.tensor([0.3, 0.1])
    torch.library.opcheck(torch.ops.tilepy.flash_attention.default,
                          (q, k, v, True, None, -1, 0, 0.0, True, "bhsd", slopes))

    def loss(q, k, v):
        return tilepy.flash_attention(q, k, v, causal=True, alibi_slopes=slopes
                                      ).float().square().sum()

    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    loss(*ins).backward()
    eager = [x.grad.clone() for x in ins]
    for x in ins:
        x.grad = None
    torch._dynamo.reset()
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*ins).backward()
    for x, g in zip(ins, eager):
        assert torch.equal(x.grad, g)


def test_flash_attention_lse_gradient_and_backward_operator():
    """The LSE used downstream as well as the output: its gradient enters the backward."""
    q, k, v = (rand(1, 2, n, 16, grad=True) for n in (21, 17, 17))
    out, lse = tilepy.flash_attention(q, k, v, scale=0.3, return_lse=True)
    dy = torch.randn(out.shape, dtype=torch.float64)
    ((out.double() * dy).sum() + lse.double().square().sum()).backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    s = 0.3 * ref[0] @ ref[1].mT
    ((torch.softmax(s, -1) @ ref[2] * dy).sum() + torch.logsumexp(s, -1).square().sum()
     ).backward()
    for x, r in zip((q, k, v), ref):
        close(x.grad, r.grad, torch.float16, "gradient with the LSE used")
    do = rand(1, 2, 21, 16)
    o, l = (t.detach() for t in tilepy.flash_attention(q, k, v, causal=True, return_lse=True))
    torch.library.opcheck(torch.ops.tilepy.flash_attention_backward.default,
                          (do, q.detach(), k.detach(), v.detach(), o, l, None, True, None,
                           -1, -1, 0.0, "bhsd", False))
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    got = tilepy.flash_attention_backward(do, q.detach(), k.detach(), v.detach(), o, l,
                                          causal=True, dq=dq, dk=dk, dv=dv)
    assert all(g is w for g, w in zip(got, (dq, dk, dv)))
    want = torch.ops.tilepy.flash_attention_backward(do, q.detach(), k.detach(), v.detach(), o,
                                                     l, None, True, None, -1, -1, 0.0, "bhsd",
                                                     False)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    with pytest.raises(TypeError, match="double backward"):
        tilepy.flash_attention_backward(do.requires_grad_(), q, k, v, o, l)


def test_gradients_of_gradients_are_refused_where_there_are_none():
    """create_graph=True through an operator whose backward has no backward of its own
    (attention, packed attention, grouped_gemm's gradient in b) is a TypeError — PyTorch
    alone would only warn and return gradients cut off from the graph — while a plain
    backward still runs."""
    q, k, v = (rand(1, 2, 9, 16).requires_grad_() for _ in range(3))
    with pytest.raises(TypeError, match="no double backward"):
        torch.autograd.grad(tilepy.flash_attention(q, k, v).float().square().sum(), q,
                            create_graph=True)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    packed = [x[0].transpose(0, 1).detach().requires_grad_() for x in (q, k, v)]
    with pytest.raises(TypeError, match="no double backward"):
        torch.autograd.grad(tilepy.flash_attention_varlen(*packed, cu, cu, 5, 5).sum(),
                            packed[1], create_graph=True)
    a = rand(8, 16).requires_grad_()
    w = rand(3, 16, 24).requires_grad_()
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="no double backward"):
        torch.autograd.grad(tilepy.grouped_gemm(a, w, offs).float().square().sum(), w,
                            create_graph=True)
    tilepy.flash_attention(q, k, v).float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ---- torch.compile ------------------------------------------------------------------------

def _counting_backend():
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend("aot_eager")


def test_compile_fullgraph_inference_has_one_graph():
    torch._dynamo.reset()
    x, w1, b1, w2 = rand(19, 24), rand(24, 32), rand(32), rand(32, 16)
    q, k, v = rand(1, 2, 19, 64), rand(1, 2, 19, 64), rand(1, 2, 19, 64)

    def model(x, w1, b1, w2, q, k, v):
        h = tilepy.gemm(x, w1, bias=b1, activation="gelu")
        s = tilepy.log_softmax(tilepy.gemm(h, w2, out_dtype=torch.float32), -1)
        o = tilepy.flash_attention(q, k, v, causal=True)
        return s, o

    backend = _counting_backend()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got, want = compiled(x, w1, b1, w2, q, k, v), model(x, w1, b1, w2, q, k, v)
    assert backend.frame_count == 1
    targets = {str(n.target) for n in backend.graphs[0].graph.nodes}
    assert {"tilepy.gemm.default", "tilepy.log_softmax.default",
            "tilepy.flash_attention.default"} <= targets
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_compile_fullgraph_training_step_matches_eager_gradients():
    torch._dynamo.reset()
    x = rand(19, 32)
    w1, b1, w2 = rand(32, 32, grad=True), rand(32, grad=True), rand(32, 16, grad=True)

    def loss(x, w1, b1, w2):
        h = tilepy.gemm(x, w1, bias=b1, activation="silu")
        a = tilepy.flash_attention(h.view(1, 19, 2, 16), h.view(1, 19, 2, 16),
                                   h.view(1, 19, 2, 16), causal=True, layout="bshd")
        return tilepy.softmax(tilepy.gemm(a.reshape(19, 32), w2).float(), -1)[:, 0].sum()

    loss(x, w1, b1, w2).backward()
    eager = [p.grad.clone() for p in (w1, b1, w2)]
    for p in (w1, b1, w2):
        p.grad = None
    backend = _counting_backend()
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    compiled(x, w1, b1, w2).backward()
    assert backend.frame_count == 1
    for p, g in zip((w1, b1, w2), eager):
        assert torch.equal(p.grad, g)


# ---- errors -----------------------------------------------------------------------------------

def test_errors_name_the_argument_in_eager_and_compiled_calls():
    a, b = rand(8, 16), rand(16, 8, dtype=torch.float32)
    with pytest.raises(TypeError, match="a and b must have the same dtype"):
        tilepy.gemm(a, b)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="a and b must have the same dtype"):
        torch.compile(lambda x, y: tilepy.gemm(x, y), fullgraph=True, backend="aot_eager")(a, b)
    with pytest.raises(ValueError, match="head_dim 20 is not supported"):
        tilepy.flash_attention(rand(1, 1, 8, 20, grad=True), rand(1, 1, 8, 20),
                               rand(1, 1, 8, 20))
    aw = rand(8, 16, grad=True)
    with pytest.raises(TypeError, match="out= does not differentiate"):
        tilepy.gemm(aw, rand(16, 8), out=torch.empty(8, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="dy requires grad"):
        tilepy.softmax_backward(rand(4, 8, dtype=torch.float32, grad=True),
                                rand(4, 8, dtype=torch.float32), -1)
    with pytest.raises(TypeError, match="x requires grad, but an explicit config= runs"):
        tilepy.softmax(rand(4, 8, dtype=torch.float32, grad=True), -1,
                       config=tilepy.ops.softmax.plan(8))
    with pytest.raises(TypeError, match="scale must be a float"):
        tilepy.flash_attention(rand(1, 1, 8, 64, grad=True), rand(1, 1, 8, 64),
                               rand(1, 1, 8, 64), scale="x")
    assert math.isfinite(tilepy.softmax(rand(4, 8, dtype=torch.float32), -1,
                                        config=tilepy.ops.softmax.plan(8)).sum().item())


def _varlen_grads(ref_in, bounds, causal, g):
    """float64 autograd gradients of packed (total, heads, dim) float64 leaves ``ref_in``
    whose sequences are ``bounds`` ((start, end) rows; scale 0.25: head dim 16) for the
    output gradient ``g``."""
    want_out = torch.cat([_attention_reference(
        *(x[None, a:e].transpose(1, 2) for x in ref_in), causal, 0.25)[0].transpose(0, 1)
        for a, e in bounds])
    return torch.autograd.grad(want_out, ref_in, g.double())


def test_flash_attention_varlen_operator_gradients_and_compile():
    """PyTorch tensors through tilepy.flash_attention_varlen: the ``tilepy::
    flash_attention_varlen`` operator (opcheck's schema, fake-tensor and autograd-registration
    checks; AOT dispatch is the compiled step below), gradients by its autograd formula
    against float64 autograd per sequence (a zero-length one among them), a compiled
    (fullgraph) step with the same gradients, and user functions with a gradient wanted
    refused (no autograd for them yet)."""
    q, k, v = rand(11, 1, 16), rand(11, 1, 16), rand(11, 1, 16)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    torch.library.opcheck(torch.ops.tilepy.flash_attention_varlen.default,
                          (q, k, v, cu, cu, 7, 7, True, None, -1, 0, 0.0, True, True),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
    g = rand(11, 1, 16)

    def loss(q, k, v):
        return (tilepy.flash_attention_varlen(q, k, v, cu, cu, 7, 7, causal=True).float()
                * g.float()).sum()

    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    got = torch.autograd.grad(loss(*ins), ins)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = _varlen_grads(ref_in, ((0, 4), (4, 11)), True, g)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        close(a, b, torch.float16, name)
    torch._dynamo.reset()
    ins2 = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*ins2).backward()
    for a, b in zip(ins2, got):
        assert torch.equal(a.grad, b)
    with pytest.raises(NotImplementedError, match="no autograd with score_mod"):
        tilepy.flash_attention_varlen(*ins, cu, cu, 7, 7,
                                      mask_mod=lambda b, h, i, j: i >= j)


def test_flash_attention_varlen_lse_gradient_and_compile():
    """The packed LSE used downstream as well as the output: its gradient enters the
    backward (``dlse``), against float64 autograd per sequence (causal, a zero-length one
    among them); compiled (fullgraph) with the LSE returned — AOT autograd hands the backward
    a gradient for it even where the loss does not use it — the same gradients."""
    q, k, v = rand(11, 2, 16), rand(11, 1, 16), rand(11, 1, 16)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    g = rand(11, 2, 16)

    def loss(q, k, v):
        out, lse = tilepy.flash_attention_varlen(q, k, v, cu, cu, 7, 7, causal=True,
                                                 return_lse=True)
        return (out.float() * g.float()).sum() + lse.square().sum()

    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    got = torch.autograd.grad(loss(*ins), ins)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    total = 0
    for a, e in ((0, 4), (4, 11)):
        qs, ks, vs = (x[a:e].transpose(0, 1) for x in ref)
        s = 0.25 * qs @ ks.repeat_interleave(2, 0).mT
        n = e - a
        s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n)[:, None], float("-inf"))
        out = torch.softmax(s, -1) @ vs.repeat_interleave(2, 0)
        total = total + (out.transpose(0, 1) * g[a:e].double()).sum() + \
            torch.logsumexp(s, -1).square().sum()
    want = torch.autograd.grad(total, ref)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        close(a, b, torch.float16, name)
    torch._dynamo.reset()

    def out_only(q, k, v):     # the LSE returned by the compiled graph, its gradient unused
        return tilepy.flash_attention_varlen(q, k, v, cu, cu, 7, 7, causal=True,
                                             return_lse=True)

    ins2 = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = torch.compile(out_only, fullgraph=True, backend="aot_eager")(*ins2)
    (out.float() * g.float()).sum().backward()
    ins3 = [x.clone().requires_grad_() for x in (q, k, v)]
    (tilepy.flash_attention_varlen(*ins3, cu, cu, 7, 7, causal=True).float()
     * g.float()).sum().backward()
    for a, b in zip(ins2, ins3):
        assert torch.equal(a.grad, b.grad)


def test_flash_attention_varlen_operator_head_dim_v():
    """v's own head dim (16 / 24) through the varlen operator: opcheck's fake tensors (out of
    v's head dim) and its gradients against float64 autograd per sequence."""
    q, k, v = rand(11, 2, 16), rand(11, 1, 16), rand(11, 1, 24)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    torch.library.opcheck(torch.ops.tilepy.flash_attention_varlen.default,
                          (q, k, v, cu, cu, 7, 7, False, None, -1, -1, 0.0, True, True),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
    g = rand(11, 2, 24)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out = tilepy.flash_attention_varlen(*ins, cu, cu, 7, 7)
    assert out.shape == (11, 2, 24)
    got = torch.autograd.grad(out, ins, g)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = _varlen_grads(ref_in, ((0, 4), (4, 11)), False, g)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        close(a, b, torch.float16, name)


def test_flash_attention_with_kvcache_operator_writes_the_cache_and_compiles():
    """PyTorch tensors through tilepy.flash_attention_with_kvcache: the ``tilepy::
    flash_attention_with_kvcache`` operator (opcheck's schema and fake-tensor checks, the
    caches declared written), the appended token in the paged cache and the result equal to
    an eager call's, under torch.compile(fullgraph=True) too (the keys split two ways: the
    schema's num_splits); inputs that require grad
    refused (an inference op)."""
    q = rand(2, 1, 2, 16)
    kc, vc = rand(3, 16, 1, 16), rand(3, 16, 1, 16)
    lens = torch.tensor([5, 16], dtype=torch.int32)
    table = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)
    kn, vn = rand(2, 1, 1, 16), rand(2, 1, 1, 16)
    torch.library.opcheck(torch.ops.tilepy.flash_attention_with_kvcache.default,
                          (q, kc.clone(), vc.clone(), lens, kn, vn, table, True, None, -1, 0,
                           0.0, True, True, 2), test_utils=("test_schema", "test_faketensor"))
    eager_k, eager_v = kc.clone(), vc.clone()
    want = tilepy.flash_attention_with_kvcache(q, eager_k, eager_v, lens, k=kn, v=vn,
                                               block_table=table, num_splits=2)
    assert torch.equal(eager_k[2, 5], kn[0, 0]) and torch.equal(eager_k[0, 0], kn[1, 0])

    def step(q, kc, vc):
        return tilepy.flash_attention_with_kvcache(q, kc, vc, lens, k=kn, v=vn,
                                                   block_table=table, num_splits=2) * 2

    torch._dynamo.reset()
    ck, cv = kc.clone(), vc.clone()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, ck, cv)
    assert torch.equal(got, want * 2) and torch.equal(ck, eager_k) and torch.equal(cv, eager_v)
    with pytest.raises(TypeError, match="q requires grad, but it has no backward"):
        tilepy.flash_attention_with_kvcache(q.clone().requires_grad_(), kc, vc, lens,
                                            block_table=table)


def test_grouped_gemm_operator_gradients_and_compile():
    """PyTorch tensors through tilepy.grouped_gemm: the ``tilepy::grouped_gemm`` operator
    (opcheck: schema, fake tensors, autograd registration), the gradients of ``a`` and of the
    experts' (E, N, K) weights (read as their transposed view) against float64 autograd
    with an empty group, and a fullgraph-compiled training step."""
    ends = torch.tensor([3, 3, 20], dtype=torch.int32)
    a, w = rand(20, 24, grad=True), rand(3, 16, 24, grad=True)
    torch.library.opcheck(torch.ops.tilepy.grouped_gemm.default,
                          (a.detach(), w.detach().mT, ends, True),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))

    def ref(a, w):
        bounds = [0] + ends.tolist()
        return torch.cat([a[s:t] @ w[g].T for g, (s, t) in enumerate(zip(bounds, bounds[1:]))])

    check_grads(lambda a, w: tilepy.grouped_gemm(a, w.mT, ends), ref, (a, w), torch.float16)
    torch._dynamo.reset()
    step = torch.compile(lambda a, w: tilepy.grouped_gemm(a, w.mT, ends).float().square().sum(),
                         fullgraph=True, backend="aot_eager")
    a.grad = w.grad = None
    step(a, w).backward()
    a64, w64 = a.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref(a64, w64).square().sum().backward()
    close(a.grad, a64.grad, torch.float16, "da compiled")
    close(w.grad, w64.grad, torch.float16, "dw compiled")


def test_gemm_fp8_operator_and_compile():
    """tilepy.gemm on float8 tensors: the ``tilepy::gemm_fp8`` operator (opcheck: fake tensors;
    its schema check compares the inputs with CPU arithmetic float8 lacks) with row / column
    scales and mixed formats (e4m3 · e5m2), under torch.compile(fullgraph=True) with a bias
    and an activation, out_dtype as a torch dtype; an input that requires grad refused."""
    a = (rand(40, 96, dtype=torch.float32) * 3).to(torch.float8_e4m3fn)
    w = (rand(24, 96, dtype=torch.float32) * 3).to(torch.float8_e5m2)
    sa, sb = rand(40, 1, dtype=torch.float32).abs() + 0.5, rand(1, 24, dtype=torch.float32)
    torch.library.opcheck(torch.ops.tilepy.gemm_fp8.default, (a, w.t(), sa, sb, torch.float16),
                          test_utils=("test_faketensor",))
    want = tilepy.gemm(a, w.t(), scale_a=sa, scale_b=sb)
    ref = (a.double() * sa.double()) @ (w.double().t() * sb.double())
    close(want, ref, torch.bfloat16, "eager")
    torch._dynamo.reset()
    bias = rand(24, dtype=torch.bfloat16)
    step = torch.compile(lambda a, w: tilepy.gemm(a, w.t(), scale_a=sa, scale_b=sb, bias=bias,
                                                  activation="relu", out_dtype=torch.float32),
                         fullgraph=True, backend="aot_eager")
    got = step(a, w)
    assert got.dtype == torch.float32
    close(got, (ref + bias.double()).clamp_min(0), torch.float32, "compiled")
    with pytest.raises(TypeError, match="a requires grad"):
        tilepy.gemm(a.float().requires_grad_().to(torch.float8_e4m3fn), w.t(), scale_a=sa)
    with pytest.raises(TypeError, match="scale_a must be a float32 tensor .* got float"):
        tilepy.gemm(a, w.t(), scale_a=2.0)
    with pytest.raises(TypeError, match="descale_k must be a float32 tensor .* got ndarray"):
        tilepy.flash_attention(a[None, None], a[None, None], a[None, None],
                               descale_k=np.ones((), np.float32))


def test_flash_attention_fp8_operator_and_compile():
    """tilepy.flash_attention on float8 tensors: the ``tilepy::flash_attention_fp8`` operator
    (opcheck: fake tensors) in the bshd layout with GQA, per-(batch, head) descales and the
    LSE; the same bits under torch.compile(fullgraph=True) as eager; bfloat16 out; an input
    that requires grad refused."""
    q = (rand(1, 40, 2, 64, dtype=torch.float32) * 2).to(torch.float8_e4m3fn)
    k = (rand(1, 50, 1, 64, dtype=torch.float32) * 2).to(torch.float8_e4m3fn)
    v = (rand(1, 50, 1, 64, dtype=torch.float32) * 2).to(torch.float8_e4m3fn)
    dq = rand(1, 1, dtype=torch.float32).abs() + 0.2
    dk, dv = torch.tensor(0.5), torch.tensor(2.0)
    torch.library.opcheck(torch.ops.tilepy.flash_attention_fp8.default,
                          (q, k, v, True, None, -1, 0, 0.0, dq, dk, dv, True, "bshd"),
                          test_utils=("test_faketensor",))
    want, want_lse = tilepy.flash_attention(q, k, v, causal=True, descale_q=dq, descale_k=dk,
                                            descale_v=dv, return_lse=True, layout="bshd")
    assert want.dtype == torch.bfloat16 and want.shape == (1, 40, 2, 64)
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v: tilepy.flash_attention(
        q, k, v, causal=True, descale_q=dq, descale_k=dk, descale_v=dv, return_lse=True,
        layout="bshd"), fullgraph=True, backend="aot_eager")
    got, lse = step(q, k, v)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    with pytest.raises(TypeError, match="q requires grad"):
        tilepy.flash_attention(q.float().requires_grad_().to(torch.float8_e4m3fn), k, v)


def test_quantize_fp8_operator_and_compile():
    """PyTorch tensors through tilepy.quantize_fp8: the ``tilepy::quantize_fp8`` operator
    (opcheck: schema, fake tensors), float8 values and float32 scales equal to an eager call's
    under torch.compile(fullgraph=True); an input that requires grad refused."""
    x = rand(40, 300, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.tilepy.quantize_fp8.default, (x, "1x128", "e5m2"),
                          test_utils=("test_schema", "test_faketensor"))
    values, scales = tilepy.quantize_fp8(x, granularity=(1, 128), dtype="e5m2")
    assert values.dtype == torch.float8_e5m2 and scales.shape == (40, 3)
    torch._dynamo.reset()
    step = torch.compile(lambda x: tilepy.quantize_fp8(x, granularity=(1, 128), dtype="e5m2"),
                         fullgraph=True, backend="aot_eager")
    got_v, got_s = step(x)
    assert torch.equal(got_v.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(got_s, scales)
    values, scale = tilepy.quantize_fp8(x)        # one scale: the int32 atomic-max buffer
    want = x.float().abs().max() * torch.tensor(1 / 448, dtype=torch.float32)
    assert scale.shape == () and scale.item() == want.item()
    with pytest.raises(TypeError, match="x requires grad"):
        tilepy.quantize_fp8(x.clone().requires_grad_())
