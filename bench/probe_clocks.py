"""SM clock, power and throttle reasons while a kernel runs back to back (issue 10: is a
kernel's throughput cap a clock/power cap?).

    python bench/probe_clocks.py [--json FILE] [--seconds 2]

For each case (cuBLAS through torch.matmul, tilepy's default GEMM and its persistent TMA-store
config at 8192^3 fp16; tilepy's attention and SDPA's cuDNN backend at B4 H32 S4096 D128), the
case runs in a loop for ``--seconds`` while ``nvidia-smi`` samples the GPU every 50 ms; prints
TFLOPS (CUDA events over the loop), the median SM clock (MHz), power (W) and the throttle
reasons seen (0x4: the software power cap). Cases run in one process, one after the other,
each warmed up (compiled) before sampling starts and after a 0.5 s pause.
"""

import argparse
import json
import statistics
import subprocess
import time

FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def sample(seconds, run):
    """Run ``run()`` in a loop for ``seconds`` under nvidia-smi sampling; return (calls,
    elapsed ms from CUDA events, samples)."""
    import torch

    for _ in range(3):          # compile and warm up before sampling starts
        run()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    try:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                run()
            calls += 10
            torch.cuda.synchronize()
        stop.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(stop)
    finally:
        smi.terminate()
        out, _ = smi.communicate(timeout=5)
    rows = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            try:
                rows.append((float(parts[0]), float(parts[1]), float(parts[2]), parts[3]))
            except ValueError:
                pass
    return calls, ms, rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tilepy
    from tilepy.ops.gemm_wgmma_ws import TMA_STORE

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    out = torch.empty(n, n, device="cuda", dtype=torch.float16)
    q, k, v = (torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.float16)
               for _ in range(3))
    o = torch.empty_like(q)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    gemm_flop = 2 * n ** 3
    attn_flop = 4 * 4 * 32 * 4096 * 4096 * 128
    cases = [("cuBLAS torch.matmul 8192^3", gemm_flop, lambda: torch.matmul(a, b, out=out)),
             ("tilepy.gemm default 8192^3", gemm_flop, lambda: tilepy.gemm(a, b, out=out)),
             ("tilepy.gemm persistent TMA-store 8192^3", gemm_flop,
              lambda: tilepy.gemm(a, b, out=out, config=TMA_STORE)),
             ("SDPA cuDNN B4 H32 S4096 D128", attn_flop, cudnn),
             ("tilepy.flash_attention B4 H32 S4096 D128", attn_flop,
              lambda: tilepy.flash_attention(q, k, v, out=o))]
    rows = []
    for name, flop, run in cases:
        time.sleep(0.5)
        calls, ms, smp = sample(args.seconds, run)
        clk = [r[0] for r in smp]
        pw = [r[1] for r in smp]
        reasons = sorted({r[3] for r in smp})
        row = dict(case=name, calls=calls, ms_per_call=ms / calls,
                   tflops=flop * calls / ms / 1e9,
                   sm_clock_mhz_median=statistics.median(clk) if clk else None,
                   sm_clock_mhz_min=min(clk) if clk else None,
                   power_w_median=statistics.median(pw) if pw else None,
                   temperature_c_max=max(r[2] for r in smp) if smp else None,
                   throttle_reasons=reasons, samples=len(smp))
        rows.append(row)
        print(f"{name:45s} {row['tflops']:7.1f} TFLOPS  SM {row['sm_clock_mhz_median']} MHz "
              f"(min {row['sm_clock_mhz_min']})  {row['power_w_median']} W  "
              f"throttle {reasons}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "seconds": args.seconds,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
