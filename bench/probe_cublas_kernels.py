"""Which cuBLAS kernels torch.matmul runs at the GEMM benchmark shapes: the kernel name carries
the tile and the cluster shape (e.g. ``nvjet_sm90_hsh_256x128_64x4_1x2_h_bz_coopA_NNT``; cuBLAS
sees torch's row-major product transposed, so its M is our N). GPU only:

    python bench/probe_cublas_kernels.py
"""

import torch
from torch.profiler import ProfilerActivity, profile

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 11008, 4096), (4096, 4096, 11008)]

for dt in (torch.float16, torch.bfloat16):
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=dt)
        b = torch.randn(k, n, device="cuda", dtype=dt)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            a @ b
            torch.cuda.synchronize()
        names = [e.key for e in p.key_averages() if e.device_type.name == "CUDA"]
        print(dt, m, n, k, names)
