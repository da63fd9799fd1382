"""GEMM: the tilepy mma.sync main loop against cuBLAS (torch.matmul / cupy.matmul), same run.

Kernel-level for now (the `tilepy.gemm` op wrapper is issue 5): the default config,
row-major A and B, 16-bit out, timed with CUDA events.
"""

import numpy as np
import pytest

from tilepy.testing.timing import time_cuda

SIZES = [4096, 8192]
DTYPES = ["float16", "bfloat16"]


def cuda_ms(torch, fn, repeat=20, warmup=3):
    return time_cuda(fn, warmup=warmup, repeat=repeat)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_gemm_tilepy_vs_cublas(benchmark, record, torch, gpu_name, n, dtype):
    from numba import cuda

    from tilepy.ops.gemm_kernel import gemm_kernel, grid, launch
    from tilepy.tile.config import GemmConfig

    tdt = getattr(torch, dtype)
    a = torch.randn(n, n, device="cuda", dtype=tdt)
    b = torch.randn(n, n, device="cuda", dtype=tdt)
    out = torch.empty(n, n, device="cuda", dtype=tdt)
    bias = torch.zeros(1, device="cuda", dtype=torch.float32)
    cfg = GemmConfig(dtype=dtype)
    kern = gemm_kernel(cfg, True, dtype)
    args = [cuda.as_cuda_array(t.view(torch.int16)[None]).view(np.uint16) for t in (a, b, out)]
    args += [args[2], cuda.as_cuda_array(bias)]
    launch(kern, cfg, *args)  # compile + allow smem
    torch.cuda.synchronize()
    ref = a.float() @ b.float()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, err
    configured = kern[grid(cfg, n, n), cfg.threads, 0, cfg.smem_bytes]
    alpha, beta = np.float32(1.0), np.float32(0.0)
    ms = cuda_ms(torch, lambda: configured(*args, alpha, beta))
    peer_ms = cuda_ms(torch, lambda: torch.matmul(a, b))
    flop = 2 * n**3
    record(gpu=gpu_name, tflops=flop / ms / 1e9, peer="torch.matmul (cuBLAS)",
           peer_tflops=flop / peer_ms / 1e9, ratio=peer_ms / ms, config=cfg.describe(),
           max_rel_err=err)
    benchmark.pedantic(lambda: (configured(*args, alpha, beta), torch.cuda.synchronize()),
                       rounds=5, iterations=1)
