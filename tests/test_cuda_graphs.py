"""CUDA-graph capture of tilepy's ops with PyTorch CUDA tensors (GPU only).

Each case captures one op call with ``torch.cuda.graph``, then fills the static inputs with
new random contents, replays, and compares the static output with a PyTorch reference
computed afresh — twice, so a replay that only repeated the capture-time result would fail.
Capture forbids host synchronisation, allocation outside PyTorch's allocator (the graph's
private pool), copies from pageable host memory and work on other streams; the TMA kernels'
tensor maps and tile counters are made so (:mod:`tilepy.tile.device_write`).

``warmup=True``: the call of the captured signature ran eagerly before (its plan, tensor maps
and counters exist: the capture reuses them). ``warmup=False``: the captured call is the first
of its signature, so its plan, maps and counters are made during the capture — after one call
of *another* shape of the same kernel, which loads the kernels (the op's and the map writer's)
and makes the per-device placeholders (a process whose very first tilepy call is captured
would also compile and load modules during the capture, which this file does not test).
"""

from __future__ import annotations

import pytest

import tilepy

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU for PyTorch")
    return torch


def hopper(torch) -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def capture(torch, fn, warmup: bool):
    """``(graph, static output)`` of ``fn()`` captured with torch.cuda.graph, after two eager
    calls on a side stream when ``warmup`` (the pattern PyTorch documents)."""
    if warmup:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def replay_and_check(torch, graph, out, inputs, reference, check, rounds=2):
    """Per round: new random contents in ``inputs`` (in place), replay, compare ``out`` with
    ``reference()`` computed now."""
    for _ in range(rounds):
        for x in inputs:
            x.copy_(torch.randn_like(x, dtype=torch.float32).to(x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference())


def close(got, want, rel):
    """Max error over max |want| at most ``rel`` (NaN fails)."""
    got = got.float()
    assert not bool(got.isnan().any()), "NaN (or an unwritten element)"
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
    assert err <= rel, err


def softmax_close(got, want):
    """float16 softmax values: each within 4e-3 relative (two roundings and float32 math) plus
    1e-5 absolute (values below float16's normal range)."""
    got = got.float()
    assert not bool(got.isnan().any()), "NaN (or an unwritten element)"
    bound = 4e-3 * want.abs() + 1e-5
    assert bool(((got - want).abs() <= bound).all()), \
        float(((got - want).abs() / bound).max())


# ---- flash_attention ------------------------------------------------------------------------

def attention_case(torch, b, h, s, d, causal):
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))

    def run():
        return tilepy.flash_attention(q, k, v, causal=causal)

    def reference():
        return torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=causal)

    def check(got, want):
        assert not bool(got.isnan().any()), "NaN (or a lost tile)"
        assert (got.float() - want).abs().max().item() < 1e-2

    return (q, k, v), run, reference, check


@pytest.mark.parametrize("d,causal", [(128, False), (128, True), (64, False), (64, True)])
@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_flash_attention(torch, d, causal, warmup):
    """The default config (on sm_90 the TMA kernels; persistent with a tile counter at head_dim
    64 and causal 128)."""
    s = 1024 if warmup else 777 + d + causal      # a signature no other case has
    if not warmup:
        tilepy.flash_attention(*attention_case(torch, 1, 2, 256, d, causal)[0], causal=causal)
    inputs, run, reference, check = attention_case(torch, 2, 8, s, d, causal)
    graph, out = capture(torch, run, warmup)
    replay_and_check(torch, graph, out, inputs, reference, check)
    # an eager call after the capture with the same arrays (the maps and counter the capture
    # made are written only by the graph: the eager call must not pick them up unwritten)
    check(run(), reference())


# ---- gemm ------------------------------------------------------------------------------------

@pytest.mark.parametrize("epilogue", ["plain", "bias_gelu"])
@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_gemm(torch, epilogue, warmup):
    """A plain product (on sm_90 the TMA kernel with TMA stores: maps of a, b and out) and a
    float16 bias with GELU (the staged epilogue; the bias converted to float32 per call)."""
    m = 4096 if warmup else 4096 + 128 + 64 * (epilogue == "plain")
    n, k = 2048, 1024
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16)
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    if epilogue == "plain":
        inputs = (a, b)

        def run():
            return tilepy.gemm(a, b)

        def reference():
            return a.float() @ b.float()
    else:
        inputs = (a, b, bias)

        def run():
            return tilepy.gemm(a, b, bias=bias, activation="gelu")

        def reference():
            return torch.nn.functional.gelu(a.float() @ b.float() + bias.float())
    if not warmup:   # another signature of the same kernel (4096 rows fill the SMs too)
        tilepy.gemm(a[:4096], b, **({} if epilogue == "plain" else
                                    {"bias": bias, "activation": "gelu"}))

    def check(got, want):
        close(got, want, 2e-3)

    graph, out = capture(torch, run, warmup)
    replay_and_check(torch, graph, out, inputs, reference, check)
    check(run(), reference())


# ---- gemm_softmax ----------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["default", "global_park"])
@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_gemm_softmax(torch, path, warmup):
    """The built-in choice (on sm_90 the TMA + wgmma softmax mode: maps of a, b and out) and
    the mma.sync kernel with rows parked in global memory (a float32 scratch allocated per
    call: inside the capture, from the graph's pool)."""
    from tilepy.ops import gemm_softmax as gs
    from tilepy.ops.gemm_softmax_kernel import GemmSoftmaxConfig

    m = 4096 if warmup else 4096 + 192 + 64 * (path == "default")
    n, k, scale = 1024, 512, 1 / 24
    config = None if path == "default" else GemmSoftmaxConfig(gs._GLOBAL_GPU, "global")
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16)

    def run():
        return tilepy.gemm_softmax(a, b, scale=scale, config=config)

    def reference():
        return torch.softmax(scale * (a.float() @ b.float()), dim=-1)

    if not warmup:
        tilepy.gemm_softmax(a[:1024], b, scale=scale, config=config)
    graph, out = capture(torch, run, warmup)
    replay_and_check(torch, graph, out, (a, b), reference, softmax_close)
    softmax_close(run(), reference())


# ---- softmax, log_softmax --------------------------------------------------------------------

@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("warmup", [True, False], ids=["warm", "first-call"])
def test_softmax(torch, op, warmup):
    rows = 4096 if warmup else 4096 + 320 + 64 * (op == "softmax")
    x = torch.randn(rows, 1000, device="cuda", dtype=torch.float16)
    fn = getattr(tilepy, op)
    ref = getattr(torch, op)

    def run():
        return fn(x)

    def reference():
        return ref(x.float(), dim=-1)

    def check(got, want):
        if op == "softmax":
            softmax_close(got, want)
        else:   # log-probabilities of a few units: float16 spacing there is ~4e-3
            assert not bool(got.isnan().any())
            assert (got.float() - want).abs().max().item() < 2e-2

    if not warmup:
        fn(x[:1024])
    graph, out = capture(torch, run, warmup)
    replay_and_check(torch, graph, out, (x,), reference, check)
    check(run(), reference())
