"""Launch the GEMM kernel a few times for a profiler (ncu) to look at.

    ncu --clock-control none --kernel-name regex:kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis python3 bench/profile_gemm.py 4096 float16

Hardware counters need a Firecracker device machine (see the device tool's KINDS.md: ncu
fails on gVisor); without them, bench/sweep_gemm.py --variants times variants instead.
"""

import sys

import numpy as np


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float16"
    from numba import cuda

    from tilepy.ops.gemm import LARGE
    from tilepy.ops.gemm_mma_sync import gemm_kernel, launch
    from tilepy.tile.config import GemmConfig

    cfg = GemmConfig(LARGE.block, LARGE.warps, LARGE.pipeline, dtype)
    rng = np.random.default_rng(0)
    a = cuda.to_device(rng.standard_normal((1, n, n)).astype(np.float16).view(np.uint16))
    b = cuda.to_device(rng.standard_normal((1, n, n)).astype(np.float16).view(np.uint16))
    out = cuda.device_array((1, n, n), np.uint16)
    bias = cuda.device_array(1, np.float32)
    kern = gemm_kernel(cfg, True, dtype)
    for _ in range(4):
        launch(kern, cfg, a, b, out, out, bias)
    cuda.synchronize()
    print(cfg.describe())


if __name__ == "__main__":
    main()
