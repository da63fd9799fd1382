"""Where a warp-specialised GEMM launch's time goes, block by block: the op's built-in config
of each shape run once more as a traced kernel (``wgmma_ws_gemm_kernel(..., trace=True)``,
:mod:`tilepy.tile.trace`), its phase marks summarised, beside the launch's event time, the same
untraced kernel's, the op's in a CUDA graph and cuBLAS's (torch.matmul) in the same run.

    python bench/trace_gemm.py [--shapes 16x4096x4096,2048x2048x2048] [--json FILE]

Per shape: the config, event µs of one traced launch and of one untraced launch (medians of
``RUNS``), graph-replay µs per call of tilepy.gemm and of cuBLAS, and the phases (mean / min /
max over blocks, µs, from the global timer): start spread (the last block's entry after the
first's), prologue (entry → barriers met), first wait (→ the first stage landed), first main
loop, split-K step, first epilogue, the last item, the drain (its epilogue → the block's end),
and the span (first entry → last end) against the event time — the difference is the launch's
cost outside every block.
"""

import argparse
import json
import statistics

SHAPES = "16x4096x4096,64x4096x4096,128x4096x4096,256x4096x4096,128x14336x4096,2048x2048x2048," \
         "4096x4096x4096"
RUNS = 7
PHASES = (("prologue", "entry", "ready"), ("first wait", "ready", "first_stage"),
          ("first main loop", "first_stage", "first_loop_end"),
          ("split-K step", "first_loop_end", "first_reduced"),
          ("first epilogue", "first_reduced", "first_item_end"),
          ("last item", "last_loop_start", "last_item_end"),
          ("last main loop", "last_loop_start", "last_loop_end"),
          ("drain", "last_item_end", "consumer_end"),
          ("entry to end", "entry", "consumer_end"),
          ("producer: ready to last load", "ready", "producer_end"))


def event_us(torch, fn, runs=RUNS):
    """Median event time of one call (after warm-up), µs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(runs):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3)
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--json")
    args = p.parse_args()
    import numpy as np
    import torch
    from measure import graph_ms
    from numba import cuda

    import tilepy
    from tilepy import arrays
    from tilepy.arrays import describe, kernel_view
    from tilepy.ops import gemm as G
    from tilepy.ops import gemm_wgmma_ws as ws
    from tilepy.tile import trace as TR

    dtype, tdt = "bfloat16", torch.bfloat16
    rows_out = []
    for shape in args.shapes.split(","):
        m, n, k = map(int, shape.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=tdt)
        b = torch.randn(k, n, device="cuda", dtype=tdt)
        out = torch.empty(m, n, device="cuda", dtype=tdt)
        cfg = G.hopper_config(m, n, 1, dtype, tma_store=True, k=k)
        if not isinstance(cfg, ws.WsConfig):
            print(f"{shape}: the built-in choice is {cfg!r}, not the warp-specialised kernel")
            continue
        va = kernel_view(describe(a, "a"), 3)
        vb = kernel_view(describe(b, "b"), 3)
        vo = kernel_view(describe(out, "out"), 3)
        alloc = arrays.byte_allocator(describe(a, "a"))
        plans = {}
        for traced in (False, True):
            kern = ws.wgmma_ws_gemm_kernel(cfg, True, dtype, trace=traced)
            g = ws.grid(cfg, m, n, 1, ws.sm_count(ws.SMS) if cfg.persistent else None)
            trace = cuda.to_device(np.zeros((g[0] * g[1], TR.WIDTH), np.uint64)) \
                if traced else None
            plans[traced] = ws.plan(kern, cfg, va, vb, vo, vo, arrays.placeholder(1),
                                    alloc=alloc, trace=trace) + (trace,)
        stream = torch.cuda.current_stream().cuda_stream

        def launch(traced):
            pl, pargs, _ = plans[traced]
            pl.launch(stream, pargs)

        untraced_us = event_us(torch, lambda: launch(False))
        traced_us = event_us(torch, lambda: launch(True))
        want = a.double() @ b.double()
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        summaries = []
        trace = plans[True][2]
        for _ in range(RUNS):
            trace.copy_to_device(np.zeros(trace.shape, np.uint64))
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            launch(True)
            e.record()
            e.synchronize()
            sm = TR.summary(trace.copy_to_host(), ws.TRACE_MARKS, PHASES,
                            {"items": ws.TRACE_MARKS["items"], "smid": ws.TRACE_MARKS["smid"]})
            sm["event_us"] = s.elapsed_time(e) * 1e3
            summaries.append(sm)
        op_us = graph_ms(torch, lambda: tilepy.gemm(a, b, out=out)) * 1e3
        cublas_us = graph_ms(torch, lambda: torch.matmul(a, b, out=out)) * 1e3
        mid = sorted(summaries, key=lambda x: x["span_us"])[len(summaries) // 2]
        row = {"shape": [m, n, k], "config": cfg.describe(), "max_rel_err": err,
               "untraced_event_us": untraced_us, "traced_event_us": traced_us,
               "op_graph_us": op_us, "cublas_graph_us": cublas_us, "median_run": mid,
               "spans_us": [x["span_us"] for x in summaries]}
        rows_out.append(row)
        print(f"\n{shape} bf16  {cfg.describe()}  err {err:.1e}", flush=True)
        print(f"  events: untraced {untraced_us:.1f} us, traced {traced_us:.1f} us; graph "
              f"replay per call: tilepy.gemm {op_us:.1f} us, cuBLAS {cublas_us:.1f} us")
        print(f"  median run: {mid['blocks']} blocks, event {mid['event_us']:.1f} us, span "
              f"{mid['span_us']:.1f} us, start spread {mid['start_spread_us']:.2f} us, timer "
              f"step {mid['timer_step_ns']} ns, items per block {mid['values']['items']}")
        for name, ph in mid["phases"].items():
            if ph.get("blocks"):
                print(f"  {name:30} mean {ph['mean_us']:7.2f}  min {ph['min_us']:7.2f}  "
                      f"max {ph['max_us']:7.2f} us  ({ph['blocks']} blocks)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
