"""mma.sync throughput with operands in registers: tilepy's Numba intrinsic against the same
loop written in CUDA C++ (WMMA API, compiled by NVRTC through CuPy) in the same run.

The anchor (shared/anchors.md) is 540 TFLOPS for such a loop on the H200; issue 3 asks for at
least 90% of it, measured beside a repeat of that ceiling measurement.

Each loop is timed with ``time_cuda`` (``ms``, ``tflops``) and as called, back to back with
nothing in front (``bench/measure.py``: ``ms_as_called``, ``tflops_as_called``); ``ratio`` is
of each one's slower time (``ratio_gpu``: of the ``time_cuda`` times).
"""

import numpy as np
import pytest
from measure import as_called_calls, as_called_ms

ITERS = 4096
BLOCKS_PER_SM = 8
WARPS = 4
CHAINS = 8

WMMA_SRC = r"""
#include <mma.h>
using namespace nvcuda;
extern "C" __global__ void wmma_loop(const half* a_in, float* out, long long iters) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c[CHAINS];
    wmma::load_matrix_sync(a, a_in, 16);
    wmma::load_matrix_sync(b, a_in, 16);
    #pragma unroll
    for (int j = 0; j < CHAINS; j++) wmma::fill_fragment(c[j], 0.0f);
    for (long long i = 0; i < iters; i++) {
        #pragma unroll
        for (int j = 0; j < CHAINS; j++) wmma::mma_sync(c[j], a, b, c[j]);
    }
    float s = 0.0f;
    #pragma unroll
    for (int j = 0; j < CHAINS; j++)
        for (int e = 0; e < c[j].num_elements; e++) s += c[j].x[e];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def cuda_include_options():
    """NVRTC from the CUDA 13 wheels lacks crt/mma.h; point it at a toolkit's headers."""
    import os
    import shutil

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    inc = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include")
    return (f"-I{inc}",) if os.path.exists(os.path.join(inc, "crt", "mma.h")) else ()


def timed(run, flop, sync):
    """{tflops, ms, ms_as_called, tflops_as_called} of ``run``: ``time_cuda`` and as
    called (``bench/measure.py``)."""
    from tilepy.testing.timing import time_cuda

    ms = time_cuda(run, repeat=10)
    called = as_called_ms(run, as_called_calls(ms, 0.0), sync=sync)
    return {"tflops": flop / ms / 1e9, "ms": ms, "ms_as_called": called,
            "tflops_as_called": flop / called / 1e9}


def effective_ms(t):
    """The slower of the two times (what ``ratio`` compares)."""
    return max(t["ms"], t["ms_as_called"])


@pytest.fixture(scope="module")
def wmma_peer():
    """(timed figures, run) of the CUDA C++ WMMA loop; each wmma 16x16x16 = two m16n8k16
    mma."""
    cupy = pytest.importorskip("cupy")

    # CHAINS/2 wmma fragments of 16x16 = CHAINS m16n8k16 accumulators: same work per warp.
    chains = CHAINS // 2
    kernel = cupy.RawKernel(WMMA_SRC.replace("CHAINS", str(chains)), "wmma_loop",
                            options=("--std=c++17",) + cuda_include_options())
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    blocks, threads = sms * BLOCKS_PER_SM, 32 * WARPS
    a = (cupy.random.standard_normal(256, dtype=cupy.float32) * 0.01).astype(cupy.float16)
    out = cupy.empty(blocks * threads, cupy.float32)
    run = lambda: kernel((blocks,), (threads,), (a, out, np.int64(ITERS)))  # noqa: E731
    flop = 2 * 16 * 16 * 16 * chains * ITERS * blocks * WARPS
    return timed(run, flop, cupy.cuda.Device().synchronize), run


def test_mma_sync_register_loop_tilepy(benchmark, record, wmma_peer, gpu_name):
    from numba import cuda

    from tilepy.testing.peak import mma_peak_setup

    run, flop = mma_peak_setup(ITERS, BLOCKS_PER_SM, WARPS, CHAINS)
    ours = timed(run, flop, cuda.synchronize)
    peer = wmma_peer[0]
    record(gpu=gpu_name, **ours, peer="CUDA C++ wmma loop (NVRTC)",
           peer_tflops=peer["tflops"], peer_tflops_as_called=peer["tflops_as_called"],
           ratio=effective_ms(peer) / effective_ms(ours), ratio_gpu=peer["ms"] / ours["ms"],
           anchor_tflops=540.0, fraction_of_anchor=ours["tflops"] / 540.0)
    benchmark.pedantic(lambda: (run(), cuda.synchronize()), rounds=5, iterations=1)


def test_mma_sync_register_loop_cuda_cpp_peer(benchmark, record, wmma_peer, gpu_name):
    import cupy

    figures, run = wmma_peer
    record(gpu=gpu_name, **figures, anchor_tflops=540.0,
           fraction_of_anchor=figures["tflops"] / 540.0)
    benchmark.pedantic(lambda: (run(), cupy.cuda.Device().synchronize()), rounds=5,
                       iterations=1)
