"""FlashAttention forward: ``tilepy.flash_attention`` against PyTorch's
``scaled_dot_product_attention`` with the FlashAttention-2 backend and with the cuDNN backend,
same run.

Throughput is ``4·B·H·Sq·Sk·D`` FLOP (two matmuls), halved for causal attention, per second
of GPU time. Timed with CUDA events around ``INNER`` back-to-back calls on PyTorch's current
stream (the median of ``REPEAT`` such runs, divided by ``INNER``), so the host cost of each
wrapper hides behind the GPU work as it does in a model; tilepy writes into a preallocated
``out``, SDPA allocates its result (from PyTorch's cache). The backend is pinned with
``torch.nn.attention.sdpa_kernel`` around the whole timing loop. A backend that refuses a
case (e.g. cuDNN missing) is recorded as ``None``.

Shapes of issue 7: B=4, H=32, S ∈ {1024, 4096}, D=128; B=8, H=16, S=2048, D=64; causal and
not; float16 and bfloat16; plus GQA with 8 KV heads (B=4, Hq=32, S=4096, D=128).
"""

import pytest

from tilepy.testing.timing import time_cuda

# (batch, heads_q, heads_kv, seq, head_dim)
SHAPES = [(4, 32, 32, 1024, 128), (4, 32, 32, 4096, 128), (8, 16, 16, 2048, 64),
          (4, 32, 8, 4096, 128)]
DTYPES = ["float16", "bfloat16"]
INNER = 10
REPEAT = 15


def cuda_ms(torch, fn, repeat=REPEAT, inner=INNER, warmup=3):
    """Median milliseconds per call of ``fn`` (CUDA events around ``inner`` calls)."""
    return time_cuda(fn, warmup=warmup, repeat=repeat, inner=inner)


def sdpa_ms(torch, backend, q, k, v, causal):
    """Milliseconds of SDPA pinned to ``backend``; None if the backend refuses the case."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gqa = q.shape[1] != k.shape[1]
    kw = {"enable_gqa": True} if gqa else {}
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            sdpa(q, k, v, is_causal=causal, **kw)  # refuses here if it cannot run the case
            torch.cuda.synchronize()
            return cuda_ms(torch, lambda: sdpa(q, k, v, is_causal=causal, **kw))
    except (RuntimeError, TypeError):
        return None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_S{}_D{}".format(*s))
def test_flash_attention_vs_sdpa(benchmark, record, torch, gpu_name, shape, causal, dtype):
    from tilepy.ops.attention import choose_config, flash_attention

    b, hq, hkv, s, d = shape
    tdt = getattr(torch, dtype)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=tdt)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=tdt)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=tdt)
    out = torch.empty_like(q)
    flash_attention(q, k, v, causal=causal, out=out)  # compile
    torch.cuda.synchronize()
    kr = k.repeat_interleave(hq // hkv, dim=1)
    vr = v.repeat_interleave(hq // hkv, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
    err = (out.float() - want.float()).abs().max().item()
    assert err < (4e-3 if dtype == "float16" else 3e-2) * v.abs().max().item(), err

    ms = cuda_ms(torch, lambda: flash_attention(q, k, v, causal=causal, out=out))
    flash = sdpa_ms(torch, "FLASH_ATTENTION", q, k, v, causal)
    cudnn = sdpa_ms(torch, "CUDNN_ATTENTION", q, k, v, causal)
    flop = 4 * b * hq * s * s * d / (2 if causal else 1)

    def tflops(t):
        return None if t is None else flop / t / 1e9

    figures = {"gpu": gpu_name, "shape": f"B={b} Hq={hq} Hkv={hkv} S={s} D={d}",
               "dtype": dtype, "causal": causal, "tflops": tflops(ms),
               "peer": "SDPA FLASH_ATTENTION", "peer_tflops": tflops(flash),
               "ratio": None if flash is None else flash / ms,
               "cudnn_tflops": tflops(cudnn),
               "ratio_cudnn": None if cudnn is None else cudnn / ms,
               "config": choose_config(d, dtype).describe(), "max_abs_err": err,
               "timing": f"CUDA events, {INNER} calls per event pair, median of {REPEAT}"}
    # A backend that refused the case leaves its figures out (bench/summary.py formats
    # every ratio it finds).
    record(**{key: val for key, val in figures.items() if val is not None})
    benchmark.pedantic(lambda: (flash_attention(q, k, v, causal=causal, out=out),
                                torch.cuda.synchronize()), rounds=5, iterations=1)
