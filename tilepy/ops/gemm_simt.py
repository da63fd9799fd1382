"""A float32 GEMM on the CUDA cores (no tensor cores): the exact path for float32 inputs.

``simt_gemm_kernel(activation, has_bias, has_c)`` returns ``kernel(a, b, out, c, bias, alpha,
beta)`` with the operand conventions of :mod:`tilepy.ops.gemm_mma_sync` but float32 arrays of any
strides. 16 × 16 threads per block, each computing one element of a 16 × 16 output tile from
16 × 16 shared tiles. Correct first; it is also the "plain Numba" baseline of the benchmarks.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ..launch import GridSplit, LaunchPlan
from ..tile.epilogue import activation_fn
from ..kcache import cached_jit

T = 16


@functools.cache
def simt_gemm_kernel(activation=None, has_bias=False, has_c=False):
    act = activation_fn(activation)

    @cached_jit
    def kernel(a3, b3, out3, c3, bias, alpha, beta):
        z = cuda.blockIdx.z
        a = a3[min(z, a3.shape[0] - 1)]
        b = b3[min(z, b3.shape[0] - 1)]
        out = out3[z]
        m, k = a.shape
        n = out.shape[1]
        ta = cuda.shared.array((T, T), np.float32)
        tb = cuda.shared.array((T, T), np.float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        row = cuda.blockIdx.y * T + ty
        col = cuda.blockIdx.x * T + tx
        acc = np.float32(0)
        for k0 in range(0, k, T):
            ka = k0 + tx
            kb = k0 + ty
            ta[ty, tx] = a[row, ka] if row < m and ka < k else np.float32(0)
            tb[ty, tx] = b[kb, col] if kb < k and col < n else np.float32(0)
            cuda.syncthreads()
            for q in range(T):
                acc += ta[ty, q] * tb[q, tx]
            cuda.syncthreads()
        if row < m and col < n:
            v = alpha * acc
            if has_bias:
                v += bias[col]
            if has_c:
                v += beta * c3[min(z, c3.shape[0] - 1)][row, col]
            out[row, col] = act(v)

    return kernel


#: How the kernel's blocks index its arguments along grid y (T rows of a, out and c each) and
#: z (the batch of a, b, out and c), so that more than the grid's y or z limit of row tiles or
#: matrices launch in chunks (:class:`tilepy.launch.GridSplit`).
SPLIT = (tuple(GridSplit(1, arg, 1, per_block=T) for arg in (0, 2, 3))
         + tuple(GridSplit(2, arg, 0) for arg in range(4)))


def plan(kernel, a, b, out, c, bias, alpha=1.0, beta=0.0):
    """``(launch plan, arguments)`` for 3-D float32 operands: grid (column tiles, row tiles,
    batch), chunked past the grid's y / z limits (:data:`SPLIT`)."""
    z, m, n = out.shape
    grid = ((n + T - 1) // T, (m + T - 1) // T, z)
    args = (a, b, out, c, bias, np.float32(alpha), np.float32(beta))
    return LaunchPlan(kernel, args, grid, (T, T), split=SPLIT), args


def launch(kernel, a, b, out, c, bias, alpha, beta, stream=0):
    p, args = plan(kernel, a, b, out, c, bias, alpha, beta)
    p.launch(stream, args)


def compile_reports():
    """Offline sm_90 report of the float32 kernel (bias + gelu + c), for the compile layer."""
    from numba import types

    from ..offline import compile_kernel

    f3 = types.Array(types.float32, 3, "A")
    kern = simt_gemm_kernel("gelu", True, True)
    rep = compile_kernel("gemm_simt", kern.py_func,
                         (f3, f3, f3, f3, types.float32[::1], types.float32, types.float32))
    d = dict(rep.__dict__)
    d.pop("ptx")
    return [d]
