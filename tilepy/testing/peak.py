"""Register-only mma.sync throughput: how close a Numba kernel gets to the tensor cores' peak.

Each warp keeps ``chains`` independent accumulators and issues ``chains`` m16n8k16 f16→f32
mma per loop iteration with operands held in registers, so nothing but the tensor cores is
measured. The kernel body is generated as straight-line source (guaranteed unrolling).
"""

from __future__ import annotations

import functools

import numpy as np

FLOP_PER_MMA = 2 * 16 * 8 * 16


@functools.cache
def mma_loop_kernel(chains: int = 8):
    from numba import cuda

    from ..ptx import mma_m16n8k16_f16_f32 as mma

    lines = ["def mma_loop(regs, out, iters):",
             "    tid = cuda.grid(1)",
             "    lane = cuda.threadIdx.x % 32",
             "    a0 = regs[lane, 0]; a1 = regs[lane, 1]; a2 = regs[lane, 2]; a3 = regs[lane, 3]",
             "    b0 = regs[lane, 4]; b1 = regs[lane, 5]"]
    for c in range(chains):
        lines.append(f"    c{c}_0 = np.float32(0); c{c}_1 = np.float32(0); "
                     f"c{c}_2 = np.float32(0); c{c}_3 = np.float32(0)")
    lines.append("    for _ in range(iters):")
    for c in range(chains):
        acc = f"c{c}_0, c{c}_1, c{c}_2, c{c}_3"
        lines.append(f"        {acc} = mma(a0, a1, a2, a3, b0, b1, {acc})")
    total = " + ".join(f"c{c}_{i}" for c in range(chains) for i in range(4))
    lines.append(f"    out[tid] = {total}")
    ns = {"cuda": cuda, "np": np, "mma": mma}
    exec(compile("\n".join(lines) + "\n", f"<tilepy mma_loop chains={chains}>", "exec"), ns)
    return cuda.jit(ns["mma_loop"]), chains


def mma_peak_setup(iters: int = 4096, blocks_per_sm: int = 8, warps_per_block: int = 4,
                   chains: int = 8):
    """(run, flop): a closure that launches the register-only mma loop once, and its FLOPs."""
    from numba import cuda

    kernel, chains = mma_loop_kernel(chains)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    blocks, threads = sms * blocks_per_sm, 32 * warps_per_block
    rng = np.random.default_rng(0)
    regs = cuda.to_device((rng.standard_normal((32, 12)).astype(np.float16) * 0.01)
                          .view(np.uint32))
    out = cuda.device_array(blocks * threads, np.float32)
    launch = kernel[blocks, threads]

    def run():
        launch(regs, out, iters)

    return run, FLOP_PER_MMA * chains * iters * blocks * warps_per_block


def run_mma_peak(iters: int = 4096, blocks_per_sm: int = 8, warps_per_block: int = 4,
                 chains: int = 8, repeat: int = 10):
    """(TFLOPS, ms) of the register-only mma loop on the current GPU (CUDA-event median)."""
    from .timing import time_cuda

    run, flop = mma_peak_setup(iters, blocks_per_sm, warps_per_block, chains)
    ms = time_cuda(run, repeat=repeat)
    return flop / ms / 1e9, ms
