"""Where the time of a small GEMM goes: kernel durations under torch.profiler for tilepy.gemm
(built-in choice and fixed split-K configs) and cuBLAS, eager and in a CUDA graph of 20 calls.

    python bench/probe_gemm_small.py [--json FILE]

Per (shape, implementation): the mean duration of each GPU kernel / memset per call, their sum,
and the wall time per call of a graph replay (events), so the kernel's own time, the extra
nodes a captured call adds, and the gaps between them can be told apart.
"""

import argparse
import json

SHAPES = ((16, 4096, 4096), (128, 4096, 4096), (256, 4096, 14336), (2048, 2048, 2048))
CALLS = 20


def configs(dtype):
    from tilepy.ops.gemm_wgmma_ws import WsConfig

    return [("builtin", None)] + [
        (f"64x128 split{s}", WsConfig(64, 128, 8, dtype, consumers=1, smem_epilogue=True,
                                      splits=s)) for s in (1, 2, 4)] + [
        ("128x128 split2", WsConfig(128, 128, 6, dtype, smem_epilogue=True, splits=2))]


def profile(torch, fn, graph):
    """{kernel name: mean µs per call}, replay wall µs per call (graph) or None."""
    from measure import capture_calls
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    wall = None
    if graph:
        run = capture_calls(torch, fn, CALLS).replay
        run()
        torch.cuda.synchronize()
        start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        run()
        stop.record()
        stop.synchronize()
        wall = start.elapsed_time(stop) * 1e3 / CALLS
    else:
        for _ in range(3):
            fn()

        def run():
            for _ in range(CALLS):
                fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kernels[e.name[:80]] = kernels.get(e.name[:80], 0.0) + e.device_time / CALLS
    return kernels, wall


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    import torch

    import tilepy

    dtype = "bfloat16"
    tdt = torch.bfloat16
    rows = []
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=tdt)
        b = torch.randn(k, n, device="cuda", dtype=tdt)
        out = torch.empty(m, n, device="cuda", dtype=tdt)
        impls = [("cuBLAS", lambda: torch.matmul(a, b, out=out))] + [
            (name, (lambda c=cfg: tilepy.gemm(a, b, out=out, config=c)))
            for name, cfg in configs(dtype)]
        for name, fn in impls:
            for graph in (False, True):
                try:
                    kernels, wall = profile(torch, fn, graph)
                except Exception as e:  # noqa: BLE001 - recorded, the probe goes on
                    print(f"{m}x{n}x{k} {name} graph={graph}: FAILED {e!r}"[:300], flush=True)
                    continue
                total = sum(kernels.values())
                rows.append({"shape": [m, n, k], "impl": name, "graph": graph,
                             "kernels_us": kernels, "sum_us": total, "replay_us": wall})
                ks = ", ".join(f"{k_[:40]} {v:.1f}" for k_, v in kernels.items())
                print(f"{m}x{n}x{k} {name:16} graph={graph!s:5} sum {total:6.1f} us"
                      + (f" replay {wall:6.1f} us" if wall else "") + f" | {ks}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
