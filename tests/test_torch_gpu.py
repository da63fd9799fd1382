"""The PyTorch operators on a GPU: ``torch.compile(fullgraph=True)`` with Inductor, gradients
at full size against float64, and a random-weight Llama through the transformers
integration (eager and compiled) against SDPA. The simulator versions are
tests/test_torch_ops.py and tests/test_transformers.py; CUDA-graph capture is
tests/test_cuda_graphs.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import tilepy  # noqa: E402
import tilepy.integrations.pytorch  # noqa: E402,F401

pytestmark = pytest.mark.gpu


def _rand(*shape, dtype=torch.float16, grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(grad)


def _rel(got, ref):
    got, ref = got.double(), ref.double()
    assert not torch.isnan(got).any()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def test_gpu_compile_fullgraph_inductor_matches_eager():
    torch._dynamo.reset()
    x, w1, b1, w2 = _rand(1000, 512), _rand(512, 1024), _rand(1024), _rand(1024, 768)
    q, k, v = _rand(2, 8, 1000, 128), _rand(2, 2, 1000, 128), _rand(2, 2, 1000, 128)

    def model(x, w1, b1, w2, q, k, v):
        h = tilepy.gemm(x, w1, bias=b1, activation="gelu")
        s = tilepy.softmax(tilepy.gemm(h, w2), -1)
        o = tilepy.flash_attention(q, k, v, causal=True)
        return s * 2, o.float().sum(-1)

    compiled = torch.compile(model, fullgraph=True)
    for got, want in zip(compiled(x, w1, b1, w2, q, k, v), model(x, w1, b1, w2, q, k, v)):
        assert _rel(got, want) < 1e-2


@pytest.mark.parametrize("act", [None, "gelu", "silu"])
def test_gpu_gemm_gradients_against_float64(act):
    a, b, bias = _rand(4, 300, 520, grad=True), _rand(520, 264, grad=True), _rand(264, grad=True)
    y = tilepy.gemm(a, b, bias=bias, activation=act, alpha=0.5)
    dy = torch.randn_like(y)
    (y.float() * dy.float()).sum().backward()
    A, B, Bi = (t.detach().double().requires_grad_() for t in (a, b, bias))
    z = 0.5 * (A @ B) + Bi
    ref = {None: z, "gelu": torch.nn.functional.gelu(z), "silu": torch.nn.functional.silu(z)}[act]
    (ref * dy.double()).sum().backward()
    for got, want in ((a.grad, A.grad), (b.grad, B.grad), (bias.grad, Bi.grad)):
        assert _rel(got, want) < 1e-2


@pytest.mark.parametrize("log", [False, True])
def test_gpu_softmax_and_gemm_softmax_gradients_against_float64(log):
    x = _rand(1000, 3000, dtype=torch.float32, grad=True)
    fn, ref_fn = (tilepy.log_softmax, torch.log_softmax) if log else (tilepy.softmax,
                                                                        torch.softmax)
    dy = torch.randn(1000, 3000, device="cuda")
    (fn(x, -1) * dy).sum().backward()
    X = x.detach().double().requires_grad_()
    (ref_fn(X, -1) * dy.double()).sum().backward()
    assert _rel(x.grad, X.grad) < 1e-4
    a, b = _rand(1000, 256, grad=True), _rand(256, 1000, grad=True)
    dy = torch.randn(1000, 1000, device="cuda")
    (tilepy.gemm_softmax(a, b, scale=0.1).float() * dy).sum().backward()
    A, B = (t.detach().double().requires_grad_() for t in (a, b))
    (torch.softmax(0.1 * (A @ B), -1) * dy.double()).sum().backward()
    assert _rel(a.grad, A.grad) < 2e-2 and _rel(b.grad, B.grad) < 2e-2


def test_gpu_transformers_llama_eager_and_compiled():
    transformers = pytest.importorskip("transformers")
    import tilepy.integrations.transformers as tt

    name = tt.register()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=1024, intermediate_size=2048,
                                   num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.float16).eval()
    ids = torch.randint(0, 1000, (2, 500), device="cuda")
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids, use_cache=False).logits
        model.set_attn_implementation(name)
        got = model(ids, use_cache=False).logits
        assert _rel(got, ref) < 2e-2
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        assert _rel(compiled(ids, use_cache=False).logits, ref) < 2e-2
